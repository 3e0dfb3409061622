"""Finite bin edges for hookcap histograms, for tools that need them
(TensorBoard, W&B, plots). Shared so every consumer draws the same buckets."""

from __future__ import annotations

import numpy as np

from ..histogram import Histogram


def finite_edges(spec: Histogram) -> np.ndarray:
    """float64 [nbins + 1], strictly increasing (Histogram.linear's bins are
    at least 16 doubles wide) and finite; bin i is
    ``[edges[i], edges[i+1])`` as in ``spec.bin_edges``, except for the
    open-ended bins, which get one bin's width:

    - log2 (bins of ``|x|``): the exact-zero bin becomes ``[-2**lo, 0]`` (the
      only bin left of 0; it holds exact zeros only), underflow ``[0, 2**lo)``,
      the overflow bin ``[2**hi, 2**(hi+1))`` (one octave).
    - signed log2: the overflow bins ``[+-2**hi, +-2**(hi+1))``; the zero bin
      ``[-2**(lo-1), 2**(lo-1))`` and the underflow bins beside it shrink to
      ``[-2**lo, -2**(lo-1))`` and ``[2**(lo-1), 2**lo)`` (edges stay increasing).
    - linear: underflow ``[lo - w, lo)``, overflow ``[hi, hi + w)`` with ``w`` the
      bin width.
    """
    e = np.array(spec.bin_edges, dtype=np.float64)
    if spec.kind == "log2" and spec.signed:
        e[-1] = 2.0 * e[-2]
        e[0] = -e[-1]
        c = spec.zero_bin  # the zero bin [0, 0] becomes [-2**lo / 2, 2**lo / 2) around 0
        half = np.ldexp(1.0, int(spec.lo) - 1)
        e[c], e[c + 1] = -half, half
    elif spec.kind == "log2":
        e[0] = -np.ldexp(1.0, int(spec.lo))
        e[-1] = 2.0 * e[-2]
    else:
        w = (spec.hi - spec.lo) / spec.bins
        e[0] = spec.lo - w
        e[-1] = spec.hi + w
    return e


def band(counts: np.ndarray) -> tuple[int, int]:
    """[first, last + 1) of the non-zero bins; (0, 0) when all are zero."""
    nz = np.flatnonzero(counts)
    return (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
