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
_SIGNED = 256  # log2: hist_bins = bins per octave + 256 when signed (op_checks.h log2_layout)
MAX_LOG2_BINS = 2200  # (hi - lo) * sub, op_checks.h kMaxLog2Octaves


@dataclass(frozen=True)
class Histogram:
    """What the kernel bins, fixed up front so no range pre-pass (and no host
    sync) is ever needed. Build with :meth:`log2` or :meth:`linear`."""

    kind: str  # "log2" or "linear"
    lo: float
    hi: float
    bins: int = 0  # linear only: equal-width bins in [lo, hi)
    sub: int = 1  # log2 only: bins per octave
    signed: bool = False  # log2 only: negative and positive values in separate bins

    @staticmethod
    def log2(lo: int = -64, hi: int = 64, sub: int = 1, signed: bool = False) -> "Histogram":
        """Bins of ``|x|`` by binary exponent, ``sub`` bins per octave.

        ``sub`` (1, 2, 4, 8 or 16) splits each octave ``[2**e, 2**(e+1))``
        into ``sub`` equal-width bins ``[2**e * (1 + j/sub), 2**e * (1 +
        (j+1)/sub))`` by the top mantissa bits. With ``N = (hi - lo) * sub``
        the unsigned layout has ``N + 3`` bins: index 0 = exact zeros (incl.
        -0); 1 = underflow ``0 < |x| < 2**lo``; ``2 + (e - lo) * sub + j``;
        last = ``|x| >= 2**hi``.

        ``signed=True`` keeps the sign, in value order (``2 * N + 5`` bins):
        with ``c = N + 2`` and ``u`` a value's unsigned bin, bin ``c + u`` for
        ``x > 0``, ``c - u`` for ``x < 0`` and ``c`` for zeros; so bin 0 is
        ``x <= -2**hi`` and the last ``x >= 2**hi``.

        NaN and +-Inf are not binned (they are counted separately). At most
        2,200 bins between ``2**lo`` and ``2**hi``: ``(hi - lo) * sub <= 2200``."""
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise ValueError(f"Histogram.log2: lo and hi must be integers, got lo={lo!r} hi={hi!r}")
        if lo >= hi:
            raise ValueError(f"Histogram.log2: need lo < hi, got lo={lo} hi={hi}")
        if lo < -1100 or hi > 1100:
            raise ValueError(f"Histogram.log2: lo and hi must lie in [-1100, 1100], got {lo}, {hi}")
        if isinstance(sub, bool) or sub not in (1, 2, 4, 8, 16):
            raise ValueError(f"Histogram.log2: sub must be 1, 2, 4, 8 or 16 bins per octave, got {sub!r}")
        if (hi - lo) * sub > MAX_LOG2_BINS:
            raise ValueError(f"Histogram.log2: (hi - lo) * sub = {(hi - lo) * sub} bins; at most "
                             f"{MAX_LOG2_BINS} (narrow [lo, hi) or use fewer bins per octave)")
        if not isinstance(signed, (bool, np.bool_)):
            raise ValueError(f"Histogram.log2: signed must be a bool, got {signed!r}")
        return Histogram("log2", int(lo), int(hi), 0, int(sub), bool(signed))

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
            top = int(self.hi - self.lo) * self.sub + 2
            return 2 * top + 1 if self.signed else top + 1
        return self.bins + 2

    @property
    def magnitudes(self) -> bool:
        """Whether the bins hold ``|x|`` (an unsigned log2 histogram)."""
        return self.kind == "log2" and not self.signed

    @property
    def zero_bin(self) -> int | None:
        """The bin of exact zeros (log2), None for linear histograms."""
        if self.kind != "log2":
            return None
        return self.nbins // 2 if self.signed else 0

    @property
    def unsigned(self) -> "Histogram":
        """The same log2 bins without the sign (itself when unsigned)."""
        return Histogram.log2(int(self.lo), int(self.hi), self.sub) if self.kind == "log2" else self

    def fold(self, counts) -> np.ndarray:
        """Counts [..., nbins] of this histogram -> counts of ``|x|`` in the
        bins of :attr:`unsigned` (a signed log2 histogram's two sides added)."""
        counts = np.asarray(counts)
        if not (self.kind == "log2" and self.signed):
            return counts
        c = self.nbins // 2
        out = counts[..., c:].copy()
        out[..., 1:] += counts[..., :c][..., ::-1]
        return out

    @property
    def bin_edges(self) -> np.ndarray:
        """float64 [nbins + 1]; bin i covers [edges[i], edges[i+1]).
        log2: edges of |x| = [0, 0, 2**lo, ..., 2**hi, inf] (bin 0 is exactly
        0), with ``sub`` bins per octave ``2**e * (1 + j/sub)``; signed, in
        value order: [-inf, -2**hi, ..., -2**lo, 0, 0, 2**lo, ..., 2**hi, inf]
        (a negative bin covers ``(edges[i], edges[i+1]]``; the zero bin is
        ``[0, 0]``).
        linear: [-inf, lo, lo + w, ..., hi, inf]."""
        if self.kind == "log2":
            exps = np.arange(int(self.lo), int(self.hi), dtype=np.int64)
            steps = 1.0 + np.arange(self.sub, dtype=np.float64) / self.sub
            inner = (np.ldexp(1.0, exps)[:, None] * steps[None, :]).reshape(-1)  # exact
            mags = np.concatenate([[0.0, 0.0], inner, [np.ldexp(1.0, int(self.hi)), np.inf]])
            if not self.signed:
                return mags
            return np.concatenate([-mags[:1:-1], [0.0, 0.0], mags[2:]])
        return np.concatenate([[-np.inf], linear_inner_edges(self), [np.inf]])

    def op_args(self):
        """(hist_kind, hist_lo, hist_hi, hist_bins) for hookcap::accumulate
        (log2: hist_bins = bins per octave, plus 256 when signed; 0 for the
        plain octaves)."""
        if self.kind == "log2":
            bins = (self.sub if self.sub > 1 else 0) + (_SIGNED if self.signed else 0)
            return (_LOG2, float(self.lo), float(self.hi), bins)
        return (_LINEAR, self.lo, self.hi, self.bins)

    def to_dict(self) -> dict:
        """``{"kind", "lo", "hi"}`` plus ``"bins"`` (linear), ``"sub"`` and
        ``"signed"`` (log2, when not 1 and False): how files store the spec."""
        d = {"kind": self.kind, "lo": self.lo, "hi": self.hi}
        if self.kind == "linear":
            d["bins"] = self.bins
        else:
            if self.sub != 1:
                d["sub"] = self.sub
            if self.signed:
                d["signed"] = True
        return d

    @staticmethod
    def from_dict(d: dict | None) -> "Histogram | None":
        """Inverse of :meth:`to_dict` (None -> None)."""
        if d is None:
            return None
        if d["kind"] == "log2":
            return Histogram.log2(int(d["lo"]), int(d["hi"]), int(d.get("sub", 1)), bool(d.get("signed", False)))
        return Histogram.linear(d["lo"], d["hi"], int(d["bins"]))


def linear_inner_edges(h: Histogram) -> np.ndarray:
    """The bins+1 edges lo .. hi of a linear histogram, computed exactly as the
    kernel does (lo + i * width, last pinned to hi)."""
    width = (h.hi - h.lo) / h.bins
    edges = h.lo + np.arange(h.bins + 1, dtype=np.float64) * width
    edges[-1] = h.hi
    return edges


NO_HIST_ARGS = (0, 0.0, 0.0, 0)
