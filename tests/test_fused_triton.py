"""Monitor(fused=True) under Inductor's Triton scheduler, whose kernels a
GPU would run, generated on the CPU (benchmarks/_fusion.py): the statistics
must ride in the kernels that compute or consume each captured tensor (no
launch and no read beyond the unwatched model's), in memory order, under
dynamic shapes without a guard. Values: test_fused.py (and
test_fused_interpreted.py, which runs these kernels)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hookcap._capture.fused
import hookcap._capture.fused_batch
from hookcap import Monitor
from test_fused import Block, fresh_dynamo, has_statistics  # noqa: F401 (fresh_dynamo: autouse here too)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _fusion  # noqa: E402


def triton_kernels(make=Block, shape=(256, 64), channels_last=False, dynamic=False, backward=True, **kw):
    """The Triton kernel launches of one training step (forward only without
    ``backward``) of a compiled ``make()`` on a ``shape`` input (with a
    fused=True Monitor when ``kw`` names its captures), as Inductor's Triton
    scheduler writes them for a GPU; generated on the CPU, not run."""
    return triton_step(make, shape, channels_last, dynamic, backward, **kw).kernels()


def triton_step(make=Block, shape=(256, 64), channels_last=False, dynamic=False, backward=True, **kw):
    """:func:`triton_kernels`' step: the ``_fusion.triton_codegen`` that
    generated it (its ``codes``, its ``kernels()``)."""
    pytest.importorskip("triton")
    with _fusion.triton_codegen() as tc:
        torch.manual_seed(0)
        model, x = make(), torch.randn(shape)
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        mon = Monitor(model, histogram=None, fused=True, detectors=[], **kw).attach() if kw else None  # garbage values
        model.compile(dynamic=True if dynamic else None)

        def step():
            y = model(x)
            if backward:
                y.pow(2).sum().backward()

        tc.run(step)
        if mon is not None:
            mon.detach()
    return tc


def test_triton_computes_the_statistics_in_the_model_kernels(monkeypatch):
    """Under Triton the statistics of GELU's input (a matmul result), GELU's
    and LayerNorm's outputs and the gradients their backward produces ride in
    the model's kernels: no launch more than the unwatched model, none that
    reads a captured tensor again (a split reduction's second stage per
    statistic would be a kernel each). A Linear output whose only consumer is
    LayerNorm's row reduction joins it by rows, LayerNorm's loop; in blocks
    of another length (planted: too many rows for a block each) it cannot, and
    is found read once more, exactly."""
    base = triton_kernels()
    fused = triton_kernels(modules=["l", "g", "l2", "ln"], capture=("output", "grad_input"))
    assert any(has_statistics(k.source) for k in fused)
    assert len(fused) == len(base)
    assert _fusion.triton_reduce_only_bytes(fused, 257) == _fusion.triton_reduce_only_bytes(base, 257)
    monkeypatch.setattr(hookcap._capture.fused, "MAX_BLOCKS", 128)
    planted = triton_kernels(modules=["l2"], capture="output")
    assert len(planted) == len(base) + 1
    assert (_fusion.triton_reduce_only_bytes(planted, 257) - _fusion.triton_reduce_only_bytes(base, 257)
            == 256 * 64 * 4)


class ConvBlock(nn.Module):
    def __init__(self, channels=16):
        super().__init__()
        self.conv = nn.Conv2d(8, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.out = nn.Conv2d(channels, 4, 1)

    def forward(self, x):
        return self.out(self.act(self.bn(self.conv(x))))


def conv_triton_kernels(channels=16, channels_last=True, **kw):
    """:func:`triton_kernels` of a ConvBlock on 8×8×16×16 images."""
    return triton_kernels(lambda: ConvBlock(channels), (8, 8, 16, 16), channels_last, **kw)


def test_triton_blocks_follow_a_channels_last_layout(monkeypatch):
    """A channels-last BatchNorm/ReLU output is split into blocks in memory
    order, the order of the kernel that computes it: its statistics join that
    kernel. In the tensor's logical (NCHW) order the blocks would read it
    strided, which no model loop does: one kernel more each (the compile
    would hand them to the op: planted with that off too)."""
    from torch._dynamo.utils import counters

    base = conv_triton_kernels()
    counters["hookcap"].clear()
    fused = conv_triton_kernels(modules=["bn", "act"], capture="output")
    assert any(has_statistics(k.source) for k in fused)
    assert counters["hookcap"]["reduce_only_to_op"] == 0
    assert len(fused) == len(base)
    assert _fusion.triton_traffic_bytes(fused) == _fusion.triton_traffic_bytes(base)
    monkeypatch.setattr(hookcap._capture.fused, "_memory_order", lambda x: x)
    monkeypatch.setattr(hookcap._capture.fused, "_blocks_out_of_memory_order", lambda x, only, planes: False)
    planted = conv_triton_kernels(modules=["bn", "act"], capture="output")
    assert len(planted) == len(base) + 2
    assert (_fusion.triton_reduce_only_bytes(planted, 257) - _fusion.triton_reduce_only_bytes(base, 257)
            == 2 * 8 * 16 * 16 * 16 * 4)  # both outputs read once more


def test_a_layout_inductor_picks_after_tracing_goes_to_the_op(monkeypatch):
    """As docs/compile-and-distributed.md says: with 128 channels Inductor
    makes an NCHW model's convolution tensors channels-last after the hooks
    were traced, so the blocks would not run in memory order. The pass sees
    that decision and hands those captures to the op: the unwatched block's
    launches, the op reads each once. Planted (the decision not seen): each
    is read once more by a kernel of its own, which on a GPU of 132 SMs
    Inductor splits in two stages, the second a kernel per statistic. The
    same model made channels-last by its user fuses."""
    from torch._dynamo.utils import counters

    base = conv_triton_kernels(128, False)
    captured = 2 * 8 * 128 * 16 * 16 * 4  # the BatchNorm and ReLU outputs
    counters["hookcap"].clear()
    fused = conv_triton_kernels(128, False, modules=["bn", "act"], capture="output")
    assert len(fused) == len(base)
    assert _fusion.triton_reduce_only_bytes(fused, 257) == _fusion.triton_reduce_only_bytes(base, 257)
    assert counters["hookcap"]["relaid_to_op"] == counters["hookcap"]["reduce_only_to_op"] == 2
    assert counters["hookcap"]["reduce_only_to_op_bytes"] == captured
    counters["hookcap"].clear()
    assert len(conv_triton_kernels(128, True, modules=["bn", "act"], capture="output")) == (
        len(conv_triton_kernels(128, True)))
    assert counters["hookcap"]["reduce_only_to_op"] == 0
    monkeypatch.setattr(hookcap._capture.fused, "_channels_last_planes", lambda graph: set())
    planted = conv_triton_kernels(128, False, modules=["bn", "act"], capture="output")
    assert len(planted) > len(base) + 2  # the split: more than one kernel per capture
    assert _fusion.triton_reduce_only_bytes(planted, 257) - _fusion.triton_reduce_only_bytes(base, 257) >= captured


@pytest.mark.parametrize("channels", [16, 128])
def test_channels_last_gradients_go_to_the_op(monkeypatch, channels):
    """Gradients are split in logical order (dynamo cannot read their
    strides in a hook): those of a channels-last model, made so by its user
    or by Inductor, go to the op, at most one launch more than unwatched
    (128 channels with the statistics split per statistic: over ten). The gradients of
    a model left NCHW fuse (16 channels: Inductor keeps NCHW)."""
    from torch._dynamo.utils import counters

    grads = 2 * 8 * channels * 16 * 16 * 4
    for channels_last in (True, False):
        base = conv_triton_kernels(channels, channels_last)
        counters["hookcap"].clear()
        fused = conv_triton_kernels(channels, channels_last, modules=["bn", "act"], capture=("output", "grad_output"))
        handed = counters["hookcap"]["reduce_only_to_op_bytes"]
        if channels_last or channels == 128:
            assert len(base) <= len(fused) <= len(base) + 1
            assert handed == (grads if channels_last else 2 * grads)  # NCHW 128: the outputs too
        else:
            assert len(fused) == len(base) and handed == 0
    if channels == 128:  # planted: a kernel per statistic for each (16 channels: blocks too small to split)
        monkeypatch.setattr(hookcap._capture.fused, "_blocks_out_of_memory_order", lambda x, only, planes: False)
        planted = conv_triton_kernels(channels, True, modules=["bn", "act"], capture=("output", "grad_output"))
        assert len(planted) > len(conv_triton_kernels(channels, True)) + 2


def test_codegen_answers_as_a_gpu():
    """The Triton scheduler sees a GPU's SM count (it decides split
    reductions by it), and the CPU's properties are back after the context."""
    import torch._inductor.runtime.hints as hints

    cpu, create = torch.device("cpu"), vars(hints.DeviceProperties)["create"]
    with _fusion.triton_codegen():
        assert hints.DeviceProperties.create(cpu).multi_processor_count == 132
    assert vars(hints.DeviceProperties)["create"] is create


