"""Accuracy and semantics of the fused stats op on the CPU, against the float64
reference (hookcap.reference), for every dtype, layout and special value."""

import math

import numpy as np
import pytest
import torch
from conftest import abs_sum, assert_stats_match

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HISTS = [Histogram.log2(), Histogram.linear(-3.0, 5.0, 17), None]


def specials(n, dtype, seed=0):
    """Random values with NaN, +-Inf, zeros, -0 and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 4
    tiny = torch.finfo(dtype).tiny
    idx = torch.randperm(n, generator=g)
    k = max(n // 50, 1)
    x[idx[0 * k:1 * k]] = float("nan")
    x[idx[1 * k:2 * k]] = float("inf")
    x[idx[2 * k:3 * k]] = float("-inf")
    x[idx[3 * k:4 * k]] = 0.0
    x[idx[4 * k:5 * k]] = -0.0
    x[idx[5 * k:6 * k]] = tiny / 4  # subnormal in dtype
    x[idx[6 * k:7 * k]] = -tiny / 2
    return x.to(dtype)


def check(x, histogram=Histogram.log2(), **kw):
    got = hookcap.tensor_stats(x, histogram)
    ref = hookcap.reference.tensor_stats(x, histogram)
    assert_stats_match(got, ref, abs_sum=abs_sum(x), **kw)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("histogram", HISTS, ids=["log2", "linear", "nohist"])
@pytest.mark.parametrize("n", [1, 7, 200, 1000, 100_003])  # < 256: bins straight into the ring
def test_specials_all_dtypes(dtype, histogram, n):
    check(specials(n, dtype, seed=n), histogram)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
@pytest.mark.parametrize("offset", [0.0, 40.0, -3e3])  # 40, -3e3: blocks centred again on their finite mean
@pytest.mark.parametrize("layout", ["dense", "causal", "strided"])
def test_masked_blocks_match_float64(dtype, offset, layout):
    """Blocks holding -inf (an attention mask), +inf and NaN among finite
    values take a vectorised pass over the finite ones: every statistic
    and the class counts against float64, from a 1 % to an all-masked block."""
    g = torch.Generator().manual_seed(int(abs(offset)) + 3)
    x = torch.randn(8, 96, 160, generator=g, dtype=torch.float64) * 3 + offset
    if layout == "causal":  # hidden keys -inf, as attention_rows leaves a tile
        x.masked_fill_(torch.ones(96, 160, dtype=torch.bool).triu(1), float("-inf"))
    else:
        x[torch.rand(x.shape, generator=g) < 0.3] = float("-inf")
    x[0, 0, :5] = float("nan")
    x[1, 3, 7] = float("inf")
    x[2] = float("-inf")  # whole blocks with no finite value
    x[3, :, :2] = 0.0
    x = x.to(dtype)
    if layout == "strided":
        x = x[:, ::2, 3:150]
    for h in HISTS:
        check(x, h)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
def test_tiny_reads_every_size(dtype):
    """Reads of at most 16 values take their own scalar pass: every size on
    both sides of that bound, with specials, each histogram kind and the
    third and fourth moments, dense, expanded (each value counted per
    repeat) and from a row already holding another tensor's values."""
    hists = HISTS + [Histogram.log2(sub=2, signed=True)]
    for n in range(1, 19):
        x = specials(max(n, 8), torch.float64, seed=n)[:n] * 3
        if dtype == torch.float64:
            x[n // 2] = 1e300 if n % 2 else 1e-300  # wide values: their own moments
        x = x.to(dtype)
        for h in hists:
            for v in (x, x.expand(3, n)):
                got = hookcap.tensor_stats(v, h, moments=4)
                ref = hookcap.reference.tensor_stats(v, h, moments=4)
                assert_stats_match(got, ref, abs_sum=abs_sum(v))
                for k in ("skew", "kurtosis"):
                    if dtype == torch.float64:  # a wide value: no fourth powers kept (test_moments)
                        assert np.isnan(got[k])
                    else:
                        assert (np.isnan(got[k]) and np.isnan(ref[k])) or got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9)
    # Merged into a row whose shift another tensor set.
    a, b = torch.tensor([1000.0, 1001.0]), specials(9, torch.float32, seed=5)
    h = Histogram.log2()
    ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64)
    state = new_state("cpu")
    _ops.reset_slot(ring, state)
    for t in (a, b):
        _ops.accumulate(t, ring, state, 0, h)
    got = _layout.decode(ring[0, 0].numpy())
    both = torch.cat([a, b])
    ref = hookcap.reference.tensor_stats(both, h)
    for k in ("count", "nan", "inf", "zeros", "min", "max", "absmax"):
        if k in ref:
            assert float(got[k]) == ref[k] or (np.isnan(float(got[k])) and np.isnan(ref[k])), k
    fin = both[torch.isfinite(both)].double()
    assert abs(float(got["sum"]) - fin.sum().item()) <= 1e-6 * fin.abs().sum().item()
    assert float(got["std"]) == pytest.approx(fin.std(unbiased=False).item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8(dtype):
    x = (torch.randn(5000) * 8).to(dtype)
    got = check(x, Histogram.log2(-20, 20))
    assert got["count"] == 5000


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_value_widens_exactly(dtype):
    """All 256 bit patterns, one tensor each (min and max are the value
    itself, or NaN/Inf counted), and all together at once."""
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = bits.view(dtype)
    wide = values.double()  # torch's own conversion
    for v, w in zip(values, wide.tolist()):
        s = hookcap.tensor_stats(v.reshape(1), None)
        if math.isnan(w):
            assert s["nan"] == 1, w
        elif math.isinf(w):
            assert (s["posinf"], s["neginf"]) == ((1, 0) if w > 0 else (0, 1))
        else:
            assert s["min"] == s["max"] == w and s["zeros"] == (w == 0), w
    check(values.repeat(40), Histogram.log2(-20, 20))


def test_counts_exact_values():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), 3.0])
    s = hookcap.tensor_stats(x)
    assert (s["count"], s["nan"], s["posinf"], s["neginf"], s["zeros"]) == (8, 1, 1, 1, 2)
    assert (s["inf"], s["finite"]) == (2, 5)
    assert (s["sum"], s["sumsq"], s["min"], s["max"], s["absmax"]) == (2.0, 14.0, -2.0, 3.0, 3.0)
    assert s["mean"] == pytest.approx(0.4)
    assert s["std"] == pytest.approx(np.std([1.0, -2.0, 0.0, 0.0, 3.0]))
    assert s["rms"] == pytest.approx(math.sqrt(14.0 / 5))
    assert s["l2norm"] == pytest.approx(math.sqrt(14.0))
    assert s["zero_frac"] == 2 / 8


