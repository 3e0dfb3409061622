"""hookcap op calls per recorded step, counted through the dispatcher: HF
GPT-2 (2 layers), one capture kind at a time. A statistics op call is one
kernel launch on a GPU; the update op's one call launches once per 24
parameters there. Prints the table; asserts today's plan: one statistics
call per metric call, the optimizer's kinds in one multi-tensor call."""

import pytest
import torch

import hookcap
from conftest import CountOps

transformers = pytest.importorskip("transformers")


def launches(capture):
    """(hookcap op calls of the second recorded step by op, metrics recorded, parameters)."""
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = hookcap.Monitor(model, capture=capture, optimizer=opt).attach()
    x = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        count = CountOps()
        with count:
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    mon.detach()
    h = mon.history()
    return count.calls, len(h.names), sum(1 for _ in model.parameters())


def test_launches_per_recorded_step_on_gpt2():
    rows = []
    for capture in (("param",), ("param_grad",), ("output",), ("grad_output",), ("update",)):
        calls, metrics, params = launches(capture)
        stats_calls = calls["accumulate"]
        rows.append((capture[0], metrics, params, dict(calls)))
        if capture[0] == "update":
            # Δw and w_before of every parameter in one call (on a GPU: a launch per 24).
            assert calls["accumulate_updates"] == 1 and stats_calls == 0
        elif capture[0] in ("param", "param_grad"):
            # Every parameter in one call (on a GPU: tensors alike, 32 to a launch).
            assert calls["accumulate_many"] == 1 and stats_calls == 0 and metrics == params
        else:
            assert stats_calls == metrics  # one launch per metric call
    print("\nhookcap op calls per recorded step, HF GPT-2 (2 layers, 28 parameters):")
    for kind, metrics, params, calls in rows:
        print(f"  {kind:<12} metrics {metrics:>3}  calls {calls}")


def test_gpu_launches_of_the_parameter_kinds():
    """The launches accumulate_many makes of GPT-2's 28 parameters on a GPU
    (csrc/cuda/many_plan.h, run by the emulation harness with the device
    flag off, so no kernel reads anything): at least 3 x fewer than one per
    parameter."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "cuda_emu"))
    import emu_build

    emu = emu_build.load()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    params = [p.detach() for p in transformers.GPT2LMHeadModel(cfg).parameters()]
    ring = torch.zeros((1, len(params), hookcap._layout.HEADER), dtype=torch.int64)
    off = torch.tensor([0, 0, 0])  # the kernels return at once
    launches = emu.accumulate_many(params, ring, off, list(range(len(params))), 0, 0.0, 0.0, 0,
                                   256 * 64, 4 * 132, 256)
    print(f"\nGPU launches for GPT-2's {len(params)} parameters (param or param_grad): {len(launches)} "
          f"(tensors per launch: {launches})")
    assert sum(launches) == len(params) and len(launches) * 3 <= len(params)
