"""accumulate_groups: a tensor split along one dimension into groups of
consecutive slices (heads, experts, channels), each group's statistics in
its own row from one call, equal to float64 statistics of the group's slice
(counts, extrema and bins exactly, as the statistics op on that slice's
view; sums to the float loop's rounding), on both CPU paths: a view per
group (long runs, strided inputs, moments=4) and the gathered blocks (short
runs of a contiguous tensor: heads)."""

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import abs_sum, assert_stats_match, decoded, ring_for
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, Monitor, _layout, _ops
from hookcap.functional import new_state
from hookcap.reference import tensor_stats

OPS = torch.ops.hookcap


EXACT_COLS = [getattr(_layout, c) for c in ("COUNT", "NAN", "POSINF", "NEGINF", "ZEROS", "MIN", "MAX", "ABSMAX",
                                             "CALLS")]


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       hist=st.sampled_from([None, Histogram.log2(), Histogram.linear(-2, 2, 16),
                             Histogram.log2(-20, 8, sub=4, signed=True)]),
       transpose=st.booleans(), big=st.booleans(), moments=st.sampled_from([2, 4]))
def test_groups_equal_float64_of_each_slice(shape, data, dtype, hist, transpose, big, moments):
    """Every group's row equals float64 statistics of its slice (counts,
    extrema and bins exactly, as the statistics op on the slice's view), for
    any dim and group size, dtype and strided input. ``big``: a leading
    dimension of 3,000 (several gathered blocks per group, several threads).
    moments=4 reads a view per group: then rows equal the op's bit for bit."""
    if big:
        shape = [3000] + shape[:2]
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[0])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)  # a strided view: no copy is made
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1))
    extent = x.shape[dim]
    size = data.draw(st.sampled_from([d for d in range(1, extent + 1) if extent % d == 0]))
    groups = extent // size
    ring, each = ring_for(groups + 1, hist), ring_for(groups, hist)
    rows = list(range(1, groups + 1))  # row 0 left untouched
    _ops.accumulate_groups(x, ring, new_state("cpu"), rows, dim, size, hist, moments)
    for gi in range(groups):
        part = x.narrow(dim, gi * size, size)
        _ops.accumulate(part, each, new_state("cpu"), gi, hist, moments)
        got_raw, want_raw = ring[0, gi + 1].numpy(), each[0, gi].numpy()
        assert np.array_equal(got_raw[EXACT_COLS], want_raw[EXACT_COLS]), gi
        assert np.array_equal(got_raw[_layout.HEADER:], want_raw[_layout.HEADER:]), gi
        if moments == 4:
            assert np.array_equal(got_raw, want_raw), gi
        got = decoded(ring, gi + 1, hist)
        assert_stats_match(got, tensor_stats(part, hist), abs_sum=abs_sum(part))
    assert decoded(ring, 0, hist)["count"] == 0


def test_heads_of_a_projection_in_one_call():
    """The use it is for: [batch, tokens, heads * head_dim] split per head
    (dim -1, size head_dim), a planted outlier head seen in its own row,
    rows -1 skipped, and the whole tensor's row is the merge of the
    groups' rows (what the drain does with rows of one metric)."""
    torch.manual_seed(0)
    b, t, heads, hd = 2, 5, 4, 8
    x = torch.randn(b, t, heads * hd)
    x[..., 2 * hd:3 * hd] *= 100.0  # head 2
    ring = ring_for(heads, None)
    _ops.accumulate_groups(x, ring, new_state("cpu"), [0, 1, 2, -1], -1, hd, None)
    absmax = [decoded(ring, r, None)["absmax"] for r in range(3)]
    assert int(np.argmax(absmax)) == 2
    for r in range(3):
        assert absmax[r] == float(x[..., r * hd:(r + 1) * hd].abs().max())
    assert decoded(ring, 3, None)["count"] == 0  # group 3: not recorded
    whole = ring_for(1, None)
    _ops.accumulate_groups(x, whole, new_state("cpu"), [0], -1, heads * hd, None)
    _, merged = _layout.merge_groups(ring[0, :3].numpy(), np.zeros(3, dtype=np.int64))
    three = x[..., :3 * hd]
    got = {k: float(v) for k, v in _layout.decode(merged[0]).items()}
    assert_stats_match(got, tensor_stats(three, None), abs_sum=abs_sum(three))


