"""Monitor(fused=True): statistics computed by the compiled graph's own
reductions and merged by hookcap::merge_partials, against the float64
reference and the accumulate op; the ring-read shift; and Inductor's
generated code, which must compute the statistics inside the model's own
loops (benchmarks/_fusion.py reads it)."""

import gc
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import hookcap
import hookcap._capture.fused
from conftest import assert_fused_matches_op, assert_stats_match, triton_partials
from hookcap import Monitor, _layout, _ops
from hookcap._capture.fused import partials
from hookcap.reference import stats_from_values

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _fusion  # noqa: E402

SPECIAL = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    # The fused path on CPU tensors (hookcap uses the op there by default).
    monkeypatch.setattr(hookcap._capture.fused, "DEVICE_TYPES", {"cuda", "cpu"})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def new_ring(rows=2, slots=4):
    ring = torch.zeros((slots, rows, _layout.HEADER), dtype=torch.int64)
    state = torch.tensor([0, 1, 0])
    ring[:, :, _layout.STEP_TAG] = -(1 << 62)
    _ops.reset_slot(ring, state)
    return ring, state


def row_stats(ring, state, row):
    d = _layout.decode(ring[int(state[2])].numpy())
    return {k: d[k][row] for k in hookcap.STAT_NAMES}


def merge(x, ring, state, row, form="flat"):
    """``form``: "flat" (one block on the CPU), "blocks" (the blocks Triton
    gets), "memory" (Triton's blocks in memory order: forward captures) or
    "rows"."""
    k = _ops.shift_of_row(ring, state, row)
    if form in ("blocks", "memory"):
        p = triton_partials(x, k, strided=form == "memory")
    else:
        p = partials(x, k, form == "rows")
    _ops.merge_row(p, k, ring, state, row)


def values(x):
    return x.detach().double().reshape(-1).numpy()


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    n = draw(st.integers(0, 3000))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30 if dtype == torch.float32 else 1e3]))
    offset = draw(st.sampled_from([0.0, 1.0, -50.0, 3e3]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale + offset
    k = draw(st.integers(0, min(n, 6)))
    if k:
        at = torch.randint(n, (k,), generator=g)
        x[at] = torch.tensor([SPECIAL[int(i)] for i in torch.randint(len(SPECIAL), (k,), generator=g)],
                             dtype=torch.float64)
    x = x.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "channels_last"]))
    if layout == "transposed" and n >= 6:
        x = x[: n - n % 6].reshape(-1, 3).t()  # a non-contiguous view
    elif layout == "channels_last" and n >= 24:
        x = x[: n - n % 24].reshape(-1, 2, 3, 4).contiguous(memory_format=torch.channels_last)
    return x


@given(tensors(), st.sampled_from(["flat", "blocks", "memory", "rows"]))
def test_merged_partials_equal_the_float64_reference_and_the_op(x, form):
    ring, state = new_ring()
    merge(x, ring, state, 0, form)
    _ops.accumulate(x, ring, state, 1, None)
    got, op = row_stats(ring, state, 0), row_stats(ring, state, 1)
    assert_stats_match(got, stats_from_values(values(x), None), rtol_sum=1e-12, rtol_std=1e-9,
                       abs_sum=float(np.abs(values(x)[np.isfinite(values(x))]).sum()))
    for k in ("count", "nan", "posinf", "neginf", "zeros", "finite", "min", "max", "absmax"):
        assert got[k] == op[k] or (np.isnan(got[k]) and np.isnan(op[k])), k
    assert ring[0, 0, _layout.CALLS] == ring[0, 1, _layout.CALLS] == 1


