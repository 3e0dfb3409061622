"""Moving finished steps from the device rings to the host: hand a step's slot
over at ``step()``, advance the rings, collect the copies that have landed,
and turn each complete step's rows into a :class:`StepRecord`. Steps the
host cannot keep up with are dropped, counted and warned about once. The
drain returns records; what consumes them is not its concern."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .. import _layout
from .._rows.catalog import Catalog
from .._rows.config import SLOTS, Config
from .._rows.fastpath import ring_index_of, row_of
from .record import StepRecord, make_record
from .._rows.ring import next_host_state
from .._capture.timing import time_of

log = logging.getLogger("hookcap")

# A step's rows are merged by key: a metric row's key is its metric index, a
# timing row's _TIMER_KEY + its module's timing index (never a metric index),
# so a module's timing rows on several devices merge like a metric's rows.
_TIMER_KEY = 1 << 40


@dataclass
class _StepPlan:
    keys: np.ndarray  # merge key of each row of the step's concatenated rows
    call_rows: np.ndarray  # row of every call, in execution order
    calls: np.ndarray  # metric of every call, in execution order
    order: np.ndarray  # metrics in first-execution order
    groups: _layout.GroupPlan
    # Grouped metrics (Monitor(groups=...)): which rows also count for their whole
    # metric, the whole metric's key of each, and whether it is group 0 (which
    # alone brings the call count).
    wholes: tuple | None = None


class Drain:
    """``dropped``: recorded steps the host could not keep (never recorded in
    the history). A step is complete once every ring that held it has
    delivered its rows."""

    def __init__(self, config: Config, catalog: Catalog):
        self.config = config
        self.catalog = catalog
        self.dropped = 0
        self._warned_drop = False
        self._expect: dict[int, set[int]] = {}  # step -> ring indices still to deliver
        self._partial: dict[int, list] = {}  # step -> [order, (ring index, keys, rows)...]
        self._plans: dict[tuple, _StepPlan] = {}
        self._keys: dict[int, tuple] = {}  # ring index -> (rows_version, ring, merge keys)
        self._empty: list[StepRecord] = []  # steps closed before any ring existed
        self._kind_everys = {config.every_of(k) for k in config.kinds_in_use()}  # rings of timing rows aside

    def finish(self, rings, step: int, order: np.ndarray, module_kinds_on: bool = True) -> None:
        """Hand over the slot of ``step`` (just closed) on every ring whose
        cadence records it (a ring of timing rows alone: only when a module
        kind recorded, ``module_kinds_on``). With no ring yet (no hooked
        module has run) the step is recorded empty; with rings but none of
        them on, nothing."""
        if not rings:
            self._empty.append(make_record(step, np.empty(0, np.int64), np.empty((0, self.config.width), np.int64),
                                           order))
            return
        on = [ring for ring in rings if ring.on and (module_kinds_on or ring.every in self._kind_everys)]
        if not on:
            return
        if len(on) < len(rings) and len(order):  # writes of kinds off this step were dropped on the device
            order = order[np.isin(ring_index_of(order), [ring.index for ring in on])]
        expect = set()
        for ring in on:
            if ring.finish(step):
                expect.add(ring.index)
            else:
                self._drop(step)
                return
        self._expect[step] = expect
        self._partial[step] = [order]

    def advance(self, rings, step: int) -> int:
        """Move every ring to the next step (each by its own cadence); returns that step."""
        moves = []
        for ring in rings:
            _, on, slot = next_host_state(step, ring.slot, ring.every, SLOTS)
            if on and not ring.is_cuda:
                dropped = ring.drop_unread(slot)
                if dropped is not None:
                    self._drop(dropped)
            moves.append((ring, on, slot))
        for ring, on, slot in moves:
            ring.advance(on, slot)
        return step + 1

    def watermark(self, current_step: int) -> int:
        """Every recorded step up to this one is complete here (or dropped)."""
        return min(self._partial) - 1 if self._partial else current_step

    def collect(self, rings, wait: bool) -> list[StepRecord]:
        """The steps completed since the last call, oldest first. ``wait``:
        wait for copies in flight (the explicit read)."""
        done, read = [], []
        for ring in rings:
            for step, rows, slot_rows in ring.ready(wait=wait):
                parts = self._partial.get(step)
                if parts is None:
                    continue  # dropped
                n = rows.shape[0]
                keys = self._ring_keys(ring)[:n]
                self._expect[step].discard(ring.index)
                complete = not self._expect[step]
                if slot_rows is not None:
                    if not complete:
                        # Waits for another device: keep a copy, the slot is reused.
                        rows = rows.copy()
                    read.append((ring, step, slot_rows))
                parts.append((ring.index, keys, rows))
                if complete:
                    done.append(self._complete(step))
        for ring, step, slot_rows in read:  # CPU slots read: reset while in cache
            ring.reset_read(slot_rows, self.config.hist_args, step + SLOTS * ring.every)
        done += self._empty
        self._empty.clear()
        done.sort(key=lambda r: r.step)
        return done

    def _ring_keys(self, ring) -> np.ndarray:
        """The merge key of each of the ring's rows (cached while its rows stay as they are)."""
        cached = self._keys.get(ring.index)
        if cached is not None and cached[0] == ring.rows_version and cached[1] is ring:
            return cached[2]
        keys = np.asarray(ring.metric_of_row, dtype=np.int64)
        for row, timer in ring.timer_of_row.items():
            keys[row] = _TIMER_KEY + timer
        keys.flags.writeable = False
        self._keys[ring.index] = (ring.rows_version, ring, keys)
        return keys

    def _drop(self, step: int) -> None:
        self.dropped += 1
        self._expect.pop(step, None)
        self._partial.pop(step, None)
        if not self._warned_drop:
            self._warned_drop = True
            log.warning("hookcap: the host fell behind; step %d was dropped (counted in "
                        "Monitor.dropped_steps; logged once)", step)

    def _step_plan(self, order, chunks, keys) -> _StepPlan:
        """Execution order, per-call metric and row, and the merge plan of a
        step's rows: the same every step of a steady training loop, so cached
        by the step's call pattern."""
        order = np.asarray(order, dtype=np.int64)
        key = (order.tobytes(), tuple((ri, len(k)) for ri, k, _ in chunks))
        plan = self._plans.get(key)
        if plan is not None and np.array_equal(plan.keys, keys):
            return plan
        offset, pos = {}, 0
        for ri, k, _ in chunks:
            offset[ri] = pos
            pos += len(k)
        ring_offset = np.zeros(max(offset, default=0) + 1, dtype=np.int64)
        for ri, o in offset.items():
            ring_offset[ri] = o
        call_rows = ring_offset[ring_index_of(order)] + row_of(order)
        calls = keys[call_rows] if len(call_rows) else np.empty(0, np.int64)
        _, first = np.unique(calls, return_index=True)
        order = calls[np.sort(first)]
        wholes, merge_keys = None, keys
        index = self.catalog.group_index()
        if index is not None:
            whole, group = index
            in_range = (keys >= 0) & (keys < len(whole))
            w = np.where(in_range, whole[np.where(in_range, keys, 0)], -1)
            rows_of = np.flatnonzero(w >= 0)
            if len(rows_of):
                wholes = (rows_of, w[rows_of], group[keys[rows_of]] == 0)
                merge_keys = np.concatenate([keys, w[rows_of]])
                # Each whole metric just before its first group in the order.
                ow = np.where((order >= 0) & (order < len(whole)), whole[np.clip(order, 0, len(whole) - 1)], -1)
                both = np.stack([ow, order], axis=1).ravel()
                both = both[both >= 0]
                _, f = np.unique(both, return_index=True)
                order = both[np.sort(f)]
        plan = _StepPlan(keys.copy(), call_rows, calls, order, _layout.GroupPlan(merge_keys), wholes)
        if len(self._plans) >= 8:  # patterns keep changing: keep only the newest
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _complete(self, step: int) -> StepRecord:
        order, *chunks = self._partial.pop(step)
        del self._expect[step]
        if len(chunks) == 1:  # one ring: its rows as they are (a view, no copy)
            keys, rows = chunks[0][1], chunks[0][2]
        else:
            keys = np.concatenate([k for _, k, _ in chunks]) if chunks else np.empty(0, np.int64)
            rows = (np.concatenate([r for _, _, r in chunks]) if chunks
                    else np.empty((0, self.config.width), np.int64))
        plan = self._step_plan(order, chunks, keys)
        # Which calls saw NaN/Inf (one entry per call-row, in execution order).
        calls_bad = ((rows[:, _layout.NAN] | rows[:, _layout.POSINF] | rows[:, _layout.NEGINF]) != 0)[plan.call_rows]
        if plan.wholes is not None:  # a grouped metric's rows count for it too
            at, whole_keys, first = plan.wholes
            extra = rows[at].copy()
            extra[~first, _layout.CALLS] = 0
            keys, rows = np.concatenate([keys, whole_keys]), np.concatenate([rows, extra])
        if not plan.groups.trivial:  # several calls or devices per metric
            keys, rows = _layout.merge_groups(rows, keys, plan.groups)
        timed = keys >= _TIMER_KEY
        timers = time_rows = None
        if timed.any():  # timing rows (timing=True) are not metrics
            timers, time_rows = keys[timed] - _TIMER_KEY, rows[timed]
            keys, rows = keys[~timed], rows[~timed]
        # make_record leaves out rows never written this step (time_ns with them).
        time_ns = time_of(self.catalog, keys, timers, time_rows) if self.config.timing else None
        hist = self.config.histogram
        return make_record(step, keys, rows, plan.order, plan.calls, calls_bad, time_ns,
                           zero_bin=hist is not None and hist.zero_bin == 0,
                           hist_args=None if hist is None else self.config.hist_args)
