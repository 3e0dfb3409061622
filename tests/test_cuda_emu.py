"""The CUDA kernels' own source (csrc/cuda/stats_kernel.cuh), executed on the
CPU by the thread-level emulation in tests/cuda_emu, against the float64
reference and the CPU op. Runs on every CI machine: no GPU needed.

Also: the harness's own semantics (warp primitives, atomics, fault detection),
a ThreadSanitizer run of the kernels, and proof that a driver run told to skip a
barrier or break an index is caught.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.cpp_extension as cpp_ext
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import (abs_sum, assert_moments, assert_stats_match, assert_wide_match, attention_rows_ref,
                      attention_tile, draw)

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.histogram import NO_HIST_ARGS
from hookcap.reference import tensor_stats

ROOT = Path(__file__).resolve().parent.parent
EMU = ROOT / "tests" / "cuda_emu"
sys.path.insert(0, str(EMU))
from emu_build import BUILD, CFLAGS, CXX  # noqa: E402
import emu_build  # noqa: E402

LOG2 = Histogram.log2()
THREADS = 256  # the launcher's block size
OPS = torch.ops.hookcap


def _sources():
    return sorted([*EMU.glob("*.h"), *EMU.glob("*.cpp"), *(ROOT / "csrc" / "cuda").glob("*.cuh"),
                   *(ROOT / "csrc" / "hookcap").glob("*.h")])


@pytest.fixture(scope="session")
def emu(selftest_builds):
    """The kernels + harness as a Python module (built once; ninja keeps it),
    built while the standalone drivers build beside it (selftest_builds)."""
    return emu_build.load()


@pytest.fixture(autouse=True)
def _forward_order(request):
    if "emu" in request.fixturenames:
        request.getfixturevalue("emu").configure()
    yield


# ---------------------------------------------------------------------------
# Inputs and result decoding
# ---------------------------------------------------------------------------
def sample(n, dtype, seed, max_exp=None):
    """Log-uniform magnitudes over much of dtype's range, both signs, plus NaN,
    +-Inf, +-0 and subnormals at random positions."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    hi = min(np.log2(fi.max) - 1, 120.0) if max_exp is None else max_exp
    lo = max(np.log2(fi.smallest_normal), -120.0)
    e = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g)
    sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    x = sign * torch.exp2(e)
    kind = torch.randint(0, 24, (n,), generator=g)
    x[kind == 0] = float("nan")
    x[kind == 1] = float("inf")
    x[kind == 2] = float("-inf")
    x[kind == 3] = 0.0
    x[kind == 4] = -0.0
    sub = kind == 5
    x[sub] = fi.smallest_normal * torch.rand(int(sub.sum()), generator=g, dtype=torch.float64)
    return x.to(dtype)


def hist_args(h):
    return NO_HIST_ARGS if h is None else h.op_args()


def width(h):
    return _layout.HEADER + (h.nbins if h is not None else 0)


def new_ring(slots, rows, h):
    ring = torch.full((slots, rows, width(h)), -7, dtype=torch.int64)
    for s in range(slots):
        OPS.reset_slot(ring, torch.tensor([0, 1, s]))
    return ring


def row_stats(raw, h):
    raw = np.asarray(raw)
    out = {k: float(v) for k, v in _layout.decode(raw).items()}
    if h is not None:
        out["hist"] = raw[_layout.HEADER:].copy()
        out["bin_edges"] = h.bin_edges
    return out


def emu_accumulate(emu, x, ring, state, row, h, grid, block):
    return emu.accumulate(x, ring, state, row, *hist_args(h), grid, block)


def run_emu(emu, x, h, grid, block, tree=True):
    ring = new_ring(1, 1, h)
    emu.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *hist_args(h), grid, block, tree=tree)
    return ring[0, 0].numpy()


def run_cpu(x, h):
    ring = new_ring(1, 1, h)
    OPS.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *hist_args(h))
    return ring[0, 0].numpy()


# The double sums (summation order) and the shifts (the first block to merge sets each).
SUM_COLS = [_layout.S1, _layout.S2, _layout.SUM, _layout.SUMSQ, _layout.SHIFT, _layout.BIG_SHIFT, _layout.BIG_S1,
            _layout.BIG_S2, _layout.SMALL_SHIFT, _layout.SMALL_S1, _layout.SMALL_S2]
# Equal bit for bit on CPU and GPU. The shift is not: each picks a central
# value of its own (the CPU a probe, the kernel the first block's center).
EXACT_COLS = ["COUNT", "NAN", "POSINF", "NEGINF", "ZEROS", "MIN", "MAX", "ABSMAX",
              "CALLS", "STEP_TAG"]


def sum_rtol(values):
    """Float64 input is summed in double; narrower inputs in float runs of
    <= 512 values per thread, flushed to double (as the CPU loop does)."""
    return (1e-12, 1e-9) if values.dtype == torch.float64 else (1e-5, 1e-4)


def check(raw, x, h, *, cpu_raw=None, values=None, narrow=False):
    """Emulated row vs the float64 reference (and the CPU op's row if given).
    ``narrow``: float64 ``values`` that came from narrower inputs."""
    values = x if values is None else values
    ref = hookcap.reference.tensor_stats(values, h)
    rtol_sum, rtol_std = sum_rtol(values.float() if narrow else values)
    assert_stats_match(row_stats(raw, h), ref, rtol_sum=rtol_sum, rtol_std=rtol_std,
                       abs_sum=abs_sum(values))
    if cpu_raw is None:
        return
    for c in EXACT_COLS:
        col = getattr(_layout, c)
        assert raw[col] == cpu_raw[col], f"{c}: emulated {raw[col]}, CPU {cpu_raw[col]}"
    np.testing.assert_array_equal(raw[_layout.HEADER:], cpu_raw[_layout.HEADER:])
    # Both sum inputs of <= 32 bits in float runs, float64 in double.
    rtol = 1e-9 if values.dtype == torch.float64 and not narrow else 1e-5
    got, cpu = row_stats(raw, None), row_stats(cpu_raw, None)
    a = abs_sum(values)
    assert abs(got["sum"] - cpu["sum"]) <= rtol * a + 1e-300
    assert abs(got["sumsq"] - cpu["sumsq"]) <= rtol * cpu["sumsq"] + 1e-300