def test_memory_order_is_a_contiguous_view_of_dense_tensors_only():
    order = hookcap._capture.fused._memory_order
    x = torch.randn(4, 6, 5, 3)
    cl = x.contiguous(memory_format=torch.channels_last)
    v = order(cl)
    assert v.is_contiguous() and v.data_ptr() == cl.data_ptr() and v.shape == (4, 5, 3, 6)
    assert torch.equal(v, x.permute(0, 2, 3, 1))
    assert order(x) is x
    t = x.reshape(24, 15).t()
    assert torch.equal(order(t), x.reshape(24, 15)) and order(t).is_contiguous()
    for other in (x[:, ::2], x[:1].expand(3, 6, 5, 3), x.reshape(-1)[::2]):  # not dense: as it is
        assert order(other) is other
    ones = torch.randn(5, 1, 3).transpose(0, 1)  # a size-1 dimension's stride is free
    assert order(ones).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stored_bits_widen_every_half_precision_value_exactly(dtype):
    """hookcap._capture.fused._stored_float on all 65,536 bit patterns, eager and
    compiled: the float32 value of each (signed zeros, subnormals,
    infinities; NaN stays NaN)."""
    from hookcap._capture.fused import _stored_float

    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    want = x.float()
    for got in (_stored_float(x), torch.compile(_stored_float)(x)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan], want[~nan])
        assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))


def test_blocks_divide_the_tensor_and_stay_in_range():
    blocks = hookcap._capture.fused.blocks
    assert blocks(1) == 1 and blocks(1000) == 1000 and blocks(1024) == 1024
    assert blocks(8 * 1024 * 768) == 1024 and blocks(3 * 5 * 7 * 11 * 13) == 1001
    assert blocks(1031 * 3) == 1  # 3 x a prime above 1,024: no divisor in [64, 1024]
    assert blocks(64 * 4099) == 64
    for n in (1025, 4096 * 3, 10**6 + 6, 999_983 * 2):
        b = blocks(n)
        assert n % b == 0 and (b == 1 or hookcap._capture.fused.MIN_BLOCKS <= b <= hookcap._capture.fused.MAX_BLOCKS)


def test_rows_are_blocks_where_enough_and_not_too_many_or_long():
    from hookcap._capture.fused import MAX_BLOCKS, MIN_BLOCKS, MIN_ROW, _rows_are_blocks, blocks

    def rows(*shape):
        x = torch.empty(shape)
        return _rows_are_blocks(x, blocks(x.numel()))

    assert rows(8, 128, 16)  # 1,024 rows
    assert rows(MIN_BLOCKS, 1)
    assert not rows(MIN_BLOCKS - 1, 4096)
    assert not rows(MAX_BLOCKS + 1, MIN_ROW - 1)
    assert rows(8, 1024, MIN_ROW)  # 8,192 rows, long enough
    assert not rows(4096)
    assert not _rows_are_blocks(torch.empty(8, 1024, MIN_ROW), 0)  # a run-time size


def test_several_writes_into_a_row_rebase_onto_its_shift():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(500, generator=g) + 1e3, torch.randn(300, generator=g) * 5 - 2e3,
          torch.tensor([float("nan"), 7.0, float("inf")])]
    ring, state = new_ring()
    for x in xs:
        merge(x, ring, state, 0)
    want = stats_from_values(np.concatenate([values(x) for x in xs]), None)
    assert_stats_match(row_stats(ring, state, 0), want, rtol_sum=1e-12, rtol_std=1e-9)
    assert ring[0, 0, _layout.CALLS] == 3


def test_shift_comes_from_the_row_then_from_the_last_recorded_step():
    ring, state = new_ring(slots=4)
    assert _ops.shift_of_row(ring, state, 0).item() == 0.0  # nothing recorded yet
    x = torch.randn(1000, dtype=torch.float64).float() * 0.01 + 5e3
    merge(x, ring, state, 0)
    shift = ring[0, 0, _layout.SHIFT].view(torch.float64).item()
    assert _ops.shift_of_row(ring, state, 0).item() == shift == 0.0  # this step: the row's shift
    _ops.advance(ring, state)  # step 1 in slot 1: the mean of step 0
    mean = values(x).mean()
    assert _ops.shift_of_row(ring, state, 0).item() == pytest.approx(mean, rel=1e-12)
    # A row whose earlier slot holds no step of it (a ring grown, a slot the
    # host reset for a later step, garbage) reads no shift from there.
    ring[0, 0, _layout.STEP_TAG] = -(1 << 62)
    assert _ops.shift_of_row(ring, state, 0).item() == 0.0
    ring[0, 0, _layout.STEP_TAG] = 7
    assert _ops.shift_of_row(ring, state, 0).item() == 0.0