# Dynamo in torch 2.11 cannot compile gradient hooks in a graph with dynamic
# shapes (docs/compile-and-distributed.md): there these tests capture outputs only.
DYNAMIC_GRADS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)


@pytest.mark.parametrize("channels_last", [False, True])
def test_triton_partials_of_a_dynamic_size_need_no_guard(channels_last):
    """Under Triton, compiled with dynamic shapes: blocks that depend on the
    batch size would guard the graph on it (a recompile at every new batch
    size); the statistics are reduced by rows of memory order instead, and
    one graph serves every batch size, as for the unwatched model."""
    pytest.importorskip("triton")
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = ConvBlock()
    shape = lambda b: (b, 8, 16, 16)  # noqa: E731
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    capture = ("output", "grad_output") if DYNAMIC_GRADS else "output"
    mon = Monitor(model, histogram=None, fused=True, capture=capture).attach()
    with _fusion.triton_codegen():
        counters.clear()
        fn = torch.compile(model, dynamic=True)
        for b in (4, 6, 9):
            x = torch.randn(shape(b))
            y = fn(x.contiguous(memory_format=torch.channels_last) if channels_last else x)
            if DYNAMIC_GRADS:
                y.sum().backward()
        graphs = counters["stats"]["unique_graphs"]
    mon.detach()
    assert graphs == 1


