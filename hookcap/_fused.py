"""Monitor(fused=True): statistics computed by the compiled graph itself.

Inside a compiled region, a captured tensor's statistics are written as
ordinary tensor reductions (:func:`partials`), so the compiler may compute
them in the kernels that already produce or consume the tensor instead of a
separate pass; one small effectful op (``hookcap::merge_partials``) then merges
the resulting float64 vector into the tensor's ring row exactly as the
accumulate op merges a tensor (``stats_math.h`` ``row_merge_partials``).

What the graph computes, per tensor ``x`` (float32, bfloat16 or float16; the
half types are widened to float32 as they are read):

- counts of NaN, +Inf, -Inf, zeros and finite values (int64 sums: exact);
- the finite values' sum and sum of squares about a shift ``K``, in float64
  (no float32 overflow or underflow is possible for these inputs, and the
  error is the compiler's summation order only: see docs). ``K`` comes from
  the ring (``hookcap::fused_shift``: the row's shift this step, else its
  mean at the last recorded step, else 0), not from the tensor, so the
  reductions need nothing of the tensor before they start and can run in
  the loop that produces it;
- the finite values' min and max (exact).

Other tensors (float64, float8, ``moments=4``, a histogram) are recorded by
the accumulate op as without ``fused=True``: see :func:`fusable`.
"""

from __future__ import annotations

import torch

from . import _layout

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Devices whose tensors take the fused path (process-global). Not the CPU:
# there Inductor's C++ reductions cost about ten times the op's vectorised
# pass over the same data (docs/performance.md), and a re-read mostly hits
# the cache. Tests and benchmarks add "cpu" to inspect and time the path.
DEVICE_TYPES = {"cuda"}
_MERGE = torch.ops.hookcap.merge_partials.default
_SHIFT = torch.ops.hookcap.fused_shift.default


def fusable(config, t: torch.Tensor) -> bool:
    """Whether ``t``'s statistics go through the fused partials under
    ``config`` (else the accumulate op records it)."""
    return config.fused and t.dtype in FUSED_DTYPES and t.device.type in DEVICE_TYPES


def row_wise(kind: str, mtype: str) -> bool:
    """Whether the statistics of a ``kind`` capture of a module of class
    ``mtype`` are reduced row by row (see :func:`partials`): the outputs and
    input gradients of normalisation layers (LayerNorm, RMSNorm, ...), whose
    kernels compute row by row (the compiler fuses a reduction only into a
    loop of the same shape: a flat one for elementwise producers)."""
    return kind in ("output", "grad_input") and "Norm" in mtype


def partials(x: torch.Tensor, k: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """float64 [PARTIALS]: ``x``'s statistics about the shift ``k`` (float64
    0-dim) in ``hookcap._layout.P_*`` order, as plain tensor ops (traced into
    the graph). ``rows``: each reduction runs over the last dimension first,
    then over the rest (the loop shape of kernels that compute a tensor row by
    row, e.g. LayerNorm's, so the compiler can fuse the statistics into them).
    ``x`` is not modified and no gradient flows through the result."""
    x = x.detach()
    f = x if x.dtype == torch.float32 else x.float()
    n = f.numel()
    if n == 0:
        return _empty_partials(f.device)
    by_rows = rows and f.dim() >= 2

    def total(t, op):  # op: torch.sum, torch.amin or torch.amax, over all of t
        return op(op(t, dim=-1)) if by_rows else op(t)

    def count(m):
        return total(m.to(torch.int64), torch.sum).double()

    fin = torch.isfinite(f)
    d = torch.where(fin, f.double() - k, 0.0)
    inf = float("inf")
    cols = {
        _layout.P_COUNT: torch.full((), n, dtype=torch.float64, device=f.device),
        _layout.P_NAN: count(torch.isnan(f)),
        _layout.P_POSINF: count(f == inf),
        _layout.P_NEGINF: count(f == -inf),
        _layout.P_ZEROS: count(f == 0),
        _layout.P_FINITE: count(fin),
        _layout.P_SHIFT: k,
        _layout.P_S1: total(d, torch.sum),
        _layout.P_S2: total(d * d, torch.sum),
        _layout.P_MIN: total(torch.where(fin, f, inf), torch.amin).double(),
        _layout.P_MAX: total(torch.where(fin, f, -inf), torch.amax).double(),
    }
    return torch.stack([cols[i] for i in range(_layout.PARTIALS)])


def _empty_partials(device) -> torch.Tensor:
    p = torch.zeros(_layout.PARTIALS, dtype=torch.float64, device=device)
    p[_layout.P_MIN] = float("inf")
    p[_layout.P_MAX] = float("-inf")
    return p


def merge(x: torch.Tensor, sink: int, rid: int, rows: bool = False) -> None:
    """Traced: ``x``'s partials into row ``rid`` of sink ``sink``."""
    k = _SHIFT(torch.empty(0, device=x.device), sink, rid)
    _MERGE(partials(x, k, rows), sink, rid)