def test_sums_about_the_last_steps_mean_keep_tight_data_exact():
    # 1e4 + 0.01 noise: the float64 sums about 0 lose the variance's digits
    # (relative error ~1e-16 * (mean/std)**2); about the last step's mean
    # they do not.
    g = torch.Generator().manual_seed(3)
    x = (1e4 + 1e-2 * torch.randn(200_000, generator=g, dtype=torch.float64)).float()
    ring, state = new_ring()
    merge(x, ring, state, 0)
    _ops.advance(ring, state)
    merge(x, ring, state, 0)
    got = row_stats(ring, state, 0)
    ref = values(x)
    np.testing.assert_allclose(got["std"], ref.std(), rtol=1e-9)


def test_disabled_state_merges_nothing():
    ring, state = new_ring()
    before = ring.clone()
    state[1] = 0
    merge(torch.randn(10), ring, state, 0)
    assert torch.equal(ring, before)


def test_opcheck():
    ring, state = new_ring()
    k = torch.zeros((), dtype=torch.float64)
    p = partials(torch.randn(7, 3), k)
    torch.library.opcheck(torch.ops.hookcap.merge_row.default, (p, k, ring, state, 1))
    blocked = triton_partials(torch.randn(2560), k)  # 640 blocks of 4
    assert blocked.shape == (_layout.PARTIALS, 640)
    torch.library.opcheck(torch.ops.hookcap.merge_row.default, (blocked, k, ring, state, 0))
    torch.library.opcheck(torch.ops.hookcap.shift_of_row.default, (ring, state, 1))