@pytest.mark.parametrize("case", ["block", "block3d", "conv"])
def test_triton_rows_of_a_dynamic_size_ride_in_the_model_kernels(case):
    """Compiled with dynamic shapes, the runs that replace the blocks (a
    matrix's rows, a sequence batch's planes, an image's planes) still join
    the model's kernels: the captures cost no launch."""
    pytest.importorskip("triton")
    make, shape = {"block": (Block, (256, 64)), "block3d": (Block, (8, 32, 64)),
                   "conv": (ConvBlock, (8, 8, 16, 16))}[case]
    grads = ("output", "grad_input") if DYNAMIC_GRADS else "output"
    modules = ["bn", "act"] if case == "conv" else ["l", "g", "ln"]

    def launches(**kw):
        return triton_kernels(make, shape, dynamic=True, backward=DYNAMIC_GRADS, **kw)

    fused = launches(modules=modules, capture="output" if case == "conv" else grads)
    assert any(has_statistics(k.source) for k in fused)
    assert len(fused) == len(launches())


class Merge(nn.Module):
    """Concatenates per-head (B, H, T, D) tensors into (B, T, 3·H·D)."""

    def forward(self, q, k, v):
        return torch.cat([t.transpose(1, 2).flatten(2) for t in (q, k, v)], dim=-1)


class Heads(nn.Module):
    """Query, key and value heads as attention's matmuls leave them (the key
    transposed in memory), merged by a concatenation and projected: the
    pattern in which attention's query/key/value gradients become the
    gradient of its input projection (GPT-2's ``c_attn``)."""

    def __init__(self, heads=4, dim=16):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.w = nn.Parameter(torch.randn(3, heads, dim, dim) / dim**0.5)
        self.merge = Merge()
        self.out = nn.Linear(3 * heads * dim, 8)

    def forward(self, x):  # (B, T, H*D)
        h = x.unflatten(-1, (self.heads, self.dim)).transpose(1, 2)  # (B, H, T, D)
        q, v = h @ self.w[0], h @ self.w[2]
        k = (self.w[1].transpose(-1, -2) @ h.transpose(-1, -2)).transpose(-1, -2)  # stored (B, H, D, T)
        return self.out(self.merge(q, k, v))


