"""Monitor(fused=True): statistics computed by the compiled graph itself.

Inside a compiled region, a captured tensor's statistics are written as
ordinary tensor reductions (:func:`partials`), so the compiler may compute
them in the kernels that already produce or consume the tensor instead of a
separate pass; one small effectful op (``hookcap::merge_partials``) then merges
the resulting float64 partials (a column per block) into the tensor's ring
row as the accumulate op merges a tensor (``stats_math.h``
``row_merge_partials``).

What the graph computes, per tensor ``x`` (float32, bfloat16 or float16; the
half types are widened to float32 as they are read):

- counts of +Inf, -Inf, zeros and finite values (integer sums: exact;
  int32 where a block has fewer than 2**31 values) and of NaN (the rest);
- the finite values' sum and sum of squares about a shift ``K``, in float64
  (no float32 overflow or underflow is possible for these inputs, and the
  error is the compiler's summation order only: see docs). ``K`` comes from
  the ring (``hookcap::fused_shift``: the row's shift this step, else its
  mean at the last recorded step, else 0), not from the tensor, so the
  reductions need nothing of the tensor before they start and can run in
  the loop that produces it;
- the finite values' min and max (exact).

Each is computed per block of the tensor (its rows, else :func:`blocks`),
giving a float64 [PARTIALS, blocks] matrix that the merge combines: Triton
then needs one reduction kernel for all of them, fused into the model's,
instead of a second small kernel per statistic to finish each whole-tensor
reduction (about eleven launches per capture). The blocks of a captured
output run in its memory order (channels-last included), the order of the
loops that write it. Inductor's C++ backend (the CPU) fuses a reduction only
into a loop of its own shape, so there a flat tensor is one block.

Other tensors (float64, float8, ``moments=4``, a histogram) are recorded by
the accumulate op as without ``fused=True`` (:func:`fusable`); so are captures
only external kernels write and read (:func:`hand_reduce_only_to_the_op`).
"""

from __future__ import annotations

import functools
import operator
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import fused_batch as _fused_batch
from .. import _layout

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Devices whose tensors take the fused path (process-global). Not the CPU:
# there Inductor's C++ reductions cost about 2.5 times the op's vectorised
# pass over the same data (float64 sums widened lane by lane;
# docs/performance.md), and a re-read mostly hits the cache. Tests and
# benchmarks add "cpu" to inspect and time the path.
DEVICE_TYPES = {"cuda"}
_MERGE = _fused_batch.MERGE
_SHIFT = _fused_batch.SHIFT


def fusable(config, t: torch.Tensor) -> bool:
    """Whether ``t``'s statistics go through the fused partials under
    ``config`` (else the accumulate op records it)."""
    return config.fused and t.dtype in FUSED_DTYPES and t.device.type in DEVICE_TYPES


def row_wise(kind: str, mtype: str) -> bool:
    """Whether the statistics of a ``kind`` capture of a module of class
    ``mtype`` are reduced row by row (see :func:`partials`): the outputs and
    input gradients of layers that normalise over the last dimension (class
    names containing ``LayerNorm`` or ``RMSNorm``), whose kernels compute row
    by row (the compiler fuses a reduction only into a loop of the same
    shape). Not BatchNorm, GroupNorm or InstanceNorm: their kernels reduce
    over other dimensions, and their many short rows would only make the
    partials large."""
    return kind in ("output", "grad_input") and ("LayerNorm" in mtype or "RMSNorm" in mtype)


MAX_BLOCKS = 1024
MIN_BLOCKS = 64
# Rows at least this long are blocks however many there are: a row's
# partial column (PARTIALS float64 values, 72 bytes) costs at most 7 % of
# its float32 bytes (14 % in half precision).
MIN_ROW = 256