def test_bad_partials_are_refused():
    ring, state = new_ring()
    k = torch.zeros((), dtype=torch.float64)
    good = torch.zeros(_layout.PARTIALS, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64 matrix"):
        _ops.merge_row(good.float(), k, ring, state, 0)
    with pytest.raises(RuntimeError, match="float64 matrix"):
        _ops.merge_row(torch.zeros(_layout.PARTIALS, dtype=torch.float64), k, ring, state, 0)
    with pytest.raises(RuntimeError, match="rows"):
        _ops.merge_row(torch.zeros(3, 2, dtype=torch.float64), k, ring, state, 0)
    with pytest.raises(RuntimeError, match="a column"):
        _ops.merge_row(torch.zeros(_layout.PARTIALS, 0, dtype=torch.float64), k, ring, state, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        _ops.merge_row(torch.zeros(2, _layout.PARTIALS, dtype=torch.float64).t(), k, ring, state, 0)
    with pytest.raises(RuntimeError, match="shift"):
        _ops.merge_row(good, k.float(), ring, state, 0)
    with pytest.raises(RuntimeError, match="shift"):
        _ops.merge_row(good, torch.zeros(1, dtype=torch.float64), ring, state, 0)
    with pytest.raises(RuntimeError, match="out of range"):
        _ops.merge_row(good, k, ring, state, 5)


def test_cpu_tensors_keep_the_op_unless_asked(monkeypatch):
    config = Monitor(nn.Linear(3, 3), histogram=None, fused=True)._config
    assert hookcap._capture.fused.fusable(config, torch.ones(2))
    assert not hookcap._capture.fused.fusable(config, torch.ones(2, dtype=torch.float64))
    monkeypatch.setattr(hookcap._capture.fused, "DEVICE_TYPES", {"cuda"})
    assert not hookcap._capture.fused.fusable(config, torch.ones(2))


def test_fused_needs_no_histogram_and_validates():
    model = nn.Linear(3, 3)
    with pytest.warns(UserWarning, match="histogram=None"):
        mon = Monitor(model, fused=True)
    assert not mon.fused
    assert Monitor(model, fused=True, histogram=None).fused
    with pytest.raises(ValueError, match="fused"):
        Monitor(model, fused=1)


class Block(nn.Module):
    """Linear -> GELU -> Linear -> LayerNorm."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 128)
        self.g = nn.GELU()
        self.l2 = nn.Linear(128, 64)
        self.ln = nn.LayerNorm(64)

    def forward(self, x):
        return self.ln(self.l2(self.g(self.l(x))))


class Amplify(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 1000.0


class Amplified(nn.Module):
    """Linear -> relu(x) * 1000 -> LayerNorm: the product is computed in
    float32 inside a kernel and rounded as it is stored; in float16 the
    larger ones overflow to infinity there."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)
        self.amp = Amplify()
        self.ln = nn.LayerNorm(64)

    def forward(self, x):
        return self.ln(self.amp(self.l(x)))


def block_inputs(batches, dtype=torch.float32, scale=1.0):
    """Inputs of 64 features, one batch of each size in ``batches``."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 64, generator=g) * scale).to(dtype) for b in batches]


def compiled_steps(model, xs, **kw):
    mon = Monitor(model, histogram=None, **kw).attach()
    fn = torch.compile(model)
    start = counters["stats"]["unique_graphs"]
    for x in xs:
        fn(x).pow(2).sum().backward()
        model.zero_grad()
        mon.step()
    mon.detach()
    return mon.history(), counters["stats"]["unique_graphs"] - start


def op_and_fused(model, xs, **kw):
    """The op's and fused=True's histories of the same compiled steps, each
    in a fresh compile, and the number of graphs each compiled."""
    torch._dynamo.reset()
    op, graphs_op = compiled_steps(model, xs, **kw)
    torch._dynamo.reset()
    fused, graphs_fused = compiled_steps(model, xs, fused=True, **kw)
    return op, fused, graphs_op, graphs_fused


def op_and_fused_in_one_run(model, steps, **kw):
    """The op's and fused=True's histories of the same compiled values: two
    Monitors on ``model`` through ``steps`` (callables, one training step
    each), both stepped after each."""
    kw = dict(histogram=None, detectors=[], **kw)
    op, fused = Monitor(model, **kw).attach(), Monitor(model, fused=True, **kw).attach()
    for step in steps:
        step()
        op.step()
        fused.step()
    op.detach()
    fused.detach()
    return op.history(), fused.history()


@pytest.mark.parametrize("batches", [(32, 32, 32), (32, 24, 40)], ids=["static", "dynamic"])
def test_fused_equals_the_op_on_the_same_compiled_values(batches):
    # (32, 24, 40): dynamo recompiles with a symbolic batch size at the second step
    torch.manual_seed(0)
    capture = ("output", "grad_output", "grad_input")
    op, fused, graphs_op, graphs_fused = op_and_fused(Block(), block_inputs(batches), capture=capture)
    assert graphs_fused == graphs_op
    assert len(op.names) == 11  # no grad_input of the first layer
    assert_fused_matches_op(op, fused)


def test_no_extra_graphs_or_recompiles_over_an_unwatched_model():
    torch.manual_seed(0)
    model = Block()
    xs = [torch.randn(8, 64) for _ in range(4)]
    noop = [m.register_forward_hook(lambda *a: None) for m in model.children()]
    fn = torch.compile(model)
    start = counters["stats"]["unique_graphs"]
    for x in xs:
        fn(x).sum().backward()
    plain = counters["stats"]["unique_graphs"] - start
    for h in noop:
        h.remove()
    torch._dynamo.reset()
    _, graphs = compiled_steps(model, xs, capture=("output", "grad_output"), fused=True, every=2)
    assert graphs == plain


def test_float64_and_nonfinite_tensors_under_fused():
    # float64 keeps the op's exact wide-range path; NaN/Inf are counted in the graph.
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    m = M()
    x32 = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, 3.0])
    x64 = torch.tensor([1e300, -1e-300, 2.0], dtype=torch.float64)
    mon = Monitor(m, modules=["."], capture="output", histogram=None, fused=True).attach()
    fn = torch.compile(m)
    fn(x32)
    fn(x64)
    mon.step()
    mon.detach()
    h = mon.history()
    s = {k: h[k][0, 0] for k in hookcap.STAT_NAMES}
    ref = stats_from_values(np.concatenate([values(x32 * 2), values(x64 * 2)]), None)
    assert_stats_match(s, ref, rtol_sum=1e-12, rtol_std=1e-9)


def test_a_gone_monitor_gets_no_merge_and_a_zero_shift():
    model = nn.Linear(3, 3)
    mon = Monitor(model, histogram=None, fused=True).attach()
    sink = mon._recorder.fast.id
    mon.detach()
    del mon
    gc.collect()
    k = torch.zeros((), dtype=torch.float64)
    torch.ops.hookcap.merge_partials(partials(torch.ones(3), k), k, sink, 0)  # a stale graph's: nothing happens
    assert torch.ops.hookcap.fused_shift(torch.empty(0), sink, 0).item() == 0.0


# -- proof of fusion -------------------------------------------------------------


def generated_code(model, x, **kw):
    """Inductor's forward and backward code of one watched training step."""
    from torch._inductor.utils import run_and_get_code

    mon = Monitor(model, histogram=None, **kw).attach()
    fn = torch.compile(model)

    def step():
        fn(x).pow(2).sum().backward()

    _, codes = run_and_get_code(step)
    mon.detach()
    return codes


def has_statistics(text: str) -> bool:
    """Whether a kernel (its name or source) computes partials: the finite
    extrema, which no model kernel of these tests computes."""
    return "amin" in text and "amax" in text


def test_statistics_are_computed_in_the_model_loops():
    """The outputs of GELU (after a Linear) and LayerNorm, and the gradients
    their backward kernels produce, get their statistics in the loops that
    compute them: no loop nest of the step re-reads a captured tensor for
    telemetry (the reduce-only nests left are the second stage of row-wise
    partials, one value per row)."""
    torch.manual_seed(0)
    rows = 256
    codes = generated_code(Block(), torch.randn(rows, 64), modules=["g", "ln"],
                           capture=("output", "grad_input"), fused=True)
    nests = _fusion.nests(codes)
    assert nests and all(n.elements <= rows for n in nests if n.reduce_only)
    gelu = [k for c in codes for k, _, _ in _fusion.cpp_kernels(c) if "gelu" in k]
    norm = [k for c in codes for k, _, _ in _fusion.cpp_kernels(c) if "native_layer_norm" in k]
    # forward and backward kernels of both, each with the statistics in it
    assert len(gelu) == 2 and len(norm) == 2
    assert all(has_statistics(k) for k in gelu + norm)
    assert _fusion.reduce_only_bytes(codes, min_elements=rows + 1) == 0


def test_the_fusion_check_sees_a_statistic_that_is_not_fused():
    # Planted: a Linear's output comes from an extern matmul, so its
    # statistics need a nest of their own, which the check must find.
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    codes = generated_code(Block(), x, modules=["l"], capture="output", fused=True)
    extra = _fusion.reduce_only_bytes(codes, min_elements=257)
    assert extra == 256 * 128 * 4  # the Linear's float32 output, read once more
    op = generated_code(Block(), x, modules=["l"], capture="output")
    assert _fusion.reduce_only_bytes(op, min_elements=257) == 0  # the op's read is outside Inductor's code


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1.0), (torch.float16, 100.0)], ids=["bf16", "fp16"])
def test_half_precision_statistics_with_emulated_casts_equal_the_ops(dtype, scale):
    """The op and fused=True on one compiled model (two Monitors: the same
    values). Inductor elides the rounding between fused half-precision
    operations unless ``emulate_precision_casts`` is set, so a tensor computed
    twice from differently rounded intermediates (the stored one and the one
    the statistics join) can differ by one rounding; with the casts kept, the
    statistics are exact (float16 overflow to infinity included)."""
    import torch._inductor.config as icfg

    torch.manual_seed(0)
    model = Amplified().to(dtype)
    fn = torch.compile(model)
    steps = [lambda x=x: fn(x).pow(2).sum().backward() for x in block_inputs((16, 16), dtype, scale)]
    with icfg.patch(emulate_precision_casts=True):
        a, b = op_and_fused_in_one_run(model, steps, modules=["amp", "ln"],
                                       capture=("output", "grad_output", "grad_input"))
    if dtype == torch.float16:
        assert b["posinf"][:, b.column("amp/output")].sum() > 0
    assert_fused_matches_op(a, b)


