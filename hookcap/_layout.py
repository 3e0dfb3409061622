"""Ring row layout and decoding of raw rows into statistics.

The column numbers come from the extension itself (hookcap::layout), so the
Python decoder cannot drift from the C++ writer.
"""

from __future__ import annotations

import numpy as np
import torch

ABI_VERSION = 1

_raw = list(torch.ops.hookcap.layout())
(
    _abi,
    HEADER,
    COUNT,
    NAN,
    POSINF,
    NEGINF,
    ZEROS,
    SHIFT,
    S1,
    S2,
    MIN,
    MAX,
    ABSMAX,
    CALLS,
    STEP_TAG,
    SUM,
    SUMSQ,
    SHIFT_UNSET,
    STATE_STEP,
    STATE_ENABLED,
    STATE_SLOT,
    STATE_SIZE,
    _cuda,
) = _raw
CUDA_BUILT = bool(_cuda)
if _abi != ABI_VERSION:
    raise ImportError(f"hookcap: extension ABI {_abi} does not match the Python package ({ABI_VERSION})")

# Stat names (a public contract), in display order.
STAT_NAMES = (
    "count", "nan", "posinf", "neginf", "inf", "zeros", "finite",
    "sum", "sumsq", "min", "max", "absmax", "mean", "std", "rms", "l2norm", "zero_frac",
)


def order_key(v) -> np.ndarray:
    """float64 -> ordered int64 key (numpy twin of the C++ order_key)."""
    bits = np.asarray(v, dtype=np.float64).view(np.int64)
    return np.where(bits >= 0, bits, bits ^ np.int64(0x7FFFFFFFFFFFFFFF))


def _unkey(k: np.ndarray) -> np.ndarray:
    """Inverse of the C++ order_key: ordered int64 key -> float64."""
    k = np.asarray(k, dtype=np.int64)
    bits = np.where(k >= 0, k, k ^ np.int64(0x7FFFFFFFFFFFFFFF))
    return bits.view(np.float64)


def decode(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Raw int64 rows [..., width] -> dict of float64 arrays [...] for every
    name in STAT_NAMES. Stats over finite elements are NaN where there is none;
    ``zero_frac`` is NaN for empty tensors."""
    rows = np.asarray(rows, dtype=np.int64)
    f64 = lambda col: rows[..., col].copy().view(np.float64)  # noqa: E731
    count = rows[..., COUNT].astype(np.float64)
    nan = rows[..., NAN].astype(np.float64)
    posinf = rows[..., POSINF].astype(np.float64)
    neginf = rows[..., NEGINF].astype(np.float64)
    zeros = rows[..., ZEROS].astype(np.float64)
    inf = posinf + neginf
    finite = count - nan - inf
    total, sumsq = f64(SUM), f64(SUMSQ)
    # S1, S2 are moments about the slot's shift K (close to the mean), so the
    # variance does not cancel even when |mean| >> std.
    s1, s2 = f64(S1), f64(S2)
    has = finite > 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nf = np.where(has, finite, 1.0)
        mean = np.where(has, total / nf, np.nan)
        dmean = s1 / nf
        var = np.maximum(s2 / nf - dmean * dmean, 0.0)
        std = np.where(has, np.sqrt(var), np.nan)
        rms = np.where(has, np.sqrt(np.maximum(sumsq, 0.0) / nf), np.nan)
        zero_frac = np.where(count > 0, zeros / np.where(count > 0, count, 1.0), np.nan)
    return {
        "count": count,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
        "inf": inf,
        "zeros": zeros,
        "finite": finite,
        "sum": np.where(has, total, 0.0),
        "sumsq": np.where(has, sumsq, 0.0),
        "min": np.where(has, _unkey(rows[..., MIN]), np.nan),
        "max": np.where(has, _unkey(rows[..., MAX]), np.nan),
        "absmax": np.where(has, _unkey(rows[..., ABSMAX]), np.nan),
        "mean": mean,
        "std": std,
        "rms": rms,
        "l2norm": np.sqrt(np.where(has, np.maximum(sumsq, 0.0), 0.0)),
        "zero_frac": zero_frac,
    }


_ADD_COLS = (COUNT, NAN, POSINF, NEGINF, ZEROS, CALLS)


def merge_rows(rows: np.ndarray) -> np.ndarray:
    """Merge raw rows [k, width] of one metric (written on different devices or
    ranks) into one row, exactly as repeated writes into one row would:
    counts, sums and histograms add, extrema combine, and the shifted moments
    are re-expressed about one common shift before they add."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape[0] == 1:
        return rows[0].copy()
    out = rows[0].copy()
    out[list(_ADD_COLS)] = rows[:, list(_ADD_COLS)].sum(axis=0)
    out[HEADER:] = rows[:, HEADER:].sum(axis=0)
    f = rows[:, [SUM, SUMSQ, S1, S2, SHIFT]].copy().view(np.float64)
    out[[SUM, SUMSQ]] = np.array([f[:, 0].sum(), f[:, 1].sum()]).view(np.int64)
    out[MIN] = rows[:, MIN].min()
    out[MAX] = rows[:, MAX].max()
    out[ABSMAX] = rows[:, ABSMAX].max()
    out[STEP_TAG] = rows[:, STEP_TAG].max()
    is_set = rows[:, SHIFT] != SHIFT_UNSET
    if not is_set.any():
        return out
    k = f[np.argmax(is_set), 4]
    finite = (rows[:, COUNT] - rows[:, NAN] - rows[:, POSINF] - rows[:, NEGINF]).astype(np.float64)
    t = np.where(is_set, f[:, 4] - k, 0.0)  # sum(x - k) = s1 + m*t; sum((x-k)^2) = s2 + 2t*s1 + m*t^2
    s1 = (f[:, 2] + finite * t).sum()
    s2 = (f[:, 3] + 2.0 * t * f[:, 2] + finite * t * t).sum()
    out[[SHIFT, S1, S2]] = np.array([k, s1, s2]).view(np.int64)
    return out
