"""Float64 values beyond squaring range (|x| >= 2**400, or all below 2**-400):
sum of squares, l2norm, rms and std stay right for any finite input, through
every path a row takes (the CPU op, repeated writes into one row, the drain's
merge of calls, the host store, files of the older layout, the rank merge),
against the float64 reference computed on scaled values."""

import json
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import hookcap
from hookcap import Histogram, Monitor, _layout, io
from hookcap.functional import new_state

from conftest import assert_wide_match

def one_row(*tensors, histogram=None):
    """Raw row after accumulating each tensor into one ring row (the op)."""
    width = _layout.HEADER + (histogram.nbins if histogram is not None else 0)
    ring = torch.zeros(1, 1, width, dtype=torch.int64)
    state = new_state(torch.device("cpu"))
    hookcap._ops.reset_slot(ring, state)
    for t in tensors:
        hookcap._ops.accumulate(t, ring, state, 0, histogram)
    return ring[0, 0].numpy().copy()


def row_stats(row, histogram=None):
    out = {k: float(v) for k, v in _layout.decode(row).items()}
    if histogram is not None:
        out["hist"] = row[_layout.HEADER:]
    return out


def test_huge_values_give_finite_l2norm_rms_std():
    x = torch.full((10,), 1e200, dtype=torch.float64)
    got = hookcap.tensor_stats(x, None)
    assert got["l2norm"] == pytest.approx(1e200 * np.sqrt(10), rel=1e-15)
    assert got["rms"] == pytest.approx(1e200, rel=1e-15)
    assert got["std"] == 0.0 and got["mean"] == pytest.approx(1e200, rel=1e-15)
    assert got["sumsq"] == np.inf  # 1e401: beyond double, as it truly is
    assert_wide_match(got, x.numpy())


def test_huge_values_far_from_zero_keep_their_spread():
    """|mean| >> std among huge values: the big bucket's own shift keeps the
    variance free of cancellation."""
    g = torch.Generator().manual_seed(0)
    x = 1e200 * (1 + 1e-9 * torch.randn(4000, generator=g, dtype=torch.float64))
    got = hookcap.tensor_stats(x, None)
    ref = hookcap.reference.tensor_stats(x, None)
    assert got["std"] == pytest.approx(ref["std"], rel=1e-6)
    assert_wide_match(got, x.numpy())


def test_tiny_values_are_not_lost_to_underflow():
    g = torch.Generator().manual_seed(1)
    x = 1e-200 * torch.randn(3000, generator=g, dtype=torch.float64)
    got = hookcap.tensor_stats(x, None)
    assert got["l2norm"] > 0 and got["rms"] == pytest.approx(1e-200, rel=0.1)
    assert_wide_match(got, x.numpy())
    sub = torch.full((5,), 5e-324, dtype=torch.float64)  # the smallest subnormal
    assert_wide_match(hookcap.tensor_stats(sub, None), sub.numpy())
    # Beside zeros (ordinary values whose squares are nothing) and NaN/Inf.
    mixed = torch.tensor([float("inf"), float("nan"), -0.0, 5.56e-309, 0.0], dtype=torch.float64)
    got = hookcap.tensor_stats(mixed, None)
    assert got["l2norm"] == 5.56e-309
    assert_wide_match(got, mixed.numpy())


@pytest.mark.parametrize("histogram", [None, Histogram.log2(-1074, 1023), Histogram.log2()],
                         ids=["nohist", "log2-full", "log2"])
