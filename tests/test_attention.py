"""Capture kind "attention": per head, the max logit and statistics of the
allowed pre-softmax logits, and per query row the logsumexp and entropy,
inside F.scaled_dot_product_attention, against float64 from the same q, k
and mask: causal, padded, additive, grouped-query and cross attention, in
tiles; a planted large-logit head in HF GPT-2 is the one flagged."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (abs_sum, assert_stats_match, attention_reference, attention_rows_ref, attention_tile, decoded,
                      ring_for)
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, Monitor, _layout, _ops
from hookcap.functional import new_state
from hookcap.reference import tensor_stats


class _Attn(nn.Module):
    """Calls F.scaled_dot_product_attention with the q, k, v it is given."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kw)


def assert_rows_match(logits, lse, ent, ref, rtol=1e-5):
    """attention_rows' outputs (and its in-place causal mask) against
    attention_rows_ref's float64: -inf where the reference is, NaN where it is."""
    x64, lse64, ent64 = ref
    np.testing.assert_array_equal(torch.isneginf(logits).numpy(), torch.isneginf(x64).numpy())
    for got, want in ((lse, lse64), (ent, ent64)):
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=rtol, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 70), st.integers(-1, 80), st.booleans(),
       st.booleans(), st.integers(0, 2**16))
def test_attention_rows_match_float64(heads, rows, keys, causal_row0, peaked, holes, seed):
    """Per row, logsumexp and entropy equal float64 within 1e-5 relative
    (peaked rows of entropy ~1e-7 nats, ties at the max, -inf holes, rows
    with no allowed key), and the causal mask is written -inf in place."""
    x = attention_tile(seed, (2, heads, rows, keys), peaked=peaked, holes=holes)
    ref = attention_rows_ref(x, causal_row0)
    lse, ent = _ops.attention_rows(x, causal_row0)
    assert lse.shape == ent.shape == x.shape[:-1] and lse.dtype == torch.float32
    assert_rows_match(x, lse, ent, ref)


def test_attention_rows_nan_inf_and_bad_input():
    """A row holding NaN or +inf gives NaN (as softmax); the others are
    unharmed; a tile that is not contiguous float32 is refused."""
    x = attention_tile(1, (3, 9), holes=False)
    x[0, 4], x[1, 2] = float("nan"), float("inf")
    lse, ent = _ops.attention_rows(x.clone())
    assert lse[:2].isnan().all() and ent[:2].isnan().all()
    ref = attention_rows_ref(x[2:])
    np.testing.assert_allclose(lse[2:].double(), ref[1], rtol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        _ops.attention_rows(x.double())
    with pytest.raises(RuntimeError, match="contiguous float32"):
        _ops.attention_rows(x.t())
    with pytest.raises(RuntimeError, match="causal_row0"):
        _ops.attention_rows(x, -2)
    torch.library.opcheck(torch.ops.hookcap.attention_rows.default, (attention_tile(2, (2, 3, 5)), 1))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40), st.integers(1, 300), st.integers(-1, 60),
       st.booleans(), st.sampled_from([None, Histogram.log2(), Histogram.linear(-8, 8, 12)]), st.sampled_from([2, 4]),
       st.integers(0, 2**16))