def test_empty_tensor_records_count_zero():
    s = hookcap.tensor_stats(torch.empty(0, 3))
    assert s["count"] == 0 and s["finite"] == 0 and s["nan"] == 0 and s["zeros"] == 0
    assert s["sum"] == 0 and s["sumsq"] == 0 and s["hist"].sum() == 0
    for k in ("min", "max", "absmax", "mean", "std", "rms", "zero_frac"):
        assert math.isnan(s[k]), k


def test_no_finite_element_gives_nan():
    s = hookcap.tensor_stats(torch.tensor([float("nan"), float("inf")]))
    assert s["count"] == 2 and s["finite"] == 0
    for k in ("min", "max", "absmax", "mean", "std", "rms"):
        assert math.isnan(s[k]), k
    assert s["l2norm"] == 0 and s["hist"].sum() == 0


def test_zero_dim():
    check(torch.tensor(-2.5))


def test_accuracy_1e7_float32():
    """Contract: sum/sumsq/l2norm rel err <= 1e-5 on 1e7 float32 elements;
    std rel err <= 1e-4 even when |mean| = 1000 * std."""
    g = torch.Generator().manual_seed(1)
    for mean, std in ((0.5, 1.0), (1000.0, 1.0), (-3e4, 30.0)):
        x = torch.randn(10_000_000, generator=g) * std + mean
        got = hookcap.tensor_stats(x, None)
        ref = hookcap.reference.tensor_stats(x, None)
        for k in ("sum", "sumsq", "l2norm"):
            assert abs(got[k] / ref[k] - 1) <= 1e-5, (mean, k, got[k], ref[k])
        assert abs(got["std"] / ref["std"] - 1) <= 1e-4, (mean, got["std"], ref["std"])
        assert got["min"] == ref["min"] and got["max"] == ref["max"]


