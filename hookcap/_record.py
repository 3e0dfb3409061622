"""The data model of recorded steps: one :class:`StepRecord` per recorded
step, built from raw ring rows, kept in a bounded :class:`HostStore`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from . import _layout


@dataclass
class StepRecord:
    """One recorded step: header columns of every metric written in it, and
    its histogram counts trimmed to the band of bins that are non-zero."""

    step: int
    metrics: np.ndarray  # int64 [k] global metric indices
    header: np.ndarray  # int64 [k, HEADER]
    hist_lo: int  # first stored bin
    hist: np.ndarray  # int64 [k, nb]
    order: np.ndarray  # int64 [k'] metric indices in first-execution order this step
    calls: np.ndarray  # int64 [c] metric index of every call, in execution order
    calls_nonfinite: np.ndarray  # bool [c] whether that call saw NaN/Inf
    # float64 [k, 2] (forward, backward) ns of the module owning each metric
    # (Monitor(timing=True)); NaN where not measured. None: recorded without timing.
    time_ns: np.ndarray | None = None


def make_record(step: int, metrics: np.ndarray, rows: np.ndarray, order, calls=None,
                calls_nonfinite=None) -> StepRecord:
    """Build a record from raw ring rows [k, width] (rows never written this
    step, calls == 0, are left out)."""
    written = rows[:, _layout.CALLS] > 0
    metrics, rows = metrics[written], rows[written]
    hist = rows[:, _layout.HEADER:]
    nz = np.flatnonzero(hist.any(axis=0)) if hist.size else np.empty(0, dtype=np.int64)
    lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
    order = np.asarray(order, dtype=np.int64)
    calls = order if calls is None else np.asarray(calls, dtype=np.int64)
    if calls_nonfinite is None:
        calls_nonfinite = np.zeros(len(calls), dtype=bool)
    return StepRecord(step, metrics, rows[:, : _layout.HEADER].copy(), lo, hist[:, lo:hi].copy(),
                      order, calls, np.asarray(calls_nonfinite, dtype=bool))


class HostStore:
    """Bounded store of the newest ``capacity`` recorded steps."""

    def __init__(self, capacity: int):
        self.records: deque[StepRecord] = deque(maxlen=capacity)

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)