@given(tensors(), st.booleans())
def test_the_benchmarks_variant_forms_count_as_hookcap_does(x, rows):
    # bench_fused_variants times other forms of the partials on a GPU: with
    # packed counts they must be hookcap's partials exactly; with float32
    # sums, the counts and extrema still are.
    import bench_fused_variants as bv

    k = torch.tensor(0.5, dtype=torch.float64)
    want = partials(x, k, rows)
    packed = bv.variant_partials(x, k, rows, packed_counts=True)
    assert torch.equal(packed, want)
    exact = [i for i in range(_layout.PARTIALS) if i not in (_layout.P_S1, _layout.P_S2)]
    assert torch.equal(bv.variant_partials(x, k, rows, float_sums=True)[exact], want[exact])
    two = bv.variant_partials(x, k, rows, two_statistics=True)  # the finite count and the sum, per block
    assert two.shape == want.shape
    assert torch.equal(two[[_layout.P_FINITE, _layout.P_S1]], want[[_layout.P_FINITE, _layout.P_S1]])
    one = bv.variant_partials(x, k, rows, one_sum=True)  # the float32 sum of the values, per block
    assert one.shape == want.shape
    if x.numel() and torch.isfinite(x).all():
        f = x.detach().double()
        ref = f.reshape(-1, f.shape[-1]).sum(-1) if rows and x.dim() >= 2 else f.sum().reshape(1)
        scale = f.abs().reshape(ref.shape[0], -1).sum(-1) + 1e-30
        assert ((one[_layout.P_S1] - ref).abs() <= 1e-5 * scale).all()


