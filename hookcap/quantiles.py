"""Quantiles of the finite values from a histogram, with guaranteed bounds.

A histogram says how many values fall in each bin, not where inside the bin
they are; every quantile is therefore an estimate with an interval that
certainly holds the true value. The estimate interpolates by rank within
the bin; the interval is the bin's edges, tightened by the exact extrema the
pass also records (``absmax``, ``min``, ``max``). See docs/statistics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .histogram import Histogram


@dataclass(frozen=True)
class Quantiles:
    """Quantiles of one metric (or one tensor) estimated from its histogram.

    ``value``, ``lower``, ``upper`` and ``rel_error`` have the shape of the
    data's leading dimensions (steps of a History, metrics of a DrainedStep,
    none for one tensor) followed by one entry per ``q`` (dropped when ``q``
    was given as a single float).

    Attributes:
        q: the probabilities asked for, float64.
        of: ``"|x|"`` for an unsigned log2 histogram (its bins hold
            magnitudes, so these are quantiles of ``|x|``), ``"x"`` for a
            signed log2 or a linear one.
        value: the estimate, in the tensor's units; NaN where nothing finite
            was recorded.
        lower, upper: the true quantile (numpy's default ``"linear"`` method
            over the finite values) certainly lies in ``[lower, upper]``: the
            bins of the two order statistics it interpolates, mixed with its
            weights.
        rel_error: the largest ``|value - t| / |t|`` over ``t`` in
            ``[lower, upper]``: a guaranteed relative error bound. ``inf``
            where the interval includes 0 and is not just 0 (the quantile lies
            in the underflow bin, or a linear bin across 0); 0 where it is
            exact (zeros, the largest value).
    """

    q: np.ndarray
    of: str
    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    rel_error: np.ndarray

    @property
    def abs_error(self) -> np.ndarray:
        """The largest ``|value - t|`` over ``t`` in ``[lower, upper]``."""
        return np.maximum(self.value - self.lower, self.upper - self.value)


def check_q(q) -> tuple[np.ndarray, bool]:
    """float64 [Q] of probabilities in [0, 1], and whether ``q`` was a scalar."""
    scalar = np.ndim(q) == 0
    qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
    if qs.ndim != 1 or qs.size == 0 or not np.all((qs >= 0) & (qs <= 1)):
        raise ValueError(f"quantiles: need probabilities in [0, 1], got {q!r}")
    return qs, scalar


def column_name(q: float) -> str:
    """Sink column of quantile ``q``: ``p`` and the percentage (0.5 -> ``p50``,
    0.999 -> ``p99.9``, 1e-7 -> ``p1e-05``)."""
    return "p" + format(round(100.0 * float(q), 10), ".10g")


def from_histogram(counts, spec: Histogram, q, lo_clip=None, hi_clip=None) -> Quantiles:
    """Quantiles from histogram ``counts`` (int [..., nbins], bins of ``spec``).

    ``lo_clip``, ``hi_clip`` ([...], optional): known bounds of the binned
    quantity (the smallest and largest finite value for a linear histogram;
    0 and ``absmax`` for an unsigned log2 one). They make the end bins' intervals
    finite and the extreme order statistics exact."""
    qs, scalar = check_q(q)
    counts = np.asarray(counts, dtype=np.int64)
    lead = counts.shape[:-1]
    c = counts.reshape(-1, counts.shape[-1])
    R, B = c.shape
    edges = spec.bin_edges
    a, b = edges[:-1], edges[1:]
    n = c.sum(axis=1)  # finite values per row
    lo_c = np.full(R, -np.inf) if lo_clip is None else np.broadcast_to(np.asarray(lo_clip, np.float64), lead).reshape(-1)
    hi_c = np.full(R, np.inf) if hi_clip is None else np.broadcast_to(np.asarray(hi_clip, np.float64), lead).reshape(-1)
    lo_c, hi_c = np.where(np.isnan(lo_c), -np.inf, lo_c), np.where(np.isnan(hi_c), np.inf, hi_c)
    if spec.magnitudes:
        lo_c = np.maximum(lo_c, 0.0)
    h = np.maximum(n - 1, 0)[:, None] * qs[None, :]  # numpy's position, [R, Q]
    k0 = np.floor(h).astype(np.int64)
    k1 = np.minimum(k0 + 1, np.maximum(n - 1, 0)[:, None])
    frac = h - k0
    cum = np.cumsum(c, axis=1)
    # Rows' cumulative counts, each lifted above the one before, searched as one array.
    row_off = (np.arange(R) * (cum[:, -1:].max(initial=0) + 1))[:, None]
    flat = (cum + row_off).reshape(-1)

    def order_stat(k):
        """Estimate and interval of the k-th smallest finite value ([R, Q] each)."""
        # Bin holding rank k: the first bin whose cumulative count exceeds k.
        j = np.searchsorted(flat, (k + row_off).reshape(-1), side="right")
        j = (j - np.repeat(np.arange(R) * B, k.shape[1])).reshape(k.shape)
        j = np.clip(j, 0, B - 1)
        start = np.take_along_axis(cum, j, axis=1) - np.take_along_axis(c, j, axis=1)
        nb = np.maximum(np.take_along_axis(c, j, axis=1), 1)
        lo = np.maximum(a[j], lo_c[:, None])
        hi = np.minimum(b[j], hi_c[:, None])
        # The extremes are recorded exactly.
        top = k == (n - 1)[:, None]
        lo = np.where(top & np.isfinite(hi_c)[:, None], hi_c[:, None], lo)
        if not spec.magnitudes:
            bottom = (k == 0) & np.isfinite(lo_c)[:, None]
            hi = np.where(bottom, lo_c[:, None], hi)
        hi = np.maximum(hi, lo)
        with np.errstate(invalid="ignore"):
            est = lo + (hi - lo) * ((k - start + 0.5) / nb)
        est = np.where(np.isfinite(est), est, np.where(np.isfinite(lo), lo, hi))
        return np.clip(est, lo, hi), lo, hi

    # numpy's quantile is (1 - frac) x_k0 + frac x_k1, increasing in both:
    # the same weights on the estimates and on the intervals' ends.
    e0, lo0, hi0 = order_stat(k0)
    e1, lo1, hi1 = order_stat(k1)
    between = frac > 0

    def mix(u, v):
        with np.errstate(invalid="ignore"):
            return np.where(between, (1 - frac) * u + frac * v, u)
    value, lower, upper = mix(e0, e1), mix(lo0, lo1), mix(hi0, hi1)
    # numpy's interpolation rounds too: a few ulps of slack where it mixes, of
    # the larger end (values of opposite signs cancel: the result's own ulp
    # can be far smaller than the rounding of the terms).
    # Ends that are exactly 0 mix exactly (no slack: a quantile of zeros is exact).
    def slack(u, v):
        m = np.maximum(np.abs(u), np.abs(v))
        return np.where(m > 0, 4 * np.spacing(m), 0.0)

    with np.errstate(invalid="ignore"):
        lower = np.where(between, lower - slack(lo0, lo1), lower)
        upper = np.where(between, upper + slack(hi0, hi1), upper)
    value = np.clip(value, lower, upper)
    empty = (n == 0)[:, None]
    value, lower, upper = (np.where(empty, np.nan, v) for v in (value, lower, upper))
    rel = relative_bound(value, lower, upper)
    shape = lead if scalar else lead + (len(qs),)
    out = [v.reshape(shape) if not scalar else v[:, 0].reshape(lead) for v in (value, lower, upper, rel)]
    return Quantiles(qs, "|x|" if spec.magnitudes else "x", *out)


def from_stats(counts, spec: Histogram, q, stat) -> Quantiles:
    """:func:`from_histogram` clipped by the recorded extrema: ``stat(name)``
    gives ``"min"``, ``"max"`` or ``"absmax"`` aligned with ``counts``' rows
    (``absmax`` for a histogram of magnitudes, ``min`` and ``max`` otherwise)."""
    if spec.magnitudes:
        return from_histogram(counts, spec, q, hi_clip=stat("absmax"))
    return from_histogram(counts, spec, q, lo_clip=stat("min"), hi_clip=stat("max"))


def relative_bound(value, lower, upper) -> np.ndarray:
    """max |value - t| / |t| over t in [lower, upper] (value inside it)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # (t - value) / t tends to 1 as t grows without bound.
        pos = np.maximum((value - lower) / lower, np.where(np.isinf(upper), 1.0, (upper - value) / upper))
        neg = np.maximum(np.where(np.isinf(lower), 1.0, (value - lower) / -lower), (upper - value) / -upper)
        out = np.where(lower > 0, pos, np.where(upper < 0, neg, np.inf))
        out = np.where((lower == 0) & (upper == 0), 0.0, out)
    return np.where(np.isnan(value), np.nan, out)


def exact(values, q, of: str = "x") -> Quantiles:
    """Quantiles of the finite ``values`` (of their magnitudes with
    ``of="|x|"``) by ``numpy.quantile``: ``lower == upper == value``,
    ``rel_error`` 0. The reference's form."""
    qs, scalar = check_q(q)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    v = np.abs(v) if of == "|x|" else v
    got = np.quantile(v, qs) if v.size else np.full(len(qs), np.nan)
    got = got[0] if scalar else got
    zero = np.where(np.isnan(got), np.nan, 0.0)
    return Quantiles(qs, of, got, got, got, zero)


__all__ = ["Quantiles", "column_name", "exact", "from_histogram", "from_stats"]
