"""The data model of recorded steps: one :class:`StepRecord` per recorded
step, built from raw ring rows, kept compactly encoded (``hookcap._host.pack``) in
a :class:`HostStore` bounded in steps or in bytes."""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from .. import _layout
from .._rows.config import parse_capacity
from .pack import PackedStep, pack

log = logging.getLogger("hookcap")


class StepRecord:
    """One recorded step: header columns of every metric written in it, and
    its histogram counts trimmed to the band of bins that are non-zero.

    ``metrics``: int64 [k] global metric indices; ``header``: int64 [k, HEADER];
    ``hist_lo`` / ``hist``: first stored bin and int64 [k, nb]; ``order``: int64
    metric indices in first-execution order; ``calls``: int64 metric index of
    every call in execution order; ``calls_nonfinite``: bool per call, whether
    it saw NaN/Inf; ``time_ns``: float64 [k, 2] (forward, backward) ns of the
    module owning each metric (``Monitor(timing=True)``, NaN where not
    measured), or None. A record built from a :class:`PackedStep` decodes
    header and histogram on first use."""

    __slots__ = ("step", "metrics", "order", "calls", "calls_nonfinite", "time_ns", "packed",
                 "_header", "_hist")

    def __init__(self, step, metrics, header, hist_lo, hist, order, calls, calls_nonfinite,
                 time_ns=None):
        self.step = step
        self.metrics = metrics
        self._header = header
        self._hist = (hist_lo, hist)
        self.order = order
        self.calls = calls
        self.calls_nonfinite = calls_nonfinite
        self.time_ns = time_ns
        self.packed: PackedStep | None = None

    @classmethod
    def from_packed(cls, p: PackedStep) -> StepRecord:
        rec = cls(p.step, p.metrics, None, 0, None, p.order, p.calls, p.calls_nonfinite(), p.time_ns())
        rec._hist = None
        rec.packed = p
        return rec

    @property
    def header(self) -> np.ndarray:
        if self._header is None:
            self._header = self.packed.header()
        return self._header

    def header_now(self) -> np.ndarray:
        """``header``, decoded afresh and not kept when the record is packed
        (a History reading every step keeps no step's rows)."""
        return self._header if self._header is not None else self.packed.header()

    def header_column(self, c: int) -> np.ndarray:
        """int64 [k]: header column ``c`` (decoding that column alone when packed)."""
        return self._header[:, c] if self._header is not None else self.packed.column(c)

    def metric_band(self, j: int) -> tuple[int, np.ndarray]:
        """(first bin, int64 counts) of the ``j``-th metric's histogram band."""
        if self._hist is None and self.packed is not None:
            return self.packed.metric_band(j)
        lo, band = self._band()
        return lo, band[j]

    def _band(self):
        if self._hist is None:
            self._hist = self.packed.histogram(self.header)
        return self._hist

    @property
    def hist_lo(self) -> int:
        return self._band()[0]

    @property
    def hist(self) -> np.ndarray:
        return self._band()[1]

    def any_nonfinite(self) -> bool:
        """Whether any metric or call of the step saw NaN/Inf."""
        if self.packed is not None:
            return self.packed.any_nonfinite()
        return bool(self.calls_nonfinite.any() or self.header[
            :, [_layout.NAN, _layout.POSINF, _layout.NEGINF]].any())


def make_record(step: int, metrics: np.ndarray, rows: np.ndarray, order, calls=None,
                calls_nonfinite=None, time_ns=None, zero_bin: bool = False,
                hist_args=None) -> StepRecord:
    """Build a record from raw ring rows [k, width] (rows never written this
    step, calls == 0, are left out; ``rows`` may be a view of a ring: the
    record keeps an encoded copy). ``zero_bin``: histogram bin 0 counts zeros
    (log2). ``time_ns``: aligned with ``metrics``. ``hist_args``: the rows
    are as the kernels wrote them with this histogram (see ``pack``)."""
    written = rows[:, _layout.CALLS] > 0
    if not written.all():
        metrics, rows = metrics[written], rows[written]
        time_ns = None if time_ns is None else time_ns[written]
    order = np.asarray(order, dtype=np.int64)
    calls = order if calls is None else np.asarray(calls, dtype=np.int64)
    if calls_nonfinite is None:
        calls_nonfinite = np.zeros(len(calls), dtype=bool)
    return StepRecord.from_packed(pack(step, metrics, rows, order, calls, calls_nonfinite, time_ns, zero_bin,
                                         hist_args))


class HostStore:
    """The newest recorded steps, encoded, within ``capacity`` (a step count
    or a byte size, see :func:`parse_capacity`); the oldest go first and are
    counted in ``evicted``. The newest step is always kept. ``nbytes``: the
    encoded bytes held (per step: its blob, plus its metric/order/call index
    arrays where they differ from the step before's, which it shares)."""

    _OVERHEAD = 200  # Python objects of one stored step, bytes (approximate)

    def __init__(self, capacity):
        self.max_steps, self.max_bytes = parse_capacity(capacity)
        self.steps: deque[PackedStep] = deque()
        self._cost: deque[int] = deque()
        self.nbytes = 0
        self.evicted = 0
        self._warned = False

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, rec: StepRecord) -> None:
        p = pack_record(rec)
        cost = p.nbytes + self._OVERHEAD
        prev = self.steps[-1] if self.steps else None
        for attr in ("metrics", "order", "calls"):
            a = getattr(p, attr)
            b = getattr(prev, attr) if prev is not None else None
            if b is not None and (a is b or np.array_equal(a, b)):
                setattr(p, attr, b)  # shared with the step before: stored once
            else:
                cost += a.nbytes
        self.steps.append(p)
        self._cost.append(cost)
        self.nbytes += cost
        while len(self.steps) > 1 and (
                (self.max_steps is not None and len(self.steps) > self.max_steps)
                or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            self._evict()

    def _evict(self) -> None:
        old = self.steps.popleft()
        cost = self._cost.popleft()
        nxt = self.steps[0]
        for attr in ("metrics", "order", "calls"):
            a = getattr(old, attr)
            if getattr(nxt, attr) is a:  # the next step now carries the shared array
                self._cost[0] += a.nbytes
                self.nbytes += a.nbytes
        self.nbytes -= cost
        self.evicted += 1
        if not self._warned:
            self._warned = True
            log.info("hookcap: the host history reached its capacity; the oldest recorded steps are "
                     "dropped from it (Monitor.evicted_steps counts them)")

    def records(self) -> list[StepRecord]:
        return [StepRecord.from_packed(p) for p in self.steps]


def pack_record(rec: StepRecord) -> PackedStep:
    """The record's encoding (made once, then kept in ``rec.packed``)."""
    if rec.packed is None:
        lo, h = rec.hist_lo, rec.hist
        rows = np.zeros((len(rec.metrics), _layout.HEADER + lo + h.shape[1]), dtype=np.int64)
        rows[:, :_layout.HEADER] = rec.header
        rows[:, _layout.HEADER + lo:] = h  # bins keep their positions
        rec.packed = pack(rec.step, rec.metrics, rows, rec.order, rec.calls, rec.calls_nonfinite,
                          rec.time_ns, False)
    return rec.packed