def test_disabled_state_and_bad_arguments():
    x = torch.randn(3, 8)
    ring = ring_for(2, None)
    off = new_state("cpu")
    off[1] = 0
    _ops.accumulate_groups(x, ring, off, [0, 1], 1, 4, None)
    assert decoded(ring, 0, None)["count"] == 0
    for rows, dim, size, match in (([0, 1], 1, 3, "must divide"), ([0], 1, 4, "2 groups but 1 rows"),
                                   ([0, 9], 1, 4, "out of range"), ([0, 1], 2, 4, "dim 2 out of range")):
        with pytest.raises(RuntimeError, match=match):
            _ops.accumulate_groups(x, ring, new_state("cpu"), rows, dim, size, None)


@pytest.mark.parametrize("x,dim,size,h", [
    (torch.randn(4, 12), -1, 3, Histogram.log2()),
    (torch.randn(6, 5).t(), 0, 5, None),
    (torch.randn(2, 3, 8).to(torch.bfloat16), 2, 2, Histogram.linear(-1, 1, 5)),
])
def test_opcheck_accumulate_groups(x, dim, size, h):
    groups = x.shape[dim] // size
    ring = ring_for(groups, h)
    args = (x, ring, new_state("cpu"), list(range(groups)), dim, size) + (h.op_args() if h else (0, 0.0, 0.0, 0))
    torch.library.opcheck(torch.ops.hookcap.accumulate_groups.default, args)


class _Proj(nn.Module):
    """A q projection ([batch, tokens, 4 heads x 8]) feeding an output layer."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 32)
        self.o = nn.Linear(32, 16)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)))


def _check_group(got: dict, want: torch.Tensor):
    ref = tensor_stats(want, None)
    assert got["count"] == ref["count"] and got["min"] == ref["min"] and got["max"] == ref["max"]
    assert got["absmax"] == ref["absmax"]
    np.testing.assert_allclose(got["l2norm"], ref["l2norm"], rtol=1e-6)
    np.testing.assert_allclose(got["mean"], ref["mean"], rtol=1e-5, atol=1e-6 * ref["absmax"])


def test_monitor_records_heads_and_the_whole_tensor(tmp_path):
    """Monitor(groups=...) on a projection's output and its gradient: each
    head's metric equals float64 statistics of its slice of the real tensor,
    the metric itself those of the whole tensor (each value counted once), a
    planted large head is the one with the largest absmax, and the groups
    survive a save and load."""
    torch.manual_seed(0)
    model = _Proj()
    with torch.no_grad():
        model.q.weight[8:16] *= 40.0  # head 1
    seen = []

    def keep(mod, args, out):
        seen.append([out.detach().double().clone(), None])
        out.register_hook(lambda g: seen[-1].__setitem__(1, g.double().clone()))

    model.q.register_forward_hook(keep)
    groups = {"q/output": hookcap.Groups(dim=-1, size=8), "q/grad_output": hookcap.Groups(-1, 8)}
    mon = Monitor(model, groups=groups, histogram=Histogram.log2()).attach()
    for _ in range(3):
        model(torch.randn(4, 5, 16)).pow(2).mean().backward()
        mon.step()
    mon.detach()
    h = mon.history()
    assert [n for n in h.names if n.startswith("q/output")] == ["q/output"] + [f"q/output[{g}]" for g in range(4)]
    for s, (out, grad) in enumerate(seen):
        for metric, full in (("q/output", out), ("q/grad_output", grad)):
            stats = {k: h.groups(metric, k)[s] for k in ("count", "min", "max", "absmax", "l2norm", "mean")}
            for g in range(4):
                _check_group({k: float(v[g]) for k, v in stats.items()}, full[..., 8 * g:8 * (g + 1)])
            _check_group({k: float(h[k][s, h.column(metric)]) for k in stats}, full)
        assert int(np.argmax(h.groups("q/output", "absmax")[s])) == 1
    whole_hist = h.histogram("q/output")[-1]
    assert whole_hist.sum() == seen[-1][0].numel()
    path = tmp_path / "h.hookcap"
    h.save(path)
    np.testing.assert_array_equal(hookcap.load(path).groups("q/output", "l2norm"), h.groups("q/output", "l2norm"))
    with pytest.raises(KeyError, match="no groups"):
        h.groups("o/output", "max")


def test_groups_argument_errors_and_a_size_that_does_not_divide(caplog):
    for bad, match in (({"q/output": 8}, "expected hookcap.Groups"), ([("q", 1)], "expected a dict"),
                       ({"": hookcap.Groups()}, "non-empty")):
        with pytest.raises(ValueError, match=match):
            Monitor(_Proj(), groups=bad)
    for kw, match in (({"size": 0}, "size must be >= 1"), ({"dim": 1.5}, "dim must be an int")):
        with pytest.raises(ValueError, match=match):
            hookcap.Groups(**kw)
    model = _Proj()
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        mon = Monitor(model, groups={"q/output": hookcap.Groups(-1, 5)}).attach()
        x = torch.randn(2, 16)
        model(x)
        mon.step()
        mon.detach()
    assert "recorded whole, not by groups" in caplog.text and "size 5 does not divide" in caplog.text
    h = mon.history()
    assert h["count"][0, h.column("q/output")] == 2 * 32
    with pytest.raises(KeyError):
        h.groups("q/output", "max")


class _Experts(nn.Module):
    """Four experts stacked along dim 0: [experts, tokens, hidden]; expert 2 is dead (ReLU of negatives)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6, 6))

    def forward(self, x):  # x: [tokens, 6]
        h = torch.einsum("td,edh->eth", x, self.w)
        h = torch.cat([h[:2], -h[2:3].abs() - 1.0, h[3:]])
        return torch.relu(h)