def test_outlier_first_element_does_not_spoil_std():
    x = torch.randn(1_000_000, dtype=torch.float32)
    x[0] = 1e6
    x[1] = -1e6
    check(x, None, rtol_std=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e25, 1e37])
def test_float32_extreme_ranges_take_exact_path(scale):
    """float32 data whose squares under/overflow float still gets exact-range sums."""
    x = (torch.randn(50_000, dtype=torch.float64) * scale).float()
    got = check(x, None)
    assert math.isfinite(got["sumsq"]) and got["sumsq"] > 0


def test_huge_float64_sumsq_overflows_like_reference():
    x = torch.tensor([1e200, -1e200, 1.0], dtype=torch.float64)
    got = hookcap.tensor_stats(x)
    assert got["sumsq"] == math.inf and got["absmax"] == 1e200


# -- layouts ----------------------------------------------------------------

def test_transposed_and_permuted_dense():
    x = torch.randn(37, 53, 11)
    check(x.permute(2, 0, 1))
    check(x.transpose(0, 2))


def test_channels_last():
    x = torch.randn(4, 8, 9, 7).to(memory_format=torch.channels_last)
    check(x)


def test_sliced_and_strided():
    x = specials(64 * 50, torch.float32).reshape(64, 50)
    check(x[::3, 5:41])
    check(x.t()[7:, ::2])
    check(x[:, 1])  # column: stride 50


def test_expanded_counts_repeats():
    base = torch.tensor([1.0, float("nan"), -2.0])
    x = base.expand(1000, 3)
    s = check(x)
    assert s["count"] == 3000 and s["nan"] == 1000


@pytest.mark.parametrize("histogram", HISTS + [Histogram.linear(-3.0, 5.0, 3000)],
                         ids=["log2", "linear", "nohist", "wide"])
@pytest.mark.parametrize("n", [150, 700, 9000])  # tiny: bins straight into the ring; else local copies
def test_stride_zero_dims_count_as_a_multiplicity(histogram, n):
    """Each element of an expanded view is read once and counted per repeat:
    counts, sums and every bin (zeros and float subnormals included)."""
    row = specials(n, torch.float32, seed=n)
    row[3::41] = 1e-41
    for v in (row.expand(5, n), row.reshape(-1, 10)[:, None, ::2].expand(-1, 3, -1)):
        got = check(v, histogram)
        assert got["count"] == v.numel()


def test_misaligned_starts():
    x = specials(10_007, torch.float32)
    for off in range(1, 9):
        check(x[off:])
    h = specials(10_007, torch.float16)
    for off in range(1, 9):
        check(h[off:])


def test_many_dims_fallback():
    x = torch.randn([2] * 14)
    # A non-dense view that no merge can reduce to <= 12 dims.
    y = x[(slice(None, 1),) + (slice(None),) * 13].transpose(1, 13)[..., :1]
    check(y)


# -- histograms ---------------------------------------------------------------

def test_log2_layout_contract():
    lo, hi = -4, 3
    h = Histogram.log2(lo, hi)
    assert h.nbins == hi - lo + 3
    x = torch.tensor([0.0, -0.0, 2.0**-5, 2.0**-4, -2.0**-4 * 1.5, 0.75, 1.0, 2.0**2 * 1.9, 8.0, -1e10,
                      float("nan"), float("inf")], dtype=torch.float64)
    s = hookcap.tensor_stats(x, h)
    expected = np.zeros(h.nbins, dtype=np.int64)
    expected[0] = 2  # exact zeros
    expected[1] = 1  # 2**-5 < 2**lo
    expected[2 + (-4 - lo)] = 2  # 2**-4 and 1.5 * 2**-4
    expected[2 + (-1 - lo)] = 1  # 0.75
    expected[2 + (0 - lo)] = 1  # 1.0
    expected[2 + (2 - lo)] = 1  # 7.6
    expected[-1] = 2  # 8 = 2**hi and 1e10: overflow
    np.testing.assert_array_equal(s["hist"], expected)
    edges = s["bin_edges"]
    assert len(edges) == h.nbins + 1 and edges[2] == 2.0**lo and edges[-2] == 2.0**hi


