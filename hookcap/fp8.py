"""How well a tensor would fit an FP8 format, from its log2 histogram.

With per-tensor scaling ``s`` a value ``x`` is cast as ``x * s``. The pass
already has what decides the fit: the magnitudes' octave histogram and the
exact ``absmax``. See docs/statistics.md#fp8-fit for the definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .histogram import Histogram

# (largest finite, smallest normal, smallest subnormal) of the OCP FP8 formats
# torch calls float8_e4m3fn and float8_e5m2.
FORMATS = {
    "e4m3": (448.0, 2.0 ** -6, 2.0 ** -9),
    "e5m2": (57344.0, 2.0 ** -14, 2.0 ** -16),
}


@dataclass(frozen=True)
class FP8Fit:
    """Fractions of the finite values, each bounded: the true fraction lies in
    ``[x_lo, x_hi]`` (equal where the histogram decides it exactly). Arrays
    have the data's leading shape (steps of a History); NaN where nothing
    finite was recorded.

    Attributes:
        fmt: ``"e4m3"`` or ``"e5m2"``.
        scale: the factor applied before the cast (``max / absmax`` for
            ``scaling="amax"``).
        underflow_lo, underflow_hi: non-zero values with ``|x * s|`` at or
            below half the smallest subnormal: they become 0 (the tie rounds
            to even, to 0).
        subnormal_lo, subnormal_hi: values with ``|x * s|`` above that, up to
            the smallest normal, before rounding: they keep fewer mantissa
            bits (those within half a subnormal step of the smallest normal
            round up to it).
        saturate_lo, saturate_hi: values with ``|x * s|`` above the largest
            finite value: a saturating cast clips them.
    """

    fmt: str
    scale: np.ndarray
    underflow_lo: np.ndarray
    underflow_hi: np.ndarray
    subnormal_lo: np.ndarray
    subnormal_hi: np.ndarray
    saturate_lo: np.ndarray
    saturate_hi: np.ndarray

    @property
    def exact(self) -> np.ndarray:
        """bool: every fraction known exactly."""
        return ((self.underflow_lo == self.underflow_hi) & (self.subnormal_lo == self.subnormal_hi)
                & (self.saturate_lo == self.saturate_hi))


def _fractions(counts, a, b, inside, overlap, finite):
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = (counts * inside).sum(axis=-1) / finite
        hi = (counts * overlap).sum(axis=-1) / finite
    return np.where(finite > 0, lo, np.nan), np.where(finite > 0, hi, np.nan)


def fit(counts, spec: Histogram, absmax, fmt: str = "e4m3", scaling="amax") -> FP8Fit:
    """FP8 fit of values whose log2 histogram is ``counts`` (int [..., nbins])
    and whose largest magnitude is ``absmax`` ([...]). ``scaling``:
    ``"amax"`` (``s = max / absmax``, per row) or a positive float ``s``."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8_fit: fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if spec is None or spec.kind != "log2":
        raise ValueError("fp8_fit needs a log2 histogram (Histogram.log2): its bins are magnitudes")
    counts = np.asarray(spec.fold(counts), dtype=np.float64)  # signed: both sides' magnitudes
    spec = spec.unsigned
    absmax = np.asarray(absmax, dtype=np.float64)
    fmax, fnorm, fsub = FORMATS[fmt]
    if isinstance(scaling, str):
        if scaling != "amax":
            raise ValueError(f"fp8_fit: scaling must be 'amax' or a positive float, got {scaling!r}")
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(absmax > 0, fmax / np.where(absmax > 0, absmax, 1.0), 1.0)
    else:
        scale = float(scaling)
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"fp8_fit: scaling must be 'amax' or a positive float, got {scaling!r}")
        scale = np.full(absmax.shape, scale)
    edges = spec.bin_edges
    a, b = edges[:-1], edges[1:]
    binned = np.ones(len(a), dtype=bool)
    binned[0] = False  # exact zeros: they stay 0 and are neither
    finite = counts.sum(axis=-1)
    s = scale[..., None]
    t0, t1, t2 = (fsub / 2) / s, fnorm / s, fmax / s  # thresholds on |x|, [..., 1]
    amax = absmax[..., None]
    if isinstance(scaling, str):
        t2 = amax  # max / s is absmax itself, whatever the rounding of s
    # Bin [a, b) against [L, U): inside if a >= L and b <= U, overlapping if b > L and a < U.
    # Half the smallest subnormal itself rounds to even, to 0: a bin starting
    # there may hold such ties, so it bounds underflow from above.
    under = _fractions(counts, a, b, binned & (b <= t0), binned & (a <= t0), finite)
    sub = _fractions(counts, a, b, binned & (a > t0) & (b <= t1), binned & (b > t0) & (a < t1), finite)
    # (t2, inf): no value exceeds absmax, so nothing saturates when absmax <= t2.
    sat = _fractions(counts, a, b, binned & (a > t2), binned & (b > t2) & (amax > t2), finite)
    return FP8Fit(fmt, scale, *under, *sub, *sat)


__all__ = ["FORMATS", "FP8Fit", "fit"]
