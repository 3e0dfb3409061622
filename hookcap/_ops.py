"""Thin typed wrappers over the dispatcher ops (torch.ops.hookcap.*).

The ops mutate preallocated buffers in place and return nothing, so they need
no autograd formula and their fake (Meta) implementation is the shared
argument check in C++.
"""

from __future__ import annotations

import torch

from . import _C, _layout
from .histogram import NO_HIST_ARGS, Histogram

_ops = torch.ops.hookcap


def accumulate(
    x: torch.Tensor,
    ring: torch.Tensor,
    state: torch.Tensor,
    row: int,
    histogram: Histogram | None,
    moments: int = 2,
) -> None:
    """Merge the statistics of every element of ``x`` into ``ring[state.slot, row]``.

    ``ring``: int64 [slots, rows, width] on x's device; ``state``: int64 [3]
    (step, enabled, slot) on the same device. Nothing happens when
    ``state[1] == 0``. One pass, no allocation, no host sync. ``moments=4``
    also sums the third and fourth powers.
    """
    _ops.accumulate(x, ring, state, row, *hist_args(histogram, moments))


def accumulate_many(
    xs: list[torch.Tensor],
    ring: torch.Tensor,
    state: torch.Tensor,
    rows: list[int],
    histogram: Histogram | None,
    moments: int = 2,
) -> None:
    """:func:`accumulate` of each ``xs[i]`` into ``ring[state.slot, rows[i]]``
    (-1: not recorded), in one call: on a GPU, contiguous float16, bfloat16,
    float32 and float64 tensors go up to 32 to a launch. Every tensor is
    checked before any is written. No allocation, no host sync.
    """
    _ops.accumulate_many(xs, ring, state, rows, *hist_args(histogram, moments))


def accumulate_groups(
    x: torch.Tensor,
    ring: torch.Tensor,
    state: torch.Tensor,
    rows: list[int],
    dim: int,
    size: int,
    histogram: Histogram | None,
    moments: int = 2,
) -> None:
    """Split ``x`` along ``dim`` into groups of ``size`` consecutive slices
    (heads of a projection's output, experts, channels) and merge group
    ``g``'s statistics into ``ring[state.slot, rows[g]]`` (-1: not
    recorded), each row exactly as :func:`accumulate` of that group's view
    would. ``size`` must divide ``x.shape[dim]``; ``len(rows)`` is the
    number of groups. One call, no copy, no allocation, no host sync.
    """
    _ops.accumulate_groups(x, ring, state, rows, dim, size, *hist_args(histogram, moments))


def accumulate_bins(
    index: torch.Tensor,
    weight: torch.Tensor | None,
    ring: torch.Tensor,
    state: torch.Tensor,
    rows: list[int],
    histogram: Histogram | None,
) -> None:
    """Each element of the contiguous integer tensor ``index`` adds its value
    (``weight``'s element of the same position, or 1.0 without ``weight``)
    to ``ring[state.slot, rows[index]]``, so bin ``b``'s ``count`` is exactly
    ``(index == b).sum()`` (``torch.bincount``) and its other statistics are
    those of the weights naming it. An index outside ``[0, len(rows))`` is
    in no bin; ``rows[b] == -1``: bin ``b`` not recorded. One call, no
    allocation, no host sync.
    """
    _ops.accumulate_bins(index, weight, ring, state, rows, *hist_args(histogram))


def hist_args(histogram: Histogram | None, moments: int = 2, side_stream: bool = False) -> tuple:
    """(hist_kind, hist_lo, hist_hi, hist_bins) of the accumulate op: the
    histogram's (``NO_HIST_ARGS`` for none), with the moments=4 and the
    side-stream (``Monitor(stream="side")``) flags added to hist_kind."""
    kind, lo, hi, bins = NO_HIST_ARGS if histogram is None else histogram.op_args()
    kind += (_layout.MOMENTS4_FLAG if moments == 4 else 0) + (_layout.SIDE_STREAM_FLAG if side_stream else 0)
    return (kind, lo, hi, bins)


