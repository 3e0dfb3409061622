"""moments=4: third and fourth central moments, skew and Pearson kurtosis in
the same pass, against a two-pass float64 reference of the same values; the
rows merge (calls, host groups, files, sinks) without losing them, and rows
that cannot hold them say so with NaN."""

import json

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, Monitor, _layout, reference, sinks
from conftest import assert_moments, draw

NAMES = hookcap.MOMENT_NAMES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "t3", "cauchy", "offset", "negative", "spiky"])
def test_matches_float64_reference(kind, dtype):
    x = draw(kind, 50_001, 7).to(dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    got = hookcap.tensor_stats(x, moments=4)
    want = reference.tensor_stats(x, moments=4)
    assert_moments(got, want, x.double().numpy())
    if kind == "normal":
        assert abs(got["kurtosis"] - 3.0) < 0.1 and abs(got["skew"]) < 0.05
    if kind == "t3":
        assert got["kurtosis"] > 5.0


@given(st.integers(1, 5000), st.integers(0, 2**31), st.sampled_from(["normal", "t3", "offset", "spiky"]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), st.booleans())
@example(1, 27884, "spiky", torch.float64, True)  # three equal values: no shape, the reference too
def test_any_size_layout_and_specials(n, seed, kind, dtype, strided):
    x = draw(kind, n, seed).to(dtype)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, 12, (n,), generator=g)
    x[pick == 0] = float("nan")
    x[pick == 1] = float("inf")
    x[pick == 2] = 0.0
    if strided:  # a permuted 2-D view and a stride-0 expand: the strided walk and its multiplicity
        x = torch.cat([x, x[: (-n) % 2]]).reshape(2, -1).t()[:, :1].expand(-1, 3)
    got = hookcap.tensor_stats(x, Histogram.log2(sub=2, signed=True), moments=4)
    want = reference.tensor_stats(x, Histogram.log2(sub=2, signed=True), moments=4)
    assert_moments(got, want, x.double().numpy())


def test_not_computable_rows_read_nan():
    const = hookcap.tensor_stats(torch.full((1000,), 2.5), moments=4)
    assert const["m3"] == 0.0 and const["m4"] == 0.0
    assert np.isnan(const["skew"]) and np.isnan(const["kurtosis"])  # no spread: undefined
    empty = hookcap.tensor_stats(torch.full((10,), float("nan")), moments=4)
    assert all(np.isnan(empty[k]) for k in NAMES)
    # float64 values beyond squaring range go to the wide buckets, which keep no fourth powers
    wide = hookcap.tensor_stats(torch.tensor([1.0, 2.0, 1e300], dtype=torch.float64), moments=4)
    assert all(np.isnan(wide[k]) for k in NAMES) and np.isfinite(wide["std"])
    assert not set(NAMES) & set(hookcap.tensor_stats(torch.ones(3)))  # moments=2: not there
    with pytest.raises(ValueError, match="moments"):
        hookcap.tensor_stats(torch.ones(3), moments=3)


def _ring_rows(parts, moments_of):
    """Raw rows of each tensor of ``parts`` written on its own (own shift),
    with moments=4 where ``moments_of(i)``."""
    rows = []
    for i, x in enumerate(parts):
        ring = torch.empty((1, 1, _layout.HEADER), dtype=torch.int64)
        state = hookcap.functional.new_state("cpu")
        hookcap._ops.reset_slot(ring, state)
        hookcap._ops.accumulate(x, ring, state, 0, None, 4 if moments_of(i) else 2)
        rows.append(ring[0, 0].numpy().copy())
    return np.stack(rows)


def test_rows_of_different_shifts_merge_exactly():
    """merge_groups (one metric written by several devices or ranks) moves
    each row's sums to the group's shift by the binomial expansion."""
    parts = [draw("offset", 3000, 1), draw("t3", 2000, 2) * 50 - 7, draw("negative", 500, 3)]
    rows = _ring_rows(parts, lambda i: True)
    assert len({r[_layout.SHIFT] for r in rows}) == 3  # three different shifts
    _, merged = _layout.merge_groups(rows, np.zeros(3, dtype=np.int64))
    got = {k: v[0] for k, v in _layout.decode(merged).items()}
    allv = torch.cat(parts)
    assert_moments(got, reference.tensor_stats(allv, moments=4), allv.numpy())
    # one row written without moments=4: the merged row cannot hold them
    _, merged = _layout.merge_groups(_ring_rows(parts, lambda i: i != 1), np.zeros(3, dtype=np.int64))
    assert all(np.isnan(_layout.decode(merged)[k][0]) for k in NAMES)


