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
_MERGE = torch.ops.hookcap.merge_partials.default
_SHIFT = torch.ops.hookcap.fused_shift.default


def fusable(config, t: torch.Tensor) -> bool:
    """Whether ``t``'s statistics go through the fused partials under
    ``config`` (else the accumulate op records it)."""
    return config.fused and t.dtype in FUSED_DTYPES


def partials(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float64 [PARTIALS]: ``x``'s statistics about the shift ``k`` (float64
    0-dim) in ``hookcap._layout.P_*`` order, as plain tensor ops (traced into
    the graph). ``x`` is not modified and no gradient flows through the result."""
    x = x.detach()
    f = x if x.dtype == torch.float32 else x.float()
    n = f.numel()
    fin = torch.isfinite(f)
    d = torch.where(fin, f.double() - k, 0.0)
    inf = float("inf")
    cols = {
        _layout.P_COUNT: torch.full((), n, dtype=torch.float64, device=f.device),
        _layout.P_NAN: torch.isnan(f).sum(dtype=torch.int64).double(),
        _layout.P_POSINF: (f == inf).sum(dtype=torch.int64).double(),
        _layout.P_NEGINF: (f == -inf).sum(dtype=torch.int64).double(),
        _layout.P_ZEROS: (f == 0).sum(dtype=torch.int64).double(),
        _layout.P_FINITE: fin.sum(dtype=torch.int64).double(),
        _layout.P_SHIFT: k,
        _layout.P_S1: d.sum(),
        _layout.P_S2: (d * d).sum(),
        _layout.P_MIN: torch.where(fin, f, inf).amin().double() if n else torch.full(
            (), inf, dtype=torch.float64, device=f.device),
        _layout.P_MAX: torch.where(fin, f, -inf).amax().double() if n else torch.full(
            (), -inf, dtype=torch.float64, device=f.device),
    }
    return torch.stack([cols[i] for i in range(_layout.PARTIALS)])


def merge(x: torch.Tensor, sink: int, rid: int) -> None:
    """Traced: ``x``'s partials into row ``rid`` of sink ``sink``."""
    k = _SHIFT(torch.empty(0, device=x.device), sink, rid)
    _MERGE(partials(x, k), sink, rid)