def blocks(n) -> int:
    """How many equal blocks :func:`partials` splits ``n`` values into: the
    largest divisor of ``n`` up to ``MAX_BLOCKS`` (enough blocks to occupy a
    GPU, few enough columns for the merge), where one of at least
    ``MIN_BLOCKS`` exists or ``n`` fits; else 1 (one whole-tensor reduction,
    which the compiler splits itself). 0 where the answer depends on a size
    known only at run time (dynamic shapes): deciding it would guard the
    graph on that size, a recompile whenever it changes."""
    if _known(n <= MAX_BLOCKS):
        return max(n, 1)
    for d in range(MAX_BLOCKS, MIN_BLOCKS - 1, -1):
        if _known(n % d == 0):
            return d
        if not _known(n % d != 0):
            return 0
    return 1


def _rows_are_blocks(x: torch.Tensor, b: int) -> bool:
    """Whether :func:`partials` reduces ``x`` (two or more dimensions, a
    size known when compiled: ``b``, its :func:`blocks`, is not 0) by its
    rows: ``MIN_BLOCKS`` of them or more, and at most ``MAX_BLOCKS`` or each
    at least ``MIN_ROW`` long. Decided without a guard (:func:`_known`)."""
    if b == 0 or x.dim() < 2:
        return False
    row, n = x.shape[-1], x.numel()
    return _known(MIN_BLOCKS * row <= n) and (_known(n <= MAX_BLOCKS * row) or _known(row >= MIN_ROW))


def _known(cond) -> bool:
    """Whether ``cond`` holds for every size the graph can run with: a plain
    bool, or a symbolic one (dynamic shapes) provable without a guard."""
    return statically_known_true(cond)


def _triton(device: torch.device) -> bool:
    """Whether Inductor compiles code on ``device`` with Triton (which fuses
    loops of equal element count, whatever their shape)."""
    if device.type != "cpu":
        return True
    cfg = sys.modules.get("torch._inductor.config")
    return cfg is not None and cfg.cpu_backend == "triton"


def block_view(x: torch.Tensor, rows: bool = False, strided: bool = False):
    """``(v, whole)``: ``x`` detached, as float32 (see :func:`_stored_float`),
    viewed so that :func:`partials` reduces it over its last dimension (its
    blocks), or, ``whole``, over all of it; ``(None, True)`` for an empty
    tensor. Arguments as for :func:`partials`."""
    x = x.detach()
    f = x if x.dtype == torch.float32 else _stored_float(x)
    n = f.numel()
    if n == 0:
        return None, True
    # In a compiled graph a reshape is only indexing under Triton, even of a
    # strided tensor; under C++ the whole-tensor reductions of the tensor as
    # it is fuse best (reshape(1, -1) measured slower).
    if rows and f.dim() >= 2:
        return f.reshape(-1, f.shape[-1]), False
    if not _triton(f.device):
        return f, True
    g, b = (_memory_order(f) if strided else f), blocks(n)
    if _rows_are_blocks(g, b):
        return g, False  # see reducer()
    if b == 0:  # a run-time size: rows of memory order, whose count needs no guard
        row = g.shape[-1] if g.dim() < 3 else g.shape[-2] * g.shape[-1]  # a plane for images
        return (g.reshape(-1, row) if g.dim() >= 2 else g.reshape(1, -1)), False
    return g.reshape(b, -1), False


def reducer(whole: bool):
    """``red(t, op, **kw)``: the reduction ``op`` (torch.sum, torch.amin, ...)
    of a :func:`block_view` per block, in the shape the reduction leaves
    (its leading dimensions; 0-dim when ``whole``): see :func:`stack_partials`.

    Rows are reduced in the tensor's own shape, not reshaped to a matrix:
    the compiler joins two loops over the same data only where they index
    it alike, and a matrix view of a tensor computed from permuted inputs
    (e.g. the concatenated query, key and value gradients of attention)
    indexes it differently from the kernel that computes it."""
    def red(t, op, **kw):
        return op(t, **kw) if whole else op(t, dim=-1, **kw)
    return red


