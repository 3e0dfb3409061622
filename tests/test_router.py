"""Mixture-of-experts routing: ``accumulate_bins`` (each index element's
value into the row of the bin it names: counts are exactly torch.bincount,
the other statistics float64's of each bin's weights), ``tap(indices, name,
bins=)``, the capture kind ``"router"`` (tokens per expert, load balance,
z-loss, entropy) on a plain top-k router and HF MoE models, and the
``Threshold`` detector naming a dead expert."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_stats_match, decoded, ring_for
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, Monitor, _layout, _ops
from hookcap.functional import new_state
from hookcap.reference import tensor_stats

OPS = torch.ops.hookcap


def bin_values(index, weight, b):
    """Float64 values of bin ``b``: the weights of the elements equal to b, or ones."""
    sel = index.reshape(-1) == b
    if weight is None:
        return torch.ones(int(sel.sum()), dtype=torch.float64)
    return weight.reshape(-1)[sel].double()


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([0, 1, 7, 300, 40_000]), bins=st.integers(1, 20),
       idx_dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
       w_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       hist=st.sampled_from([None, Histogram.log2(), Histogram.linear(0, 1, 10)]),
       outside=st.booleans(), skip=st.booleans(), seed=st.integers(0, 2**16))
def test_bins_equal_bincount_and_float64_of_each_bin(n, bins, idx_dtype, w_dtype, hist, outside, skip, seed):
    """Bin b's row: count = bincount exactly; with weights, the float64
    statistics of the weights naming b (counts, extrema, bins exactly);
    elements outside [0, bins) in no bin; a -1 row not written."""
    g = torch.Generator().manual_seed(seed)
    lo = -2 if outside and idx_dtype != torch.uint8 else 0
    index = torch.randint(lo, bins + (3 if outside else 0), (n,), generator=g).to(idx_dtype)
    weight = None if w_dtype is None else torch.rand(n, generator=g).to(w_dtype)
    if weight is not None and n > 3:
        weight[1] = float("nan")
        weight[2] = 0.0
    ring = ring_for(bins + 1, hist)
    rows = [b + 1 for b in range(bins)]
    if skip:
        rows[0] = -1
    _ops.accumulate_bins(index, weight, ring, new_state("cpu"), rows, hist)
    counts = torch.bincount(index.long().clamp(min=-1).masked_fill((index.long() < 0) | (index.long() >= bins), bins),
                            minlength=bins + 1)[:bins]
    assert ring[0, 0, _layout.CALLS] == 0  # row 0: nobody's
    for b in range(bins):
        row = decoded(ring, b + 1, hist)
        if rows[b] < 0:
            assert ring[0, b + 1, _layout.CALLS] == 0 and row["count"] == 0
            continue
        assert row["count"] == counts[b], b
        assert ring[0, b + 1, _layout.CALLS] == 1
        vals = bin_values(index, weight, b)
        assert_stats_match(row, tensor_stats(vals, hist), abs_sum=float(vals.nan_to_num().abs().sum()))


def test_bins_merge_calls_and_skip_off_steps():
    """Two calls into the same rows add up (counts, sums, extrema); a state
    with recording off writes nothing."""
    index = torch.tensor([0, 1, 1, 3, 3, 3])
    weight = torch.tensor([0.5, 0.25, 0.75, 0.1, 0.2, 0.3])
    ring = ring_for(4, None)
    st = new_state("cpu")
    _ops.accumulate_bins(index, weight, ring, st, [0, 1, 2, 3], None)
    _ops.accumulate_bins(index[:3], weight[:3] * 2, ring, st, [0, 1, 2, 3], None)
    assert [decoded(ring, b, None)["count"] for b in range(4)] == [2, 4, 0, 3]
    r1 = decoded(ring, 1, None)
    assert r1["max"] == 1.5 and r1["min"] == 0.25 and r1["sum"] == pytest.approx(0.25 + 0.75 + 0.5 + 1.5)
    assert ring[0, 2, _layout.CALLS] == 2  # a bin no element named: written, count 0
    off = ring_for(4, None)
    st_off = new_state("cpu")
    st_off[1] = 0
    _ops.accumulate_bins(index, weight, off, st_off, [0, 1, 2, 3], None)
    assert off[0, :, _layout.CALLS].sum() == 0 and off[0, :, _layout.COUNT].sum() == 0


@pytest.mark.parametrize("bad, match", [
    (dict(index=torch.zeros(3)), "integer tensor"),
    (dict(weight=torch.zeros(2)), "number of elements"),
    (dict(weight=torch.zeros(3, dtype=torch.int32)), "weight must be"),
    (dict(index=torch.zeros(3, 2, dtype=torch.long).t()), "contiguous"),
    (dict(rows=[0, 9]), "out of range"),
    (dict(rows=[]), "one row per bin"),
])
def test_bins_bad_input_is_a_clear_error(bad, match):
    args = dict(index=torch.zeros(3, dtype=torch.long), weight=None, rows=[0, 1])
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        OPS.accumulate_bins(args["index"], args["weight"], ring_for(2, None), new_state("cpu"), args["rows"],
                            *_ops.hist_args(None))


def test_bins_opcheck():
    from torch.library import opcheck

    ring = ring_for(4, Histogram.log2())
    args = (torch.tensor([[0, 2], [1, 2]]), torch.rand(2, 2), ring, new_state("cpu"), [0, 1, 3],
            *_ops.hist_args(Histogram.log2()))
    opcheck(OPS.accumulate_bins.default, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# -- tap(bins=) ----------------------------------------------------------------------------------------


def test_tap_bins_counts_are_bincount_and_weights_their_stats():
    model = nn.Linear(4, 4)
    mon = Monitor(model, capture="output").attach()
    g = torch.Generator().manual_seed(0)
    want_counts, want_mean = [], []
    for _ in range(3):
        model(torch.randn(2, 4))
        idx = torch.randint(-1, 6, (50, 2), generator=g)  # -1: dropped, in no expert
        w = torch.rand(50, 2, generator=g)
        hookcap.tap(idx, "moe.choice", bins=6, weights=w)
        valid = idx >= 0
        want_counts.append(torch.bincount(idx[valid], minlength=6).double().numpy())
        want_mean.append([w[idx == e].double().mean().item() if (idx == e).any() else math.nan for e in range(6)])
        mon.step()
    h = mon.history()
    mon.detach()
    np.testing.assert_array_equal(h.groups("moe.choice", "count"), np.stack(want_counts))
    np.testing.assert_allclose(h.groups("moe.choice", "mean"), np.array(want_mean), rtol=1e-6)
    assert h["count"][:, h.column("moe.choice")].tolist() == [c.sum() for c in want_counts]  # the whole: all groups


def test_tap_bins_without_weights_and_bad_arguments():
    mon = Monitor(nn.Linear(2, 2), capture="output").attach()
    idx = torch.tensor([0, 0, 2], dtype=torch.int32)
    hookcap.tap(idx, "r", bins=3)
    mon.step()
    h = mon.history()
    np.testing.assert_array_equal(h.groups("r", "count")[0], [2, 0, 1])
    np.testing.assert_array_equal(h.groups("r", "sum")[0], [2, 0, 1])  # a value of 1 per element
    with pytest.raises(TypeError, match="integer tensor"):
        hookcap.tap(torch.zeros(3), "r", bins=3)
    with pytest.raises(ValueError, match="bins must be"):
        hookcap.tap(idx, "r", bins=0)
    with pytest.raises(TypeError, match="weights must be"):
        hookcap.tap(idx, "r", bins=3, weights=torch.zeros(2))
    with pytest.raises(TypeError, match="weights= goes with bins="):
        hookcap.tap(torch.zeros(3), "r", weights=torch.zeros(3))
    mon.detach()


# -- capture kind "router" -----------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """A plain PyTorch top-k router: (logits, normalised top-k weights, indices)."""

    def __init__(self, d, experts, k):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=True)
        self.k = k

    def forward(self, x):
        logits = self.gate(x.reshape(-1, x.shape[-1]))
        w, idx = torch.topk(torch.softmax(logits, -1), self.k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), idx


class TinyMoE(nn.Module):
    def __init__(self, d=8, experts=6, k=2):
        super().__init__()
        self.router = TopKRouter(d, experts, k)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        logits, w, idx = self.router(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if len(tok):
                out[tok] += w[tok, slot, None] * expert(flat[tok])
        return out.reshape(x.shape)


def reference_router(logits, idx, experts):
    lf = logits.double()
    lse = torch.logsumexp(lf, -1)
    p = torch.softmax(lf, -1)
    ent = -(p * torch.log(p)).nan_to_num().sum(-1)
    counts = torch.bincount(idx.reshape(-1), minlength=experts).double()
    return lse, ent, counts


def test_router_metrics_equal_float64():
    torch.manual_seed(0)
    model = TinyMoE()
    seen = []
    model.router.register_forward_hook(lambda m, a, o: seen.append((o[0].detach(), o[2].detach())))
    mon = Monitor(model, capture="router").attach()
    for _ in range(2):
        model(torch.randn(3, 10, 8)).sum().backward()
        mon.step()
    h = mon.history()
    mon.detach()
    for s, (logits, idx) in enumerate(seen):
        lse, ent, counts = reference_router(logits, idx, 6)
        np.testing.assert_array_equal(h.groups("router/router.tokens", "count")[s], counts.numpy())
        load = {k: h[k][s, h.column("router/router.load")] for k in ("max", "mean", "std", "zeros", "min")}
        assert load["max"] == counts.max() and load["min"] == counts.min() and load["zeros"] == (counts == 0).sum()
        assert load["mean"] == pytest.approx(counts.mean().item(), rel=1e-12)
        assert load["std"] == pytest.approx(counts.std(unbiased=False).item(), rel=1e-9)
        z = h["mean"][s, h.column("router/router.z")]
        assert z == pytest.approx((lse**2).mean().item(), rel=1e-5)
        e = h["mean"][s, h.column("router/router.entropy")]
        assert e == pytest.approx(ent.mean().item(), rel=1e-5)
        assert h["min"][s, h.column("router/router.entropy")] == pytest.approx(ent.min().item(), rel=1e-5)
    # Only the router is a router: no other module gets router metrics.
    assert {n.split("/")[0] for n in h.names if "/router." in n} == {"router"}


class GivenLogits(nn.Module):
    """A router over logits it is given: ``(logits, top-2 weights, top-2 choices)``."""

    def forward(self, logits):
        w, idx = torch.softmax(logits, -1).topk(2, -1)
        return logits, w, idx


def test_router_z_and_entropy_of_odd_tokens_and_the_model_untouched():
    """A token whose logits are all -inf has z inf and entropy -inf (counted
    as such, outside the sums), a NaN logit makes both NaN; the other tokens'
    z and entropy equal float64. The logits the router returns, which the
    model differentiates through, keep their values, version and gradient."""
    torch.manual_seed(3)
    base = torch.randn(7, 5, dtype=torch.float32) * 2
    base[2] = float("-inf")
    base[4, 1] = float("nan")
    logits = base.clone().requires_grad_(True)
    router = GivenLogits()
    mon = Monitor(router, capture="router").attach()
    out = router(logits * 1.0)
    version = out[0]._version
    (out[0].nan_to_num(0.0, 0.0, 0.0) ** 2).sum().backward()
    mon.step()
    h = mon.history()
    mon.detach()
    assert out[0]._version == version
    assert torch.equal(logits.grad.nan_to_num(), (2 * base).nan_to_num(0.0, 0.0, 0.0))
    ok = [i for i in range(7) if i not in (2, 4)]
    lse, ent, _ = reference_router(base[ok], torch.zeros(len(ok), 2, dtype=torch.long), 5)
    z, e = h.column("./router.z"), h.column("./router.entropy")
    assert h["posinf"][0, z] == 1 and h["nan"][0, z] == 1 and h["count"][0, z] == 7
    assert h["neginf"][0, e] == 1 and h["nan"][0, e] == 1 and h["count"][0, e] == 7
    assert h["mean"][0, z] == pytest.approx((lse**2).mean().item(), rel=1e-5)
    assert h["mean"][0, e] == pytest.approx(ent.mean().item(), rel=1e-5)
    assert h["min"][0, e] == pytest.approx(ent.min().item(), rel=1e-5)


def test_dead_expert_is_named_by_threshold():
    """An expert whose gate bias keeps every token away: its group count is
    0 at every step and Threshold names that group after `steps` steps."""
    torch.manual_seed(1)
    model = TinyMoE()
    with torch.no_grad():
        model.router.gate.bias[4] = -1e4  # expert 4: dead
    det = hookcap.Threshold("count", below=1, steps=3, metrics="*/router.tokens", groups=True)
    mon = Monitor(model, capture="router", detectors=[det], on_anomaly=None).attach()
    for _ in range(4):
        model(torch.randn(4, 8, 8))
        mon.step()
    mon.detach()
    h = mon.history()
    found = h.anomalies
    assert (h.groups("router/router.tokens", "count")[:, 4] == 0).all()
    assert [(a.name, a.kind, a.step) for a in found] == [("router/router.tokens[4]", "threshold", 2)]
    assert h["zeros"][:, h.column("router/router.load")].tolist() == [1, 1, 1, 1]


def test_hf_moe_with_the_trainer_callback_names_a_planted_dead_expert(tmp_path):
    """HF OLMoE (tiny config) trained by the HF Trainer with HookcapCallback:
    every layer's router recorded at every step; tokens per expert equal
    the bincount of the router's real choices; expert 3 of layer 1, never
    chosen (its logit forced to -inf before the top-k), is named."""
    transformers = pytest.importorskip("transformers")
    from hookcap.integrations.transformers import HookcapCallback

    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(cfg)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == 2
    choices = {0: [], 1: []}

    def dead3(mod, args, out):
        logits = out[0].clone()
        logits[:, 3] = float("-inf")
        w, idx = torch.topk(torch.softmax(logits.float(), -1), mod.top_k, dim=-1)
        return out[0], (w / w.sum(-1, keepdim=True)).to(out[1].dtype), idx

    routers[1].register_forward_hook(dead3)
    for i, r in enumerate(routers):
        r.register_forward_hook(lambda m, a, out, i=i: choices[i].append(out[2].detach().clone()) if m.training
                                else None)
    det = hookcap.Threshold("count", below=1, steps=2, metrics="*/router.tokens", groups=True)
    cb = HookcapCallback(capture=("router",), detectors=[det], on_anomaly=None)

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                          save_strategy="no", report_to=[], use_cpu=True, logging_steps=1,
                                          dataloader_num_workers=0, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    h = cb.monitor.history()
    names = [f"model.layers.{i}.mlp.gate/router.tokens" for i in (0, 1)]
    for i, name in enumerate(names):
        want = np.stack([torch.bincount(c.reshape(-1), minlength=4).double().numpy() for c in choices[i]])
        np.testing.assert_array_equal(h.groups(name, "count"), want)
        for m in ("load", "z", "entropy"):
            assert np.isfinite(h["mean"][:, h.column(name.replace("tokens", m))]).all()
    assert (h.groups(names[1], "count")[:, 3] == 0).all()
    assert {(a.name, a.kind) for a in h.anomalies} == {(names[1] + "[3]", "threshold")}


def test_compiled_router_and_bins_tap_record_like_eager():
    """Inside torch.compile: the router is recorded as in eager mode (an
    opaque op in the graph), on recorded steps only, and tap(bins=) runs
    eagerly and records the exact counts."""

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyMoE()
        mon = Monitor(model, capture="router", every=2).attach()
        fn = torch.compile(model) if compiled else model
        outs = []
        for _ in range(4):
            outs.append(fn(torch.randn(2, 5, 8)))
            mon.step()
        mon.detach()
        return mon.history(), outs

    (eager, out_e), (comp, out_c) = run(False), run(True)
    for a, b in zip(out_e, out_c):
        torch.testing.assert_close(a, b)
    assert comp.steps.tolist() == eager.steps.tolist()
    np.testing.assert_array_equal(comp.groups("router/router.tokens", "count"),
                                  eager.groups("router/router.tokens", "count"))
    for m in ("z", "entropy", "load"):
        np.testing.assert_allclose(comp["mean"][:, comp.column(f"router/router.{m}")],
                                   eager["mean"][:, eager.column(f"router/router.{m}")], rtol=1e-5)

    @torch.compile
    def choose(logits):
        idx = torch.topk(logits, 2, dim=-1).indices
        hookcap.tap(idx, "choice", bins=6)
        return idx * 1

    mon = Monitor(nn.Linear(2, 2), capture="output").attach()
    idx = choose(torch.randn(10, 6))
    mon.step()
    h = mon.history()
    mon.detach()
    np.testing.assert_array_equal(h.groups("choice", "count")[-1], torch.bincount(idx.reshape(-1), minlength=6))


def test_compiled_router_fullgraph_one_graph_for_every_step():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    router = TopKRouter(8, 6, 2)
    mon = Monitor(router, capture="router", every=2).attach()
    fn = torch.compile(router, fullgraph=True)
    xs = [torch.randn(12, 8) for _ in range(4)]
    graphs = []
    for x in xs:
        fn(x)
        graphs.append(counters["stats"]["unique_graphs"])
        mon.step()
    mon.detach()
    h = mon.history()
    assert graphs[0] >= 1 and len(set(graphs)) == 1  # no recompile at the off-steps or back
    assert h.steps.tolist() == [0, 2]
    for s, x in zip((0, 1), (xs[0], xs[2])):
        idx = router(x)[2]
        np.testing.assert_array_equal(h.groups("./router.tokens", "count")[s], torch.bincount(idx.reshape(-1), minlength=6))


def test_hf_switch_transformers_capacity_kept_wanted_and_dropped():
    """HF Switch Transformers' top-1 router returns a dispatch mask after
    capacity: router.tokens counts the kept tokens per expert, router.wanted
    the tokens whose top expert it is (before capacity), router.dropped the
    tokens none took; all equal the router's own tensors."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwitchTransformersConfig(vocab_size=64, d_model=16, d_kv=8, d_ff=16, num_layers=2,
                                                num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=3,
                                                encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=0,
                                                pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    routers = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Top1Router")}
    assert routers
    seen = {n: [] for n in routers}
    for n, m in routers.items():
        m.register_forward_hook(lambda mod, a, out, n=n: seen[n].append((out[0].detach().clone(),
                                                                          out[2].detach().clone())))
    mon = Monitor(model, capture="router").attach()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    mon.step()
    mon.detach()
    h = mon.history()
    for n in routers:
        (mask, logits), = seen[n]
        kept = mask.reshape(-1, 4).sum(0).double().numpy()
        wanted = torch.bincount(logits.reshape(-1, 4).argmax(-1), minlength=4).double().numpy()
        dropped = int((mask.reshape(-1, 4).sum(-1) == 0).sum())
        np.testing.assert_array_equal(h.groups(f"{n}/router.tokens", "count")[0], kept)
        np.testing.assert_array_equal(h.groups(f"{n}/router.wanted", "count")[0], wanted)
        assert h["sum"][0, h.column(f"{n}/router.dropped")] == dropped
        assert h["count"][0, h.column(f"{n}/router.dropped")] == mask.numel() // 4
    assert any(h["sum"][0, h.column(f"{n}/router.dropped")] > 0 for n in routers)  # capacity 3 of 16 tokens