def test_the_benchmarks_cnn_workload_records_as_the_op_without_a_shift_kernel(monkeypatch):
    """bench_fused_variants --workload cnn on the CPU (channels-last, 2 images
    of 32 pixels, compiled; TinyResNet, the workload without torchvision,
    whose resnet18 takes three times as long to compile): "fused, no shift
    kernel" (sums about 0) records every capture of the first step with the
    op's counts and extrema exactly and its sums within float32 rounding of
    the values' magnitude."""
    import bench_fused_variants as bv

    monkeypatch.setitem(sys.modules, "torchvision", None)  # its import fails: TinyResNet

    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False, cache_size_limit=64):
        out = bv.measure(torch.device("cpu"), 1, rounds=1, steps_per_round=2, quick=True,
                         names=("op histogram=None", "fused, no shift kernel"), workload="cnn")
    op, fused = out["histories"]["op histogram=None"], out["histories"]["fused, no shift kernel"]
    assert "TinyResNet" in out["model"] and out["shape"] == {"batch": 2, "size": 32, "channels_last": True}
    assert len(op.names) > 20 and op.names == fused.names
    for stat in ("count", "nan", "posinf", "neginf", "zeros", "min", "max"):
        np.testing.assert_array_equal(op[stat][0], fused[stat][0])
    scale = np.abs(op["mean"][0]) + op["std"][0]
    assert (np.abs(op["mean"][0] - fused["mean"][0]) <= 1e-5 * scale).all()