FINE = [Histogram.log2(-10, 6, sub=4), Histogram.log2(-10, 6, sub=16), Histogram.log2(-10, 6, signed=True),
        Histogram.log2(-10, 6, sub=8, signed=True), Histogram.log2(-150, 6, sub=2, signed=True),
        Histogram.log2(sub=16, signed=True)]


@pytest.mark.parametrize("h", FINE, ids=lambda h: f"sub{h.sub}{'s' if h.signed else ''}[{h.lo},{h.hi})")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 1000, 100_003])
def test_sub_octave_and_signed_bins(h, dtype, n):
    """Every bin equals the reference's (frexp mantissas, numpy), for every
    dtype, both signs, zeros, subnormals and NaN/Inf."""
    x = specials(n, dtype, seed=n)
    x = x * torch.where(torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0).to(dtype)
    check(x, h)


@pytest.mark.parametrize("h", FINE[:4], ids=lambda h: f"sub{h.sub}{'s' if h.signed else ''}")
def test_values_on_every_edge(h):
    """Every bin edge, and the double just below it, in the bin the edges say
    (signed: negative bins are (edges[i], edges[i+1]])."""
    e = h.bin_edges
    e = e[np.isfinite(e) & (e != 0)]
    v = np.concatenate([e, np.nextafter(e, 0.0), [0.0, -0.0, 1e300, -1e300]])
    s = check(torch.tensor(v, dtype=torch.float64), h)
    idx = np.array([int(np.flatnonzero(hookcap.reference.hist_counts(np.array([a]), h))[0]) for a in v])
    edges = h.bin_edges
    for a, i in zip(v, idx):
        if h.magnitudes:
            assert (abs(a) == 0 and i == 0) or edges[i] <= abs(a) < edges[i + 1], (a, i)
        else:
            assert (a == 0 and i == h.zero_bin) or (a > 0 and edges[i] <= a < edges[i + 1]) or \
                (a < 0 and edges[i] < a <= edges[i + 1]), (a, i)
    np.testing.assert_array_equal(s["hist"], np.bincount(idx, minlength=h.nbins))


def test_fine_log2_layout_contract():
    h = Histogram.log2(-1, 1, sub=4, signed=True)
    assert h.nbins == 2 * (2 * 4 + 2) + 1 and h.zero_bin == 10
    x = torch.tensor([0.0, -0.0, 0.3, -0.3, 0.5, 0.625, -0.75, 1.0, 1.99, -2.0, 5.0, float("nan")])
    got = hookcap.tensor_stats(x, h)["hist"]
    want = np.zeros(h.nbins, dtype=np.int64)
    want[10] = 2  # zeros
    want[11], want[9] = 1, 1  # 0 < |x| < 2**-1: underflow, each side
    want[12], want[13] = 1, 1  # [0.5, 0.625), [0.625, 0.75)
    want[10 - 4] = 1  # -0.75: magnitude bin [0.75, 0.875) is u = 4
    want[16], want[19] = 1, 1  # [1, 1.25), [1.75, 2)
    want[0], want[20] = 1, 1  # -2 and 5: overflow, each side
    np.testing.assert_array_equal(got, want)
    assert Histogram.log2(-1, 1, sub=4).fold(got).sum() == got.sum()


def test_fine_log2_arguments_validated():
    for bad in (3, 32, 0):
        with pytest.raises(ValueError, match="sub"):
            Histogram.log2(sub=bad)
    with pytest.raises(ValueError, match="at most"):
        Histogram.log2(-1100, 1100, sub=2)
    with pytest.raises(ValueError, match="signed"):
        Histogram.log2(signed=1)
    ring = torch.zeros(2, 1, _layout.HEADER + Histogram.log2().nbins, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="hist_bins"):
        torch.ops.hookcap.accumulate(torch.randn(4), ring, new_state("cpu"), 0, 1, -64.0, 64.0, 3)
    h = Histogram.log2(sub=4)  # a ring sized for plain octaves does not fit 4 bins per octave
    with pytest.raises(RuntimeError, match="ring width"):
        torch.ops.hookcap.accumulate(torch.randn(4), ring, new_state("cpu"), 0, *h.op_args())


