"""What moved first: for an anomaly at one step, the (metric, statistic)
pairs ranked by the earliest step at which each left its own trailing
baseline, with how many steps before the anomaly and how far (robust z)."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import numpy as np

from .groups import split_group

# Statistics compared by default: scale (rms, absmax), location (mean), the
# non-finite and zero counts, and the element count (a dead expert's tokens).
STATS = ("rms", "absmax", "mean", "nan", "inf", "zero_frac", "count")
_MAD_TO_SIGMA = 1.4826
_REL_FLOOR = 1e-3  # the scale is at least this x |median|: a constant baseline's noise floor
_REFRESH = 8  # steps between baselines: each step is compared with the window before its block of 8


@dataclass(frozen=True)
class Mover:
    """One (metric, statistic) that left its baseline before or at the anomaly.

    name: the metric (a group's column ``f"{metric}[{g}]"`` included); stat:
    the statistic; step: the first step it left its trailing baseline;
    lead: steps from there to the anomaly (0: the same step); z: its robust
    z-score there ((value − median) / (1.4826 · MAD) of the ``window``
    steps before; ±inf from a constant baseline, e.g. the first NaN);
    value and baseline: the statistic there and the window's median;
    order: its place in that step's execution order (ties: earlier first)."""

    name: str
    stat: str
    step: int
    lead: int
    z: float
    value: float
    baseline: float
    order: int


class Explanation(list):
    """The movers, first mover first (a list of :class:`Mover`); ``step``:
    the anomaly's step; ``str()`` / :meth:`table` print them."""

    def __init__(self, movers, step: int, z: np.ndarray | None = None, steps: np.ndarray | None = None):
        super().__init__(movers)
        self.step = step
        self.zscores = z  # float64 [steps, movers]: each mover's robust z over the steps examined
        self.steps = steps

    def table(self, n: int = 20) -> str:
        lines = [f"what moved first before the anomaly at step {self.step}:",
                 f"{'#':>3}  {'step':>6}  {'lead':>4}  {'z':>9}  {'stat':<9}  metric"]
        for i, m in enumerate(self[:n], 1):
            lines.append(f"{i:>3}  {m.step:>6}  {m.lead:>4}  {m.z:>9.3g}  {m.stat:<9}  {m.name}")
        if len(self) > n:
            lines.append(f"... {len(self) - n} more")
        if not len(self):
            lines.append("  (nothing left its baseline)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def explain(history, step: int | None = None, *, stats=STATS, window: int = 64, horizon: int = 32,
            z: float = 6.0, top: int | None = None) -> Explanation:
    """Rank what moved first before an anomaly.

    For the anomaly at ``step`` (default: the latest of ``history.anomalies``,
    else the last recorded step), each metric's statistic (``stats``) is
    compared, at each of the ``horizon`` recorded steps up to ``step``, with
    its own trailing baseline: the straight-line trend of its ``window``
    recorded steps before, extended to the step, and the median absolute
    residual about it (refreshed every 8 steps; per row: a layer with a small
    norm counts as much as a large one; the trend: a weight drifting as it
    trains is not a move). A pair has moved at the first step where
    ``|z| > z`` and it stays beyond ``z / 2`` on the same side at the next
    step, at the anomaly and for at least half the steps from there (a blip
    that returns is not a move). Movers are
    ranked by that step, then by execution order at it (the first offender
    of a step comes first), then by ``|z|``.

    ``history``: a :class:`hookcap.History` (a loaded dump too: the flight
    recorder's steps are enough). Returns an :class:`Explanation`; ``top``
    keeps the first ``top``. Needs ``window`` + 1 recorded steps before
    ``step``; fewer give an empty result.
    """
    if not (isinstance(window, int) and window >= 3 and isinstance(horizon, int) and horizon >= 1):
        raise ValueError(f"explain: window must be an int >= 3 and horizon an int >= 1, got {window!r}, "
                         f"{horizon!r}")
    steps = np.asarray(history.steps)
    if step is None:
        anomalies = list(getattr(history, "anomalies", None) or [])
        step = max(int(a.step) for a in anomalies) if anomalies else (int(steps[-1]) if len(steps) else 0)
    at = np.searchsorted(steps, step, side="right") - 1  # the last recorded step <= step
    if at < 0 or at < window:
        return Explanation([], int(step))
    lo = max(window, at - horizon + 1)
    names = list(history.names)
    per_stat = {}  # stat -> (values [window + h, M], z [h, M])
    for stat in (s for s in stats if s in history):
        x = np.asarray(history[stat], dtype=np.float64)[lo - window:at + 1]
        unit = None
        if stat == "mean" and "rms" in history:  # a shift of the mean, in units of the spread
            unit = np.asarray(history["rms"], dtype=np.float64)[lo - window:at + 1]
        per_stat[stat] = (x, _trailing_z(x, window, unit))
    found, orders = [], {}
    for stat, (_, zz) in per_stat.items():
        first = _first_moves(zz, z)
        for j in np.flatnonzero(first >= 0):
            k = int(first[j])
            t = int(steps[lo + k])
            if t not in orders:
                orders[t] = _order_index(history, t)
            found.append((t, orders[t].get(split_group(names[j])[0], len(names)), -abs(zz[k, j]), stat, int(j), k))
    found.sort()
    movers, zcols = [], []
    for t, order, _, stat, j, k in found[:top] if top else found:
        x, zz = per_stat[stat]
        with _quiet():
            base = float(np.nanmedian(x[k:k + window, j]))
        movers.append(Mover(names[j], stat, t, int(step) - t, float(zz[k, j]), float(x[window + k, j]), base,
                            int(order)))
        zcols.append(zz[:, j])
    zmat = np.stack(zcols, axis=1) if zcols else np.zeros((at + 1 - lo, 0))
    return Explanation(movers, int(step), zmat, steps[lo:at + 1].copy())


def _trailing_z(x: np.ndarray, window: int, unit: np.ndarray | None = None) -> np.ndarray:
    """Robust z of rows window.. of ``x`` [window + h, M] against the
    ``window`` rows before each (refreshed every _REFRESH rows): the
    distance from the window's straight-line trend, extended to the row, in
    units of 1.4826 x the median absolute residual (NaN where a row or its
    baseline is missing). The trend keeps a slowly drifting statistic from
    reading as a move. The scale is at least _REL_FLOOR x the window's
    |mean| of ``unit`` (default ``x``; the mean's: the tensor's rms, so a
    weight's mean wandering by a thousandth of its spread is no move)."""
    h = x.shape[0] - window
    starts = np.arange(0, h, _REFRESH)
    win = np.lib.stride_tricks.sliding_window_view(x[:-1], window, axis=0)[starts]  # [blocks, M, window]
    pos = np.arange(window, dtype=np.float64) - (window - 1) / 2
    with np.errstate(invalid="ignore", divide="ignore"), _quiet():
        ok = ~np.isnan(win)
        n = ok.sum(axis=2)
        mean = np.nansum(win, axis=2) / n
        dev = np.where(ok, win - mean[..., None], 0.0)
        p = np.where(ok, pos, 0.0)
        slope = np.nan_to_num(np.einsum("bmw,bmw->bm", p, dev) / np.einsum("bmw,bmw->bm", p, p))
        resid = win - (mean[..., None] + slope[..., None] * pos)
        median = np.nanmedian if not ok.all() else np.median  # np.median: several times faster
        mad = median(np.abs(resid), axis=2)
    k = np.arange(h)
    blk = k // _REFRESH
    ahead = window + (k - starts[blk]) - (window - 1) / 2  # the row's place past the window's centre
    pred = mean[blk] + slope[blk] * ahead[:, None]
    if unit is None:
        ref = np.abs(mean)
    else:
        uw = np.lib.stride_tricks.sliding_window_view(unit[:-1], window, axis=0)[starts]
        with _quiet():
            ref = np.abs(np.nanmean(uw, axis=2))
    scale = np.maximum(_MAD_TO_SIGMA * mad[blk], _REL_FLOOR * np.nan_to_num(ref[blk]))
    d = x[window:] - pred
    with np.errstate(divide="ignore", invalid="ignore"):
        zz = np.where(scale > 0, d / np.where(scale > 0, scale, 1.0), np.sign(d) * np.inf)
    return np.where(d == 0, 0.0, zz)


def _first_moves(zz: np.ndarray, thr: float) -> np.ndarray:
    """Per column, the first row where |z| > thr and z stays beyond thr / 2
    on that side for at least half the rows from there on, the last row
    included; -1 if none."""
    h, m = zz.shape
    out = np.full(m, -1, dtype=np.int64)
    big = np.nan_to_num(np.abs(zz), nan=0.0) > thr
    cand = np.flatnonzero(big.any(axis=0))
    for j in cand:
        col = np.nan_to_num(zz[:, j], nan=0.0)
        for k in np.flatnonzero(big[:, j]):
            side = np.sign(col[k])
            stay = (side * col[k:]) > thr / 2
            if stay[-1] and stay.mean() >= 0.5:
                out[j] = k
                break
    return out


def _order_index(history, step: int) -> dict:
    try:
        order = history.order(step)
    except (KeyError, ValueError, IndexError):
        order = []
    return {n: i for i, n in enumerate(order)}


@contextlib.contextmanager
def _quiet():
    """All-NaN slices are expected (metrics absent from a window)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