def test_the_benchmarks_wide_rows_variant_changes_only_wide_rows():
    import bench_fused_variants as bv

    for shape, want in (((8, 64, 3072), False), ((8, 1024, 768), True), ((64, 2304), True)):
        x = torch.empty(shape)
        b = hookcap._capture.fused.blocks(x.numel())
        assert hookcap._capture.fused._rows_are_blocks(x, b) is True
        assert bv.wide_rows_in_blocks(x, b) is want


class Chain(nn.Module):
    """Linear -> Linear -> GELU -> Linear: the first Linear's output is read
    only by a matmul, the last one's leaves the graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.g, self.c = nn.Linear(64, 128), nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 32)

    def forward(self, x):
        return self.c(self.g(self.b(self.a(x))))


def test_captures_only_external_kernels_touch_are_handed_to_the_op():
    # a's output (matmul -> matmul) and c's (matmul -> out of the graph) have no
    # model kernel to join: the op records them; b's and g's join GELU's kernel.
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    counters["hookcap"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        codes = generated_code(Chain(), x, capture="output", fused=True)
    text = "\n".join(codes)
    assert text.count("hookcap.record.default(") == 2 and text.count("hookcap.merge_partials_list.default(") == 1
    assert counters["hookcap"]["merges_batched"] == 2  # b's and g's, one after the other
    assert counters["hookcap"]["reduce_only_to_op"] == 2
    assert counters["hookcap"]["reduce_only_to_op_bytes"] == (256 * 128 + 256 * 32) * 4
    assert _fusion.reduce_only_bytes(codes, min_elements=257) == 256 * 96 * 4  # b's: C++ fuses it nowhere
    # The values: those of the op on the same compiled steps, the handed ones bit for bit.
    xs = [torch.randn(256, 64) for _ in range(3)]
    model = Chain()
    fn = torch.compile(model)
    op, fused = op_and_fused_in_one_run(model, [lambda x=x: fn(x).pow(2).sum().backward() for x in xs],
                                        capture=("output", "grad_output"))
    assert_fused_matches_op(op, fused)
    for name in ("a/output", "c/output"):
        for stat in ("sum", "sumsq", "l2norm", "std"):
            np.testing.assert_array_equal(fused[stat][:, fused.column(name)], op[stat][:, op.column(name)])
    # b's and g's merges, gathered into one call between a's and c's records, keep the step's order
    for step in op.steps:
        assert fused.order(step) == op.order(step)
        assert op.order(step)[:4] == ["a/output", "b/output", "g/output", "c/output"]


class WideConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 128, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(128)
        self.act = nn.ReLU()
        self.out = nn.Conv2d(128, 4, 1)

    def forward(self, x):
        return self.out(self.act(self.bn(self.conv(x))))


def test_captures_inductor_lays_out_channels_last_after_tracing_go_to_the_op():
    # Inductor makes this NCHW block's tensors channels-last (on the CPU with
    # oneDNN always; on a GPU for wide convolutions: test_fused_triton.py):
    # the BatchNorm and ReLU outputs and their gradients go to the op, whose
    # values they then are.
    torch.manual_seed(0)
    model, xs = WideConv(), [torch.randn(2, 8, 8, 8) for _ in range(2)]
    fn = torch.compile(model)
    counters["hookcap"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        op, fused = op_and_fused_in_one_run(model, [lambda x=x: fn(x).pow(2).sum().backward() for x in xs],
                                            capture=("output", "grad_output"), modules=["bn", "act"])
    assert counters["hookcap"]["relaid_to_op"] == 4  # the outputs, and their gradients, channels-last too
    assert counters["hookcap"]["reduce_only_to_op_bytes"] == 4 * 2 * 128 * 8 * 8 * 4
    for name in ("bn/output", "act/output", "bn/grad_output", "act/grad_output"):
        for stat in ("count", "zeros", "min", "max", "sum", "sumsq"):
            np.testing.assert_array_equal(fused[stat][:, fused.column(name)], op[stat][:, op.column(name)])


def test_the_pass_is_installed_while_a_fused_monitor_is_attached():
    from torch._inductor import config as icfg

    seen = []

    class Mine(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "mine"

    mine = Mine()
    with icfg.patch(post_grad_custom_post_pass=mine, fx_graph_cache=False):
        model = Chain()
        a = Monitor(model, capture="output", histogram=None, fused=True).attach()
        b = Monitor(model, capture="output", histogram=None, fused=True).attach()
        installed = icfg.post_grad_custom_post_pass
        ours = installed[-1] if isinstance(installed, list) else installed  # a list where torch takes one
        assert isinstance(ours, hookcap._capture.fused._Pass)
        assert (installed == [mine, ours]) if isinstance(installed, list) else (ours.before is mine)
        torch.compile(model)(torch.randn(8, 64))
        assert seen  # the user's pass runs
        a.detach()
        assert icfg.post_grad_custom_post_pass is installed
        counters["hookcap"].clear()
        torch.compile(model)(torch.randn(8, 64))  # b alone (with two, each capture has two readers)
        assert counters["hookcap"]["reduce_only_to_op"] == 2  # and hookcap's
        b.detach()
        assert icfg.post_grad_custom_post_pass is mine
        plain = Monitor(model, capture="output", histogram=None).attach()  # the op: no pass
        assert icfg.post_grad_custom_post_pass is mine
        plain.detach()


class Split(nn.Module):
    """A Linear's output split in two, each part read by a matmul only."""

    def __init__(self):
        super().__init__()
        self.a, self.p, self.q = nn.Linear(64, 128), nn.Linear(64, 16), nn.Linear(64, 16)

    def forward(self, x):
        u, v = self.a(x).split(64, dim=-1)
        return self.p(u) * self.q(v)