def test_log2_subnormals_land_in_true_exponent_bin():
    h = Histogram.log2(-1080, 0)
    x = torch.tensor([2.0**-1074, 3 * 2.0**-1070, 2.0**-1022], dtype=torch.float64)
    s = hookcap.tensor_stats(x, h)
    for e in (-1074, -1069, -1022):
        assert s["hist"][2 + e + 1080] == 1, e
    f = torch.tensor([2.0**-149, 2.0**-130 * 1.5], dtype=torch.float32)
    s = hookcap.tensor_stats(f, Histogram.log2(-160, 0))
    assert s["hist"][2 + (-149 + 160)] == 1 and s["hist"][2 + (-130 + 160)] == 1


def test_linear_edges_exact():
    h = Histogram.linear(-2.0, 2.0, 10)
    edges = hookcap.histogram.linear_inner_edges(h)
    x = torch.tensor(np.concatenate([edges, np.nextafter(edges, -np.inf), [-5.0, 7.0]]))
    s = check(x, h)
    assert s["hist"][0] == 1 + 1 + 0  # -5 and nextafter(-2, -inf); -2 itself is in bin 1
    assert s["hist"][-1] == 2  # 2.0 and 7.0


def test_wide_linear_histogram():
    check(specials(20_000, torch.float32), Histogram.linear(-4, 4, 3000))


def test_histogram_arguments_validated():
    with pytest.raises(ValueError, match="lo < hi"):
        Histogram.log2(3, 3)
    with pytest.raises(ValueError, match="integers"):
        Histogram.log2(0.5, 3)
    with pytest.raises(ValueError, match="bins"):
        Histogram.linear(0, 1, 0)
    with pytest.raises(ValueError, match="finite"):
        Histogram.linear(0, float("inf"), 3)
    with pytest.raises(ValueError, match="narrower"):
        Histogram.linear(1e16, 1e16 + 64, 1000)  # bins of 0.064 where doubles are 2 apart
    # The op checks the same rule for histograms built without Histogram.linear.
    narrow = Histogram("linear", 1e16, 1e16 + 64, 1000)
    ring = torch.zeros(2, 1, _layout.HEADER + narrow.nbins, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="narrower"):
        _ops.accumulate(torch.randn(10, dtype=torch.float64), ring, new_state("cpu"), 0, narrow)


def test_side_stream_flag_is_accepted_and_changes_no_cpu_row():
    """hist_kind's side-stream flag (Monitor(stream="side")) only picks the CUDA
    stream: a CPU row equals the one written without it; other bits are refused."""
    h = Histogram.log2()
    x = specials(1000, torch.float32, seed=3)
    rows = []
    for side in (False, True):
        kind, lo, hi, bins = _ops.hist_args(h, 4, side_stream=side)
        assert bool(kind & _layout.SIDE_STREAM_FLAG) == side
        ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64)
        state = new_state("cpu")
        _ops.reset_slot(ring, state)
        torch.ops.hookcap.accumulate(x, ring, state, 0, kind, lo, hi, bins)
        rows.append(ring)
    assert torch.equal(rows[0], rows[1])
    with pytest.raises(RuntimeError, match="hist_kind"):
        torch.ops.hookcap.accumulate(x, rows[0], new_state("cpu"), 0, kind | 64, lo, hi, bins)


@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_python_and_op_share_the_narrowest_width(factor):
    # Histogram.linear (MIN_WIDTH_EXP) and the op (kLinearMinWidthExp) draw the line at the same width.
    lo, bins = -3.0, 4
    hi = lo + bins * math.ldexp(abs(lo), hookcap.histogram.MIN_WIDTH_EXP) * factor
    raw = Histogram("linear", lo, hi, bins)
    ring = torch.zeros(2, 1, _layout.HEADER + raw.nbins, dtype=torch.int64)
    if factor < 1:
        with pytest.raises(ValueError, match="narrower"):
            Histogram.linear(lo, hi, bins)
        with pytest.raises(RuntimeError, match="narrower"):
            _ops.accumulate(torch.randn(10, dtype=torch.float64), ring, new_state("cpu"), 0, raw)
    else:
        assert Histogram.linear(lo, hi, bins).nbins == raw.nbins
        _ops.accumulate(torch.full((10,), lo, dtype=torch.float64), ring, new_state("cpu"), 0, raw)
        assert ring[0, 0, _layout.HEADER + 1] == 10  # every value on the first edge: bin 1


