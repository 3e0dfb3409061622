"""Ring row layout and decoding of raw rows into statistics.

The column numbers come from the extension itself (hookcap::layout), so the
Python decoder cannot drift from the C++ writer.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

ABI_VERSION = 13

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
    BIG_N,  # float64 values too large or small to square in double: see stats_math.h
    BIG_SHIFT,
    BIG_S1,
    BIG_S2,
    SMALL_N,
    SMALL_SHIFT,
    SMALL_S1,
    SMALL_S2,
    WIDE_SCALE,
    N4,  # moments=4: values summed into S3 and S4 (about SHIFT)
    S3,
    S4,
    MOMENTS4_FLAG,  # added to the op's hist_kind for moments=4
    SIDE_STREAM_FLAG,  # added to the op's hist_kind: CUDA launches on hookcap's side stream
) = _raw
CUDA_BUILT = bool(_cuda)

# Stat names (a public contract), in display order.
STAT_NAMES = (
    "count", "nan", "posinf", "neginf", "inf", "zeros", "finite",
    "sum", "sumsq", "min", "max", "absmax", "mean", "std", "rms", "l2norm", "zero_frac",
    "crest",
)

# Per-module durations of Monitor(timing=True), in milliseconds.
TIMING_NAMES = ("fwd_ms", "bwd_ms")

# Higher moments of Monitor(moments=4) / tensor_stats(..., moments=4): central
# moments E[(x - mean)^3], E[(x - mean)^4] over finite values, skewness
# m3 / std^3 and Pearson's (non-excess) kurtosis m4 / std^4. NaN in rows
# recorded without moments=4.
MOMENT_NAMES = ("m3", "m4", "skew", "kurtosis")


def order_key(v) -> np.ndarray:
    """float64 -> ordered int64 key (numpy twin of the C++ order_key)."""
    bits = np.asarray(v, dtype=np.float64).view(np.int64)
    return np.where(bits >= 0, bits, bits ^ np.int64(0x7FFFFFFFFFFFFFFF))


def _unkey(k: np.ndarray) -> np.ndarray:
    """Inverse of the C++ order_key: ordered int64 key -> float64."""
    k = np.asarray(k, dtype=np.int64)
    bits = np.where(k >= 0, k, k ^ np.int64(0x7FFFFFFFFFFFFFFF))
    return bits.view(np.float64)


# The buckets of wide float64 values (stats_math.h wide_bucket): columns
# (count, shift, S1, S2), and the exponent e of their unit: a stored value
# y stands for y * 2**e.
WIDE_BUCKETS = ((BIG_N, BIG_SHIFT, BIG_S1, BIG_S2, WIDE_SCALE),
                (SMALL_N, SMALL_SHIFT, SMALL_S1, SMALL_S2, -WIDE_SCALE))
WIDE_COLS = tuple(c for bucket in WIDE_BUCKETS for c in bucket[:4])


@functools.cache
def fresh_header() -> np.ndarray:
    """int64 [HEADER]: the header of a row freshly reset for step 0, written
    by the kernels' own reset (stats_math.h reset_value), so no Python copy
    of the reset values can drift. Read-only."""
    ring = torch.zeros((1, 1, HEADER), dtype=torch.int64)
    torch.ops.hookcap.reset_slot(ring, torch.tensor([0, 1, 0], dtype=torch.int64))
    out = ring[0, 0].numpy().copy()
    out.flags.writeable = False
    return out


def _f64(rows: np.ndarray, col: int) -> np.ndarray:
    return rows[..., col].copy().view(np.float64)


def _wide_moments(rows: np.ndarray) -> dict[str, np.ndarray]:
    """sum, sumsq, mean, std, rms and l2norm of rows [k, width] holding wide
    float64 values: each bucket's moments, and the ordinary values', brought
    to the scale of the largest part holding a non-zero value (powers of two: exact, except
    what is negligible beside it), combined there by the parallel-variance
    rule, and scaled back. A statistic whose true value exceeds double's
    range (sum, sumsq of huge values; l2norm of many) is inf; mean, std and
    rms never are."""
    finite = (rows[:, COUNT] - rows[:, NAN] - rows[:, POSINF] - rows[:, NEGINF]).astype(np.float64)
    parts = []  # (n, sum, sumsq, M2 about the part's mean, scale exponent of its unit)
    n0 = finite - rows[:, BIG_N] - rows[:, SMALL_N]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s1, s2 = _f64(rows, S1), _f64(rows, S2)
        m2 = np.where(n0 > 0, s2 - s1 * s1 / np.where(n0 > 0, n0, 1.0), 0.0)
        parts.append((n0, _f64(rows, SUM), _f64(rows, SUMSQ), m2, 0))
        for n_c, k_c, s1_c, s2_c, unit in WIDE_BUCKETS:
            n = rows[:, n_c].astype(np.float64)
            has = n > 0
            k = np.where(has, _f64(rows, k_c), 0.0)
            b1, b2 = _f64(rows, s1_c), _f64(rows, s2_c)
            nn = np.where(has, n, 1.0)
            parts.append((n, n * k + b1, b2 + 2.0 * k * b1 + n * k * k,
                          np.where(has, b2 - b1 * b1 / nn, 0.0), unit))
        # The unit: that of the largest part with a non-zero value (by its
        # squares: a part of zeros has no say).
        e = np.where(parts[1][2] > 0, WIDE_SCALE, np.where(parts[0][2] > 0, 0, -WIDE_SCALE))
        nf = np.where(finite > 0, finite, 1.0)
        tot = sum(np.where(n > 0, np.ldexp(sm, pe - e), 0.0) for n, sm, _, _, pe in parts)
        sq = sum(np.where(n > 0, np.ldexp(q, 2 * (pe - e)), 0.0) for n, _, q, _, pe in parts)
        mean = tot / nf
        m2 = 0.0
        for n, sm, _, pm2, pe in parts:
            pm = np.ldexp(sm / np.where(n > 0, n, 1.0), pe - e)
            m2 = m2 + np.where(n > 0, np.ldexp(pm2, 2 * (pe - e)) + n * (pm - mean) ** 2, 0.0)
        return {
            "sum": np.ldexp(tot, e), "sumsq": np.ldexp(np.maximum(sq, 0.0), 2 * e),
            "mean": np.ldexp(mean, e), "std": np.ldexp(np.sqrt(np.maximum(m2, 0.0) / nf), e),
            "rms": np.ldexp(np.sqrt(np.maximum(sq, 0.0) / nf), e),
            "l2norm": np.ldexp(np.sqrt(np.maximum(sq, 0.0)), e),
        }


def decode(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Raw int64 rows [..., width] -> dict of float64 arrays [...] for every
    name in STAT_NAMES. Stats over finite elements are NaN where there is none;
    ``zero_frac`` is NaN for empty tensors; ``crest`` where ``rms`` is 0."""
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
    out = {
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
    wide = np.asarray((rows[..., BIG_N] != 0) | (rows[..., SMALL_N] != 0))
    if wide.any():  # float64 values beyond squaring range: only then
        pick = wide.reshape(-1)
        w = _wide_moments(rows.reshape(-1, rows.shape[-1])[pick])
        for k, v in w.items():
            a = np.array(out[k], dtype=np.float64).reshape(-1)
            a[pick] = v
            out[k] = a.reshape(wide.shape)
    out["crest"] = crest(out["absmax"], out["rms"])
    out.update(higher_moments(rows, finite))
    return out


def higher_moments(rows: np.ndarray, finite=None) -> dict[str, np.ndarray]:
    """``m3``, ``m4``, ``skew``, ``kurtosis`` (MOMENT_NAMES) of raw rows
    [..., width], from the shifted sums S1..S4 about the row's shift K:
    with d = S1/n, m2 = S2/n - d^2, m3 = S3/n - 3 d S2/n + 2 d^3 and
    m4 = S4/n - 4 d S3/n + 6 d^2 S2/n - 3 d^4 (K lies near the mean, so d is
    small and these do not cancel). NaN where the row holds no third and
    fourth moments of all its finite values (written without moments=4, or
    float64 values too wide to square: see stats_math.h wide_bucket), where
    it has no finite value, and, for skew and kurtosis, where m2 is 0 or the
    fourth powers leave double's normal range (deviations beyond about
    2**±255)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows[..., N4].any():  # the default (moments=2): nothing to derive on every decode
        return {k: np.full(rows.shape[:-1], np.nan) for k in MOMENT_NAMES}
    if finite is None:
        finite = (rows[..., COUNT] - rows[..., NAN] - rows[..., POSINF] - rows[..., NEGINF]).astype(np.float64)
    n = finite - rows[..., BIG_N] - rows[..., SMALL_N]
    ok = (rows[..., N4] > 0) & (rows[..., N4] == finite) & (n == finite)
    f64 = lambda col: rows[..., col].copy().view(np.float64)  # noqa: E731
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nn = np.where(ok, n, 1.0)
        d = f64(S1) / nn
        a2, a3, a4 = f64(S2) / nn, f64(S3) / nn, f64(S4) / nn
        m2 = np.maximum(a2 - d * d, 0.0)
        m3 = a3 - 3.0 * d * a2 + 2.0 * d ** 3
        m4 = np.maximum(a4 - 4.0 * d * a3 + 6.0 * d * d * a2 - 3.0 * d ** 4, 0.0)
        m3 = np.where(ok & np.isfinite(m3), m3, np.nan)
        m4 = np.where(ok & np.isfinite(m4), m4, np.nan)
        # m2² (and m4 >= m2²) must be normal doubles: subnormal fourth powers
        # (deviations near 2**-256) lose their digits, so they give NaN, not noise.
        shape = (m2 > 0) & np.isfinite(m2 * m2) & (m2 * m2 >= np.finfo(np.float64).tiny)
        skew = np.where(shape, m3 / (m2 * np.sqrt(m2)), np.nan)
        kurt = np.where(shape, m4 / (m2 * m2), np.nan)
    return {"m3": m3, "m4": m4, "skew": skew, "kurtosis": kurt}


def crest(absmax, rms) -> np.ndarray:
    """Crest factor ``absmax / rms`` (>= 1; NaN where ``rms`` is 0 or NaN).
    ``absmax >= rms`` always; the rounding of ``rms`` (a few ulps) could put
    the quotient just below 1, so it is held at 1 there."""
    absmax, rms = np.asarray(absmax, np.float64), np.asarray(rms, np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return np.where(rms > 0, np.fmax(absmax / np.where(rms > 0, rms, 1.0), 1.0), np.nan)


_ADD_COLS = [COUNT, NAN, POSINF, NEGINF, ZEROS, CALLS, BIG_N, SMALL_N, N4]
# Shifted moments: the ordinary values' and each wide bucket's, (S1, S2, shift).
MOMENT_SETS = ((S1, S2, SHIFT), (BIG_S1, BIG_S2, BIG_SHIFT), (SMALL_S1, SMALL_S2, SMALL_SHIFT))


def moment_count(rows: np.ndarray, cols=(S1, S2, SHIFT)) -> np.ndarray:
    """float64 [...]: how many values the moments ``cols`` (one of
    MOMENT_SETS) of raw rows [..., width] are over."""
    if cols[2] == BIG_SHIFT:
        return rows[..., BIG_N].astype(np.float64)
    if cols[2] == SMALL_SHIFT:
        return rows[..., SMALL_N].astype(np.float64)
    return (rows[..., COUNT] - rows[..., NAN] - rows[..., POSINF] - rows[..., NEGINF]
            - rows[..., BIG_N] - rows[..., SMALL_N]).astype(np.float64)


def moments_about(rows: np.ndarray, to, cols=(S1, S2, SHIFT)) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) of raw rows [..., width] re-expressed about shift ``to``
    (numpy twin of the C++ shift_rebase); ``cols``: which moments (one of
    MOMENT_SETS). Rows with no shift set are unchanged (they hold no such
    value)."""
    f = rows[..., list(cols)].copy().view(np.float64)
    n = moment_count(rows, cols)
    t = np.where(rows[..., cols[2]] != SHIFT_UNSET, f[..., 2] - to, 0.0)
    return f[..., 0] + n * t, f[..., 1] + 2.0 * t * f[..., 0] + n * t * t


def moments4_about(rows: np.ndarray, to) -> tuple[np.ndarray, np.ndarray]:
    """(S3, S4) of raw rows [..., width] re-expressed about shift ``to`` by
    the binomial expansion of ((x - K) + t)^k, t = K - to, from the rows' own
    S1, S2 about their shift K; 0 for rows that hold none (N4 = 0)."""
    f = rows[..., [S1, S2, S3, S4, SHIFT]].copy().view(np.float64)
    n = moment_count(rows)
    t = np.where((rows[..., SHIFT] != SHIFT_UNSET) & (rows[..., N4] > 0), f[..., 4] - to, 0.0)
    s1, s2, s3, s4 = f[..., 0], f[..., 1], f[..., 2], f[..., 3]
    t2 = t * t
    return (s3 + 3.0 * t * s2 + 3.0 * t2 * s1 + n * t2 * t,
            s4 + 4.0 * t * s3 + 6.0 * t2 * s2 + 4.0 * t2 * t * s1 + n * t2 * t2)


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
    out[:, [SUM, SUMSQ]] = np.add.reduceat(r[:, [SUM, SUMSQ]].copy().view(np.float64), starts).view(np.int64)
    for cols in MOMENT_SETS:
        c1, c2, cs = cols
        is_set = r[:, cs] != SHIFT_UNSET
        # The group's shift: that of its first row with one set.
        first = np.minimum.reduceat(np.where(is_set, np.arange(len(r)), len(r)), starts)
        has = first < len(r)
        k = np.where(has, r[np.minimum(first, len(r) - 1), cs].view(np.float64), 0.0)
        if cs == SHIFT:  # moments=4 sums, about the same shift (before S1, S2 move)
            s3, s4 = moments4_about(r, k[seg])
            out[:, [S3, S4]] = np.add.reduceat(np.stack([s3, s4], axis=1), starts).view(np.int64)
        s1, s2 = moments_about(r, k[seg], cols)
        out[:, [c1, c2]] = np.add.reduceat(np.stack([s1, s2], axis=1), starts).view(np.int64)
        out[:, cs] = np.where(has, k.view(np.int64), SHIFT_UNSET)
    return uniq, out