def test_detectors_name_the_group():
    """A group is a metric to the detectors: Dead names the dead expert,
    Spike the head whose activations jump, not its neighbours."""
    torch.manual_seed(0)
    experts, proj = _Experts(), _Proj()
    model = nn.ModuleDict({"experts": experts, "proj": proj})
    mon = Monitor(model, capture=("output",), groups={"experts/output": hookcap.Groups(dim=0, size=1),
                                                       "proj.q/output": hookcap.Groups(-1, 8)},
                  detectors=[hookcap.Dead(zero_frac=0.99, steps=3), hookcap.Spike("absmax", z=6, warmup=5,
                                                                                   metrics="proj.q/output?*")],
                  on_anomaly=None).attach()
    for step in range(12):
        if step == 10:
            with torch.no_grad():
                proj.q.weight[24:32] *= 50.0  # head 3 jumps
        experts(torch.randn(5, 6))
        proj(torch.randn(2, 5, 16))
        mon.step()
    mon.detach()
    found = {(a.kind, a.name) for a in mon.history().anomalies}
    assert ("dead", "experts/output[2]") in found
    assert not any(k == "dead" and n in {f"experts/output[{g}]" for g in (0, 1, 3)} for k, n in found)
    spiked = {n for k, n in found if k == "spike"}
    assert "proj.q/output[3]" in spiked and not spiked & {f"proj.q/output[{g}]" for g in (0, 1, 2)}


def test_channels_name_the_massive_activation_channel():
    """Channels(dim=-1, top=3) on a projection whose output channel 5 is
    planted 300x larger: each step, top_channels rank 0 is channel 5, and
    the per-channel absmax/rms, top-k values and top/median ratio equal
    float64 of the output; the output itself is still recorded whole."""
    torch.manual_seed(0)
    model = nn.Linear(16, 32)
    with torch.no_grad():
        model.weight[5] *= 300.0
    outs = []
    model.register_forward_hook(lambda m, a, o: outs.append(o.detach().double()))
    mon = Monitor(model, capture="output", groups={"./output": hookcap.Channels(dim=-1, top=3)}).attach()
    for _ in range(3):
        model(torch.randn(4, 10, 16))
        mon.step()
    mon.detach()
    h = mon.history()
    for s, o in enumerate(outs):
        absmax = o.abs().amax(dim=(0, 1))
        rms = o.pow(2).mean(dim=(0, 1)).sqrt()
        top, ids = torch.topk(absmax, 3)
        assert h.groups("./output.top_channels", "max")[s].tolist() == ids.tolist() and ids[0] == 5
        np.testing.assert_allclose(h.groups("./output.top_absmax", "max")[s], top.numpy(), rtol=1e-6)
        col = lambda n, stat: h[stat][s, h.column(n)]  # noqa: E731
        assert col("./output.channel_absmax", "count") == 32
        assert col("./output.channel_absmax", "max") == pytest.approx(absmax.max().item(), rel=1e-6)
        assert col("./output.channel_rms", "mean") == pytest.approx(rms.mean().item(), rel=1e-5)
        median = absmax.sort().values[15]  # the lower middle of 32
        assert col("./output.top_over_median", "max") == pytest.approx((top[0] / median).item(), rel=1e-5)
        assert col("./output", "count") == o.numel()  # the whole output, as without Channels
    assert not h.anomalies