@pytest.mark.parametrize("n", [7, 5000, 300_001])
def test_every_magnitude_with_specials(histogram, n):
    g = np.random.default_rng(n)
    e = g.uniform(-1074, 1023, n)
    x = np.ldexp(g.choice([-1.0, 1.0], n) * g.uniform(1, 2, n), np.floor(e).astype(int))
    k = max(n // 50, 1)
    idx = g.permutation(n)
    x[idx[:k]] = np.nan
    x[idx[k:2 * k]] = np.inf
    x[idx[2 * k:3 * k]] = 0.0
    x[idx[3 * k:4 * k]] = 1.0 + g.standard_normal(k)  # ordinary values among them
    t = torch.from_numpy(x)
    got = row_stats(one_row(t, histogram=histogram), histogram)
    assert_wide_match(got, x, histogram)
    # Strided and broadcast views take the same buckets.
    m = x[: (n // 4) * 4].reshape(-1, 4)
    assert_wide_match(row_stats(one_row(torch.from_numpy(m).t())), m.reshape(-1))
    col = torch.from_numpy(x[:3].copy()).reshape(3, 1).expand(3, 1000)
    assert_wide_match(row_stats(one_row(col)), np.repeat(x[:3], 1000))


magnitudes = st.lists(
    st.tuples(st.integers(-1074, 1023), st.floats(1.0, 2.0, exclude_max=True), st.booleans()),
    min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(magnitudes, min_size=1, max_size=4))
def test_writes_into_one_row_merge_like_one_tensor(parts):
    """Several tensors into one row (each sets or rebases onto the buckets'
    shifts) equal one tensor of all their values."""
    arrays = [np.array([(-1.0 if s else 1.0) * np.ldexp(m, e) for e, m, s in p]) for p in parts]
    row = one_row(*(torch.from_numpy(a) for a in arrays))
    assert_wide_match(row_stats(row), np.concatenate(arrays), rtol=1e-9)


def test_narrow_types_never_use_the_buckets():
    x = torch.tensor([3e38, -3e38, 1e-45, 0.0], dtype=torch.float32)
    row = one_row(x)
    assert row[_layout.BIG_N] == 0 and row[_layout.SMALL_N] == 0


class Scale(nn.Module):
    def forward(self, x, s):
        return x * s


def wide_steps():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return [(1e250, 1.0, 1e-250), (1.0, 1e-300, 1e300), (1e-170, 1e-170, 1e170)], base


def test_monitor_history_store_and_file(tmp_path):
    """Calls of one module at different magnitudes merge into one metric per
    step (the drain's merge), the host store and a saved file keep them."""
    scales, base = wide_steps()
    model = Scale()
    with Monitor(model, capture="output", histogram=Histogram.log2(-1074, 1023)) as mon:
        outs = []
        for step_scales in scales:
            outs.append([model(base, s).detach() for s in step_scales])
            mon.step()
    h = mon.history()
    path = h.save(tmp_path / "wide")
    loaded = hookcap.load(path)
    for hist in (h, loaded):
        m = hist.column("./output")
        for s, values in enumerate(outs):
            got = {k: hist[k][s, m] for k in hookcap.STAT_NAMES}
            got["hist"] = hist.histogram("./output")[s]
            assert_wide_match(got, torch.cat([v.reshape(-1) for v in values]).numpy(),
                              hist.histogram_spec, rtol=1e-9)


def test_file_of_the_older_layout_reads_the_same(tmp_path):
    """A history file written with 16 header columns (before the buckets) reads
    as it was written: its steps gain empty buckets."""
    model = nn.Linear(4, 3)
    with Monitor(model, capture=("output", "param")) as mon:
        for _ in range(3):
            model(torch.randn(2, 4))
            mon.step()
    h = mon.history()
    path = h.save(tmp_path / "new")
    old = tmp_path / "old.npz"
    # Rewrite it as the older writer did: header columns 0-15 only (the
    # bucket columns of ordinary data are constants, stored in the blob's
    # leading constants block).
    with np.load(path) as z:
        a = {k: z[k] for k in z.files}
    meta = json.loads(bytes(a["meta_json"]).decode())
    H = _layout.HEADER
    assert all(all(c == 0 for c in d[1][16:]) for d in meta["descs"])  # CONST
    blobs, off = [], 0
    for n in a["blob_len"]:
        b = a["blob"][off:off + n]
        blobs.append(np.concatenate([b[:8 * 16], b[8 * H:]]))
        off += n
    meta["layout_header"] = 16
    meta["descs"] = [[d[0], d[1][:16], *d[2:]] for d in meta["descs"]]
    a["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    a["blob"] = np.concatenate(blobs)
    a["blob_len"] = np.array([len(b) for b in blobs], dtype=np.int64)
    np.savez(old, **a)
    with zipfile.ZipFile(old) as zf:
        assert "meta_json.npy" in zf.namelist()
    got = hookcap.load(old)
    assert got.names == h.names and got.steps.tolist() == h.steps.tolist()
    for stat in hookcap.STAT_NAMES:
        np.testing.assert_array_equal(got[stat], h[stat], err_msg=stat)
    for n in h.names:
        np.testing.assert_array_equal(got.histogram(n), h.histogram(n))
    recs = io.read(old)[0]
    assert recs[0].header.shape[1] == H
    assert (recs[0].header[:, _layout.BIG_SHIFT] == _layout.SHIFT_UNSET).all()


def test_merge_groups_rebases_each_bucket():
    """The host merge of rows (calls, devices) matches one row written with
    every tensor, bucket by bucket."""
    g = np.random.default_rng(5)
    arrays = [np.ldexp(g.uniform(1, 2, 50) * g.choice([-1, 1], 50), g.integers(-1074, 1023, 50))
              for _ in range(3)]
    rows = np.stack([one_row(torch.from_numpy(a)) for a in arrays])
    _, merged = _layout.merge_groups(rows, np.zeros(3, dtype=np.int64))
    assert_wide_match(row_stats(merged[0]), np.concatenate(arrays), rtol=1e-9)
