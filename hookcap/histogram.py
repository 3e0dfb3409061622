"""Histogram specifications for the fused stats kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Narrowest linear bin, as a power of two of max(|lo|, |hi|): the double
# estimate of a value's bin then errs by under 0.2 bins, so one compare with
# each neighbouring edge places it exactly (stats_math.h linear_bin).
MIN_WIDTH_EXP = -48

_LOG2, _LINEAR = 1, 2  # hist_kind values of the hookcap::accumulate op


@dataclass(frozen=True)
class Histogram:
    """What the kernel bins, fixed up front so no range pre-pass (and no host
    sync) is ever needed. Build with :meth:`log2` or :meth:`linear`."""

    kind: str  # "log2" or "linear"
    lo: float
    hi: float
    bins: int = 0  # linear only: equal-width bins in [lo, hi)

    @staticmethod
    def log2(lo: int = -64, hi: int = 64) -> "Histogram":
        """Bins of |x| by binary exponent. Length ``hi - lo + 3``:
        index 0 = exact zeros (incl. -0); 1 = underflow ``0 < |x| < 2**lo``;
        ``2 + (e - lo)`` for ``2**e <= |x| < 2**(e+1)``; last = ``|x| >= 2**hi``.
        NaN and +-Inf are not binned (they are counted separately)."""
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise ValueError(f"Histogram.log2: lo and hi must be integers, got lo={lo!r} hi={hi!r}")
        if lo >= hi:
            raise ValueError(f"Histogram.log2: need lo < hi, got lo={lo} hi={hi}")
        if lo < -1100 or hi > 1100:
            raise ValueError(f"Histogram.log2: lo and hi must lie in [-1100, 1100], got {lo}, {hi}")
        return Histogram("log2", int(lo), int(hi))

    @staticmethod
    def linear(lo: float, hi: float, bins: int) -> "Histogram":
        """Signed values in ``bins`` equal-width bins over ``[lo, hi)``, plus
        index 0 = ``x < lo`` and the last index = ``x >= hi``. Length ``bins + 2``.
        Edge ``i`` is ``lo + i * (hi - lo) / bins``; the last edge is ``hi``.
        A bin must be at least ``2**-48 * max(|lo|, |hi|)`` wide (about 16
        doubles' spacing there), or bins could not be told apart exactly."""
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"Histogram.linear: need finite lo < hi, got lo={lo} hi={hi}")
        if not isinstance(bins, (int, np.integer)) or bins < 1 or bins > (1 << 24):
            raise ValueError(f"Histogram.linear: bins must be an int in [1, 2**24], got {bins!r}")
        width = (hi - lo) / bins
        if not math.isfinite(width) or width <= 0:
            raise ValueError("Histogram.linear: bin width is not a positive finite number")
        if width < math.ldexp(max(abs(lo), abs(hi)), MIN_WIDTH_EXP):
            raise ValueError(
                f"Histogram.linear: bins of width {width!r} are narrower than 2**{MIN_WIDTH_EXP} of "
                f"max(|lo|, |hi|) = {max(abs(lo), abs(hi))!r}; double precision cannot place values in them "
                "exactly (use fewer bins, or a range nearer zero)")
        return Histogram("linear", lo, hi, int(bins))

    @property
    def nbins(self) -> int:
        """Total number of bins, special bins included."""
        if self.kind == "log2":
            return int(self.hi - self.lo) + 3
        return self.bins + 2

    @property
    def bin_edges(self) -> np.ndarray:
        """float64 [nbins + 1]; bin i covers [edges[i], edges[i+1]).
        log2: edges of |x| = [0, 0, 2**lo, ..., 2**hi, inf] (bin 0 is exactly 0).
        linear: [-inf, lo, lo + w, ..., hi, inf]."""
        if self.kind == "log2":
            exps = np.arange(int(self.lo), int(self.hi) + 1, dtype=np.float64)
            return np.concatenate([[0.0, 0.0], np.ldexp(1.0, exps.astype(np.int64)), [np.inf]])
        return np.concatenate([[-np.inf], linear_inner_edges(self), [np.inf]])

    def op_args(self):
        """(hist_kind, hist_lo, hist_hi, hist_bins) for hookcap::accumulate."""
        if self.kind == "log2":
            return (_LOG2, float(self.lo), float(self.hi), 0)
        return (_LINEAR, self.lo, self.hi, self.bins)


def linear_inner_edges(h: Histogram) -> np.ndarray:
    """The bins+1 edges lo .. hi of a linear histogram, computed exactly as the
    kernel does (lo + i * width, last pinned to hi)."""
    width = (h.hi - h.lo) / h.bins
    edges = h.lo + np.arange(h.bins + 1, dtype=np.float64) * width
    edges[-1] = h.hi
    return edges


NO_HIST_ARGS = (0, 0.0, 0.0, 0)