def test_channels_bad_arguments():
    with pytest.raises(ValueError, match="top must be"):
        hookcap.Channels(top=0)
    with pytest.raises(ValueError, match="Channels"):
        hookcap.Channels(dim="x")


def test_channels_of_a_gradient_every_step():
    torch.manual_seed(0)
    model = nn.Linear(8, 12)
    grads = []
    model.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].detach().double()))
    mon = Monitor(model, capture=("output", "grad_output"),
                  groups={"./grad_output": hookcap.Channels(top=2)}).attach()
    for _ in range(3):
        model(torch.randn(5, 8)).pow(3).sum().backward()
        mon.step()
    mon.detach()
    h = mon.history()
    want = [torch.topk(g.abs().amax(0), 2).indices.tolist() for g in grads]
    assert h.groups("./grad_output.top_channels", "max").tolist() == want


def test_channels_ratio_is_inf_when_the_median_channel_is_zero_and_no_anomaly():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with torch.no_grad():
        model[0].bias[:6] = -100.0  # 6 of 8 channels dead: the median channel is 0
    mon = Monitor(model, capture="output", groups={"1/output": hookcap.Channels(top=2)}).attach()
    model(torch.randn(3, 4))
    mon.step()
    mon.detach()
    h = mon.history()
    assert h["posinf"][0, h.column("1/output.top_over_median")] == 1  # +inf: no finite max
    assert np.isnan(h["max"][0, h.column("1/output.top_over_median")])
    assert not h.anomalies


def test_compiled_module_outputs_are_grouped_like_eager():
    """Inside torch.compile (fullgraph), a grouped output and a Channels
    summary are recorded by groups as eagerly (an opaque op in the graph),
    on recorded steps only, with no recompile."""
    from torch._dynamo.utils import counters

    def run(compiled):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        mon = Monitor(model, capture="output", every=2,
                      groups={"0/output": hookcap.Groups(-1, 4), "1/output": hookcap.Channels(top=2)}).attach()
        fn = torch.compile(model, fullgraph=True) if compiled else model
        graphs = []
        for _ in range(4):
            fn(torch.randn(5, 8))
            graphs.append(counters["stats"]["unique_graphs"])
            mon.step()
        mon.detach()
        return mon.history(), graphs

    (eager, _), (comp, graphs) = run(False), run(True)
    assert len(set(graphs)) == 1
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 2]
    for name, stat in (("0/output", "max"), ("0/output", "count"), ("1/output.top_channels", "max")):
        np.testing.assert_allclose(comp.groups(name, stat), eager.groups(name, stat), rtol=1e-6)
    np.testing.assert_allclose(comp["l2norm"][:, comp.column("0/output")], eager["l2norm"][:, eager.column("0/output")],
                               rtol=1e-6)


def test_host_bytes_per_group_step_within_a_metrics():
    """The store keeps a group's step in no more bytes than an ordinary
    metric's (sparse histograms): heads and one group per channel."""
    def per_step(groups):
        torch.manual_seed(0)
        m = nn.Linear(64, 768)
        mon = Monitor(m, capture="output", groups=groups).attach()
        for _ in range(5):
            m(torch.randn(8, 64, 64))
            mon.step()
        mon.detach()
        return mon.history_bytes / 5

    whole = per_step(None)
    for size in (64, 1):
        groups = 768 // size
        extra = per_step({"./output": hookcap.Groups(-1, size)}) - whole
        assert 0 < extra / groups <= whole, (size, extra / groups, whole)