@pytest.mark.parametrize("case", ["few_rows", "long_rows"])
def test_a_concatenation_of_permuted_tensors_joins_the_kernel_that_computes_it(monkeypatch, case):
    """On a GPU Inductor computes the concatenation as one pointwise kernel
    (the codegen installs that rule; on CPU tensors it would write one kernel
    per input). Its statistics are reduced by the tensor's own rows, indexed
    as that kernel indexes its inputs, so they join it: no launch and no read
    more than the unwatched model. Blocks of a reshaped matrix (planted: rows
    too many or too short to be blocks) index the permuted inputs differently, and the
    compiler computes the concatenation a second time in a kernel of its own.
    Rows: 256 of 192 values (at most ``MAX_BLOCKS``), or 2,048 of 768 (each
    at least ``MIN_ROW`` long)."""
    make, shape, planted_setting = {
        "few_rows": (Heads, (8, 32, 64), ("MAX_BLOCKS", 128)),
        "long_rows": (lambda: Heads(4, 64), (8, 256, 256), ("MIN_ROW", 1024)),
    }[case]
    base = triton_kernels(make, shape)
    assert [k.reductions for k in base if "_cat_" in k.name] == [0]  # one pointwise kernel
    fused = triton_kernels(make, shape, modules=["merge"], capture="output")
    assert [has_statistics(k.source) for k in fused if "_cat_" in k.name] == [True]
    assert len(fused) == len(base)
    assert _fusion.triton_reduce_only_bytes(fused, 257) == _fusion.triton_reduce_only_bytes(base, 257)
    monkeypatch.setattr(hookcap._capture.fused, *planted_setting)
    planted = triton_kernels(make, shape, modules=["merge"], capture="output")
    assert len(planted) == len(base) + 1
    assert _fusion.triton_reduce_only_bytes(planted, 257) > _fusion.triton_reduce_only_bytes(base, 257)


def test_the_partials_the_merge_reads_and_tiled_kernels_are_counted():
    """What the benchmark counts: the partials of three captures of a 256-row
    Block (a block per row: PARTIALS float64 each), and the elements of a
    pointwise kernel tiled in two dimensions (ynumel × xnumel)."""
    codes = triton_step(backward=False, modules=["l", "g", "ln"], capture="output").codes
    assert _fusion.merge_partials_bytes(codes) == 3 * hookcap._layout.PARTIALS * 256 * 8
    tiled = ("'in_ptr0': '*fp32', 'out_ptr0': '*fp32'\n@triton.jit\ndef k(in_ptr0, out_ptr0, ynumel, xnumel):\n"
             "    ynumel = 8\n    xnumel = 16\n    tmp0 = tl.load(in_ptr0 + (y0 + 8*x1), xmask)\n"
             "    tl.store(out_ptr0 + (x1 + 16*y0), tmp0, xmask)\n")
    k = _fusion.triton_kernel(tiled)
    assert (k.elements, k.loads, k.big_stores) == (128, {"in_ptr0": 4}, {"out_ptr0": 4})


def test_registers_of_the_kernels_the_statistics_join():
    """benchmarks/triton_registers.py on a Linear -> GELU step (64 rows of
    2,048: looped row reductions), each kernel compiled for sm_90 on the CPU
    (Triton, its bundled ptxas): the statistics joined into the GELU kernels
    raise their registers several fold, so an SM holds a quarter of the
    warps (64 -> 16) by registers."""
    pytest.importorskip("triton")
    import triton_registers

    def make():
        return nn.Sequential(nn.Linear(64, 2048), nn.GELU())

    def rows(**kw):
        got = triton_registers.kernel_rows(triton_kernels(make, shape=(64, 64), **kw))
        assert got and all(r["regs"] > 0 and r["spill_bytes"] >= 0 for r in got)
        return {r["kernel"]: r for r in got}

    plain, fused = rows(), rows(capture=("output", "grad_output"))
    gelu = [r for name, r in plain.items() if "gelu" in name]
    joined = [r for name, r in fused.items() if "gelu" in name]
    assert len(gelu) == len(joined) == 2 and all(r["reductions"] == 0 for r in gelu)
    assert all(r["reductions"] >= 8 for r in joined)  # the statistics of two captures each
    assert max(r["regs"] for r in gelu) * 3 < min(r["regs"] for r in joined)
    assert min(r["warps_per_sm"] for r in gelu) == 64 and max(r["warps_per_sm"] for r in joined) <= 16


def test_warps_an_sm_holds_by_registers():
    import triton_registers

    w = triton_registers.warps_per_sm
    assert [w(32, 8), w(138, 8), w(95, 8), w(80, 1), w(24, 1), w(255, 16)] == [64, 8, 16, 25, 32, 0]