def test_accumulate_attention_rows_equal_float64_per_head(batch, heads, rows, keys, causal_row0, peaked, hist,
                                                          moments, seed):
    """accumulate_attention: the causal mask written as attention_rows
    writes it, and per head its logits' row equals float64 statistics of
    the head's masked logits (counts, extrema and bins exactly), its lse and
    entropy rows those of attention_rows' outputs; a head's rows -1 are left
    untouched, and count and calls add up as the grouped op's do. Tiles of
    up to 300 keys: several rows per pushed chunk, and a chunk per row."""
    x = attention_tile(seed, (batch, heads, rows, keys), peaked=peaked)
    ref = attention_rows_ref(x, causal_row0)
    lse, ent = _ops.attention_rows(x.clone(), causal_row0)
    skip = heads - 1 if heads > 1 else None  # that head's lse is not recorded
    ring = ring_for(3 * heads + 1, hist)
    rows_of = [[1 + m * heads + h for h in range(heads)] for m in range(3)]
    if skip is not None:
        rows_of[1][skip] = -1
    got_x = x.clone()
    for _ in range(2):  # a second call merges into the same rows
        got_x = x.clone()
        _ops.accumulate_attention(got_x, causal_row0, ring, new_state("cpu"), *rows_of, hist, moments)
    np.testing.assert_array_equal(torch.isneginf(got_x).numpy(), torch.isneginf(ref[0]).numpy())
    for m, whole in enumerate((got_x, lse, ent)):
        for h in range(heads):
            if rows_of[m][h] < 0:
                assert decoded(ring, 1 + m * heads + h, hist)["count"] == 0
                continue
            part = torch.cat([whole[:, h]] * 2)
            got = decoded(ring, rows_of[m][h], hist)
            assert ring[0, rows_of[m][h], _layout.CALLS] == 2
            assert_stats_match(got, tensor_stats(part, hist), abs_sum=abs_sum(part))
    assert decoded(ring, 0, hist)["count"] == 0