def test_a_capture_read_through_a_split_by_matmuls_goes_to_the_op():
    torch.manual_seed(0)
    counters["hookcap"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        codes = generated_code(Split(), torch.randn(32, 64), modules=["a"], capture="output", fused=True)
    assert counters["hookcap"]["reduce_only_to_op"] == 1
    assert "hookcap.merge_partials.default(" not in "\n".join(codes)


class PaddedHead(nn.Module):
    """A Linear of unaligned width whose output is padded before a matmul,
    as Inductor pads a matmul's operands on a GPU (GPT-2's 50,257 logits)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 121)
        self.w = nn.Parameter(torch.randn(128, 16) / 11)

    def forward(self, x):
        return torch.nn.functional.pad(self.a(x), (0, 7)) @ self.w


@pytest.mark.parametrize("planted", [False, True])
def test_a_capture_read_by_a_padding_to_a_matmul_goes_to_the_op(monkeypatch, planted):
    # The padding's kernel loops over 128 columns, where no reduction of the
    # 121-wide capture can ride: the statistics would be a kernel of their own.
    if planted:  # the rule that sees it, off: the capture stays fused
        monkeypatch.setattr(hookcap._capture.fused, "_pads_to_another_size", lambda n: False)
    torch.manual_seed(0)
    counters["hookcap"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        codes = generated_code(PaddedHead(), torch.randn(32, 64), modules=["a"], capture="output", fused=True)
    text = "\n".join(codes)
    assert counters["hookcap"]["reduce_only_to_op"] == (0 if planted else 1)
    assert ("hookcap.merge_partials" in text) == planted
    if planted:
        return
    assert counters["hookcap"]["reduce_only_to_op_bytes"] == 32 * 121 * 4
    xs = [torch.randn(32, 64) for _ in range(2)]
    model = PaddedHead()
    fn = torch.compile(model)
    op, fused = op_and_fused_in_one_run(model, [lambda x=x: fn(x).pow(2).sum().backward() for x in xs],
                                        capture=("output", "grad_output"), modules=["a"])
    assert_fused_matches_op(op, fused)  # the gradient, read by the bias's sum, stays fused
    for stat in ("count", "zeros", "min", "max", "sum", "sumsq"):  # the output: the op's, bit for bit
        np.testing.assert_array_equal(fused[stat][:, fused.column("a/output")], op[stat][:, op.column("a/output")])