HISTS = [None, Histogram.log2(), Histogram.log2(-20, 8, sub=4, signed=True), Histogram.linear(-4, 4, 32)]


def planted(shape, dtype, seed):
    """Normal data with a NaN, +-Inf, zeros, subnormal-sized and large values
    planted in a few places (several blocks of a 64-value head hold some)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    flat = x.view(-1)
    n = flat.numel()
    for i, v in zip((3, n // 3, n // 2 + 70, n - 5), (float("nan"), float("inf"), -float("inf"), 1e4)):
        flat[i] = v
    flat[n // 5:n // 5 + 300] = 0.0
    flat[n // 7:n // 7 + 40] = 1e-41 if dtype in (torch.float32, torch.float64) else 0.0
    return x.to(dtype)


def assert_rows_equal_float64(x, got_ring, groups, dim, size, hist, row0=0):
    """Each group's row: counts, extrema and bins exactly those of the op on a
    contiguous copy of its slice, the rest float64's to rounding."""
    each = ring_for(groups, hist)
    for gi in range(groups):
        part = x.narrow(dim, gi * size, size)
        _ops.accumulate(part.contiguous(), each, new_state("cpu"), gi, hist)
        got_raw, want_raw = got_ring[0, row0 + gi].numpy(), each[0, gi].numpy()
        assert np.array_equal(got_raw[EXACT_COLS], want_raw[EXACT_COLS]), gi
        assert np.array_equal(got_raw[_layout.HEADER:], want_raw[_layout.HEADER:]), gi
        assert_stats_match(decoded(got_ring, row0 + gi, hist), tensor_stats(part, hist), abs_sum=abs_sum(part))


@pytest.mark.parametrize("hist", HISTS, ids=["none", "log2", "fine", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim,tokens", [(64, 1100), (32, 700), (128, 300), (2048, 9), (96, 400), (48, 500), (16, 900), (24, 300)])
def test_heads_read_in_place_equal_float64(head_dim, tokens, dtype, hist):
    """Heads whose length is a multiple of 16 values are read in place as
    rows (no copy; 48, 16: a row ends mid-vector), tile by tile with the next
    tile fetched ahead; others (24) are copied first: several tiles and
    threads, a ragged last tile, NaN/Inf/zeros/subnormals in some blocks --
    exactly the slice's counts, extrema and bins."""
    heads = 6
    x = planted((tokens, heads * head_dim), dtype, head_dim + tokens)
    ring = ring_for(heads, hist)
    _ops.accumulate_groups(x, ring, new_state("cpu"), list(range(heads)), -1, head_dim, hist)
    assert_rows_equal_float64(x, ring, heads, -1, head_dim, hist)


@pytest.mark.parametrize("hist", HISTS, ids=["none", "log2", "fine", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["slice", "ragged stretches", "chunks mid-row", "rows of 48"])
def test_a_slice_of_the_last_dim_read_as_rows_equals_float64(case, dtype, hist):
    """The statistics op on a view whose innermost run is a multiple of 16
    (one head of a projection) reads whole rows per block: a plain slice,
    a view whose rows are evenly spaced only in stretches (a padded middle
    dimension), and one large enough that its chunks start mid-row."""
    if case == "slice":
        view = planted((900, 384), dtype, 1)[:, 128:192]
    elif case == "ragged stretches":
        view = planted((5, 41, 300), dtype, 2)[:, :40, 7:71].transpose(0, 1)
    elif case == "chunks mid-row":
        view = planted((20001, 128), dtype, 3)[:, 64:]  # 1.28 M values: chunks of 20,001 values
    else:
        view = planted((700, 240), dtype, 4)[:, 96:144]
    assert not view.is_contiguous()
    ring = ring_for(1, hist)
    _ops.accumulate(view, ring, new_state("cpu"), 0, hist)
    assert_rows_equal_float64(view, ring, 1, 0, view.shape[0], hist)  # the whole view: one group