def test_instructions_per_element_of_the_kernels_the_statistics_join():
    """benchmarks/triton_issue.py on a Linear -> GELU step (64 rows of 2,048),
    each kernel compiled for sm_90 on the CPU: the unwatched GELU kernels
    issue a few dozen SASS instructions per element; with the statistics of
    two captures joined they issue more than twice that, each capture's
    statistics more than a bfloat16 element's second read costs on an H200
    (about 14 instructions' issue time: 2 bytes at 4.8 TB/s)."""
    pytest.importorskip("triton")
    import triton_issue

    def make():
        return nn.Sequential(nn.Linear(64, 2048), nn.GELU())

    def gelu(**kw):
        rows = triton_issue.kernel_rows(triton_kernels(make, shape=(64, 64), **kw), 132, 1.98, 4.8)
        got = {("bwd" if "backward" in r["kernel"] else "fwd"): r for r in rows if "gelu" in r["kernel"]}
        assert len(got) == 2 and all(r["issue_us"] > 0 and r["bytes_us"] > 0 for r in got.values())
        return got

    plain, fused = gelu(), gelu(capture=("output", "grad_output"))
    for d in ("fwd", "bwd"):
        assert 10 < plain[d]["instructions_per_element"] < 80
        per_capture = (fused[d]["instructions_per_element"] - plain[d]["instructions_per_element"]) / 2
        assert per_capture > 14


def test_instruction_count_reads_loops_and_programs():
    """triton_issue's counting on made-up SASS and a made-up kernel: the
    instructions between a backward branch and its target are the loop,
    run once per block of the reduction; a forward branch is no loop."""
    import triton_issue
    from triton import Config

    ins = [(0x00, "MOV R1, R2"), (0x10, "FADD R1, R1, R2"), (0x20, "FMUL R1, R1, R1"),
           (0x30, "@P0 BRA 0x10"), (0x40, "@P1 BRA 0x60"), (0x50, "EXIT"), (0x60, "EXIT")]
    assert triton_issue.loop_body(ins) == 3
    assert triton_issue.loop_body([(a, t.replace("BRA 0x10", "BRA 0x40")) for a, t in ins]) == 0  # planted
    src = "@triton.jit\ndef k(XBLOCK, R0_BLOCK):\n    xnumel = 64\n    r0_numel = 3000\n"
    cfg = Config({"XBLOCK": 2, "R0_BLOCK": 1024}, num_warps=8)
    # 32 programs x 8 warps x (3 iterations x 3 loop instructions + 4 others)
    assert triton_issue.executed_warp_instructions(src, cfg, 3, 7) == 32 * 8 * (3 * 3 + 4)
    pointwise = "@triton.jit\ndef k(XBLOCK):\n    xnumel = 4096\n"
    assert triton_issue.executed_warp_instructions(pointwise, Config({"XBLOCK": 1024}, num_warps=4), 0, 20) == 4 * 4 * 20


def test_hookcap_calls_in_generated_code_are_one_merge_and_one_shift_per_graph():
    """_fusion.hookcap_calls on the Block's generated step: each of the
    seven captures (four outputs; three input gradients, the model's input
    needing none) is merged with its shift read from the ring, or recorded
    by the op (a capture only external kernels touch: none here); the
    merges and the shifts of each graph (forward, backward) are gathered
    into one call each (planted: the pass that gathers them off, a call per
    capture); an unwatched step calls nothing."""
    from torch._dynamo.utils import counters

    counters["hookcap"].clear()
    codes = triton_step(modules=["l", "g", "l2", "ln"], capture=("output", "grad_input")).codes
    calls = _fusion.hookcap_calls(codes)
    assert calls["merge_partials"] == calls["fused_shift"] == calls["record"] == calls["accumulate"] == 0
    assert calls["merge_partials_list"] == calls["fused_shifts"] == 2
    assert counters["hookcap"]["merges_batched"] == counters["hookcap"]["shifts_batched"] == 7
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hookcap._capture.fused_batch, "batch", lambda graph: None)
        planted = _fusion.hookcap_calls(triton_step(modules=["l", "g", "l2", "ln"],
                                                         capture=("output", "grad_input")).codes)
    assert planted["merge_partials"] == planted["fused_shift"] == 7 and planted["merge_partials_list"] == 0
    plain = _fusion.hookcap_calls(triton_step().codes)
    assert sum(plain.values()) == 0
