"""Property tests: for random shapes, strides, dtypes and injected special
values, the compiled op equals the float64 reference within the stated bounds."""

import numpy as np
import torch
from conftest import abs_sum, assert_stats_match
from hypothesis import given
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, "tiny", "huge"]


@st.composite
def tensors(draw, max_numel=200_000):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim))
    if int(np.prod(shape)) > max_numel:
        shape = [min(s, 8) for s in shape]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -1000.0]))
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset)
    flat = x.reshape(-1)
    if flat.numel():
        for _ in range(draw(st.integers(0, 6))):
            i = draw(st.integers(0, flat.numel() - 1))
            v = draw(st.sampled_from(SPECIALS))
            fi = torch.finfo(dtype)
            # "huge" stays below 1e150 so float64 squares do not overflow
            # (overflow itself is covered in test_stats.py).
            huge = min(fi.max / 2, 1e150)
            flat[i] = fi.tiny / 3 if v == "tiny" else (huge if v == "huge" else v)
    x = flat.reshape(shape).to(dtype)
    # Strided views: transposed, sliced, expanded, offset.
    view = draw(st.sampled_from(["plain", "transpose", "slice", "expand", "offset"]))
    if view == "transpose" and x.dim() >= 2:
        x = x.transpose(0, x.dim() - 1)
    elif view == "slice" and x.dim() >= 1 and x.shape[0] > 1:
        x = x[1::2]
    elif view == "expand" and x.dim() >= 1:
        x = x[:1].expand(3, *x.shape[1:]) if x.shape[0] == 1 else x.unsqueeze(0).expand(2, *x.shape)
    elif view == "offset" and x.numel() > 1:
        x = x.reshape(-1)[1:]
    return x


HISTS = st.sampled_from([
    Histogram.log2(),
    Histogram.log2(-20, 5),
    Histogram.log2(-20, 5, sub=4),
    Histogram.log2(sub=2, signed=True),
    Histogram.log2(-140, 8, sub=8, signed=True),
    Histogram.linear(-2.0, 2.0, 9),
    Histogram.linear(-1500.0, 500.0, 64),
    None,
])


@given(x=tensors(), h=HISTS)
def test_op_matches_reference(x, h):
    got = hookcap.tensor_stats(x, h)
    ref = hookcap.reference.tensor_stats(x, h)
    assert_stats_match(got, ref, abs_sum=abs_sum(x))


@given(
    n=st.integers(1_000_000, 1_300_000),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
    nspecial=st.integers(0, 3),
)
def test_large_tensors(n, dtype, seed, nspecial):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2 + 0.5
    for k in range(nspecial):
        x[(seed * 7919 + k * 104729) % n] = [float("nan"), float("inf"), 0.0][k]
    x = x.to(dtype)
    got = hookcap.tensor_stats(x)
    ref = hookcap.reference.tensor_stats(x)
    assert_stats_match(got, ref, abs_sum=abs_sum(x))


@given(parts=st.lists(tensors(max_numel=20_000), min_size=1, max_size=4))
def test_repeated_writes_merge(parts):
    from hookcap import _layout, _ops
    from hookcap.functional import new_state

    h = Histogram.log2()
    ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64)
    state = new_state("cpu")
    _ops.reset_slot(ring, state)
    for p in parts:
        _ops.accumulate(p, ring, state, 0, h)
    raw = ring[0, 0].numpy()
    got = {k: float(v) for k, v in _layout.decode(raw).items()}
    got["hist"], got["bin_edges"] = raw[_layout.HEADER:], h.bin_edges
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    ref = hookcap.reference.stats_from_values(flat.numpy(), h)
    assert_stats_match(got, ref, abs_sum=abs_sum(flat))


@given(
    n=st.integers(4096, 70_000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    octaves=st.integers(0, 60),
    zero_frac=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    h=st.sampled_from([Histogram.log2(), Histogram.log2(-20, 5), Histogram.log2(-126, 127)]),
)
def test_log2_histogram_wide_ranges_and_zeros(n, dtype, octaves, zero_frac, seed, h):
    # The CPU counts each block's exponents in a window under its largest
    # value and the rest one by one: magnitudes spread over up to 60 octaves
    # (many outside the window), ReLU-like zero runs and subnormals must all
    # land in the reference's bins.
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(-torch.rand(n, generator=g, dtype=torch.float64) * octaves)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = mag * sign * 4.0
    x[torch.rand(n, generator=g) < zero_frac] = 0.0
    fi = torch.finfo(dtype)
    x[seed % n] = fi.tiny / 4  # a subnormal
    x[(seed // 7) % n] = fi.max / 2
    x = x.to(dtype)
    got = hookcap.tensor_stats(x, h)
    ref = hookcap.reference.tensor_stats(x, h)
    assert_stats_match(got, ref, abs_sum=abs_sum(x))