@pytest.mark.parametrize("lo", [1e16, -3.5e5, 1.0, -2.0 ** -30])
@pytest.mark.parametrize("bins", [1, 7, 1000])
def test_narrowest_linear_bins_exact(lo, bins):
    # Bins about as narrow as Histogram.linear allows (2**-48 of the range's magnitude)
    # place values on every edge and one ulp either side exactly.
    w = math.ldexp(abs(lo), hookcap.histogram.MIN_WIDTH_EXP) * 1.125  # a margin for hi - lo rounding
    h = Histogram.linear(lo, lo + bins * w, bins)
    with pytest.raises(ValueError, match="narrower"):
        Histogram.linear(lo, lo + bins * w * 0.49, bins)
    e = h.bin_edges[1:-1]
    x = torch.from_numpy(np.concatenate([e, np.nextafter(e, -np.inf), np.nextafter(e, np.inf)]))
    s = check(x, h)
    hist = np.asarray(s["hist"])
    assert hist[0] == 1 and hist[-1] == 2 and np.all(hist[1:-1] == 3)  # each bin: its edge, the next ulp, the ulp below its end


# -- bad input ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_non_float_dtype_clear_error(dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(RuntimeError, match="supported dtypes are float16, bfloat16"):
        hookcap.tensor_stats(x)


def test_op_rejects_bad_ring_and_row():
    x = torch.randn(10)
    st = new_state("cpu")
    with pytest.raises(RuntimeError, match="int64"):
        _ops.accumulate(x, torch.zeros(1, 1, 200), st, 0, None)
    ring = torch.zeros(2, 3, _layout.HEADER, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        _ops.accumulate(x, ring, st, 3, None)
    with pytest.raises(RuntimeError, match="does not fit a log2"):
        _ops.accumulate(x, ring, st, 0, Histogram.log2())
    with pytest.raises(RuntimeError, match="shape \\[3\\]"):
        _ops.accumulate(x, ring, torch.zeros(2, dtype=torch.int64), 0, None)


def test_requires_grad_input_and_inference_tensor():
    x = torch.randn(100, requires_grad=True)
    check(x)
    with torch.inference_mode():
        y = torch.randn(100)
    check(y)



@pytest.mark.parametrize("n", [1, 5, 5000])
def test_constant_block_of_tiny_values_keeps_its_squares(n):
    # A constant block away from the row's shift whose squared deviations
    # underflow float must take the exact path (found by hypothesis: a
    # subnormal written after a NaN, which leaves the row's shift at 0).
    from hookcap import _layout, _ops
    from hookcap.functional import new_state

    h = Histogram.log2()
    ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64)
    state = new_state("cpu")
    _ops.reset_slot(ring, state)
    parts = [torch.tensor([float("nan")]), torch.full((n,), 3.9183e-39, dtype=torch.float32)]
    for p in parts:
        _ops.accumulate(p, ring, state, 0, h)
    got = _layout.decode(ring[0, 0].numpy())
    ref = hookcap.reference.stats_from_values(torch.cat(parts).double().numpy(), h)
    assert float(got["sumsq"]) == pytest.approx(ref["sumsq"], rel=1e-6)
    assert float(got["sumsq"]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["zeros_only", "subnormals_only", "both", "tail_only"])