def attention_rows(logits: torch.Tensor, causal_row0: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits``, a contiguous float32 tile ``[..., rows, keys]``
    of pre-softmax attention logits: ``(lse, entropy)``, float32
    ``[..., rows]``, the row's logsumexp and its softmax's entropy in nats
    (-inf both for a row with no allowed key; NaN for a row holding NaN or
    +inf). ``causal_row0 >= 0``: row ``i`` is query ``causal_row0 + i %
    rows`` under a top-left causal mask, whose hidden keys are first set to
    -inf in ``logits`` (in place); -1: no causal mask. One pass over each
    row (read twice from cache), on the tensor's device and current stream,
    no host sync."""
    return _ops.attention_rows(logits, causal_row0)


def accumulate_attention(
    logits: torch.Tensor,
    causal_row0: int,
    ring: torch.Tensor,
    state: torch.Tensor,
    logit_rows: list[int],
    lse_rows: list[int],
    entropy_rows: list[int],
    histogram: Histogram | None,
    moments: int = 2,
) -> None:
    """:func:`attention_rows` of a tile ``[batch, heads, rows, keys]``, and
    per head ``h`` its statistics merged into ``ring[state.slot, ...]``:
    of the head's logits (the ``-inf`` of its mask included) into
    ``logit_rows[h]``, of its rows' logsumexp into ``lse_rows[h]`` and of
    their entropy (nats) into ``entropy_rows[h]`` (-1: not recorded), each
    row as :func:`accumulate_groups` along dimension 1 would merge it. The
    causal mask is written into ``logits`` in place. One call, on the
    tensor's device, no host sync; on a CPU each few rows' statistics are
    read from cache right after the rows are computed."""
    _ops.accumulate_attention(logits, causal_row0, ring, state, logit_rows, lse_rows, entropy_rows,
                              *hist_args(histogram, moments))


def reset_slot(ring: torch.Tensor, state: torch.Tensor) -> None:
    """Initialise every row of slot ``state[2]`` (empty stats, step tag ``state[0]``)."""
    _ops.reset_slot(ring, state)


def reset_rows(ring: torch.Tensor, state: torch.Tensor, begin: int, end: int) -> None:
    """Initialise rows ``[begin, end)`` of slot ``state[2]`` (new metrics, or a
    row whose value is about to be replaced)."""
    _ops.reset_rows(ring, state, begin, end)


def advance(ring: torch.Tensor, state: torch.Tensor, every: int = 1) -> None:
    """Close the step: ``step += 1``; enabled iff ``step % every == 0``; a
    recorded step takes the next slot, which is reset. All on the device."""
    _ops.advance(ring, state, every)


def time_mark(ring: torch.Tensor, state: torch.Tensor, row: int, phase: int, start: bool) -> None:
    """One timing mark into row ``row`` of slot ``state[2]`` (a timing row of
    ``Monitor(timing=True)``): ``phase`` 0 = forward, 1 = backward; a start
    mark adds ``-now`` ns and an end mark ``+now`` ns, so a step's paired marks
    sum to the total duration. ``now`` is the host's steady clock on CPU and
    the device's %globaltimer on CUDA, read when the stream reaches the mark
    (no host sync). Nothing happens when ``state[1] == 0``."""
    _ops.time_mark(ring, state, row, phase, start)


def record(x: torch.Tensor, sink: int, rid: int) -> None:
    """Merge ``x`` into the row ``rid`` of a Monitor's gradient sink ``sink``
    (hookcap/_rows/fastpath.py), reading the sink's ring when it runs and logging
    the write for the step's execution order. The op compiled code calls: its
    graph holds two ints and no ring, and the op is registered as effectful,
    so compiled graphs keep it, in order, forward and backward."""
    _ops.record(x, sink, rid)


def make_effectful(op) -> bool:
    """Register ``op`` as an ordered side effect: without one, graph passes
    would drop an op that returns nothing and mutates no argument. False
    where torch has no effect API."""
    try:
        from torch._higher_order_ops.effects import _EffectType
    except ImportError:
        return False
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is None:
        try:
            from torch._higher_order_ops.effects import _register_effectful_op as register
        except ImportError:
            return False
    register(op, _EffectType.ORDERED)
    return True


RECORD_IS_EFFECTFUL = make_effectful(_ops.record.default)

# The ops with device kernels: each has CPU and Meta kernels, and CUDA ones
# where they were built (checked by test_build and by CI's build check).
DEVICE_OPS = ("accumulate", "accumulate_many", "accumulate_groups", "accumulate_bins", "accumulate_update",
              "accumulate_updates", "attention_rows", "accumulate_attention", "attention_qk", "reset_slot", "reset_rows",
              "advance", "time_mark", "record")


def layout() -> list[int]:
    return list(_ops.layout())


_BLOCK_MERGES = ("direct", "tree")


def block_merge(kind: str | None = None) -> str:
    """How a CUDA accumulate launch of several blocks merges their partials
    into the ring row, for launches from now on (process-wide); returns the
    setting before the call. ``None`` only asks.

    ``"direct"`` (default): each block adds its partial with its own atomics.
    ``"tree"``: blocks write records to a per-stream scratch and the last of
    each group of 32 merges them (about 1/20 of the atomics, a longer serial
    tail). The results are the same; benchmarks/gpu_check.py times both.
    Launches captured in a CUDA graph always merge directly. No effect on CPU."""
    if kind is not None and kind not in _BLOCK_MERGES:
        raise ValueError(f"block_merge: kind must be one of {_BLOCK_MERGES}, got {kind!r}")
    old = _C._block_merge(-1 if kind is None else _BLOCK_MERGES.index(kind))
    return _BLOCK_MERGES[old]