def test_accumulate_attention_bad_input_and_opcheck():
    """Wrong shapes and row lists are refused before anything is written;
    the op passes opcheck (schema, Meta kernel, fake tensors)."""
    ring, st0 = ring_for(7, None), new_state("cpu")
    x = attention_tile(3, (2, 2, 4, 6))
    with pytest.raises(RuntimeError, match=r"\[batch, heads, rows, keys\]"):
        _ops.accumulate_attention(x[0], 0, ring, st0, [0, 1], [2, 3], [4, 5], None)
    with pytest.raises(RuntimeError, match="2 heads but 1 rows"):
        _ops.accumulate_attention(x, 0, ring, st0, [0, 1], [2], [4, 5], None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        _ops.accumulate_attention(x.double(), 0, ring, st0, [0, 1], [2, 3], [4, 5], None)
    assert ring.abs().sum() == ring_for(7, None).abs().sum()
    torch.library.opcheck(torch.ops.hookcap.accumulate_attention.default,
                          (x, 0, ring, st0, [0, 1], [2, -1], [4, 5], *_ops.hist_args(None)))


def test_attention_qk_is_for_cuda_and_checks_its_input():
    """attention_qk (the on-chip kernel) is not offered off CUDA, and its CPU
    kernel refuses with a clear error; wrong shapes or row lists are refused
    by its checks (Meta) before anything runs; the capture on the CPU takes
    the tiles (test_attention_matches_float64's cases)."""
    ops = torch.ops.hookcap
    q, k = torch.randn(1, 2, 4, 16).bfloat16(), torch.randn(1, 2, 6, 16).bfloat16()
    hist = _ops.hist_args(Histogram.log2())
    ring, st0 = ring_for(7, Histogram.log2()), new_state("cpu")
    assert ops.attention_qk_supported(q, k, *hist, ring.shape[2]) is False
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        ops.attention_qk(q, k, True, 0.25, ring, st0, [0, 1], [2, 3], [4, 5], *hist)
    meta = {name: t.to("meta") for name, t in (("q", q), ("k", k), ("ring", ring), ("state", st0))}
    ops.attention_qk(meta["q"], meta["k"], True, 0.25, meta["ring"], meta["state"], [0, 1], [2, 3], [4, -1], *hist)
    with pytest.raises(RuntimeError, match="2 heads but 1 rows"):
        ops.attention_qk(meta["q"], meta["k"], True, 0.25, meta["ring"], meta["state"], [0, 1], [2], [4, 5], *hist)
    with pytest.raises(RuntimeError, match=r"\[batch, heads, tokens, head_dim\]"):
        ops.attention_qk(meta["q"][0], meta["k"][0], True, 0.25, meta["ring"], meta["state"], [0, 1], [2, 3],
                         [4, 5], *hist)
    with pytest.raises(RuntimeError, match="row"):
        ops.attention_qk(meta["q"], meta["k"], True, 0.25, meta["ring"], meta["state"], [0, 99], [2, 3], [4, 5],
                         *hist)
    assert ring.abs().sum() == ring_for(7, Histogram.log2()).abs().sum()


CASES = {  # q shape, k shape, sdpa kwargs, mask maker
    "causal": ((2, 4, 9, 8), (2, 4, 9, 8), {"is_causal": True}, None),
    "padded": ((2, 4, 7, 8), (2, 4, 7, 8), {}, lambda: torch.tensor([[1] * 7, [1] * 4 + [0] * 3],
                                                                    dtype=torch.bool)[:, None, None, :]),
    "additive": ((1, 2, 6, 16), (1, 2, 6, 16), {}, lambda: torch.where(
        torch.ones(6, 6, dtype=torch.bool).tril(), torch.randn(6, 6), torch.finfo(torch.float32).min)),
    "gqa": ((2, 8, 5, 8), (2, 2, 5, 8), {"is_causal": True, "enable_gqa": True}, None),
    "cross": ((3, 2, 4, 8), (3, 2, 11, 8), {}, None),
    "3d": ((4, 6, 8), (4, 6, 8), {"is_causal": True}, None),
}


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("tile", [1 << 22, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_per_head_logits_lse_entropy_match_float64(case, tile, joint, monkeypatch):
    """joint=False: each tile's three metrics written one by one (attention_rows,
    then the grouped op per metric), as where their rows lie in different rings."""
    import hookcap._capture.attention as att
    from hookcap._rows.recorder import Recorder

    monkeypatch.setattr(att, "TILE_VALUES", tile)  # 40: a tile of one or two query rows
    if not joint:
        monkeypatch.setattr(Recorder, "write_joint", lambda *a, **k: False)
    torch.manual_seed(0)
    qs, ks, kw, make_mask = CASES[case]
    mask = make_mask() if make_mask else None
    if mask is not None:
        kw = {**kw, "attn_mask": mask}
    q, k = torch.randn(qs) * 2, torch.randn(ks) * 2
    v = torch.randn(ks[:-1] + (4,))
    model = nn.ModuleDict({"0": _Attn(**kw)})
    mon = Monitor(model, capture=("attention",)).attach()
    model["0"](q, k, v)
    mon.step()
    mon.detach()
    h = mon.history()
    ref = attention_reference(q, k, mask, kw.get("is_causal", False))
    got = lambda m, s: h.groups(f"0/attn.{m}", s)[0]  # noqa: E731
    np.testing.assert_allclose(got("logit", "max"), ref["max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("logit", "min"), ref["min"].numpy(), rtol=1e-5)
    np.testing.assert_array_equal(got("logit", "finite"), ref["finite"].numpy())
    # Masked logits counted as -inf, those a causal tile leaves uncomputed too: every logit counted once.
    np.testing.assert_array_equal(got("logit", "neginf"), ref["neginf"].numpy())
    np.testing.assert_array_equal(got("logit", "count"), ref["count"].numpy())
    np.testing.assert_allclose(got("lse", "min"), ref["lse_min"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("lse", "max"), ref["lse_max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("entropy", "mean"), ref["ent_mean"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got("entropy", "min"), ref["ent_min"].numpy(), rtol=1e-5, atol=1e-6)
    assert not h.anomalies  # masked logits are -inf by construction, not a fault
    assert F.scaled_dot_product_attention is hookcap._capture.attention._ORIGINAL  # unwrapped at detach


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_gpt2_flags_the_planted_head(impl):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16,
                                  attn_implementation=impl)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # layer 1, head 2: its queries (c_attn's first n_embd outputs) x 8
        model.transformer.h[1].attn.c_attn.weight[:, 16:24] *= 8.0
    # The planted head's max logit is ~0.25, the others' below 0.05 (random init): τ = 0.1.
    qk_clip = hookcap.Threshold("max", above=0.1, metrics="*/attn.logit", groups=True)
    mon = Monitor(model, capture=("output", "attention"), every=2,
                  detectors=[hookcap.NonFinite(), qk_clip]).attach()
    for _ in range(3):
        model(torch.randint(0, 50, (2, 12)), labels=torch.randint(0, 50, (2, 12))).loss.backward()
        mon.step()
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 2]  # off-steps record nothing
    for layer in (0, 1):
        assert h.groups(f"transformer.h.{layer}.attn/attn.logit", "max").shape == (2, 4)
    assert (np.argmax(h.groups("transformer.h.1.attn/attn.logit", "max"), axis=1) == 2).all()
    assert [(a.kind, a.name, a.step) for a in h.anomalies] == [("threshold", "transformer.h.1.attn/attn.logit[2]", 0)]


def test_a_query_row_with_no_allowed_key_is_minus_inf_not_a_fault():
    q = torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False  # query row 1 sees no key (sdpa's output there is NaN)
    model = nn.ModuleDict({"0": _Attn(attn_mask=mask)})
    mon = Monitor(model, capture=("attention",)).attach()
    model["0"](q, q, q)
    mon.step()
    mon.detach()
    h = mon.history()
    for metric in ("0/attn.lse", "0/attn.entropy"):
        assert h.groups(metric, "neginf")[0].tolist() == [1, 1] and h.groups(metric, "nan")[0].tolist() == [0, 0]
    assert not h.anomalies


def test_multihead_attention_without_weights():
    """nn.MultiheadAttention(need_weights=False) goes through
    F.scaled_dot_product_attention: its heads' max logits equal float64 from
    its own in-projection."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    model = nn.ModuleDict({"mha": mha})
    x = torch.randn(2, 5, 16)
    mon = Monitor(model, capture=("attention",)).attach()
    mha(x, x, x, need_weights=False)
    mon.step()
    mon.detach()
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q = (x.double() @ w[:16].T + b[:16]).view(2, 5, 4, 4).transpose(1, 2)
    k = (x.double() @ w[16:32].T + b[16:32]).view(2, 5, 4, 4).transpose(1, 2)
    want = (q @ k.transpose(-1, -2) / 2.0).amax(dim=(0, 2, 3))
    np.testing.assert_allclose(mon.history().groups("mha/attn.logit", "max")[0], want.detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_llama_gqa_matches_float64_with_padding(impl, monkeypatch):
    """A Llama-style model with grouped-query attention (4 query heads, 2 key
    heads), one sequence right-padded: per head, the max logit, logsumexp
    range and mean entropy equal float64 from the q and k HF's attention
    received (sdpa: through F.scaled_dot_product_attention; eager: the
    model's own function, through transformers' AttentionInterface)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama import modeling_llama

    seen = []

    def recording(fn):
        def rec(module, query, key, *args, **kwargs):
            seen.append((query.detach().clone(), key.detach().clone()))
            return fn(module, query, key, *args, **kwargs)
        return rec

    if impl == "eager":
        monkeypatch.setattr(modeling_llama, "eager_attention_forward",
                            recording(modeling_llama.eager_attention_forward))
    else:
        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa",
                            recording(AttentionInterface._global_mapping["sdpa"]))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation=impl)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 10))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, 6:] = 0  # sequence 1: 6 tokens, then padding
    mon = Monitor(model, capture="attention").attach()
    model(ids, attention_mask=pad, labels=ids).loss.backward()
    mon.step()
    mon.detach()
    h = mon.history()
    assert len(seen) == 2
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()[None, None] & pad.bool()[:, None, None, :]
    for layer, (q, k) in enumerate(seen):
        ref = attention_reference(q, k, allowed, False)
        got = lambda m, stat: h.groups(f"model.layers.{layer}.self_attn/attn.{m}", stat)[0]  # noqa: E731
        np.testing.assert_allclose(got("logit", "max"), ref["max"].numpy(), rtol=1e-5)
        np.testing.assert_array_equal(got("logit", "finite"), ref["finite"].numpy())
        np.testing.assert_array_equal(got("logit", "neginf"), ref["neginf"].numpy())
        np.testing.assert_allclose(got("lse", "max"), ref["lse_max"].numpy(), rtol=1e-5)
        np.testing.assert_allclose(got("lse", "min"), ref["lse_min"].numpy(), rtol=1e-5)
        np.testing.assert_allclose(got("entropy", "mean"), ref["ent_mean"].numpy(), rtol=1e-5, atol=1e-6)
    assert AttentionInterface.__dict__["get_interface"] is not hookcap._capture.attention._hf_get_interface  # detached


def test_compiled_attention_records_per_head_like_eager():
    """Under torch.compile(fullgraph=True) (no graph break), the attention
    internals are recorded per head for the innermost watched module, equal
    to eager's, on recorded steps only (every=2: no recompile)."""
    torch._dynamo.reset()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.attn = _Attn(is_causal=True)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4)
            return self.attn(q, k, v).sum()

    def run(compiled):
        torch.manual_seed(0)
        net = Net()
        mon = Monitor(net, capture="attention", every=2).attach()
        fn = torch.compile(net, fullgraph=True) if compiled else net
        for _ in range(4):
            fn(torch.randn(2, 6, 16)).backward()
            mon.step()
        mon.detach()
        return mon.history()

    from torch._dynamo.utils import counters

    counters.clear()
    eager, comp = run(False), run(True)
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 2]
    assert sorted(comp.names) == sorted(eager.names) and "attn/attn.logit[3]" in comp.names
    for stat in ("count", "max", "mean", "min"):
        np.testing.assert_allclose(comp.groups("attn/attn.logit", stat), eager.groups("attn/attn.logit", stat),
                                   rtol=1e-5)
        np.testing.assert_allclose(comp.groups("attn/attn.entropy", stat), eager.groups("attn/attn.entropy", stat),
                                   rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for recorded and off-steps alike


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_compiled_hf_gpt2_records_attention_like_eager(impl):
    """HF GPT-2 under torch.compile records each layer's per-head attention
    metrics as eager does, with sdpa and with the model's own eager attention
    (the AttentionInterface's function, observed through the opaque op)."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16,
                                  attn_implementation=impl, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def run(compiled):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        mon = Monitor(model, capture="attention", every=2).attach()
        fn = torch.compile(model) if compiled else model
        for _ in range(3):
            fn(torch.randint(0, 50, (2, 12)), labels=torch.randint(0, 50, (2, 12))).loss.backward()
            mon.step()
        mon.detach()
        return mon.history()

    eager, comp = run(False), run(True)
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 2]
    for layer in (0, 1):
        name = f"transformer.h.{layer}.attn/attn.logit"
        assert comp.groups(name, "max").shape == (2, 4)
        for stat in ("count", "max", "mean"):
            np.testing.assert_allclose(comp.groups(name, stat), eager.groups(name, stat), rtol=1e-4)
        np.testing.assert_allclose(comp.groups(f"transformer.h.{layer}.attn/attn.entropy", "min"),
                                   eager.groups(f"transformer.h.{layer}.attn/attn.entropy", "min"), rtol=1e-4)


def test_float32_attention_under_autocast_stays_float32():
    """A float32 attention called inside a bfloat16 autocast region: the
    recomputed logits are not autocast to bfloat16 (max logit, lse within 1e-5)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 33, 16) * 2, torch.randn(2, 4, 33, 16) * 2
    model = nn.ModuleDict({"0": _Attn(is_causal=True)})
    mon = Monitor(model, capture=("attention",)).attach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model["0"](q, k, k)
    mon.step()
    mon.detach()
    h = mon.history()
    ref = attention_reference(q, k, None, True)
    np.testing.assert_allclose(h.groups("0/attn.logit", "max")[0], ref["max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(h.groups("0/attn.lse", "max")[0], ref["lse_max"].numpy(), rtol=1e-5)


def test_attention_rows_baseline_cpu_loop_matches_float64():
    """The op's loop built for the baseline ISA (HOOKCAP_CPU_ISA=baseline, as
    CPUs without AVX2 run it) gives the same rows within 1e-5 of float64."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, hookcap\n"
        "from conftest import attention_rows_ref, attention_tile\n"
        "assert hookcap.build_info()['cpu_isa'] == 'baseline'\n"
        "x = attention_tile(11, (2, 3, 7, 45), peaked=True)\n"
        "ref = attention_rows_ref(x, 2)\n"
        "lse, ent = hookcap._ops.attention_rows(x, 2)\n"
        "assert torch.equal(torch.isneginf(x), torch.isneginf(ref[0]))\n"
        "for g, w in ((lse, ref[1]), (ent, ref[2])):\n"
        "    torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-12)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, HOOKCAP_CPU_ISA="baseline", PYTHONPATH=os.pathsep.join([root, here]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