def launcher_grid(n, sms=132):
    """stats_launch.cu: blocks = max(1, min(ceil(n / 1024), 4 * SMs))."""
    return max(1, min(-(-n // (THREADS * 4)), 4 * sms))


# ---------------------------------------------------------------------------
# The harness itself
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("block", [64, 96])
def test_warp_primitives_follow_cuda_definitions(emu, block):
    out = emu.probe_warp(block).numpy()
    for t in range(block):
        lane, base = t % 32, t - t % 32
        v = lambda lane_: 1000 + base + lane_  # noqa: E731
        seg8 = lane - lane % 8
        want = [
            v(lane + 5) if lane + 5 < 32 else v(lane),  # shfl_down 5
            v(lane - 3) if lane >= 3 else v(lane),  # shfl_up 3
            v(lane ^ 9),  # shfl_xor 9
            v(7),  # shfl 7
            v(lane + 2) if lane + 2 < seg8 + 8 else v(lane),  # shfl_down 2, width 8
            v(lane),  # shfl_xor 4, width 4: partner outside the segment
            sum(1 << k for k in range(32) if k % 3 == 0),  # ballot
            1 + 4,  # all(true), not all(lane<31), any(lane==30), not any(lane>40)
            int(2 * (base + (lane ^ 1) + 0.25)),  # double through shfl_xor
            (base + lane + 16 if lane < 16 else t) + 10000 * (t - 1 if lane >= 1 else t),
        ]
        assert list(out[t]) == want, f"thread {t}"


def test_atomics_on_shared_and_global_memory(emu):
    grid, block = 3, 128
    s, mn, mx, dsum, first, shared = emu.probe_atomics(grid, block)
    total = grid * block
    assert s == total * (total - 1) // 2
    assert mn == 5 - (total - 1) and mx == 3 * (total - 1)
    assert dsum == 0.5 * total
    assert 0 <= first < total
    for b in range(grid):
        gids = range(b * block, (b + 1) * block)
        assert shared[b].tolist() == [block, sum(gids) % 2**32]


def test_exited_lanes_drop_out_of_warp_primitives_and_barriers(emu):
    out = emu.probe_exited_lanes(64).numpy()
    for t in range(64):
        lane = t % 32
        want = -1 if lane >= 16 else (t + 1 if lane < 15 else t)
        assert out[t] == want


def test_match_any_follows_cuda_definition(emu):
    """__match_any_sync: the lanes of the caller's warp (within the mask) whose
    value has the same bits, for 32-bit, 64-bit and float keys (-0.0 is not 0.0)."""
    block = 96
    out = emu.probe_match(block).numpy()
    for t in range(block):
        lane, base = t % 32, t - t % 32
        keys = [
            [k % 5 for k in range(32)],
            [(k // 8) << 40 for k in range(32)],
            [k % 3 == 0 for k in range(32)],  # -0.0 for these, +0.0 for the others
            [(base + k) // 48 for k in range(32)],  # equal keys in other warps do not count
        ]
        want = [sum(1 << k for k in range(32) if col[k] == col[lane]) for col in keys]
        assert list(out[t]) == want, f"thread {t}"
    out = emu.probe_match_exited(64).numpy()  # lanes 20..31 exited: mask 0x000fffff
    for t in range(64):
        lane = t % 32
        want = -1 if lane >= 20 else sum(1 << k for k in range(20) if k % 3 == lane % 3)
        assert out[t] == want, f"thread {t}"


def test_dynamic_shared_memory_per_block(emu):
    """Each block sees the launch's dynamic shared memory poisoned (undefined on
    a GPU: never the previous block's contents) and its own writes."""
    grid, block, words = 3, 64, 1000
    first, out = (t.numpy() for t in emu.probe_dynamic_smem(grid, block, words))
    assert (first == np.int32(np.uint32(0xa5a5a5a5).view(np.int32))).all()
    for b in range(grid):
        assert out[b].tolist() == [b * 100000 + i for i in range(words)][::-1]


@pytest.mark.parametrize("kind,error,message", [
    ("divergent", RuntimeError, "divergent __syncthreads"),
    ("deadlock", RuntimeError, "deadlock"),
    ("partial_mask", RuntimeError, "deadlock.*0x0000ffff"),
    ("not_in_mask", RuntimeError, "is not in its mask"),
    ("trap", RuntimeError, "__trap"),
    ("dynamic_too_big", ValueError, "dynamic shared memory exceed"),  # a launch error
    ("dynamic_overrun", RuntimeError, "wrote past the end of its 64 bytes of dynamic shared memory"),
])
@pytest.mark.parametrize("schedule", [0, 1])
def test_harness_reports_kernel_faults(emu, kind, error, message, schedule):
    emu.configure(schedule=schedule)
    with pytest.raises(error, match=message):
        emu.probe_fault(kind, 64)
    # ...and the next launch runs normally.
    x = sample(300, torch.float32, 1)
    check(run_emu(emu, x, LOG2, 2, 64), x, LOG2)


def test_launch_runs_exactly_the_requested_grid(emu):
    before = emu.stats()
    run_emu(emu, sample(100, torch.float32, 2), LOG2, 7, 64)
    after = emu.stats()
    assert after["launches"] - before["launches"] == 1
    assert after["blocks"] - before["blocks"] == 7
    assert after["threads"] - before["threads"] == 7 * 64
    # the kernel's two, then the tree's: publish the record, take the ticket
    assert after["barrier_phases"] - before["barrier_phases"] == 7 * 4


# ---------------------------------------------------------------------------
# accumulate_kernel
# ---------------------------------------------------------------------------
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,offset,grid,block", [
    (4099, 1, None, THREADS),  # the launcher's grid; starts off the 16-byte boundary
    (1001, 3, 2, 64),
    (37, 0, 5, 32),  # more blocks than elements
    (1500, 1, 1, 96),
])
def test_dense_matches_reference_and_cpu(emu, dtype, n, offset, grid, block):
    x = sample(n + offset, dtype, n + offset)[offset:]
    grid = launcher_grid(n) if grid is None else grid
    for h in (LOG2, Histogram.linear(-3.0, 5.0, 13)):
        ring = new_ring(1, 1, h)
        assert emu_accumulate(emu, x, ring, torch.tensor([0, 1, 0]), 0, h, grid, block)[0]  # dense
        check(ring[0, 0].numpy(), x, h, cpu_raw=run_cpu(x, h))


def wide_sample(n, seed):
    """Float64 magnitudes over all of double's range (2**-1074 .. 2**1023),
    both signs, with runs of ordinary, huge and tiny values and NaN/Inf/0."""
    g = np.random.default_rng(seed)
    x = np.ldexp(g.uniform(1, 2, n) * g.choice([-1.0, 1.0], n), g.integers(-1074, 1024, n))
    third = n // 3
    x[:third] = g.standard_normal(third)  # whole runs of ordinary values
    x[third:third + third // 2] = 1e250 * (1 + 1e-6 * g.standard_normal(third // 2))  # huge, |mean| >> std
    k = max(n // 60, 1)
    idx = g.permutation(n)
    x[idx[:k]] = np.nan
    x[idx[k:2 * k]] = -np.inf
    x[idx[2 * k:3 * k]] = 0.0
    return torch.from_numpy(x)


@pytest.mark.parametrize("n,grid,block", [(20_000, None, THREADS), (3001, 3, 64), (40, 5, 32)])
@pytest.mark.parametrize("tree", [False, True], ids=["direct", "tree"])
def test_wide_float64_values(emu, n, grid, block, tree):
    """Float64 values beyond squaring range: each thread's buckets go to the
    ring's (stats_math.h wide_to_row); l2norm, rms and std stay finite and
    right, with counts, extrema and bins equal to the CPU op's."""
    x = wide_sample(n, n)
    grid = launcher_grid(n) if grid is None else grid
    h = Histogram.log2(-1074, 1023)
    ring = new_ring(1, 1, h)
    emu.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *hist_args(h), grid, block, tree=tree)
    raw = ring[0, 0].numpy()
    assert raw[_layout.BIG_N] > 0 and raw[_layout.SMALL_N] > 0
    assert_wide_match(row_stats(raw, h), x.numpy(), h, rtol=1e-9)
    cpu = run_cpu(x, h)
    # Every big value takes the big bucket; which small ones take theirs
    # depends on how the values were cut into runs (CPU blocks, GPU threads).
    for c in EXACT_COLS + ["BIG_N"]:
        col = getattr(_layout, c)
        assert raw[col] == cpu[col], f"{c}: emulated {raw[col]}, CPU {cpu[col]}"
    np.testing.assert_array_equal(raw[_layout.HEADER:], cpu[_layout.HEADER:])
    # A broadcast view (stride 0): every element counts `mult` times.
    k = min(n, 200)
    col = x[:k].reshape(k, 1).expand(k, 8)
    ring = new_ring(1, 1, None)
    emu.accumulate(col, ring, torch.tensor([0, 1, 0]), 0, *hist_args(None), 2, 64, tree=tree)
    assert_wide_match(row_stats(ring[0, 0].numpy(), None), np.repeat(x[:k].numpy(), 8), rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grid_bound_makes_threads_loop(emu, dtype):
    """n beyond the grid bound (here a 2-SM GPU: 8 blocks): every thread
    walks the grid-stride loop several times."""
    n = 20011
    grid = launcher_grid(n, sms=2)
    assert grid == 8 and n > 2 * grid * THREADS * 4
    x = sample(n + 1, dtype, 18)[1:]
    check(run_emu(emu, x, LOG2, grid, THREADS), x, LOG2, cpu_raw=run_cpu(x, LOG2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h", [Histogram.linear(-3.0, 5.0, 13), Histogram.log2(-140, 10), LOG2, None])
def test_threads_with_many_runs_in_each_loop_form(emu, dtype, h):
    """Each thread works over two runs of 64 items and a partial one, with
    odd and even numbers of groups (16-bit counted in shared memory or by
    exponent byte: the two-register-set loop; the others the one-set loop),
    from a start off the 16-byte boundary."""
    per = 16 // dtype.itemsize
    n = 2 * 32 * per * 141 + 5 * per + 3
    x = sample(n + 1, dtype, 19)[1:]
    check(run_emu(emu, x, h, 2, 32), x, h, cpu_raw=run_cpu(x, h))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8(emu, dtype):
    x = sample(777, torch.float32, 5, max_exp=8).to(dtype)[1:]
    check(run_emu(emu, x, LOG2, 2, 128), x, LOG2, cpu_raw=run_cpu(x, LOG2))


@pytest.mark.parametrize("block", [32, 96, THREADS])
def test_blocks_up_to_the_launchers_size(emu, block):
    x = sample(3000, torch.float32, 6)[1:]
    check(run_emu(emu, x, LOG2, 2, block), x, LOG2, cpu_raw=run_cpu(x, LOG2))


def test_blocks_larger_than_the_launchers_fault(emu):
    with pytest.raises(RuntimeError, match="__trap"):
        run_emu(emu, sample(100, torch.float32, 6), LOG2, 1, 2 * THREADS)


@pytest.mark.parametrize("h", [
    Histogram.log2(-10, 10),  # underflow and overflow bins in use
    Histogram.log2(-140, 10),  # below float's normal range: log2_bin per element, not the exponent byte
    Histogram.log2(-10, 10, sub=4),  # bins per octave: keys counted in shared memory (kModeLog2Key)
    Histogram.log2(-10, 10, sub=2, signed=True),
    Histogram.log2(sub=16, signed=True),  # 8,192 keys: 32 KB of shared memory
    Histogram.log2(-140, 10, sub=8, signed=True),  # below float's normal range: log2_bin_fine per element
    Histogram.linear(1e6, 1e6 + 16.0, 100),  # bins 2.6 floats wide: at linear_float_ok's limit, in float
    Histogram.linear(1e6, 1e6 + 14.0, 100),  # 2.2 floats wide: past the limit, bins in double (kModeWideExact)
    Histogram.linear(-1e3, 1e3, 40),
    Histogram.linear(-2.0, 3.0, 2046),
    Histogram.linear(-2.0, 3.0, 2047),
    Histogram.linear(-2.0, 3.0, 5000),  # counts and float thresholds in 40 KB of dynamic shared memory
    Histogram.linear(-2.0, 3.0, 20000),  # float: thresholds beyond shared memory, bins in double
    Histogram.linear(1e13, 1e13 + 1.0, 10),  # float cannot estimate: double linear_bin (kModeWideExact)
    Histogram.linear(0.0, 1e-38, 10),  # 1 / width beyond float: kModeWideExact
    None,
])
def test_histogram_kinds(emu, h):
    x = sample(2500, torch.float32, 7, max_exp=12)
    check(run_emu(emu, x, h, 3, THREADS), x, h, cpu_raw=run_cpu(x, h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fine_log2_keys_beyond_the_budget_bin_per_element(emu, dtype):
    """With 8,192 keys over a small device's budget the launch takes
    kModeLog2Fine (log2_bin_fine per element): the same counts."""
    h = Histogram.log2(sub=16, signed=True)
    assert emu.hist_plan(*h.op_args(), True, 30000)[0] == MODE_LOG2FINE
    x = sample(3000, dtype, 12, max_exp=12)
    check(run_emu_budget(emu, x, h, 3, THREADS, 30000), x, h, cpu_raw=run_cpu(x, h))


@pytest.mark.parametrize("h", [
    Histogram.linear(-1.0, 1.0, 2500),
    Histogram.linear(1e16, 1e16 + 300 * 2.0 ** -47 * 1e16, 300),  # about the narrowest bins allowed
])
def test_linear_histogram_values_on_edges(emu, h):
    edges = torch.from_numpy(h.bin_edges[1:-1])
    x = torch.cat([edges, torch.nextafter(edges, torch.tensor(-np.inf, dtype=torch.float64))])
    check(run_emu(emu, x, h, 2, 128), x, h, cpu_raw=run_cpu(x, h))


# ---------------------------------------------------------------------------
# Histogram modes (kernels::hist_plan): counts in dynamic shared memory up to
# the device's budget, wider ones in the ring by warp-aggregated atomics
# ---------------------------------------------------------------------------
MODE_LOG2EXP, MODE_LOG2, MODE_LINEAR, MODE_WIDE, MODE_WIDE_EXACT, MODE_LOG2KEY, MODE_LOG2FINE = 1, 2, 3, 4, 5, 6, 7
STATIC_SMEM = 848  # the kernels' static shared memory (kernels::kStaticSmem)
H100 = 233472 // 4 - 1024 - STATIC_SMEM  # kernels::smem_budget: 4 blocks of 256 per SM
A100 = 167936 // 4 - 1024 - STATIC_SMEM


@pytest.mark.parametrize("h,is_float,budget,want", [
    (Histogram.linear(-2, 3, 3000), True, H100, (MODE_LINEAR, 8 * 3000 + 16)),
    (Histogram.linear(-2, 3, 6000), True, H100, (MODE_LINEAR, 8 * 6000 + 16)),
    (Histogram.linear(-2, 3, 6000), True, A100, (MODE_WIDE, 4 * 6001)),  # thresholds shared
    (Histogram.linear(-2, 3, 10000), True, H100, (MODE_WIDE, 4 * 10001)),
    (Histogram.linear(-2, 3, 10000), False, H100, (MODE_LINEAR, 4 * 10003)),  # float64: no thresholds
    (Histogram.linear(-2, 3, 20000), True, H100, (MODE_WIDE_EXACT, 0)),  # thresholds do not fit
    (Histogram.linear(-2, 3, 20000), False, H100, (MODE_WIDE, 0)),
    (Histogram.linear(-2, 3, 100000), True, H100, (MODE_WIDE_EXACT, 0)),
    (Histogram.log2(-1100, 1100), True, H100, (MODE_LOG2, 4 * 2204)),  # the widest log2
    (Histogram.log2(-1100, 1100), False, 0, (MODE_LOG2, 4 * 2204)),  # always shared
    (Histogram.log2(), True, H100, (MODE_LOG2EXP, 0)),
    (Histogram.log2(sub=4), True, H100, (MODE_LOG2KEY, 4 * 2**10)),  # exponent + 2 mantissa bits
    (Histogram.log2(signed=True), True, H100, (MODE_LOG2KEY, 4 * 2**9)),  # sign + exponent
    (Histogram.log2(sub=16, signed=True), True, A100, (MODE_LOG2KEY, 4 * 2**13)),
    (Histogram.log2(sub=16, signed=True), True, 30000, (MODE_LOG2FINE, 4 * 4102)),  # keys beyond the budget
    (Histogram.log2(sub=4), False, H100, (MODE_LOG2FINE, 4 * 516)),  # float64: log2_bin_fine per element
    (Histogram.log2(-140, 10, sub=2), True, H100, (MODE_LOG2FINE, 4 * 304)),  # float subnormals in range
    (Histogram.log2(-140, 10), True, H100, (MODE_LOG2, 4 * 154)),  # plain octaves keep log2_bin
    (Histogram.linear(1e6, 1e6 + 16, 100), True, H100, (MODE_LINEAR, 8 * 100 + 16)),  # bins 2.6 floats wide
    (Histogram.linear(1e6, 1e6 + 14, 100), True, H100, (MODE_WIDE_EXACT, 0)),  # 2.2: float cannot estimate
    (Histogram.linear(1e13, 1e13 + 1, 10), True, H100, (MODE_WIDE_EXACT, 0)),
    (Histogram.linear(0, 1e-38, 10), True, H100, (MODE_WIDE_EXACT, 0)),
    (Histogram.linear(0, 1e-38, 10), False, H100, (MODE_LINEAR, 4 * 13)),
])
def test_histogram_plan(emu, h, is_float, budget, want):
    assert emu.hist_plan(*h.op_args(), is_float, budget) == want


def wide_input(n, dtype, seed, h, clustered):
    """Values over the range and 10% beyond each end, with NaN, +-Inf and +-0
    among them; clustered: sorted, from a window of about 300 bins, so that
    the lanes of a warp share bins (their adds combine)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = h.lo, h.hi
    if clustered:
        span = (hi - lo) * min(1.0, 300 / h.bins)
        a = lo + (hi - lo) * 0.37
        x = (a + span * torch.rand(n, generator=g, dtype=torch.float64)).sort().values
    else:
        x = lo - 0.1 * (hi - lo) + 1.2 * (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)
    kind = torch.randint(0, 64, (n,), generator=g)
    for k, v in enumerate((float("nan"), float("inf"), float("-inf"), 0.0, -0.0)):
        x[kind == k] = v
    return x.to(dtype)


def run_emu_budget(emu, x, h, grid, block, budget):
    ring = new_ring(1, 1, h)
    emu.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *hist_args(h), grid, block,
                   smem_budget=budget)
    return ring[0, 0].numpy()


@pytest.mark.parametrize("bins", [3000, 6000, 20000, 100000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("clustered", [False, True])
def test_wide_linear_histograms(emu, bins, dtype, clustered):
    """Every bin equal to the CPU op's and the float64 reference's: random and
    clustered data, several blocks, a start off the 16-byte boundary (the
    head and tail elements go through the warp-uniform loop too)."""
    h = Histogram.linear(-2.5, 4.0, bins)
    x = wide_input(20001, dtype, bins + 7 * clustered, h, clustered)[1:]
    check(run_emu(emu, x, h, 3, THREADS), x, h, cpu_raw=run_cpu(x, h))


@pytest.mark.parametrize("bins,budget", [(3000, 20000), (6000, A100), (6000, 20000), (3000, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_paths_by_shared_memory_budget(emu, bins, budget, dtype):
    """A smaller device budget moves the same histogram to the ring (thresholds
    in shared memory, or too many for it: bins in double): the bins do not change."""
    h = Histogram.linear(-2.5, 4.0, bins)
    plan = emu.hist_plan(*h.op_args(), True, budget)
    assert plan[0] == (MODE_WIDE if 4 * (bins + 1) <= budget else MODE_WIDE_EXACT)
    for clustered in (False, True):
        x = wide_input(12001, dtype, bins + budget + clustered, h, clustered)[1:]
        check(run_emu_budget(emu, x, h, 4, 96, budget), x, h, cpu_raw=run_cpu(x, h))


@pytest.mark.parametrize("h", [Histogram.log2(-1100, 1000), Histogram.log2(-1100, 1023)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_log2_histograms_over_2048_bins(emu, h, dtype):
    assert h.nbins > 2048
    x = sample(6001, dtype, h.nbins)[1:]
    check(run_emu(emu, x, h, 3, THREADS), x, h, cpu_raw=run_cpu(x, h))


def float_edges(h, step=1):
    """Every step-th float threshold (least float >= an edge) and its float
    neighbours: the values a wrong correction or a wrong tie misbins."""
    edges = torch.from_numpy(h.bin_edges[1:-1][::step].copy())
    f = edges.float()
    thr = torch.where(f.double() < edges, torch.nextafter(f, torch.tensor(np.inf)), f)
    return torch.cat([thr, torch.nextafter(thr, torch.tensor(-np.inf)), torch.nextafter(thr, torch.tensor(np.inf))])


@pytest.mark.parametrize("bins,step", [(3000, 1), (20000, 3), (100000, 17)])
def test_wide_linear_values_on_edges(emu, bins, step):
    h = Histogram.linear(-1.0, 1.5, bins)
    x = float_edges(h, step)
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(bins))]
    check(run_emu(emu, x, h, 2, THREADS), x, h, cpu_raw=run_cpu(x, h))
    x64 = torch.from_numpy(h.bin_edges[1:-1][::step].copy())  # float64: exactly on the edges
    x64 = torch.cat([x64, torch.nextafter(x64, torch.tensor(-np.inf, dtype=torch.float64))])
    check(run_emu(emu, x64, h, 2, THREADS), x64, h, cpu_raw=run_cpu(x64, h))


def test_wide_strided_view(emu):
    """Strided reads (one element per item) in the ring mode."""
    h = Histogram.linear(-2.5, 4.0, 20000)
    base = wide_input(150 * 90, torch.float32, 5, h, False).reshape(150, 90)
    v = base.t()[3:, ::2]
    ring = new_ring(1, 1, h)
    assert emu_accumulate(emu, v, ring, torch.tensor([0, 1, 0]), 0, h, 3, 64)[0] is False
    check(ring[0, 0].numpy(), v, h, cpu_raw=run_cpu(v, h))


LINEAR_SPECS = [(-1, 1, 2500), (0, 1, 1), (0, 10, 100), (-4, 4, 4096), (-4, 4, 100000), (100, 101, 10000),
                (1e6, 1e6 + 17.5, 100), (-1e-30, 3e-30, 777), (1e20, 1e20 + 50 * 2e13, 50), (0.1, 0.7, 12345),
                (-2.0**20, 2.0**20, 2**20), (-3.3, 7.1, 1_000_000), (2.0**41, 2.0**41 + 100 * 4e5, 100),
                (-(2.0**41), -(2.0**41) + 1000 * 4e5, 1000), (1e6 + 0.1, 1e6 + 17.6, 100),  # lo not a float
                (-123456.789, -123206.789, 10000), (7.3e9 + 0.3, 7.3e9 + 0.3 + 200000 * 1400, 200000)]
# Bins narrower than about three floats' spacing at lo: float cannot estimate them.
LINEAR_SPECS_DOUBLE = [(1e6, 1e6 + 14.0, 100), (1e6, 1e6 + 1.0, 100), (2.0**41, 2.0**41 + 100, 100),
                       (-123456.789, -123455.789, 10000), (7.3e9 + 0.3, 7.3e9 + 1000.3, 200000)]


@pytest.mark.parametrize("lo,hi,bins", LINEAR_SPECS)
def test_linear_bin_by_threshold_is_linear_bin(emu, lo, hi, bins):
    """The kernel's float binning (linear_bin_thr: split-lo estimate, nearest
    edge, one threshold compare) against linear_bin in double, run on the host
    for each threshold and its float neighbours, values across and beyond the
    range, and the specials; linear_float_ok holds for every spec here (each
    near a limit of its bound)."""
    h = Histogram.linear(lo, hi, bins)
    g = torch.Generator().manual_seed(bins)
    span = hi - lo
    rnd = torch.rand(30000, generator=g, dtype=torch.float64)
    v = torch.cat([float_edges(h, max(1, bins // 200000)),
                   (lo + span * rnd[:20000]).float(),
                   (lo - 3 * span * rnd[20000:25000]).float(), (hi + 3 * span * rnd[25000:]).float(),
                   torch.tensor([0.0, -0.0, 3e38, -3e38, 1e-45, -1e-45, np.inf, -np.inf, np.nan])])
    got, want, ok = emu.linear_bins(lo, hi, bins, v.contiguous())
    assert ok
    finite = torch.isfinite(v)
    bad = (got != want) & finite
    assert not bad.any(), f"{int(bad.sum())} of {len(v)}: e.g. v={v[bad][:3].tolist()} {got[bad][:3].tolist()} vs {want[bad][:3].tolist()}"
    # The specials' fixed bins, which the kernel takes back by its NaN/Inf counts.
    assert got[-3:].tolist() == [bins + 1, 0, 0]


@pytest.mark.parametrize("lo,hi,bins", LINEAR_SPECS_DOUBLE)
def test_linear_bins_too_narrow_for_float(emu, lo, hi, bins):
    """linear_float_ok refuses bins narrower than about three floats' spacing
    at lo, which then bin in double (kModeWideExact, test_histogram_kinds)."""
    h = Histogram.linear(lo, hi, bins)
    assert not emu.linear_bins(lo, hi, bins, float_edges(h, max(1, bins // 2000)).contiguous())[2]


def test_strided_views_read_through_the_host_plan(emu):
    """Each view's plan (flat?, multiplicity, walked dims, reads, read as
    16-byte vectors?) and its statistics against the float64 reference and
    the CPU op."""
    base = sample(90 * 70, torch.float32, 8).reshape(90, 70)
    base2 = sample(90 * 72, torch.float32, 11).reshape(90, 72)  # rows of 18 vectors
    cube = sample(6 * 7 * 8, torch.float32, 9).reshape(6, 7, 8)
    views = [  # (view, flat, mult, walked dims, vectors[, launches: 1])
        (base.t()[3:, ::2], False, 1, 2, False),  # transposed, then sliced: walked as (rows, cols)
        (base[::3, 5:41], False, 1, 2, False),  # rows 210 elements apart: not whole vectors
        (base[:, 1], False, 1, 1, False),
        (cube.permute(2, 0, 1)[:, :, 1:], False, 1, 2, True),  # dims sorted back, (6, 8) merged: 6 x 48
        (base[:1].expand(50, 70), True, 50, 0, False),  # stride 0: one contiguous row, 50 times
        (torch.tensor(-3.5).expand(40, 30), True, 1200, 0, False),  # every stride 0
        (base.reshape(-1)[1:][::7].reshape(-1, 1).expand(-1, 3), False, 3, 1, False),
        (base.t()[:, None, :].expand(70, 4, 90), True, 4, 0, False),  # dense once stride 0 is out
        (cube[:, None, :, ::3].expand(6, 5, 7, 3).transpose(0, 3), False, 5, 2, False),
        (base.reshape(-1)[:200].as_strided((20, 19), (9, 1)), False, 1, 2, False),  # overlapping rows
        (base2[:, 8:64], False, 1, 2, True),  # a slice of whole, aligned vectors per row
        (base2.split(24, dim=1)[1], False, 1, 2, True),  # the middle third (q, k, v of a fused output)
        (base2[:, 1:57], False, 1, 2, False),  # rows not 16-byte aligned
        (base[:, 8:64], False, 1, 2, False),  # the first row aligned, the others not (70 apart)
        (base2[:, 8:62], False, 1, 2, True, 2),  # rows end in part of a vector: then their tails
        (base2.reshape(9, 10, 72)[:, :, :32][:, None].expand(9, 2, 10, 32), False, 2, 2, True),
    ]
    for i, (v, flat, mult, ndim, vectors, *reads) in enumerate(views):
        ring = new_ring(1, 1, LOG2)
        plan = emu_accumulate(emu, v, ring, torch.tensor([0, 1, 0]), 0, LOG2, 2 + i % 2, 64)
        assert plan == (flat, mult, ndim, reads[0] if reads else 1, vectors), f"view {i}: plan {plan}"
        check(ring[0, 0].numpy(), v, LOG2, cpu_raw=run_cpu(v, LOG2))
    perm = base.t().contiguous().t()[:, :]  # dense, not contiguous: read flat
    assert emu_accumulate(emu, perm, new_ring(1, 1, LOG2), torch.tensor([0, 1, 0]), 0, LOG2, 2, 64)[0]
    check(run_emu(emu, perm, LOG2, 2, 64), perm, LOG2, cpu_raw=run_cpu(perm, LOG2))


@pytest.mark.parametrize("dtype,h", [
    *[(d, h) for d in (torch.float32, torch.bfloat16, torch.float16)
      for h in (LOG2, None, Histogram.linear(-3.0, 5.0, 13), Histogram.log2(-140, 10),
                Histogram.linear(-3.0, 3.0, 20000))],
    (torch.float8_e4m3fn, LOG2), (torch.float8_e5m2, Histogram.linear(-3.0, 5.0, 13)),
    (torch.float64, LOG2), (torch.float64, Histogram.linear(-3.0, 5.0, 13)),
])
def test_rows_of_whole_vectors_read_as_vectors(emu, dtype, h):
    """A slice of each row (9 vectors of 16 bytes, rows an odd number of
    vectors apart) is read as vectors through the descriptor: every loop form
    (each thread over two runs and a partial one) and histogram mode."""
    per = 16 // dtype.itemsize
    cols, rows = 9 * per, (2 * 64 * 512 + 300) // (9 * per) + 1
    n = rows * 13 * per
    m = sample(n, torch.float32, 20, max_exp=8).to(dtype) if dtype.itemsize == 1 else sample(n, dtype, 20)
    v = m.reshape(rows, 13 * per)[:, 2 * per:2 * per + cols]
    ring = new_ring(1, 1, h)
    assert emu_accumulate(emu, v, ring, torch.tensor([0, 1, 0]), 0, h, 2, 32)[4]
    check(ring[0, 0].numpy(), v, h, cpu_raw=run_cpu(v, h))


@pytest.mark.parametrize("dtype,h", [
    *[(d, h) for d in (torch.float32, torch.bfloat16) for h in (LOG2, None, Histogram.linear(-3.0, 5.0, 13))],
    (torch.float16, Histogram.log2(-140, 10)), (torch.float8_e4m3fn, LOG2), (torch.float64, LOG2),
])
def test_padded_rows_read_as_vectors_and_tails(emu, dtype, h):
    """Rows that end in part of a vector with the row stride padded to whole
    vectors (compiled code's logits: 50,257 columns, stride 50,304): vectors,
    then one more pass over each row's last elements; equal to the CPU op,
    counted once, NaN/Inf and the histogram's edges in the tails included."""
    per = 16 // dtype.itemsize
    cols = 5 * per + (per + 1) // 2
    ld = -(-cols // per) * per + per
    rows = (2 * 64 * 512 + 300) // cols + 1
    m = sample(rows * ld, torch.float32, 21, max_exp=8).to(dtype)
    v = m.reshape(rows, ld)[:, :cols]
    v[1::3, -1] = float("nan") if dtype.itemsize > 1 else 0
    v[2::5, -2] = -float("inf") if dtype.itemsize > 1 else 0
    ring = new_ring(1, 1, h)
    plan = emu_accumulate(emu, v, ring, torch.tensor([0, 1, 0]), 0, h, 2, 32)
    want_tails = cols % per != 0
    assert plan == (False, 1, 2, 2 if want_tails else 1, per > 1)
    assert ring[0, 0, _layout.CALLS] == 1
    check(ring[0, 0].numpy(), v, h, cpu_raw=run_cpu(v, h))


@pytest.mark.parametrize("h", [LOG2, None, Histogram.linear(-3.0, 3.0, 50),
                               Histogram.linear(-3.0, 3.0, 3000), Histogram.linear(-3.0, 3.0, 20000),
                               Histogram.log2(-1100, 1000)])
def test_stride_zero_multiplicity_in_every_histogram_mode(emu, h):
    """Counts, sums and bins of an expanded view are its rows' times the
    repeat: each mode's merge scales (the zero and underflow bins included)."""
    row = sample(3000, torch.float32, 10)
    row[::17] = 0.0
    row[5::31] = 1e-41  # float subnormals: underflow bin of log2
    v = row[None].expand(7, -1)[:, None].expand(-1, 3, -1)
    ring = new_ring(1, 1, h)
    assert emu_accumulate(emu, v, ring, torch.tensor([0, 1, 0]), 0, h, 3, 128) == (True, 21, 0, 1, False)
    check(ring[0, 0].numpy(), v, h, cpu_raw=run_cpu(v, h))


def test_views_with_more_dims_than_a_kernel_walks_are_split_not_copied(emu):
    """Dims whose strides never tile (all odd): beyond the dims a kernel walks
    (kMaxDims = 25; lowered to 2 here), the host repeats the read at each index
    of the outer dims; one call and every element are counted once."""
    strides = [2 * k + 1 for k in range(6)][::-1]
    storage = sample(sum(strides) * 2 + 1, torch.float32, 11)
    v = storage.as_strided((3, 2, 3, 2, 3, 2), strides)
    for h in (Histogram.linear(-4.0, 4.0, 64), LOG2):
        ring = new_ring(1, 1, h)
        plan = emu.accumulate(v, ring, torch.tensor([0, 1, 0]), 0, *hist_args(h), 2, 64, max_walk=2)
        assert plan == (False, 1, 2, 3 * 2 * 3 * 2, False)
        assert ring[0, 0, _layout.CALLS] == 1
        check(ring[0, 0].numpy(), v, h, cpu_raw=run_cpu(v, h))


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), max_size=7), st.integers(1, 4))
def test_read_plan_visits_each_element_of_any_view(emu, dims, max_walk):
    """Property: the plan's offsets (sorted dims, merged dims, stride-0 dims
    as multiplicity, outer dims split off) are the view's, as a multiset."""
    sizes = [d[0] for d in dims]
    strides = [d[1] for d in dims]
    storage = 1 + sum((sz - 1) * st for sz, st in dims if sz > 0)
    want = torch.arange(storage).as_strided(sizes, strides).reshape(-1)
    got, flat, mult, ndim, nouter = emu.plan_offsets(sizes, strides, max_walk)
    assert torch.equal(got.sort().values, want.sort().values)
    assert ndim <= max_walk and (not flat or ndim == 0)
    assert mult == int(np.prod([sz for sz, st in dims if st == 0 and sz > 0] or [1])) or want.numel() == 0


READ_FLAT, READ_VECTORS, READ_ELEMENTS = 0, 1, 2  # strided.h ReadKind


@settings(max_examples=300)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 7), st.integers(1, 40), st.integers(0, 24),
       st.integers(0, 17), st.integers(0, 4), st.booleans())
def test_vector_read_of_rows(emu, elem, rows, cols, pad, off, rep, transposed):
    """Property: a rows x cols slice (row stride cols + pad, from element
    off; optionally expanded along a middle dimension and listed transposed)
    is read as 16-byte vectors exactly when it is two dimensions whose rows
    start 16-byte aligned and hold at least one whole vector, and the vector
    walk plus the rows' tails read the view's elements, each as often as the
    view holds it."""
    per, ld = 16 // elem, cols + pad
    sizes, strides = [rows, max(rep, 1), cols], [ld, 0 if rep else 1, 1]
    if not rep:
        sizes, strides = [rows, cols], [ld, 1]
    if transposed:
        sizes, strides = sizes[::-1], strides[::-1]
    kind, got = emu.vector_offsets(sizes, strides, elem, off)
    flat = cols == ld or rows == 1
    want_vectors = not flat and cols > 1 and cols >= per and ld % per == 0 and off * elem % 16 == 0
    assert kind == (READ_FLAT if flat else READ_VECTORS if want_vectors else READ_ELEMENTS)
    if kind == READ_VECTORS:
        want = torch.arange(off + rows * ld).as_strided(sizes, strides, off).reshape(-1)
        assert torch.equal(got.sort().values, want.sort().values)


@settings(max_examples=300)
@given(st.integers(1, 2**62), st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20))
def test_multiply_shift_division_is_exact(emu, d, i):
    i = i + [d - 1, d, 2 * d - 1, (2**63 - 1) // d * d, 2**63 - 1]
    i = torch.tensor([v for v in i if 0 <= v < 2**63], dtype=torch.int64)
    want = torch.tensor([v // d for v in i.tolist()], dtype=torch.int64)
    assert torch.equal(emu.fast_divide(i, d), want)


def test_empty_and_tiny_tensors(emu):
    for x in (torch.empty(0), torch.tensor(2.5), torch.tensor([float("nan")]),
              torch.tensor([-0.0, 0.0]), torch.tensor([float("inf"), 1e-40])):
        raw, cpu = run_emu(emu, x, LOG2, 2, 64), run_cpu(x, LOG2)
        keep = np.ones(len(raw), bool)
        keep[SUM_COLS] = False
        np.testing.assert_array_equal(raw[keep], cpu[keep])
        check(raw, x, LOG2)


def test_repeated_writes_merge(emu):
    h = Histogram.log2(-30, 30)
    parts = [sample(2000, torch.float32, 9, max_exp=25)[1:] + 100.0,
             sample(300, torch.float64, 10, max_exp=20),
             sample(999, torch.bfloat16, 11, max_exp=25), torch.tensor([float("nan"), -0.0])]
    ring, cpu = new_ring(1, 2, h), new_ring(1, 2, h)
    st = torch.tensor([0, 1, 0])
    for i, p in enumerate(parts):
        emu_accumulate(emu, p, ring, st, 1, h, 1 + i, 64 * (1 + i % 2))
        OPS.accumulate(p, cpu, st, 1, *hist_args(h))
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    check(ring[0, 1].numpy(), None, h, cpu_raw=cpu[0, 1].numpy(), values=flat, narrow=True)
    assert ring[0, 1, _layout.CALLS] == len(parts)
    np.testing.assert_array_equal(ring[0, 0].numpy(), new_ring(1, 1, h)[0, 0].numpy())


def test_std_when_mean_dwarfs_spread(emu):
    """|mean| = 1e4 std: the shifted moments (S1, S2 about the slot's shift)
    must keep std accurate, across blocks and across a second write."""
    g = torch.Generator().manual_seed(12)
    a = torch.randn(3000, generator=g, dtype=torch.float64) + 1e4
    b = torch.randn(2000, generator=g, dtype=torch.float64) * 0.5 + 1e4 - 3
    ring = new_ring(1, 1, None)
    st = torch.tensor([0, 1, 0])
    emu_accumulate(emu, a, ring, st, 0, None, 3, 128)
    emu_accumulate(emu, b, ring, st, 0, None, 4, 64)
    flat = torch.cat([a, b])
    got = row_stats(ring[0, 0].numpy(), None)
    ref = hookcap.reference.tensor_stats(flat, None)
    assert abs(got["std"] - ref["std"]) <= 1e-9 * ref["std"]
    check(ring[0, 0].numpy(), None, None, values=flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e30, 1e-25, 1e-38])
def test_float_runs_out_of_float_range(emu, dtype, scale):
    """Squares that overflow float (1e30) fail float_sums_ok: those runs are
    redone in double. Squares that underflow it (1e-25; 1e-38, float
    subnormals among the values) are summed again in float with the values
    times a power of two. Either way sumsq keeps its precision instead of
    coming out Inf or 0."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(5000, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[3000:] = x[3000:] / scale  # later runs stay in float
    raw = run_emu(emu, x, LOG2, 3, THREADS)
    got, ref = row_stats(raw, None), hookcap.reference.tensor_stats(x, None)
    assert np.isfinite(got["sumsq"]) and got["sumsq"] > 0
    assert abs(got["sumsq"] - ref["sumsq"]) <= 1e-5 * ref["sumsq"]
    check(raw, x, LOG2, cpu_raw=run_cpu(x, LOG2))


def test_nan_in_one_run_leaves_the_others_in_float(emu):
    g = torch.Generator().manual_seed(22)
    x = torch.randn(20000, generator=g)
    x[7777] = float("nan")
    x[123] = float("-inf")
    raw = run_emu(emu, x, LOG2, 4, THREADS)
    check(raw, x, LOG2, cpu_raw=run_cpu(x, LOG2))
    assert raw[_layout.NAN] == 1 and raw[_layout.NEGINF] == 1


def test_float_runs_far_from_their_center(emu):
    """float32 with |mean| = 1e4 std: runs are re-summed about their mean, so
    std stays accurate to float's resolution of the data."""
    g = torch.Generator().manual_seed(23)
    x = (torch.randn(20000, generator=g, dtype=torch.float64) + 1e4).float()
    raw = run_emu(emu, x, None, 5, THREADS)
    got, ref = row_stats(raw, None), hookcap.reference.tensor_stats(x, None)
    assert abs(got["std"] - ref["std"]) <= 1e-4 * ref["std"]
    check(raw, x, None, cpu_raw=run_cpu(x, None))


@pytest.mark.parametrize("order,seed", [(0, 0), (1, 0), (2, 3)])
def test_blocks_with_different_shifts_rebase_onto_one(emu, order, seed):
    """Each block sums about its own threads' centers (here 0 and 1e6 apart);
    whichever block merges first sets the row's shift, the others rebase."""
    g = torch.Generator().manual_seed(24)
    x = torch.randn(8192, generator=g, dtype=torch.float64)
    x[4096:] += 1e6
    emu.configure(order, seed)
    raw = run_emu(emu, x, None, 4, 64)
    got, ref = row_stats(raw, None), hookcap.reference.tensor_stats(x, None)
    assert abs(got["std"] - ref["std"]) <= 1e-9 * ref["std"]
    assert abs(got["mean"] - ref["mean"]) <= 1e-12 * abs(ref["mean"])
    check(raw, x, None)


@pytest.mark.parametrize("order,seed", [(1, 0), (2, 1), (2, 2)])
def test_result_does_not_depend_on_block_order(emu, order, seed):
    x = sample(6000, torch.float64, 13)[1:]
    forward = run_emu(emu, x, LOG2, 6, 64)
    emu.configure(order, seed)
    other = run_emu(emu, x, LOG2, 6, 64)
    # Every column but the double sums and the shift is exact.
    keep = np.ones(len(forward), bool)
    keep[SUM_COLS] = False
    np.testing.assert_array_equal(other[keep], forward[keep])
    check(other, x, LOG2)


@pytest.mark.parametrize("schedule", [1, 2])
def test_warp_serial_schedules(emu, schedule):
    """One warp at a time between barriers, warp 0 first or last: the
    deterministic worst case for shared-memory hand-offs."""
    emu.configure(order=2, seed=schedule, schedule=schedule)
    x = sample(5001, torch.float32, 16)[1:]
    for h in (LOG2, Histogram.linear(-2.0, 3.0, 3000)):
        check(run_emu(emu, x, h, 3, THREADS), x, h, cpu_raw=run_cpu(x, h))
    v = sample(60 * 50, torch.float16, 17).reshape(60, 50).t()[2:, ::3]
    check(run_emu(emu, v, LOG2, 2, 96), v, LOG2, cpu_raw=run_cpu(v, LOG2))
    ring, cpu = new_ring(2, 1, LOG2), new_ring(2, 1, LOG2)
    st, cst = torch.tensor([0, 1, 0]), torch.tensor([0, 1, 0])
    emu.advance(ring, st, 1, 1024)
    OPS.advance(cpu, cst, 1)
    assert torch.equal(ring, cpu) and torch.equal(st, cst)


def test_slot_selection_and_enabled_flag(emu):
    h = LOG2
    ring = new_ring(3, 2, h)
    x = sample(500, torch.float32, 14)
    before = ring.clone()
    emu_accumulate(emu, x, ring, torch.tensor([7, 1, 2]), 1, h, 2, 64)
    changed = (ring != before).any(dim=2)
    assert changed.nonzero().tolist() == [[2, 1]]  # only slot 2, row 1
    check(ring[2, 1].numpy(), x, h)
    before = ring.clone()
    emu_accumulate(emu, x, ring, torch.tensor([7, 0, 2]), 1, h, 2, 64)  # disabled step
    assert torch.equal(ring, before)


@pytest.mark.parametrize("slot", [-1, 3, 1 << 40])
def test_out_of_range_slot_writes_nothing(emu, slot):
    # The host never reads the device state, so the kernels themselves must
    # refuse a corrupt slot instead of writing out of bounds.
    h = LOG2
    ring = new_ring(3, 2, h)
    before = ring.clone()
    st = torch.tensor([4, 1, slot])
    emu_accumulate(emu, sample(300, torch.float32, 3), ring, st, 0, h, 2, 64)
    emu.reset_slot(ring, st, 2, 64)
    emu.reset_rows(ring, st, 0, 1, 1, 32)
    emu.advance(ring, st, 1, 64)
    assert torch.equal(ring, before) and st.tolist() == [4, 1, slot]


# ---------------------------------------------------------------------------
# reset_rows_kernel (whole slot), advance_reset_kernel + advance_state_kernel
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("grid,block", [(1, 32), (3, 64), (40, 256)])
def test_reset_slot_matches_cpu(emu, grid, block):
    h = Histogram.linear(0, 1, 50)
    ring = torch.randint(-2**62, 2**62, (3, 5, width(h)), dtype=torch.int64)
    cpu = ring.clone()
    st = torch.tensor([11, 1, 1])
    emu.reset_slot(ring, st, grid, block)
    OPS.reset_slot(cpu, st)
    assert torch.equal(ring, cpu)
    assert ring[1, :, _layout.STEP_TAG].tolist() == [11] * 5


@pytest.mark.parametrize("begin,end,grid,block", [(1, 3, 1, 32), (0, 5, 2, 64), (4, 5, 9, 256)])
def test_reset_rows_matches_cpu(emu, begin, end, grid, block):
    h = Histogram.log2(-8, 8)
    ring = torch.randint(-2**62, 2**62, (2, 5, width(h)), dtype=torch.int64)
    before, cpu = ring.clone(), ring.clone()
    st = torch.tensor([4, 1, 1])
    emu.reset_rows(ring, st, begin, end, grid, block)
    OPS.reset_rows(cpu, st, begin, end)
    assert torch.equal(ring, cpu)
    changed = (ring != before).any(dim=2)
    assert changed.nonzero().tolist() == [[1, r] for r in range(begin, end)]
    assert ring[1, begin:end, _layout.STEP_TAG].tolist() == [4] * (end - begin)


@pytest.mark.parametrize("every,block,grid", [(1, 1024, 1), (3, 256, 2), (3, 64, 3), (1, 32, 1)])
def test_advance_matches_cpu(emu, every, block, grid):
    h = Histogram.log2(-4, 4)
    ring = new_ring(3, 4, h)
    cpu = ring.clone()
    st, cst = torch.tensor([0, 1, 0]), torch.tensor([0, 1, 0])
    x = sample(200, torch.float32, 15)
    seen_off = False
    for step in range(1, 8):
        emu_accumulate(emu, x, ring, st, step % 4, h, 1, 64)
        OPS.accumulate(x, cpu, cst, step % 4, *hist_args(h))
        emu.advance(ring, st, every, block, grid)
        OPS.advance(cpu, cst, every)
        assert st.tolist() == cst.tolist() == [step, int(step % every == 0), (step // every) % 3]
        seen_off |= st[1].item() == 0
        # Identical but for the double sums of the written rows (summation order).
        keep = torch.ones(ring.shape[2], dtype=torch.bool)
        keep[SUM_COLS] = False
        assert torch.equal(ring[..., keep], cpu[..., keep]), f"step {step}"
        for s in range(3):
            check(ring[s, step % 4].numpy(), None, h, cpu_raw=cpu[s, step % 4].numpy(),
                  values=x if ring[s, step % 4, _layout.COUNT] else x[:0])
    assert seen_off == (every > 1)


# ---------------------------------------------------------------------------
# The tree merge of block partials (launch_plan.cuh): one ticket per block and
# group, one merge into the ring
# ---------------------------------------------------------------------------
TREE_HISTS = {
    "none": None,
    "log2": LOG2,  # float: exponent bytes in the records; float64: ring bins
    "linear-13": Histogram.linear(-3.0, 5.0, 13),  # float: counts with thresholds (pairs)
    "linear-254": Histogram.linear(-3.0, 5.0, 254),  # 256 counts: the largest table a record holds
    "linear-255": Histogram.linear(-3.0, 5.0, 255),  # one more: each block's counts into the ring
    "wide": Histogram.linear(-3.0, 5.0, 20000),  # counted into the ring as it goes
}


TREE_CASES = [  # (dtype, histogram): each way a record carries the counts, or does not
    (torch.float32, "none"), (torch.float32, "log2"), (torch.bfloat16, "log2"),
    (torch.float64, "log2"), (torch.float16, "linear-13"), (torch.float32, "linear-254"),
    (torch.float32, "linear-255"), (torch.bfloat16, "wide"),
]


@pytest.mark.parametrize("dtype,hname,grid", [
    *[(d, h, 33) for d, h in TREE_CASES],  # one full group and one more: two levels
    (torch.bfloat16, "log2", 97), (torch.float64, "log2", 2), (torch.float32, "linear-255", 2),
])
def test_tree_merge_matches_reference_cpu_and_direct(emu, dtype, hname, grid):
    """The tree's shapes (one group; a full group and one more; four groups),
    blocks of one warp (each thread writes several counts) in shuffled order, against the float64 reference, the CPU op, and
    the same launch with every block merging into the ring; the scratch's
    tickets are left at 0."""
    h, block = TREE_HISTS[hname], 32
    x = sample(grid * block * 16 + 77, dtype, seed=grid)
    emu.configure(order=2, seed=grid)
    tree = run_emu(emu, x, h, grid, block)
    assert emu.tree_tickets() == [0] * 64
    check(tree, x, h, cpu_raw=run_cpu(x, h))
    direct = run_emu(emu, x, h, grid, block, tree=False)
    for c in EXACT_COLS:
        col = getattr(_layout, c)
        assert tree[col] == direct[col], c
    np.testing.assert_array_equal(tree[_layout.HEADER:], direct[_layout.HEADER:])


def test_tree_with_stride_zero_multiplicity(emu):
    """An expanded view (each element read stands for 3): counts and
    histogram counts scaled once, at the merge into the ring."""
    base = sample(40 * 32 * 4, torch.float32, seed=5).reshape(-1, 1)
    x = base.expand(-1, 3)
    for h in (LOG2, Histogram.linear(-3.0, 5.0, 13)):
        raw = run_emu(emu, x, h, 40, 32)
        check(raw, x.reshape(-1), h, cpu_raw=run_cpu(x, h))


def test_tree_bounds_a_launchs_global_atomics(emu):
    """The launcher's grid for a large tensor on an H100 (528 blocks) with the
    default log2 histogram on bfloat16 activations: the launch sends at most
    1,000 global atomics (a ticket per block and per group, then one merge),
    where every block merging into the ring would send about `grid` times
    the merge's. (The count does not depend on the threads per block: 32
    here, for speed.)"""
    grid = 528
    g = torch.Generator().manual_seed(0)
    x = torch.randn(grid * 32 * 8 * 2, generator=g).to(torch.bfloat16)
    before = emu.stats()["device_atomics"]
    raw = run_emu(emu, x, LOG2, grid, 32)
    sent = emu.stats()["device_atomics"] - before
    check(raw, x, LOG2)
    bins = int((raw[_layout.HEADER:] != 0).sum())
    merge = 2 + 1 + 11 + bins  # count and calls, the shift, the header, the bins
    assert grid + 17 + 1 <= sent <= grid + 17 + merge <= 1000, (sent, bins)
    # Every block into the ring: the same merge per block, on a smaller grid.
    before = emu.stats()["device_atomics"]
    run_emu(emu, x[: 33 * 32 * 16], LOG2, 33, 32, tree=False)
    assert emu.stats()["device_atomics"] - before >= 33 * 11, "direct merges"


# ---------------------------------------------------------------------------
# ThreadSanitizer and fault injection: the standalone driver (no libtorch)
# ---------------------------------------------------------------------------
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 second_deadlock_stack=1"}
# Builds of the driver, and the runs made of them: (build, fault committed).
VARIANTS = {
    "plain": [],
    "tsan": ["-fsanitize=thread"],
}
RUNS = {
    "plain": ("plain", "none"),
    "break_index": ("plain", "index"),
    "break_sync": ("plain", "sync"),
    "break_reset_walk": ("plain", "reset_walk"),
    "break_ticket": ("plain", "ticket"),
    "break_rescale": ("plain", "rescale"),
    "tsan": ("tsan", "none"),
    "tsan_break_sync": ("tsan", "sync"),
}


def _compile(out, flags, src):
    # -g1: line tables for TSan's reports (full -g took half again as long to compile)
    cmd = [CXX, *CFLAGS, "-g1", "-pthread", f"-I{ROOT / 'csrc'}", f"-I{EMU}",
           f"-I{cpp_ext.include_paths()[0]}", *flags, str(src), "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="session")
def tsan_ok(tmp_path_factory):
    """None if TSan builds and reports a planted race here, else why not."""
    if shutil.which(CXX) is None:
        return f"no C++ compiler ({CXX})"
    d = tmp_path_factory.mktemp("tsan_probe")
    src = d / "race.cpp"
    src.write_text("#include <thread>\nint x;\nint main() { std::thread a([] { ++x; }), "
                   "b([] { ++x; }); a.join(); b.join(); }\n")
    p = _compile(d / "race", ["-fsanitize=thread"], src)
    out = p.communicate()[0]
    if p.returncode != 0:
        return f"cannot build with -fsanitize=thread: {out.strip()[-300:]}"
    r = subprocess.run([str(d / "race")], capture_output=True, text=True,
                       env={**os.environ, **TSAN_ENV})
    if r.returncode != 66 or "data race" not in r.stderr:
        return f"TSan does not run here (rc {r.returncode}): {r.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="session")
def selftest_builds(tsan_ok):
    """Start building the driver executables (per variant, in parallel,
    cached by content): (executables, running compiles)."""
    h = hashlib.sha256()
    for f in _sources():
        h.update(f.name.encode() + f.read_bytes())
    h.update(" ".join([CXX, *CFLAGS, torch.__version__]).encode())
    key = h.hexdigest()[:16]
    BUILD.mkdir(parents=True, exist_ok=True)
    exes, procs = {}, {}
    for name, flags in VARIANTS.items():
        if "-fsanitize=thread" in flags and tsan_ok is not None:
            continue
        exe = BUILD / f"selftest-{name}-{key}"
        exes[name] = exe
        for old in BUILD.glob(f"selftest-{name}-*"):  # builds of older sources
            if old != exe:
                old.unlink(missing_ok=True)
        if not exe.exists():
            tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
            procs[name] = (tmp, _compile(tmp, flags, EMU / "emu_selftest.cpp"))
    yield exes, procs
    for tmp, p in procs.values():  # a session that never needed the drivers
        if p.poll() is None:
            p.kill()
            p.wait()
        tmp.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def selftest(selftest_builds):
    """The driver executables, once built: run name -> (executable, fault)."""
    exes, procs = selftest_builds
    for name, (tmp, p) in procs.items():
        out = p.communicate()[0]
        assert p.returncode == 0, f"building the {name} driver failed:\n{out}"
        os.replace(tmp, exes[name])
    return {run: (exes[build], fault) for run, (build, fault) in RUNS.items() if build in exes}


def _run(driver, order, schedule):
    """Run a driver (executable, fault to commit) with a block order and a schedule."""
    exe, fault = driver
    return subprocess.run([str(exe), str(order), str(schedule), fault], capture_output=True, text=True,
                          env={**os.environ, **TSAN_ENV}, timeout=300)


@pytest.mark.parametrize("order,schedule", [(0, 0), (1, 0), (2, 0), (2, 1), (2, 2)])
def test_driver_passes(selftest, order, schedule):
    r = _run(selftest["plain"], order, schedule)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: 0 mismatches" in r.stdout


@pytest.mark.parametrize("schedule", [0, 1])
def test_kernels_are_race_free_under_tsan(selftest, tsan_ok, schedule):
    """Concurrent schedule: the kernels' barriers and atomics; warp-serial:
    the harness's own hand-over machinery."""
    if tsan_ok is not None:
        pytest.skip(f"ThreadSanitizer unavailable: {tsan_ok}")
    r = _run(selftest["tsan"], 2, schedule)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "ok: 0 mismatches" in r.stdout


@pytest.mark.parametrize("order", [0, 1])
def test_tsan_catches_a_removed_syncthreads(selftest, tsan_ok, order):
    """A driver run without the barrier before the warp-partials reduction:
    TSan must report the shared-memory race, whatever the schedule (the race
    is a missing happens-before edge, not a timing accident)."""
    if tsan_ok is not None:
        pytest.skip(f"ThreadSanitizer unavailable: {tsan_ok}")
    r = _run(selftest["tsan_break_sync"], order, 0)
    assert r.returncode == 66, r.stdout + r.stderr[-4000:]
    assert "WARNING: ThreadSanitizer: data race" in r.stderr
    assert "stats_kernel.cuh" in r.stderr


@pytest.mark.parametrize("schedule", [1, 2])
def test_results_catch_a_removed_syncthreads(selftest, schedule):
    """The same fault without TSan: under a warp-serial schedule, warp 0
    reads the other warps' partials before they are written (or, reversed, the
    first warp flushes the shared histogram before the others have counted),
    so the results are wrong, and wrong identically every run."""
    runs = [_run(selftest["break_sync"], 2, schedule) for _ in range(2)]
    for r in runs:
        assert r.returncode == 1, r.stdout + r.stderr
        assert "MISMATCH" in r.stdout
    assert runs[0].stdout == runs[1].stdout


def test_results_catch_a_broken_index(selftest):
    """A driver run whose vector-tail loop forgets the misaligned head."""
    r = _run(selftest["break_index"], 0, 0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH" in r.stdout


def test_results_catch_a_broken_reset_walk(selftest):
    """A driver run whose reset loop steps its column wrongly: the slots
    that advance and reset_rows reset are caught."""
    r = _run(selftest["break_reset_walk"], 0, 0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH" in r.stdout


def test_results_catch_a_ticket_left_set(selftest):
    """A driver run whose tree merge leaves its groups' tickets set: the
    next launch on the scratch never finds its last block, so its statistics
    are lost (the two-level scenario's later launches)."""
    r = _run(selftest["break_ticket"], 0, 0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "two levels" in r.stdout and "MISMATCH" in r.stdout


def test_results_catch_a_wrong_tiny_run_scale(selftest):
    """A driver run that takes a rescaled tiny run's moments back by the
    wrong power of two: the tiny scenarios' sums and squares are caught."""
    r = _run(selftest["break_rescale"], 0, 0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "tiny" in r.stdout and "MISMATCH" in r.stdout


# ---------------------------------------------------------------------------
# accumulate_update's kernel (update_kernel.cuh) against the CPU op: both
# compute each value with update_value_for from the same inputs (update_math.h),
# so counts, extrema and bins are equal and sums agree to summation order.

UPDATE_CASES = {  # rule, hyper (update_math.h order), which inputs, rows (Δw, base, ratio, a, b)
    "sgd-nesterov-wd": (0, [0.1, 0.01, 0.9, 0, 0, 0, 1 + 8, 0], "gab-", [0, 1, -1, 2, -1]),
    "sgd-momentum": (0, [0.05, 0.0, 0.9, 0, 0, 0, 8, 0], "-a--", [0, 1, -1, -1, -1]),
    "sgd-plain-maximize": (0, [0.05, 0.1, 0.0, 0, 0, 0, 2, 0], "g---", [1, 0, -1, -1, -1]),
    "adamw-amsgrad": (1, [1e-3, 0.1, 0, 0.9, 0.999, 1e-8, 4, 7], "-ab-", [0, 1, -1, -1, -1]),
    "adam-ratio-l2": (1, [1e-3, 0.01, 0, 0.9, 0.99, 1e-6, 2, 3], "gab-", [-1, -1, 0, -1, -1]),
    "adam-all-five": (1, [1e-3, 0.01, 0, 0.9, 0.99, 1e-6, 4, 3], "gab-", [4, 3, 2, 1, 0]),
    "adam-state-only": (1, [1e-3, 0.0, 0, 0.9, 0.999, 1e-8, 0, 2], "-ab-", [-1, -1, -1, 0, 1]),
    "diff": (2, [0] * 8, "-a--", [0, 1, -1, -1, -1]),
}


def update_inputs(which, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g).to(dtype)
    grad = torch.randn(n, generator=g).to(dtype) if "g" in which else None
    a = (torch.randn(n, generator=g) * 0.1).to(dtype) if "a" in which else None
    b = (torch.rand(n, generator=g) * 1e-2).to(dtype) if "b" in which else None
    if which == "-a--":
        a = (w.double() + torch.randn(n, generator=g, dtype=torch.float64) * 1e-3).to(dtype)
    return w, grad, a, b


@pytest.mark.parametrize("case", list(UPDATE_CASES))
@pytest.mark.parametrize("dtype,n,grid,h", [
    (torch.float32, 5000, 3, None),
    (torch.float32, 70001, 7, Histogram.log2()),
    (torch.bfloat16, 4097, 2, Histogram.linear(-0.5, 0.5, 64)),
    (torch.float64, 3000, 1, Histogram.log2(-1100, 1000)),  # 2103 bins: counted into the ring
])
def test_update_kernel_matches_the_cpu_op(emu, case, dtype, n, grid, h):
    rule, hyper, which, rows = UPDATE_CASES[case]
    w, grad, a, b = update_inputs(which, n, dtype, seed=n)
    step = torch.tensor(7.0) if rule == 1 else None
    nrows = sum(r >= 0 for r in rows)
    got, cpu = new_ring(1, nrows, h), new_ring(1, nrows, h)
    state = torch.tensor([0, 1, 0])
    emu.accumulate_update(w, grad, a, b, step, hyper, rule, got, state, rows, *hist_args(h), grid, 256, True)
    OPS.accumulate_update(w, grad, a, b, step, hyper, rule, cpu, state, rows, *hist_args(h))
    for r in range(nrows):
        g_, c_ = got[0, r].numpy(), cpu[0, r].numpy()
        for c in EXACT_COLS:
            col = getattr(_layout, c)
            assert g_[col] == c_[col], (case, r, c)
        np.testing.assert_array_equal(g_[_layout.HEADER:], c_[_layout.HEADER:])
        gs, cs = row_stats(g_, None), row_stats(c_, None)
        assert cs["count"] == n and cs["finite"] == n
        # The CPU op sums the state rows, and every output of a narrower
        # parameter, with the float statistics loop (float sums per block);
        # the kernel sums every output in double. (a mean near zero: to
        # within 1e-6 of the spread).
        rtol = 1e-6 if dtype != torch.float64 else 1e-9
        for k in ("l2norm", "mean", "std"):
            np.testing.assert_allclose(gs[k], cs[k], rtol=rtol, atol=rtol * cs["std"] if k == "mean" else 1e-300)
    # The state outputs are the state tensors' own statistics.
    for out, t in ((3, a), (4, b)):
        if rows[out] >= 0:
            np.testing.assert_allclose(row_stats(cpu[0, rows[out]].numpy(), None)["l2norm"],
                                       float(t.double().norm()), rtol=1e-6)


def test_update_kernels_batch_many_parameters(emu):
    """accumulate_updates as the CUDA launcher runs it: 32 parameters of two
    dtypes and two output sets go in runs of at most 24 per launch (the first
    26 alike: a run of 24, then 2), each parameter with its own block and
    bias corrections (its own step count); every row equals the CPU op's.
    One block each: an emulated block costs about a second (256 threads),
    and the merge of several blocks per parameter is tested above."""
    hyper = [1e-3, 0.01, 0, 0.9, 0.99, 1e-6, 4, 0]
    params, grads, a, b, steps, rows = [], [], [], [], [], []
    nrows = 0
    for i in range(32):
        dtype = torch.float32 if i < 28 or i % 2 else torch.bfloat16
        w, g_, a_, b_ = update_inputs("gab-", 50 + 211 * i, dtype, seed=100 + i)
        params.append(w), grads.append(g_), a.append(a_), b.append(b_)
        steps.append(torch.tensor(float(1 + i % 5)))
        if i < 26 or i % 3:
            rows += [nrows, nrows + 1, nrows + 2, nrows + 3, nrows + 4]
            nrows += 5
        else:
            rows += [nrows, nrows + 1, -1, -1, -1]
            nrows += 2
    h = Histogram.log2()
    got, cpu = new_ring(1, nrows, h), new_ring(1, nrows, h)
    state = torch.tensor([0, 1, 0])
    emu.accumulate_updates(params, grads, a, b, steps, hyper, 1, got, state, rows, *hist_args(h), 1, 256, True)
    OPS.accumulate_updates(params, grads, a, b, steps, hyper, 1, cpu, state, rows, *hist_args(h))
    for r in range(nrows):
        g_, c_ = got[0, r].numpy(), cpu[0, r].numpy()
        assert c_[_layout.COUNT] > 0
        for c in EXACT_COLS:
            assert g_[getattr(_layout, c)] == c_[getattr(_layout, c)], (r, c)
        np.testing.assert_array_equal(g_[_layout.HEADER:], c_[_layout.HEADER:])
        np.testing.assert_allclose(row_stats(g_, None)["l2norm"], row_stats(c_, None)["l2norm"], rtol=1e-6)


def test_planted_key_sign_bug_is_caught(emu):
    """The key merge with the sign dropped (a fault the harness plants) puts
    negative values in positive bins: the counts no longer match the CPU op."""
    h = Histogram.log2(-20, 10, sub=4, signed=True)
    x = sample(3000, torch.float32, 11, max_exp=8)
    cpu = run_cpu(x, h)
    emu.set_fault(7)  # cuda_emu.h Fault::key_sign
    try:
        got = run_emu(emu, x, h, 3, THREADS)
    finally:
        emu.set_fault(0)
    assert not np.array_equal(got[_layout.HEADER:], cpu[_layout.HEADER:])
    check(run_emu(emu, x, h, 3, THREADS), x, h, cpu_raw=cpu)  # without the fault: exact


def test_update_kernel_planted_bias_bug_is_caught(emu):
    """The kernel with Adam's first bias correction left out (a fault the
    harness plants) no longer matches the CPU op."""
    rule, hyper, which, _ = UPDATE_CASES["adamw-amsgrad"]
    w, grad, a, b = update_inputs(which, 2000, torch.float32, seed=1)
    step = torch.tensor(3.0)
    got, cpu = new_ring(1, 1, None), new_ring(1, 1, None)
    state = torch.tensor([0, 1, 0])
    OPS.accumulate_update(w, grad, a, b, step, hyper, rule, cpu, state, [0, -1, -1, -1, -1], *NO_HIST_ARGS)
    emu.set_fault(6)  # cuda_emu.h Fault::update_bias
    try:
        emu.accumulate_update(w, grad, a, b, step, hyper, rule, got, state, [0, -1, -1, -1, -1], *NO_HIST_ARGS,
                              2, 256, True)
    finally:
        emu.set_fault(0)
    gs, cs = row_stats(got[0, 0].numpy(), None), row_stats(cpu[0, 0].numpy(), None)
    assert not np.isclose(gs["l2norm"], cs["l2norm"], rtol=1e-6)


def test_update_kernel_off_step_writes_nothing(emu):
    w, grad, a, b = update_inputs("gab-", 100, torch.float32, seed=2)
    ring = new_ring(1, 2, None)
    before = ring.clone()
    emu.accumulate_update(w, grad, a, b, None, [0.1, 0, 0.9, 0, 0, 0, 9, 0], 0, ring, torch.tensor([0, 0, 0]),
                          [0, 1, -1, -1, -1], *NO_HIST_ARGS, 2, 256, False)
    assert torch.equal(ring, before)


# ---------------------------------------------------------------------------
# moments=4: the kernels' third and fourth powers, summed in float runs like
# the moments, flushed to double about each thread's shift and rebased
# (shift_rebase4) as partials merge, against the float64 reference and the
# CPU op (which sums them in double about the row's shift).

def run_emu4(emu, x, h, grid, block=THREADS, tree=True):
    ring = new_ring(1, 1, h)
    emu.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *_ops.hist_args(h, 4), grid, block, tree=tree)
    return ring[0, 0].numpy()


def check4(emu, x, h, grid, *, tree=True, block=THREADS):
    """The emulated moments=4 row: the ordinary statistics as without it (equal
    to the CPU op's where exact), the four higher moments within their bound,
    and the same count of values in the powers as the CPU op."""
    raw = run_emu4(emu, x, h, grid, block, tree)
    cpu = np.asarray(_ring_cpu4(x, h))
    check(raw, x, h, cpu_raw=cpu)
    assert raw[_layout.N4] == cpu[_layout.N4]
    got = row_stats(raw, h)
    assert_moments(got, hookcap.reference.tensor_stats(x, h, moments=4), x.double().numpy())
    return got


def _ring_cpu4(x, h):
    ring = new_ring(1, 1, h)
    OPS.accumulate(x, ring, torch.tensor([0, 1, 0]), 0, *_ops.hist_args(h, 4))
    return ring[0, 0].numpy()


M4_KINDS = ["normal", "t3", "offset", "negative", "spiky", "two_sd", "tiny", "huge", "halves"]


@pytest.mark.parametrize("kind", M4_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_moments4_match_reference_and_cpu(emu, kind, dtype):
    """20,001 values (a flat head and tail beside the vectors) over 3 blocks:
    centred runs, runs far from 0, heavy tails, fourth powers below float's
    range (rescaled runs) and above it (runs redone in double), blocks whose
    threads' shifts differ by 1e3 standard deviations."""
    check4(emu, draw(kind, 20_001, 3).to(dtype), LOG2, 3)


@pytest.mark.parametrize("dtype,kinds", [
    (torch.float16, ["normal", "t3", "negative", "two_sd"]),
    (torch.float8_e4m3fn, ["normal", "two_sd"]),
    (torch.float8_e5m2, ["t3"]),
])
def test_moments4_narrow_types(emu, dtype, kinds):
    for kind in kinds:
        x = draw(kind, 9_000, 5).clamp(-400, 400).to(dtype)
        check4(emu, x, LOG2, 2)


@pytest.mark.parametrize("h", [None, Histogram.log2(-20, 10, sub=4, signed=True), Histogram.linear(-3, 3, 64),
                               Histogram.linear(-3, 3, 20_000), Histogram.log2(-140, 10)],
                         ids=["none", "log2key", "linear", "wide", "log2-subnormal"])
def test_moments4_in_every_histogram_mode(emu, h):
    x = (draw("t3", 12_345, 8) * 0.7 - 0.2).float()
    check4(emu, x, h, 2)


def test_moments4_through_every_read(emu):
    """Strided views read element by element, a view of whole 16-byte rows (read
    as vectors without moments=4, by element with them), stride-0 dimensions
    (each element read counts for several), an element-misaligned start."""
    base = draw("two_sd", 64 * 200, 9).float().reshape(200, 64)
    views = {
        "strided": base[:, ::3],
        "rows": base[:, :32],
        "expanded": base[:50, :8].unsqueeze(1).expand(50, 3, 8),
        "misaligned": base.reshape(-1)[1:9000],
    }
    for name, v in views.items():
        check4(emu, v, LOG2, 2)


def test_moments4_with_nan_inf_subnormals(emu):
    """Runs holding NaN, Inf or float subnormals are redone in double, values of
    every magnitude float has (powers up to 2**480: double's range)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = sample(15_000, dtype, 21, max_exp=60)
        check4(emu, x, Histogram.log2(-140, 64), 3)


def test_moments4_of_edge_tensors(emu):
    const = run_emu4(emu, torch.full((5000,), 2.5), LOG2, 2)
    got = row_stats(const, LOG2)
    assert got["m3"] == 0 and got["m4"] == 0 and np.isnan(got["skew"]) and np.isnan(got["kurtosis"])
    for x in (torch.full((700,), float("nan")), torch.empty(0), torch.tensor([float("inf"), 1.0, -2.0])):
        raw = run_emu4(emu, x, LOG2, 1)
        ref = hookcap.reference.tensor_stats(x, LOG2, moments=4)
        assert_moments(row_stats(raw, LOG2), ref, x.double().numpy())


def alternating(n, seed, gap):
    """Normal values about 0 in even 16-byte vectors, about `gap` in odd ones:
    on an even grid each lane reads one kind only, so neighbouring lanes have
    shifts `gap` apart, and the warps and blocks merge partials of both."""
    g = np.random.default_rng(seed)
    odd = (np.arange(n) // 4) % 2 == 1
    return torch.from_numpy(g.standard_normal(n) + gap * odd).float()


@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("order,schedule", [(0, 0), (1, 1), (2, 2)])
def test_moments4_merge_order_and_tree(emu, tree, order, schedule):
    """Partials with shifts 1e3 standard deviations apart merge into one row in
    any block order and warp schedule, by the tree or block by block."""
    emu.configure(order=order, seed=4, schedule=schedule)
    check4(emu, alternating(30_000, 12, 1e3), LOG2, 6, tree=tree)


def test_planted_moments4_rebase_bug_is_caught(emu):
    """Lanes' third and fourth sums left about their own shifts when the warp
    moves to a common one (a fault the harness plants): m3 and m4 are far off."""
    x = alternating(8_000, 1, 50.0)
    want = hookcap.reference.tensor_stats(x, LOG2, moments=4)
    emu.set_fault(8)  # cuda_emu.h Fault::m4_rebase
    try:
        got = row_stats(run_emu4(emu, x, LOG2, 2), LOG2)
    finally:
        emu.set_fault(0)
    assert abs(got["m4"] - want["m4"]) > 1e-3 * want["m4"]
    check4(emu, x, LOG2, 2)  # without the fault: within the bound


# ---------------------------------------------------------------------------
# accumulate_bins (MoE routing: bins_kernel.cuh)


@pytest.mark.parametrize("idx_dtype,w_dtype,grid,h", [
    (torch.int64, torch.float32, 2, Histogram.log2()),
    (torch.int32, None, 1, None),
    (torch.uint8, torch.bfloat16, 1, Histogram.linear(0, 1, 8)),
    (torch.int64, torch.float64, 1, Histogram.log2(-1100, 1000)),  # 2103 bins: counted into the ring
])
def test_bins_kernel_matches_the_cpu_op(emu, idx_dtype, w_dtype, grid, h):
    """Each bin's row from the kernel (a block per bin and grid.x, elements
    outside [0, bins) in none, a -1 row skipped) equals the CPU op's:
    counts, extrema and histogram exactly, sums to double rounding."""
    g = torch.Generator().manual_seed(3)
    n, bins = 3000, 3
    index = torch.randint(0, bins + 2, (n,), generator=g).to(idx_dtype)  # bins, bins + 1: in no bin
    weight = None if w_dtype is None else torch.rand(n, generator=g).to(w_dtype)
    if weight is not None:
        weight[5] = float("nan")
    rows = [0, -1, 1]
    got, cpu = new_ring(1, 2, h), new_ring(1, 2, h)
    state = torch.tensor([0, 1, 0])
    emu.accumulate_bins(index, weight, got, state, rows, *hist_args(h), grid, THREADS)
    OPS.accumulate_bins(index, weight, cpu, state, rows, *hist_args(h))
    for r, b in ((0, 0), (1, 2)):
        g_, c_ = got[0, r].numpy(), cpu[0, r].numpy()
        for c in EXACT_COLS:
            assert g_[getattr(_layout, c)] == c_[getattr(_layout, c)], (r, c)
        np.testing.assert_array_equal(g_[_layout.HEADER:], c_[_layout.HEADER:])
        assert g_[_layout.COUNT] == int((index.long() == b).sum())
        gs, cs = row_stats(g_, None), row_stats(c_, None)
        for k in ("sum", "l2norm", "std"):
            np.testing.assert_allclose(gs[k], cs[k], rtol=1e-12)
    off = new_ring(1, 2, h)
    emu.accumulate_bins(index, weight, off, torch.tensor([0, 0, 0]), rows, *hist_args(h), 1, THREADS)
    assert (off[0, :, _layout.CALLS] == 0).all()


@pytest.mark.parametrize("shape,causal_row0,peaked", [
    ((2, 3, 5, 70), 3, True),  # 30 rows: four blocks, the last partly empty; keys past two warps' widths
    ((1, 2, 9, 33), -1, False),
    ((3, 40, 7), 0, False),  # more queries than keys: later rows see every key
])
def test_attention_rows_kernel_matches_float64_and_the_cpu_op(emu, shape, causal_row0, peaked):
    """attention_rows_kernel (a warp per row, shuffles across lanes) on the
    launcher's grid: the causal mask written in place as the CPU op writes
    it, logsumexp and entropy within 1e-5 of float64 and 1e-6 of the CPU op."""
    x = attention_tile(7, shape, peaked=peaked)
    ref = attention_rows_ref(x, causal_row0)
    got, cpu = x.clone(), x.clone()
    lse, ent = emu.attention_rows(got, causal_row0)
    lse_c, ent_c = OPS.attention_rows(cpu, causal_row0)
    torch.testing.assert_close(got, cpu, rtol=0, atol=0, equal_nan=True)
    for g, c, want in ((lse, lse_c, ref[1]), (ent, ent_c, ref[2])):
        np.testing.assert_allclose(g.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(g.numpy(), c.numpy(), rtol=1e-6, atol=1e-12)


def _qk_inputs(seed, b, h, hk, tq, tk, d, dtype, exact, strided=False):
    """16-bit q [b, h, tq, d] and k [b, hk, tk, d]. exact: quarters in
    [-1, 1], whose products and every sum of them are exact in float32 in
    any order (the logits then equal float64's bit for bit, tensor cores or
    not); strided: q as the transposed view of [b, tq, h, d] (HF's layout)."""
    g = torch.Generator().manual_seed(seed)
    def make(*shape):
        x = torch.randint(-4, 5, shape, generator=g).float() / 4 if exact else torch.randn(shape, generator=g) * 1.5
        return x.to(dtype)
    q = make(b, tq, h, d).transpose(1, 2) if strided else make(b, h, tq, d)
    return q, make(b, hk, tk, d)


def _qk_reference(q, k, causal, scale):
    """float64 logits [b, h, tq, tk] from the 16-bit q, k, -inf where the
    causal mask hides a key."""
    rep = q.shape[1] // k.shape[1]
    x = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) * scale
    if causal:
        x = x.masked_fill(torch.ones(x.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,causal,strided", [
    ((2, 4, 2, 70, 70, 32), True, False),   # GQA; two row blocks, the last partly empty; a key tile partly past the end
    ((1, 2, 2, 5, 130, 64), False, True),   # cross attention over three key tiles; q a strided view
    ((1, 3, 1, 130, 40, 16), True, False),  # more queries than keys: later rows see every key
])
@pytest.mark.parametrize("h", [LOG2, None])
def test_attention_qk_kernel_equals_float64_of_the_logits(emu, dtype, shape, causal, strided, h):
    """attention_qk_kernel (logits on chip only, one walk over the key
    tiles) on inputs whose logits are exact in float32: per head the
    statistics row of the logits (the mask's -inf counted, counts, extrema and
    bins exactly) equals float64's of the masked logits, a head whose row is
    -1 is left alone, and each query row's logsumexp and entropy equal
    float64 within 1e-5."""
    b, nh, hk, tq, tk, d = shape
    q, k = _qk_inputs(3, b, nh, hk, tq, tk, d, dtype, exact=True, strided=strided)
    scale = d ** -0.5 if d != 32 else 0.3  # 0.3: not a power of two, applied to each float32 product sum
    ref = _qk_reference(q, k, causal, scale)
    if d == 32:  # the kernel rounds the float32 sum times 0.3 once: so does the reference
        ref = (_qk_reference(q, k, causal, 1.0).float() * scale).double()
    rows = [1 + i for i in range(nh)]
    rows[-1] = -1
    ring = new_ring(1, nh + 1, h)
    lse, ent = emu.attention_qk(q, k, causal, scale, ring, torch.tensor([0, 1, 0]), rows, *hist_args(h))
    for i in range(nh):
        if rows[i] < 0:
            assert row_stats(ring[0, nh], h)["count"] == 0
            continue
        got = row_stats(ring[0, rows[i]], h)
        part = ref[:, i]
        assert ring[0, rows[i], _layout.CALLS] == 1
        assert_stats_match(got, tensor_stats(part, h), abs_sum=abs_sum(part))
    _, want_lse, want_ent = attention_rows_ref(ref)
    np.testing.assert_allclose(lse.double().numpy(), want_lse.numpy(), rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(ent.double().numpy(), want_ent.numpy(), rtol=1e-5, atol=1e-6)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(1, 100), st.integers(1, 140),
       st.sampled_from([16, 48]), st.booleans(), st.sampled_from([torch.bfloat16, torch.float16]),
       st.integers(0, 2**16))
def test_attention_qk_kernel_over_shapes(emu, b, heads, tq, tk, d, causal, dtype, seed):
    """Any batch, head grouping, query and key count (partial row blocks and
    key tiles, rows that see one key) and head dim: each head's logit row
    equals float64's of its masked logits, exact inputs as above."""
    nh, hk = heads
    q, k = _qk_inputs(seed, b, nh, hk, tq, tk, d, dtype, exact=True)
    ref = _qk_reference(q, k, causal, 0.25)
    ring = new_ring(1, nh, LOG2)
    lse, ent = emu.attention_qk(q, k, causal, 0.25, ring, torch.tensor([0, 1, 0]), list(range(nh)),
                                *hist_args(LOG2))
    for i in range(nh):
        part = ref[:, i]
        assert_stats_match(row_stats(ring[0, i], LOG2), tensor_stats(part, LOG2), abs_sum=abs_sum(part))
    _, want_lse, want_ent = attention_rows_ref(ref)
    # lse = max + log1p(...) in float32: near 0 its error is a few ulps of the row's max (|logit| <= 12)
    np.testing.assert_allclose(lse.double().numpy(), want_lse.numpy(), rtol=1e-5, atol=4e-6)
    np.testing.assert_allclose(ent.double().numpy(), want_ent.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order,schedule", [(1, 1), (2, 2)])
def test_attention_qk_kernel_in_any_block_order_and_warp_schedule(emu, order, schedule):
    """Blocks in reverse or shuffled order, warps one at a time between
    barriers (warp 0 first or last: a missing barrier between the tiles,
    the row maxima or the sums gives wrong rows deterministically): each
    head's row and the rows' logsumexp still equal float64."""
    emu.configure(order=order, seed=3, schedule=schedule)
    q, k = _qk_inputs(9, 2, 2, 1, 70, 100, 16, torch.bfloat16, exact=True)
    ref = _qk_reference(q, k, True, 0.25)
    ring = new_ring(1, 2, LOG2)
    lse, _ = emu.attention_qk(q, k, True, 0.25, ring, torch.tensor([0, 1, 0]), [0, 1], *hist_args(LOG2))
    for i in range(2):
        part = ref[:, i]
        assert_stats_match(row_stats(ring[0, i], LOG2), tensor_stats(part, LOG2), abs_sum=abs_sum(part))
    np.testing.assert_allclose(lse.double().numpy(), torch.logsumexp(ref, -1).numpy(), rtol=1e-5, atol=1e-12)


def test_attention_qk_kernel_on_real_valued_inputs_nan_and_off_steps(emu):
    """Normal q, k (logits rounded in float32): per head max, min, sum and
    std within float32 rounding of float64, lse and entropy within 1e-5; a
    NaN in one query row makes that head's row count it (NaN counts, the
    others unharmed) and that row's lse and entropy NaN; off-steps write
    nothing."""
    q, k = _qk_inputs(5, 2, 2, 1, 50, 90, 64, torch.bfloat16, exact=False)
    ref = _qk_reference(q, k, True, 0.125)
    ring = new_ring(1, 2, LOG2)
    lse, ent = emu.attention_qk(q, k, True, 0.125, ring, torch.tensor([0, 1, 0]), [0, 1], *hist_args(LOG2))
    for i in range(2):
        got, want = row_stats(ring[0, i], LOG2), tensor_stats(ref[:, i], LOG2)
        for key in ("count", "finite", "neginf"):
            assert got[key] == want[key]
        for key in ("max", "min", "sum", "std"):
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-4)
    _, want_lse, want_ent = attention_rows_ref(ref)
    np.testing.assert_allclose(lse.double().numpy(), want_lse.numpy(), rtol=1e-5)
    np.testing.assert_allclose(ent.double().numpy(), want_ent.numpy(), rtol=1e-5, atol=1e-6)
    qn = q.clone()
    qn[1, 0, 7, 3] = float("nan")
    ring = new_ring(1, 2, LOG2)
    lse, ent = emu.attention_qk(qn, k, True, 0.125, ring, torch.tensor([0, 1, 0]), [0, 1], *hist_args(LOG2))
    got = row_stats(ring[0, 0], LOG2)
    assert got["nan"] == 8  # query 7 sees keys 0..7
    assert got["neginf"] == tensor_stats(ref[:, 0], LOG2)["neginf"]
    assert torch.isnan(lse[1, 0, 7]) and torch.isnan(ent[1, 0, 7])
    assert torch.isfinite(lse[1, 0, :7]).all() and torch.isfinite(lse[0]).all()
    assert row_stats(ring[0, 1], LOG2)["nan"] == 0
    off = new_ring(1, 2, LOG2)
    emu.attention_qk(q, k, True, 0.125, off, torch.tensor([0, 0, 0]), [0, 1], *hist_args(LOG2))
    assert (off[0, :, _layout.CALLS] == 0).all() and (off[0, :, _layout.COUNT] == 0).all()


@pytest.mark.parametrize("row", ["rising", "falling", "peaked"])
def test_attention_qk_kernel_online_softmax_of_rising_falling_and_peaked_rows(emu, row):
    """The kernel sums each row's softmax in one walk about a running max,
    rebased whenever a key tile raises it. Rows whose logits rise along the
    keys (a rebase at every tile of every lane), fall (never), or hold one
    key far above the rest (entropy near 0, the others' terms ~e^-30): lse
    and entropy equal float64's of the same 16-bit q, k within 1e-5, with
    entropy near 0 judged within float32 rounding of the terms it sums."""
    g = torch.Generator().manual_seed(11)
    b, nh, tq, tk, d = 1, 2, 70, 200, 32
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    q = (u * 4 + torch.randn(b, nh, tq, d, generator=g) * 0.05)
    ramp = torch.linspace(0, 1, tk)[:, None]
    k = {
        "rising": ramp * u * 5,
        "falling": (1 - ramp) * u * 5,
        "peaked": torch.randn(tk, d, generator=g) * 0.1 + torch.where(torch.arange(tk)[:, None] == 150, u * 8, 0.0),
    }[row] + torch.randn(b, nh, tk, d, generator=g) * 0.05
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    for causal in (False, True):
        ref = _qk_reference(q, k, causal, 1.0)
        ring = new_ring(1, nh, LOG2)
        lse, ent = emu.attention_qk(q, k, causal, 1.0, ring, torch.tensor([0, 1, 0]), [0, 1], *hist_args(LOG2))
        _, want_lse, want_ent = attention_rows_ref(ref)
        np.testing.assert_allclose(lse.double().numpy(), want_lse.numpy(), rtol=1e-5, atol=4e-6)
        np.testing.assert_allclose(ent.double().numpy(), want_ent.numpy(), rtol=1e-5, atol=1e-6)
        if row == "peaked" and not causal:
            assert want_ent.max() < 1e-3  # the case is what it says


# ---------------------------------------------------------------------------
# accumulate_groups in one launch (grid rows: op_checks.h group_launch)


@pytest.mark.parametrize("case", ["heads", "experts", "strided", "uneven_rows", "misaligned"])
@pytest.mark.parametrize("dtype,h", [(torch.float32, LOG2), (torch.bfloat16, Histogram.linear(-3, 3, 12)),
                                     (torch.float64, None)])
def test_groups_in_one_launch_match_the_cpu_op(emu, case, dtype, h):
    """Every group's row from the kernel equals the CPU op's (counts,
    extrema, histogram exactly; sums to rounding), whether its groups share
    one launch (heads, experts, strided views: grid rows) or not (rows not
    evenly spaced, groups 16-byte misaligned: a launch each)."""
    g = torch.Generator().manual_seed(7)
    x, dim, size, rows = {
        "heads": lambda: ((torch.randn(300, 32, generator=g) * 3), -1, 8, [1, 2, 3, 4]),
        "experts": lambda: (torch.randn(3, 200, 8, generator=g), 0, 1, [0, 2, 4]),
        "strided": lambda: (torch.randn(40, 96, generator=g).t(), 0, 24, [3, 2, 1, 0]),
        "uneven_rows": lambda: (torch.randn(100, 16, generator=g), -1, 4, [0, 1, 3, 2]),
        "misaligned": lambda: (torch.randn(100, 15, generator=g), -1, 5, [0, 1, 2]),
    }[case]()
    x = x.to(dtype)
    got, cpu = new_ring(1, max(rows) + 1, h), new_ring(1, max(rows) + 1, h)
    state = torch.tensor([0, 1, 0])
    one = emu.accumulate_groups(x, got, state, rows, dim, size, *hist_args(h), 2, THREADS)
    assert one == (case in ("heads", "experts", "strided"))
    OPS.accumulate_groups(x, cpu, state, rows, dim, size, *hist_args(h))
    for r in rows:
        g_, c_ = got[0, r].numpy(), cpu[0, r].numpy()
        for c in EXACT_COLS:
            assert g_[getattr(_layout, c)] == c_[getattr(_layout, c)], (r, c)
        np.testing.assert_array_equal(g_[_layout.HEADER:], c_[_layout.HEADER:])
        gs, cs = row_stats(g_, None), row_stats(c_, None)
        for k, rtol in (("sum", 1e-5), ("l2norm", 1e-5), ("std", 1e-4)):  # float runs per thread, as the CPU's
            np.testing.assert_allclose(gs[k], cs[k], rtol=rtol, atol=1e-6 * cs["l2norm"])


# ---------------------------------------------------------------------------
# accumulate_many: tensors alike in one launch (grid rows: a ManyTable)


def _many_inputs(seed):
    """Tensors of accumulate_many: four dtypes, sizes in several grid buckets
    (per block 256 elements), an empty one, a 16-byte misaligned view, a
    transposed one and a float8 one (launches of their own), more tensors of
    one kind than a launch takes, and more kinds than batches kept open."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for i, n in enumerate([3000, 2100, 700, 260, 255, 1, 0, 4096, 1500, 33]):
        dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][i % 4]
        xs.append(sample(n, dtype, seed + i, max_exp=12))
    xs.append(sample(901, torch.float32, seed + 50, max_exp=12)[1:])  # data 4 bytes past a 16-byte boundary
    xs.append(torch.randn(20, 30, generator=g).t())  # not contiguous: alone
    xs.append(torch.randn(100, generator=g).to(torch.float8_e4m3fn))  # float8: alone
    xs += [torch.randn(int(k), generator=g) * 10.0 ** (k % 5 - 2) for k in range(5, 45)]  # 40 of one kind
    return xs


@pytest.mark.parametrize("h,moments", [(LOG2, 2), (Histogram.linear(-3, 3, 12), 2), (None, 2), (LOG2, 4)])
def test_many_tensors_in_launches_match_each_alone(emu, h, moments):
    """Each tensor's row from accumulate_many's launches equals the CPU op's
    accumulate of that tensor alone (counts, extrema, histogram exactly; sums
    to rounding), rows given as -1 are not written, and the tensors alike
    share launches (at most 32 each, grids within 2x of each tensor's)."""
    xs = _many_inputs(11)
    rows = [i if i % 7 != 3 else -1 for i in range(len(xs))]
    args = _ops.hist_args(h, moments)
    got, cpu = new_ring(1, len(xs), h), new_ring(1, len(xs), h)
    state = torch.tensor([0, 1, 0])
    launches = emu.accumulate_many(xs, got, state, rows, *args, THREADS, 16, THREADS)
    recorded = [r for r in rows if r >= 0]
    assert sum(abs(k) for k in launches) == len(recorded)
    assert all(1 <= k <= 32 for k in launches if k > 0) and launches.count(-1) == 2  # transposed, float8
    assert len(launches) < len(recorded) / 4
    for x, r in zip(xs, rows):
        if r >= 0:
            OPS.accumulate(x, cpu, state, r, *args)
    for i, r in enumerate(rows):
        g_, c_ = got[0, i].numpy(), cpu[0, i].numpy()
        if r < 0:
            assert g_[_layout.CALLS] == 0 and g_[_layout.COUNT] == 0, i
            continue
        for c in EXACT_COLS:
            assert g_[getattr(_layout, c)] == c_[getattr(_layout, c)], (i, c)
        np.testing.assert_array_equal(g_[_layout.HEADER:], c_[_layout.HEADER:])
        if moments == 4 and xs[i].dtype != torch.float64:  # float64 values below float's range: N4 follows the runs
            assert g_[_layout.N4] == c_[_layout.N4], i
        gs, cs = row_stats(g_, None), row_stats(c_, None)
        rtol = 1e-9 if xs[i].dtype == torch.float64 else 1e-5
        for k in ("sum", "l2norm", "std"):
            np.testing.assert_allclose(gs[k], cs[k], rtol=rtol * 10, atol=1e-6 * cs["l2norm"] + 1e-300)


def test_many_tensors_off_step_writes_nothing(emu):
    xs = [torch.randn(300), torch.randn(5)]
    ring = new_ring(1, 2, LOG2)
    before = ring.clone()
    emu.accumulate_many(xs, ring, torch.tensor([0, 0, 0]), [0, 1], *hist_args(LOG2), THREADS, 16, THREADS)
    assert torch.equal(ring, before)
