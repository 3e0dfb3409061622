"""PEFT LoRA: the default modules record the adapted layer's effective output
(base + B·A·x·scale), besides its base layer and adapters."""

import collections

import pytest
import torch

import hookcap
from conftest import assert_recorded

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def test_lora_adapted_layer_output_is_recorded():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0, init_lora_weights=False))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert "base_layer" in q._modules
    seen = collections.defaultdict(list)
    for part, mod in (("adapted", q), ("base", q.base_layer)):
        mod.register_forward_hook(lambda m, a, out, part=part: seen[part].append(out.detach().double().clone()))
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    ids = torch.randint(64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    mon.step()
    h = mon.history()
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    assert f"{name}/output" in h.names and f"{name}/grad_output" in h.names
    assert_recorded(h, 0, f"{name}/output", seen["adapted"])
    assert_recorded(h, 0, f"{name}.base_layer/output", seen["base"])
    # The adapter changes the output (init_lora_weights=False): the two records differ.
    assert h["sum"][0, h.column(f"{name}/output")] != h["sum"][0, h.column(f"{name}.base_layer/output")]
    for adapter in ("lora_A.default", "lora_B.default"):
        assert f"{name}.{adapter}/output" in h.names
    mon.detach()