def test_zero_and_subnormal_counts_in_finite_blocks(dtype, layout):
    # With a log2 histogram the CPU counts a finite block's zeros only when
    # its exponent bytes show field 0 (zeros and subnormals share it): each
    # must still land in "zeros" or the underflow bin exactly, wherever in
    # the block (vector body or scalar tail) it sits.
    g = torch.Generator().manual_seed(7)
    n = 3 * 4096 + 1024 + 21  # several blocks and a tail that is not a multiple of 32
    x = torch.randn(n, generator=g, dtype=torch.float64)
    tiny = torch.finfo(dtype).tiny
    pos = torch.randperm(n - 21, generator=g)[:300]
    if layout in ("zeros_only", "both"):
        x[pos[:100]] = 0.0
        x[pos[100:150]] = -0.0
    if layout in ("subnormals_only", "both"):
        x[pos[150:200]] = tiny / 8
        x[pos[200:230]] = -tiny / 2
    if layout == "tail_only":
        x[n - 5] = 0.0
        x[n - 3] = tiny / 4
    x = x.to(dtype)
    got = check(x, Histogram.log2())
    xd = x.double()
    assert got["zeros"] == int((xd == 0).sum()) == got["hist"][0]
    assert got["hist"][1] == int(((xd != 0) & (xd.abs() < 2.0 ** -64)).sum())  # underflow


@pytest.mark.parametrize("gap", [8, 14, 22, 30])
def test_log2_bimodal_blocks_count_exactly(gap):
    # Blocks whose values sit in two clusters `gap` octaves apart (seen in a
    # CNN's early-layer gradients) make the CPU count a wider exponent window
    # from the next block on; every bin must still match the reference,
    # including the values beyond even the wide window.
    g = torch.Generator().manual_seed(gap)
    n = 40 * 1024 + 300
    lo_mode = torch.randn(n, generator=g, dtype=torch.float64) * 2.0 ** -(gap + 6)
    hi_mode = torch.randn(n, generator=g, dtype=torch.float64) * 2.0 ** -6
    x = torch.where(torch.rand(n, generator=g) < 0.4, hi_mode, lo_mode).float()
    got = check(x, Histogram.log2())
    ref = hookcap.reference.tensor_stats(x, Histogram.log2())
    assert list(got["hist"]) == list(ref["hist"])
    assert sum(got["hist"]) == n


def test_log2_histograms_of_different_ranges_alternate():
    # The CPU keeps its exponent->bin table between calls; a call with another
    # range must rebuild it (on this thread and for the worker threads).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-30, 30, (50_000,), generator=g).float())
    for h in [Histogram.log2(-20, 5), Histogram.log2(), Histogram.log2(-20, 5), Histogram.log2(-126, 127)]:
        got = check(x, h)
        ref = hookcap.reference.tensor_stats(x, h)
        assert list(got["hist"]) == list(ref["hist"])


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_floating_types_the_kernels_do_not_take_are_refused_by_name(name):
    """Float types outside the dispatch list fail in the op's check with the
    list of supported dtypes, and the Monitor skips such tensors with that reason."""
    from hookcap._rows.recorder import skip_reason

    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    x = torch.zeros(8).to(dtype)
    with pytest.raises(RuntimeError, match="supported dtypes are float16, bfloat16, float32"):
        hookcap.tensor_stats(x)
    assert skip_reason(x) == f"dtype {dtype} is not supported"


def test_crest_is_at_least_one():
    """A constant magnitude: absmax = rms mathematically; the rounding of rms
    never reports a crest below 1."""
    for n in (3, 7, 1000, 12345):
        for v in (0.1, 1.0 / 3.0, 1e-30, 7.7e20):
            x = torch.full((n,), v, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(n)[:n]
            assert hookcap.tensor_stats(x)["crest"] >= 1.0, (n, v)


def test_a_second_write_far_from_the_rows_shift_keeps_its_digits():
    """The row's shift is the first write's (-1e5); a second tensor near zero
    whose one outlier makes its spread look wide is still summed about its own
    center, not the shift: sum within 1e-6 of its float64 value (about the
    shift, float runs of values ~1e5 would lose about 1e-4)."""
    from hookcap import _layout, _ops
    from hookcap.functional import new_state

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    x[123] = 2e6
    first = torch.tensor([-1e5])
    h = Histogram.log2()
    ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64)
    state = new_state("cpu")
    _ops.reset_slot(ring, state)
    _ops.accumulate(first, ring, state, 0, h)
    _ops.accumulate(x, ring, state, 0, h)
    got = _layout.decode(ring[0, 0].numpy())
    flat = torch.cat([first, x]).double()
    assert abs(float(got["sum"]) - flat.sum().item()) <= 1e-6 * flat.abs().sum().item()
    assert float(got["std"]) == pytest.approx(flat.std(unbiased=False).item(), rel=1e-6)
