"""Float64 reference implementation: the test oracle.

Plain NumPy on a float64 copy of the tensor, computed differently from the
kernels on purpose (two-pass variance, pairwise sums, frexp exponents,
searchsorted bins), so agreement means something.
"""

from __future__ import annotations

import numpy as np
import torch

from .histogram import Histogram, linear_inner_edges

_DEFAULT = Histogram.log2()


def to_float64(x: torch.Tensor) -> np.ndarray:
    """Flat float64 copy of x (exact for every supported dtype)."""
    if not x.is_floating_point():
        raise TypeError(f"reference: only floating tensors, got {x.dtype}")
    return x.detach().to("cpu", torch.float64).reshape(-1).numpy()


def hist_counts(f: np.ndarray, histogram: Histogram) -> np.ndarray:
    """Histogram counts of the finite values ``f`` (float64)."""
    out = np.zeros(histogram.nbins, dtype=np.int64)
    if histogram.kind == "log2":
        a = np.abs(f)
        m, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1)
        e = e.astype(np.int64) - 1  # 2**e <= |x| < 2**(e+1)
        sub = histogram.sub
        j = np.floor((2.0 * m - 1.0) * sub).astype(np.int64)  # exact: sub is a power of two
        lo, hi = int(histogram.lo), int(histogram.hi)
        top = (hi - lo) * sub + 2
        u = np.where(e < lo, 1, np.where(e >= hi, top, 2 + (e - lo) * sub + j))
        u = np.where(a == 0, 0, u)
        idx = top + np.where(f < 0, -u, u) if histogram.signed else u
        np.add.at(out, idx, 1)
    else:
        edges = linear_inner_edges(histogram)
        idx = np.searchsorted(edges, f, side="right")  # 0: x < lo; bins+1: x >= hi
        np.add.at(out, idx, 1)
    return out


def stats_from_values(a: np.ndarray, histogram: Histogram | None = _DEFAULT, moments: int = 2) -> dict:
    """Reference statistics of a flat float64 array (``moments=4``: also
    MOMENT_NAMES, two passes about the float64 mean)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    nan = int(np.isnan(a).sum())
    posinf = int(np.isposinf(a).sum())
    neginf = int(np.isneginf(a).sum())
    f = a[np.isfinite(a)]
    n = f.size
    out = {
        "count": float(a.size),
        "nan": float(nan),
        "posinf": float(posinf),
        "neginf": float(neginf),
        "inf": float(posinf + neginf),
        "zeros": float((a == 0).sum()),
        "finite": float(n),
    }
    # Computed on the values times a power of two that brings the largest to
    # [0.5, 1) (exact), so squares neither overflow nor underflow for any
    # finite float64 values: only sum and sumsq can exceed double's range.
    e = int(np.frexp(np.abs(f).max())[1]) if n else 0
    fs = np.ldexp(f, -e)
    with np.errstate(over="ignore"):
        out["sum"] = float(np.ldexp(np.sum(fs), e)) if n else 0.0
        out["sumsq"] = float(np.ldexp(np.sum(fs * fs), 2 * e)) if n else 0.0
    if n:
        mean_s = np.mean(fs)
        out.update(
            min=float(f.min()),
            max=float(f.max()),
            absmax=float(np.abs(f).max()),
            mean=float(np.ldexp(mean_s, e)),
            std=float(np.ldexp(np.sqrt(np.mean((fs - mean_s) ** 2)), e)),
            rms=float(np.ldexp(np.sqrt(np.mean(fs * fs)), e)),
        )
    else:
        out.update(min=np.nan, max=np.nan, absmax=np.nan, mean=np.nan, std=np.nan, rms=np.nan)
    with np.errstate(over="ignore"):
        out["l2norm"] = float(np.ldexp(np.sqrt(np.sum(fs * fs)), e)) if n else 0.0
    out["zero_frac"] = out["zeros"] / a.size if a.size else np.nan
    out["crest"] = out["absmax"] / out["rms"] if n and out["rms"] > 0 else np.nan
    if moments == 4:
        out.update(higher_moments(fs, e))
    if histogram is not None:
        out["hist"] = hist_counts(f, histogram)
        out["bin_edges"] = histogram.bin_edges
    return out


def higher_moments(fs: np.ndarray, e: int) -> dict:
    """m3, m4, skew, kurtosis of finite values fs * 2**e (fs scaled so the
    largest magnitude is in [0.5, 1): powers neither overflow nor vanish
    before the final scaling), about their mean."""
    if fs.size == 0:
        return {"m3": np.nan, "m4": np.nan, "skew": np.nan, "kurtosis": np.nan}
    # Constant values have every central moment exactly 0 (np.mean of three
    # equal values may round off the value itself).
    d = fs - (fs[0] if fs.min() == fs.max() else np.mean(fs))
    m2, m3, m4 = np.mean(d * d), np.mean(d ** 3), np.mean(d ** 4)
    with np.errstate(over="ignore"):
        out = {"m3": float(np.ldexp(m3, 3 * e)), "m4": float(np.ldexp(m4, 4 * e))}
    shape = m2 > 0
    out["skew"] = float(m3 / m2 ** 1.5) if shape else np.nan
    out["kurtosis"] = float(m4 / (m2 * m2)) if shape else np.nan
    return out


def tensor_stats(x: torch.Tensor, histogram: Histogram | None = _DEFAULT, quantiles=None,
                 moments: int = 2) -> dict:
    """Same keys and semantics as :func:`hookcap.tensor_stats`, in float64
    NumPy; ``quantiles`` are exact (``numpy.quantile`` of the finite values,
    of ``|x|`` with a log2 histogram, as the op's estimates are)."""
    from .quantiles import exact

    a = to_float64(x)
    out = stats_from_values(a, histogram, moments)
    if quantiles is not None:
        if histogram is None:
            raise ValueError("tensor_stats: quantiles= needs a histogram (histogram=None was given)")
        out["quantiles"] = exact(a, quantiles, "|x|" if histogram.magnitudes else "x")
    return out
