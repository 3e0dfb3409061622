"""Ring row layout and decoding of raw rows into statistics.

The column numbers come from the extension itself (hookcap::layout), so the
Python decoder cannot drift from the C++ writer.
"""

from __future__ import annotations

import numpy as np
import torch

ABI_VERSION = 3

_raw = list(torch.ops.hookcap.layout())
if _raw[0] != ABI_VERSION:  # checked before unpacking: an older build has fewer entries
    raise ImportError(f"hookcap: extension ABI {_raw[0]} does not match the Python package "
                      f"({ABI_VERSION}); rebuild it (python setup.py build_ext --inplace)")
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
    FWD_NS,  # timing rows (Monitor(timing=True)): see TimeCol in stats_math.h
    FWD_OPEN,
    FWD_ENDS,
    BWD_NS,
    BWD_OPEN,
    BWD_ENDS,
) = _raw
CUDA_BUILT = bool(_cuda)

# Stat names (a public contract), in display order.
STAT_NAMES = (
    "count", "nan", "posinf", "neginf", "inf", "zeros", "finite",
    "sum", "sumsq", "min", "max", "absmax", "mean", "std", "rms", "l2norm", "zero_frac",
)

# Per-module durations of Monitor(timing=True), in milliseconds.
TIMING_NAMES = ("fwd_ms", "bwd_ms")


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


_ADD_COLS = [COUNT, NAN, POSINF, NEGINF, ZEROS, CALLS]


def moments_about(rows: np.ndarray, to) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) of raw rows [..., width] re-expressed about shift ``to``
    (numpy twin of the C++ shift_rebase); rows with no shift set are unchanged
    (they hold no finite value)."""
    f = rows[..., [S1, S2, SHIFT]].copy().view(np.float64)
    finite = (rows[..., COUNT] - rows[..., NAN] - rows[..., POSINF] - rows[..., NEGINF]).astype(np.float64)
    t = np.where(rows[..., SHIFT] != SHIFT_UNSET, f[..., 2] - to, 0.0)
    return f[..., 0] + finite * t, f[..., 1] + 2.0 * t * f[..., 0] + finite * t * t


class GroupPlan:
    """How rows with the given group ids merge: computed once per call pattern
    and reused (a training step repeats the same pattern every step)."""

    def __init__(self, groups: np.ndarray, _sub: bool = True):
        groups = np.asarray(groups)
        self.perm = np.argsort(groups, kind="stable")  # stable: "first" keeps its meaning
        gs = groups[self.perm]
        self.starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
        self.uniq = gs[self.starts]
        sizes = np.diff(np.r_[self.starts, len(gs)])
        self.seg = np.repeat(np.arange(len(self.starts)), sizes)
        self.trivial = len(self.starts) == len(gs)  # no group has two rows
        # Mostly single-row groups (a step where a few modules are reused):
        # merge only the multi-row groups, pass the rest through.
        multi = (sizes > 1)[self.seg]
        self.split = None
        if not self.trivial and _sub and 2 * multi.sum() < len(gs):
            single_rows, multi_rows = self.perm[~multi], self.perm[multi]
            sub = GroupPlan(groups[multi_rows], _sub=False)
            ids = np.concatenate([groups[single_rows], sub.uniq])
            self.split = (single_rows, multi_rows, sub, np.argsort(ids, kind="stable"))


def merge_groups(rows: np.ndarray, groups, plan: GroupPlan | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge raw rows [k, width] that share a group id (one metric written by
    several calls, devices or ranks) exactly as repeated writes into one row
    would: counts, sums and histograms add, extrema combine, and shifted
    moments are re-expressed about the group's first set shift before they
    add. ``plan``: a GroupPlan of ``groups`` to reuse. Returns (sorted unique
    group ids, merged rows [g, width])."""
    rows = np.asarray(rows, dtype=np.int64)
    plan = GroupPlan(groups) if plan is None else plan
    if plan.split is not None:
        single_rows, multi_rows, sub, order = plan.split
        _, out_m = merge_groups(rows[multi_rows], None, sub)
        out = np.concatenate([rows[single_rows], out_m])[order]
        return plan.uniq, out
    r, starts, uniq, seg = rows[plan.perm], plan.starts, plan.uniq, plan.seg
    out = np.zeros((len(starts), rows.shape[1]), dtype=np.int64)
    out[:, _ADD_COLS] = np.add.reduceat(r[:, _ADD_COLS], starts)
    out[:, HEADER:] = np.add.reduceat(r[:, HEADER:], starts) if r.shape[1] > HEADER else 0
    out[:, MIN] = np.minimum.reduceat(r[:, MIN], starts)
    out[:, MAX] = np.maximum.reduceat(r[:, MAX], starts)
    out[:, ABSMAX] = np.maximum.reduceat(r[:, ABSMAX], starts)
    out[:, STEP_TAG] = np.maximum.reduceat(r[:, STEP_TAG], starts)
    f = r[:, [SUM, SUMSQ, SHIFT]].copy().view(np.float64)
    is_set = r[:, SHIFT] != SHIFT_UNSET
    # The group's shift: that of its first row with one set.
    first = np.minimum.reduceat(np.where(is_set, np.arange(len(r)), len(r)), starts)
    has = first < len(r)
    k = np.where(has, f[np.minimum(first, len(r) - 1), 2], 0.0)
    s1, s2 = moments_about(r, k[seg])
    acc = np.add.reduceat(np.stack([f[:, 0], f[:, 1], s1, s2], axis=1), starts)
    out[:, [SUM, SUMSQ, S1, S2]] = acc.view(np.int64)
    out[:, SHIFT] = np.where(has, k.view(np.int64), SHIFT_UNSET)
    return uniq, out