def test_one_row_written_with_and_without_moments_reads_nan():
    ring = torch.empty((1, 1, _layout.HEADER), dtype=torch.int64)
    state = hookcap.functional.new_state("cpu")
    hookcap._ops.reset_slot(ring, state)
    hookcap._ops.accumulate(torch.randn(100), ring, state, 0, None, 4)
    hookcap._ops.accumulate(torch.randn(100), ring, state, 0, None, 2)
    d = _layout.decode(ring[0, 0].numpy())
    assert all(np.isnan(d[k]) for k in NAMES) and np.isfinite(d["std"])


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_monitor_records_moments_of_every_call(tmp_path):
    """A module called twice per step: both calls' values in one row, about
    the first call's shift; through History, a packed history, save/load,
    JSONL and Parquet."""
    torch.manual_seed(0)
    model = _Twice()
    seen = []
    model.lin.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    jl = tmp_path / "s.jsonl"
    mon = Monitor(model, capture=("output",), moments=4,
                  sinks=[sinks.JSONL(str(jl), stats=("kurtosis", "skew")),
                         sinks.JSONL(str(tmp_path / "all.jsonl")),  # stats=None: gains the moments
                         sinks.Parquet(str(tmp_path / "pq"))])
    with mon:
        for _ in range(3):
            seen.clear()
            model(torch.randn(16, 6) * 3 + 1)
            mon.step()
    h = mon.history()
    assert set(NAMES) <= set(h.stat_names)
    m = h.column("lin/output")
    allv = torch.cat(seen).double()
    want = reference.tensor_stats(allv, moments=4)
    assert_moments({k: h[k][-1, m] for k in NAMES}, want, allv.numpy())
    lines = [json.loads(s) for s in jl.read_text().splitlines()]
    last = [r for r in lines if r["step"] == 2 and r["name"] == "lin/output"][0]
    assert last["kurtosis"] == pytest.approx(h["kurtosis"][-1, m], rel=1e-12)
    first = json.loads((tmp_path / "all.jsonl").read_text().splitlines()[0])
    assert set(hookcap.STAT_NAMES + NAMES) <= set(first)
    mon.dump(str(tmp_path / "h.npz"))
    back = hookcap.load(str(tmp_path / "h.npz"))
    np.testing.assert_array_equal(back["kurtosis"], h["kurtosis"])
    pq = hookcap.load(str(tmp_path / "pq"))
    np.testing.assert_allclose(pq["skew"], h["skew"], rtol=1e-12)
    pytest.importorskip("matplotlib")
    from hookcap.report import report

    files = report(h, out=str(tmp_path / "rep"))
    assert files["kurtosis"] and "kurtosis" in open(files["index"]).read()


def test_monitor_without_moments_has_none(tmp_path):
    jl = sinks.JSONL(str(tmp_path / "s.jsonl"))
    mon = Monitor(torch.nn.Linear(3, 3), capture=("output",), sinks=jl)
    with mon:
        mon.model(torch.randn(2, 3))
        mon.step()
    h = mon.history()
    assert "kurtosis" not in h.stat_names and "kurtosis" not in jl.stats
    with pytest.raises(KeyError):
        h["kurtosis"]
    with pytest.raises(ValueError, match="moments"):
        Monitor(torch.nn.Linear(3, 3), moments=True)


def test_optimizer_update_rows_keep_two_moments():
    """Update rows come from their own op, which keeps two moments: with
    moments=4 they record as usual and read NaN for the four, while the
    module rows beside them have them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, capture=("output", "update", "adam_ratio"), optimizer=opt, moments=4)
    with mon:
        for _ in range(2):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    h = mon.history()
    up, out = h.column("weight/update"), h.column("./output")
    assert np.isfinite(h["std"][-1, up]) and np.isnan(h["kurtosis"][-1, up])
    assert np.isfinite(h["kurtosis"][-1, out])


def test_compiled_model_records_the_moments_of_eager():
    """Under torch.compile the traced hooks pass the same op arguments (the
    moments=4 flag with them): the same moments as eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    hs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        mon = Monitor(model, capture=("output", "grad_output"), moments=4)
        run = torch.compile(model) if compiled else model
        with mon:
            run(x).square().mean().backward()
            mon.step()
        hs.append(mon.history())
    eager, comp = hs
    assert sorted(comp.names) == sorted(eager.names)
    cols = [comp.column(n) for n in eager.names]
    for k in NAMES:
        np.testing.assert_allclose(comp[k][:, cols], eager[k], rtol=1e-5, atol=1e-12, err_msg=k)
    assert np.isfinite(comp["kurtosis"]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("front", [20.0, 50.0])
def test_moments_hold_whatever_the_first_elements_are(dtype, front):
    """A run of outliers at the front of the tensor (a massive activation in
    token 0's first channels) does not become the shift the moments are
    summed about: kurtosis and m4 stay within 5e-6 of float64."""
    x = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0))
    x[0, :8] = front
    x = x.to(dtype)
    got = hookcap.tensor_stats(x, moments=4)
    ref = reference.tensor_stats(x, moments=4)
    for k in ("kurtosis", "m4"):
        assert abs(got[k] - ref[k]) <= 5e-6 * abs(ref[k]), (k, got[k], ref[k])


def test_float64_kurtosis_is_exact_or_nan_across_scales():
    """float64 data from 1e-90 to 1e90: kurtosis within 5e-6 of float64
    where its fourth powers stay normal doubles (1e-70 .. 1e70 here), NaN
    beyond (never silently off, as subnormal fourth powers would be)."""
    base = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for e in range(-90, 91, 5):
        x = base * 10.0 ** e
        got = hookcap.tensor_stats(x, moments=4)["kurtosis"]
        ref = reference.tensor_stats(x, moments=4)["kurtosis"]
        if -70 <= e <= 70:
            assert abs(got - ref) <= 5e-6 * ref, e
        else:
            assert np.isnan(got) or abs(got - ref) <= 5e-6 * ref, (e, got, ref)