def stack_partials(cols) -> torch.Tensor:
    """The float64 [PARTIALS, blocks] matrix of the per-block columns
    ``cols`` (each in the shape :func:`reducer` leaves). Stacked before they
    are flattened: Inductor writes a reduction straight into its part of the
    stacked buffer, but copies a view of one there (a copy kernel per column
    and capture on a GPU)."""
    return torch.stack(list(cols)).reshape(len(cols), -1)


def partials(x: torch.Tensor, k: torch.Tensor, rows: bool = False, strided: bool = False) -> torch.Tensor:
    """float64 [PARTIALS, blocks]: ``x``'s statistics about the shift ``k``
    (float64 0-dim) per block of ``x`` (rows in ``hookcap._layout.P_*``
    order), as plain tensor ops traced into the graph. The blocks are the
    rows of ``x`` (its last dimension) where :func:`_rows_are_blocks`, else
    :func:`blocks` equal runs of ``x``, in row-major order, or with
    ``strided`` in memory order (:func:`_memory_order`; it reads the strides,
    which dynamo cannot do for a gradient inside a hook); one block under
    Inductor's C++ backend; where
    the number of blocks depends on a run-time size, the runs over its last
    two dimensions (the last one for a matrix) in the same order; or with
    ``rows`` its rows whatever their number (the loop shape of kernels that
    compute a tensor row by row, e.g. LayerNorm's, so the compiler can fuse
    the statistics into them). ``x`` is not modified and no gradient flows
    through the result."""
    v, whole = block_view(x, rows, strided)
    if v is None:
        return _empty_partials(x.device)
    red = reducer(whole)
    size = v.numel() if whole else v.shape[-1]

    # Counts in int32 where a block cannot reach 2**31 values (int64 costs
    # twice the lanes on the CPU and is emulated on GPUs).
    ctype = torch.int32 if _known(size < 2**31) else torch.int64

    def count(m):
        return red(m, torch.sum, dtype=ctype)

    # abs(v) < inf: finite (false for NaN and both infinities); NaN counted
    # as what is left (torch.isnan and torch.isfinite compile to a scalar
    # loop in Inductor's C++ code: several times the cost of the rest).
    fin = v.abs() < float("inf")
    d = torch.where(fin, v.double() - k, 0.0)
    inf = float("inf")
    finite, posinf, neginf = count(fin), count(v == inf), count(v == -inf)
    cols = {
        _layout.P_NAN: (size - finite - posinf - neginf).double(),
        _layout.P_POSINF: posinf.double(),
        _layout.P_NEGINF: neginf.double(),
        _layout.P_ZEROS: count(v == 0).double(),
        _layout.P_FINITE: finite.double(),
        _layout.P_S1: red(d, torch.sum),
        _layout.P_S2: red(d * d, torch.sum),
        _layout.P_MIN: red(torch.where(fin, v, inf), torch.amin).double(),
        _layout.P_MAX: red(torch.where(fin, v, -inf), torch.amax).double(),
    }
    return stack_partials([cols[i] for i in range(_layout.PARTIALS)])


