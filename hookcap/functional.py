"""One-shot statistics of a single tensor through the compiled op."""

from __future__ import annotations

import numpy as np
import torch

from . import _layout, _ops
from ._rows.config import check_moments
from .histogram import Histogram

_DEFAULT = Histogram.log2()


def new_state(device: torch.device | str) -> torch.Tensor:
    """A fresh step state int64[3] = (step 0, enabled, slot 0) on ``device``.

    Made on the device itself (no copy from host memory, which would
    synchronise and is not allowed while a CUDA graph is being captured)."""
    state = torch.zeros(3, dtype=torch.int64, device=device)
    state[1].fill_(1)
    return state


def tensor_stats(x: torch.Tensor, histogram: Histogram | None = _DEFAULT, quantiles=None,
                 moments: int = 2) -> dict:
    """Statistics of every element of ``x`` in one pass on x's device.

    Returns a dict with float64 scalars for ``count``, ``nan``, ``posinf``,
    ``neginf``, ``inf``, ``zeros``, ``finite`` (element counts), ``sum``,
    ``sumsq``, ``min``, ``max``, ``absmax``, ``mean``, ``std`` (population),
    ``rms``, ``l2norm`` (over finite elements, in x's units or their squares),
    ``zero_frac``; plus ``hist`` (np.int64 counts) and ``bin_edges`` (float64)
    unless ``histogram=None``. One host transfer of the result row; for a CUDA
    tensor that transfer synchronises, as any read of a result would.

    ``quantiles`` (a float or a sequence of probabilities in [0, 1]) adds
    ``quantiles``: a :class:`hookcap.quantiles.Quantiles` estimated from the
    histogram (of ``|x|`` for a log2 histogram), with its guaranteed bounds.

    ``moments=4`` adds ``m3``, ``m4`` (central moments, in x's
    units cubed and to the fourth), ``skew`` and ``kurtosis`` (Pearson's,
    not excess: 3 for a normal distribution), from the same pass.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tensor_stats: expected a torch.Tensor, got {type(x).__name__}")
    check_moments(moments)
    width = _layout.HEADER + (histogram.nbins if histogram is not None else 0)
    ring = torch.empty((1, 1, width), dtype=torch.int64, device=x.device)
    state = new_state(x.device)
    _ops.reset_slot(ring, state)
    _ops.accumulate(x, ring, state, 0, histogram, moments)
    row = ring[0, 0].cpu().numpy()
    out = {k: float(v) for k, v in _layout.decode(row).items()
           if moments == 4 or k not in _layout.MOMENT_NAMES}
    if histogram is not None:
        out["hist"] = row[_layout.HEADER:].astype(np.int64)
        out["bin_edges"] = histogram.bin_edges
    if quantiles is not None:
        out["quantiles"] = stats_quantiles(out, histogram, quantiles)
    return out


def stats_quantiles(stats: dict, histogram: Histogram | None, q):
    """Quantiles of a tensor_stats dict's histogram, clipped by its extrema."""
    from .quantiles import from_stats

    if histogram is None:
        raise ValueError("tensor_stats: quantiles= needs a histogram (histogram=None was given)")
    return from_stats(stats["hist"], histogram, q, stats.__getitem__)