def _stored_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` (bfloat16 or float16) widened to float32 from its stored bits.

    A compiled kernel keeps a half-precision intermediate in float32 and
    rounds it only as it stores it, so statistics fused into that kernel
    would see values the tensor does not hold (other extrema; for float16,
    finite values where the tensor holds infinities). ``x.float()`` reads the
    unrounded value, and a bitcast back to ``x.dtype`` is folded away by the
    compiler; a bitcast to int16 needs the rounded bits, decoded here with
    integer operations. bfloat16's are float32's upper half: the
    sign-extended bits times 2**16 (in int32 range, so no overflow and no
    shift into the sign bit) are the float32 bits, one instruction."""
    b = x.view(torch.int16).to(torch.int32)
    if x.dtype == torch.bfloat16:
        return (b * 65536).view(torch.float32)
    # float16: sign 1, exponent 5 (bias 15), mantissa 10 bits
    e, m = (b >> 10) & 0x1F, b & 0x3FF
    normal = ((torch.where(e == 31, 255, e + 112) << 23) | (m << 13)).view(torch.float32)
    mag = torch.where(e == 0, m.float() * 2.0**-24, normal)  # zero and subnormals: m * 2**-24
    return torch.where(b < 0, -mag, mag)


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions permuted into memory order (outermost
    first; a view) where ``x`` is dense but not contiguous (e.g.
    channels-last), so that its blocks are runs of memory, as the loops of
    the kernels that write or read it run; else ``x``. Strides are compared
    only where no guard is needed (:func:`_known`): under dynamic shapes an
    order that depends on a run-time size is not taken."""
    if x.is_contiguous():
        return x
    sizes, strides = tuple(x.shape), x.stride()
    order = list(range(x.dim()))
    for i in range(1, len(order)):  # by decreasing stride
        j = i
        while j > 0 and _known(strides[order[j]] > strides[order[j - 1]]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    expect = 1
    for d in reversed(order):
        if not (_known(sizes[d] == 1) or _known(strides[d] == expect)):
            return x
        expect = expect * sizes[d]
    return x.permute(order)


def _empty_partials(device) -> torch.Tensor:
    p = torch.zeros(_layout.PARTIALS, 1, dtype=torch.float64, device=device)
    p[_layout.P_MIN] = float("inf")
    p[_layout.P_MAX] = float("-inf")
    return p


def merge(x: torch.Tensor, sink: int, rid: int, rows: bool = False, strided: bool = False) -> None:
    """Traced: ``x``'s partials into row ``rid`` of sink ``sink``
    (``rows``, ``strided``: see :func:`partials`)."""
    k = _SHIFT(torch.empty(0, device=x.device), sink, rid)
    _MERGE(partials(x, k, rows, strided), k, sink, rid)


# ---------------------------------------------------------------------------
# Captures whose statistics cannot join a model kernel go to the op.
#
# A captured tensor that an external kernel (a matmul, a convolution, an
# attention kernel) writes and that only external kernels read (or that
# leaves the graph) has no kernel of the model for its reductions to join:
# they would run as a kernel of their own that only reduces, and its
# partials would still need a merge. The accumulate op reads it once at
# memory speed instead, so a pass over Inductor's post-grad graph hands such
# a capture's merge to ``hookcap::record`` (what the op path records with),
# and the partials, now unused, are dropped.
# ---------------------------------------------------------------------------

@functools.cache
def _ops_named(*names) -> frozenset:
    """Every overload of the aten ops ``names`` this torch has."""
    out = set()
    for name in names:
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            out.update(getattr(op, o) for o in op.overloads())
    return frozenset(out)


@functools.cache
def _op_sets():
    """(external kernels, views): the aten overloads Inductor runs as
    external kernels, and those that only view their first input."""
    return (_ops_named(
            "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_scaled_mm",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
            "_efficient_attention_backward"),
            _ops_named("view", "reshape", "_unsafe_view", "permute", "t", "transpose", "alias", "squeeze",
                       "unsqueeze", "slice", "select", "split", "split_with_sizes", "unbind"))


def _is_view(n) -> bool:
    """Whether node ``n`` only views its first input's memory (a split's
    parts, taken by ``getitem``, included)."""
    _, views = _op_sets()
    if n.op != "call_function":
        return False
    if n.target is _getitem:
        return _is_view(n.args[0])
    return n.target in views


def _partials_only(p):
    """The nodes that only compute partials ``p`` (``p`` included): each of
    their users is one of them or the merge."""
    only = {p}
    grew = True
    while grew:
        grew = False
        for n in list(only):
            for u in n.all_input_nodes:
                if u not in only and u.op == "call_function" and u.users and all(v in only for v in u.users):
                    only.add(u)
                    grew = True
    return only


def _captured(only):
    """The one tensor of more than one value the partials read (the captured
    tensor), else None."""
    found = []
    for n in only:
        for u in n.all_input_nodes:
            if u in only or u in found:
                continue
            val = u.meta.get("val")
            if isinstance(val, torch.Tensor) and not _known(val.numel() <= 1):
                found.append(u)
    return found[0] if len(found) == 1 else None


def _reduce_only(x, only) -> bool:
    """Whether nothing but external kernels writes and reads ``x``'s memory
    (through views), apart from the partials ``only`` and paddings to
    another size (:func:`_pads_to_another_size`)."""
    externs, _ = _op_sets()
    src = x
    while _is_view(src):
        src = src.args[0]
    made = src.op == "placeholder" or (src.op == "call_function" and (
        src.target in externs or (src.target is _getitem and src.args[0].op == "call_function"
                                  and src.args[0].target in externs)))
    if not made:
        return False
    aliases, todo = set(), [src]
    while todo:
        n = todo.pop()
        aliases.add(n)
        todo.extend(u for u in n.users if _is_view(u) and u not in only)
    for n in aliases:
        for u in n.users:
            if u in only or u in aliases or u.op == "output":
                continue
            if not (u.op == "call_function" and (u.target in externs or u.target is _WITH_EFFECTS
                                                 or _pads_to_another_size(u))):
                return False
    return True


def _pads_to_another_size(n) -> bool:
    """Whether ``n`` pads (or crops) its input to another element count: its
    kernel loops over the new shape, where no reduction of the input can
    ride. Inductor pads the operands of a matmul of unaligned size this way
    on a GPU (e.g. the gradient of GPT-2's logits, 50,257 wide)."""
    if n.target not in _ops_named("constant_pad_nd"):
        return False
    a, b = n.args[0].meta.get("val"), n.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _known(a.numel() != b.numel())


def _channels_last_planes(graph: torch.fx.Graph) -> set:
    """(N, H, W) of the 4-D tensors Inductor will lay out channels-last
    although they were traced NCHW: its convolutions' inputs and outputs
    (and the pointwise ops on them, which follow), where it decides to for
    this graph (``GraphLowering.decide_layout_opt``, which decides
    differently for training and inference: AOT autograd's metadata says
    which this graph is); else empty."""
    try:
        from torch._guards import TracingContext
        from torch._inductor.graph import GraphLowering

        ctx, gm = TracingContext.try_get(), graph.owning_module
        meta = getattr(ctx, "fw_metadata", None)
        inference = meta is not None and not getattr(meta, "is_train", True)
        if gm is None or not GraphLowering.decide_layout_opt(gm, is_inference=inference):
            return set()
    except Exception:  # an Inductor without this decision: nothing is known
        return set()
    planes = set()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.convolution.default:
            for v in (n.meta.get("val"), n.args[0].meta.get("val")):
                key = _plane(v)
                if key is not None:
                    planes.add(key)
    return planes


def _plane(v):
    """(N, H, W) of ``v``, a 4-D tensor of static size, else None."""
    if not (isinstance(v, torch.Tensor) and v.dim() == 4):
        return None
    key = (v.shape[0], v.shape[2], v.shape[3])
    return key if all(type(d) is int for d in key) else None


def _blocks_out_of_memory_order(x, only, planes) -> bool:
    """Whether the blocks of the captured 4-D ``x``, runs of its logical
    (NCHW) order (its partials ``only`` permute nothing), will not run in the
    memory order of the kernels that compute it: ``x`` is channels-last in
    the graph Inductor compiles (e.g. a gradient of a channels-last model,
    whose strides dynamo cannot read inside a hook), or NCHW as traced but
    on one of ``planes``, which Inductor lays out channels-last
    (:func:`_channels_last_planes`). Its statistics would then be a kernel
    of their own, which a GPU's Inductor splits into a second-stage kernel
    per statistic."""
    val = x.meta.get("val")
    key = _plane(val)
    if key is None or not _known(val.shape[1] > 1):
        return False
    if any(n.op == "call_function" and n.target in _ops_named("permute") for n in only):
        return False
    if val.is_contiguous(memory_format=torch.channels_last):
        return not val.is_contiguous()
    return key in planes



def hand_reduce_only_to_the_op(graph: torch.fx.Graph) -> int:
    """The pass: each ``merge_partials`` whose tensor :func:`_reduce_only`,
    or whose blocks are :func:`_blocks_out_of_memory_order`, becomes
    ``record`` of that tensor. Returns how many; dynamo's counters keep the totals
    (``counters["hookcap"]``: ``reduce_only_to_op``, all handed over;
    ``reduce_only_to_op_bytes``, the bytes the op then reads per run of the
    graph, for sizes known when compiled; ``relaid_to_op``, those handed
    over for their layout)."""
    from torch._dynamo.utils import counters

    moved, planes = 0, None
    for m in list(graph.nodes):
        if not _fused_batch.is_merge(m):
            continue
        token, _, p, _k, sink, rid = m.args
        only = _partials_only(p)
        x = _captured(only)
        if x is None:
            continue
        if not _reduce_only(x, only):
            planes = _channels_last_planes(graph) if planes is None else planes
            if not _blocks_out_of_memory_order(x, only, planes):
                continue
            counters["hookcap"]["relaid_to_op"] += 1
        m.args = (token, _RECORD, x, sink, rid)
        moved += 1
        val = x.meta["val"]
        counters["hookcap"]["reduce_only_to_op"] += 1
        if isinstance(val.numel(), int):
            counters["hookcap"]["reduce_only_to_op_bytes"] += val.numel() * val.element_size()
    if moved:
        graph.eliminate_dead_code()
    return moved


_getitem = operator.getitem
_WITH_EFFECTS = _fused_batch.WITH_EFFECTS
_RECORD = torch.ops.hookcap.record.default


class _Pass(CustomGraphPass):
    """:func:`hand_reduce_only_to_the_op`, then ``_fused_batch.batch``, as
    Inductor's post-grad custom pass, after ``before`` (a pass set before
    it, on a torch that takes one; None where it takes a list: both there)."""

    def __init__(self, before=None):
        self.before = before

    def __call__(self, graph) -> None:
        if self.before is not None:
            self.before(graph)
        hand_reduce_only_to_the_op(graph)
        _fused_batch.batch(graph)

    def uuid(self):
        before = getattr(self.before, "uuid", lambda: repr(self.before))() if self.before is not None else None
        return (get_hash_for_files((__file__, _fused_batch.__file__)).hex(), before)


# (installed setting, the setting before it) while some fused Monitor is attached.
_installed = None
_pass_holders = 0


def hold_pass() -> None:
    """A fused Monitor attached: the pass is installed (once for all). Where
    torch takes a list of passes, hookcap's is added after the user's; else
    it wraps the user's pass (which then runs first)."""
    global _pass_holders, _installed
    from torch._inductor import config as icfg
    from torch._inductor import custom_graph_pass as cgp

    if _pass_holders == 0:
        before = icfg.post_grad_custom_post_pass
        if before is None:
            new = _Pass()
        elif hasattr(cgp, "get_custom_graph_passes"):  # a list of passes is taken
            new = [*(before if isinstance(before, (list, tuple)) else [before]), _Pass()]
        else:
            new = _Pass(before)
        icfg.post_grad_custom_post_pass = new
        _installed = (new, before)
    _pass_holders += 1


def release_pass() -> None:
    """The last fused Monitor is gone: the pass set before returns (unless
    the setting changed meanwhile)."""
    global _pass_holders, _installed
    from torch._inductor import config as icfg

    _pass_holders -= 1
    if _pass_holders == 0 and _installed is not None:
        new, before = _installed
        if icfg.post_grad_custom_post_pass is new:
            icfg.post_grad_custom_post_pass = before
        _installed = None
