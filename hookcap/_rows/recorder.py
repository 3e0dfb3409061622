"""The rows a Monitor's hooks write: one device ring per device, one row per
(metric, device, call) of a step, registered on first use; the writes
themselves; the step state the rings share; and each step's execution order.

Every row has one identity, its row id (hookcap/_rows/fastpath.py), used by the
Python hooks, the C++ fast path and the execution-order log alike.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import weakref

import numpy as np
import torch
from torch import nn

from .._capture import compile as _compile
from .catalog import Catalog
from .config import EVAL_PREFIX, MODULE_KINDS, SLOTS, Config, metric_name
from .fastpath import NO_ROW, SKIPPED, FastPath, ring_index_of, row_id, row_of
from .grouped import GroupedRows
from .ring import UNNAMED, DeviceRing, capturing
from .tensors import (PARTIAL_SKIP, is_dtensor, mesh_layout, multi_rank, placement_of,  # noqa: F401 (re-exported)
                      plain_tensor, skip_reason)

log = logging.getLogger("hookcap")

CAPTURE_SKIP = ("first seen while a CUDA graph was being captured: its row cannot be created inside the "
                "capture (run the model eagerly once before capturing; the graph's replays do not record "
                "this call)")
_OP_ACCUMULATE = torch.ops.hookcap.accumulate.default
_OP_MANY = torch.ops.hookcap.accumulate_many.default
_RESET_ROWS = torch.ops.hookcap.reset_rows.default
_OP_UPDATE = torch.ops.hookcap.accumulate_update.default
_OP_UPDATES = torch.ops.hookcap.accumulate_updates.default
# The Recorders that record now (attached, not paused, a recorded step), by
# id, as weak references: where hookcap.tap writes; empty, a tap returns at once.
RECORDING: dict[int, weakref.ref] = {}


def _runs(rows: list[int]):
    """(begin, end) of each run of consecutive ints in sorted ``rows``."""
    start = prev = None
    for r in rows:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            yield start, prev + 1
            start = prev = r
    if start is not None:
        yield start, prev + 1


class Recorder:
    """Rows, writes and step state.

    ``step``/``enabled`` mirror the rings' device state (the step being
    recorded, whether some kind records it; each ring holds its own slot and
    cadence); ``recording`` is ``enabled`` while the Monitor is attached and
    not ``paused``: the hooks write only then, and ``records(kind)`` says
    which kinds (``Monitor(every={...})``).
    ``rows`` maps ``(name, kind, path, device, call)`` to a row id. A value
    that cannot be recorded (a nested tensor, a failing op) skips that call
    only, with one warning per metric and reason."""

    def __init__(self, config: Config, catalog: Catalog, start_step: int = 0):
        self.config = config
        self.catalog = catalog
        self.fast = FastPath(config.hist_args)
        self.rings: dict[tuple[torch.device, int], DeviceRing] = {}  # (device, cadence) -> ring
        self.ring_list: list[DeviceRing] = []  # by ring index
        self.rows: dict[tuple, int] = {}
        self.step = start_step
        self.enabled = config.records_step(start_step)
        self.attached = False
        self.paused = False
        self.recording = False
        self.module_recording = False  # recording, and some kind module hooks write is on
        self._module_kinds = [k for k in MODULE_KINDS if k in config.kinds_in_use()]
        # Row ids written through the Python op wrapper this step, in first-
        # write order; every other write is logged by the C++ sink.
        self._order: dict[int, None] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._replaced: set[int] = set()  # param_grad rows written this step
        self.skipped: set[int] = set()  # rows whose C++ gradient hook could not be registered
        self._unnamed: dict[int, tuple[str, dict]] = {}  # rows awaiting their first write
        self._time_rows: dict[tuple[str, torch.device], int] = {}
        self._hook_ids: dict[str, int] = {}
        self._warned: set = set()
        self._lock = threading.Lock()
        # module name -> the layout its parallel plan gives its plain outputs (or None); set by Hooks.
        self.plan_layout = lambda name: None
        # Whether the Monitor's model is in eval mode (taps then go to eval/...); set by Hooks.
        self.in_eval = lambda: False
        self.grouped = GroupedRows(self)

    # -- state ------------------------------------------------------------------
    def set_attached(self, attached: bool) -> None:
        self.attached = attached
        self.fast.set_active(attached and not self.paused)
        self._sync(new_step=False)

    def set_paused(self, paused: bool) -> None:
        """Record nothing while paused: hooks, C++ gradient hooks and the
        kernels of compiled code (through the device flag) all stay quiet."""
        self.paused = paused
        self.fast.set_active(self.attached and not paused)
        for ring in self.ring_list:
            ring.set_enabled(ring.on and not paused)
        self._sync(new_step=False)

    def new_step(self, step: int) -> None:
        """Open ``step`` (the rings have advanced to it)."""
        self.step, self.enabled = step, self.config.records_step(step)
        self._forget_step()
        if self.paused and self.enabled:  # the device's advance enabled it
            for ring in self.ring_list:
                if ring.on:
                    ring.set_enabled(False)
        self._sync(new_step=True)

    def jump_to(self, step: int) -> None:
        """Number the open step ``step`` (a resumed run); its writes so far are dropped."""
        self.step, self.enabled = step, self.config.records_step(step)
        for ring in self.ring_list:
            ring.set_state(step, step % ring.every == 0 and not self.paused, ring.slot)
        self._forget_step()
        self.fast.take()
        self._sync(new_step=True)

    def _forget_step(self) -> None:
        """The per-step log of the step just closed: write order, call counts, replaced rows."""
        self._order = {}
        self._calls = {}
        self._replaced.clear()

    def _sync(self, new_step: bool) -> None:
        self.recording = self.enabled and self.attached and not self.paused
        self.module_recording = self.recording and any(map(self.records, self._module_kinds))
        if not self.recording:
            RECORDING.pop(id(self), None)
        elif id(self) not in RECORDING:
            RECORDING[id(self)] = weakref.ref(self, lambda _, k=id(self): RECORDING.pop(k, None))
        # The compiled-autograd config matters only to a recording step; an
        # off-step skips reading it (~5 us warm, tens of us with cold caches).
        self.fast.set_recording(self.module_recording, _compile.PYTHON_GRAD_HOOKS or (
            self.recording and _compile.refresh_compiled_autograd_config()), new_step)

    def records(self, kind: str) -> bool:
        """Whether rows of ``kind`` (a capture kind, ``"tap"`` or ``"timing"``)
        are recorded now: ``recording``, and the kind's cadence holds the step
        (timing: a module kind is recorded)."""
        if kind == "timing":
            return self.module_recording
        return self.recording and self.step % self.config.every_of(kind) == 0

    def warn_once(self, what, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    # -- rows -------------------------------------------------------------------
    def capturing(self) -> bool:
        """Whether a CUDA graph capture is under way on the current stream of a
        ring's device (of the current CUDA device while there is no ring yet)."""
        devices = {r.device for r in self.ring_list if r.is_cuda}
        if not devices and torch.cuda.is_initialized():
            devices = {torch.device("cuda", torch.cuda.current_device())}
        return any(capturing(d) for d in devices)

    def ring_of(self, rid: int) -> DeviceRing:
        return self.ring_list[ring_index_of(rid)]

    def hook_id(self, name: str) -> int:
        """The C++ fast path's id of ``name``'s output hook."""
        return self._hook_ids.setdefault(name, len(self._hook_ids))

    def call_index(self, name: str, kind: str) -> int:
        # Each call of a module in a step writes its own row (merged by name
        # on the host), so a NaN from the 2nd call of a reused module is
        # placed at that call's position in the execution order.
        ci = self._calls.get((name, kind), 0)
        self._calls[(name, kind)] = ci + 1
        return ci

    def register(self, key: tuple, t: torch.Tensor, mtype: str, defer_name: bool = False,
                 layout: dict | None = None) -> int:
        """The row id of ``key`` = (name, kind, path, device, call) for tensor
        ``t``, or SKIPPED (warned once) if ``t`` cannot be recorded."""
        reason = skip_reason(t)
        if reason is not None:
            self.skip_call(metric_name(*key[:3]), reason)
            return SKIPPED
        return self.register_row(key, t.device, tuple(t.shape), str(t.dtype), mtype, defer_name, layout)

    def layout_of(self, name: str, kind: str, path: str, t, placement: str | None = None) -> dict:
        """The layout of a new row for ``t`` (``placement_of``): a DTensor's
        own placements, else ``plain_layout``."""
        return placement_of(kind, t) if is_dtensor(t) else self.plain_layout(name, kind, path, placement)

    def new_row_layout(self, name: str, kind: str, path: str, t, placement: str | None = None) -> dict | None:
        """``layout_of`` for a row about to be made, or None (warned once)
        where ``t`` is a DTensor with a ``Partial`` placement: not recorded."""
        layout = self.layout_of(name, kind, path, t, placement)
        if layout["placement"] == "partial":
            self.skip_call(metric_name(name, kind, path), PARTIAL_SKIP.format(**layout))
            return None
        return layout

    def plain_layout(self, name: str, kind: str, path: str, placement: str | None = None) -> dict:
        """The layout of a new row of a plain tensor: ``placement`` (a
        tap's), else the first glob of ``Monitor(placements=...)`` matching
        the metric, a tensor-parallel module's plan (its outputs and their
        gradients), else ``placement_of``'s default."""
        if placement is None:
            metric = metric_name(name, kind, path)
            placement = next((p for g, p in self.config.placements if fnmatch.fnmatchcase(metric, g)), None)
        if placement is not None:
            return {"placement": placement}
        if kind in ("output", "grad_output") and multi_rank():
            plan = self.plan_layout(name)
            if plan is not None:
                return mesh_layout(*plan)
        return placement_of(kind, None)

    def tap_name(self, name: str) -> str | None:
        """The metric a tap called ``name`` writes now: ``name``, or while the
        model is in eval mode as ``eval_forwards`` says (``eval/{name}``, or
        None: not recorded)."""
        if not self.in_eval():
            return name
        mode = self.config.eval_forwards
        return name if mode == "merge" else EVAL_PREFIX + name if mode == "separate" else None

    def skip_call(self, metric: str, reason: str) -> None:
        """One call of ``metric`` is not recorded: warned once per metric and
        reason (its first line: dispatcher errors run to dozens)."""
        reason = reason.strip().splitlines()[0] if reason.strip() else reason
        self.warn_once(("skip", metric, reason),
                       f"hookcap: {metric}: a call was not recorded: {reason} (warned once per metric "
                       "and reason; other calls are recorded)")

    def register_row(self, key, device, shape, dtype, mtype, defer_name=False, layout: dict | None = None,
                     metric: str | None = None, extra: dict | None = None) -> int:
        """The row id of a metric's call, created on first use.
        ``defer_name``: a row whose first write happens in C++ (a gradient)
        gets its metric name when that write is seen (``take_order``), so
        metrics never written stay out of ``names``, and names keep their
        first-execution order. ``layout``: the metric's placement
        (``placement_of``; default per_rank). ``metric``: the row's metric
        where it is not ``key``'s (a group's); ``extra``: more of its meta."""
        name, kind, path = key[:3]
        metric = metric_name(name, kind, path) if metric is None else metric
        if capturing(device):
            self.skip_call(metric, CAPTURE_SKIP)
            return SKIPPED
        meta = {"module_type": mtype, "kind": kind, "shape": shape, "dtype": dtype,
                **(layout or {"placement": "per_rank"}), **(extra or {})}
        with self._lock:
            if key in self.rows:
                return self.rows[key]
            idx = self.catalog.index(metric)
            if idx is None:
                idx = UNNAMED if defer_name else self.catalog.add(metric, meta)
            self.catalog.module_of[metric] = name
            rid = self._add_row(device, idx, every=self.config.every_of(kind))
            if idx == UNNAMED:
                self._unnamed[rid] = (metric, meta)
            self.rows[key] = rid
            return rid

    def time_row(self, name: str, device: torch.device) -> int:
        """The row id of module ``name``'s timing row on ``device``."""
        rid = self._time_rows.get((name, device))
        if rid is None:
            if capturing(device):
                self.skip_call(f"{name} timing", CAPTURE_SKIP)
                return SKIPPED
            with self._lock:
                rid = self._add_row(device, None, self.catalog.timing_index(name), self.config.every_of("timing"))
                self._time_rows[(name, device)] = rid
        return rid

    def _add_row(self, device: torch.device, metric: int | None, timer: int | None = None, every: int = 1) -> int:
        """A new row of the ring of ``device`` and cadence ``every`` (created
        on first use). Caller holds the lock."""
        ring = self.rings.get((device, every))
        if ring is None:
            ring = DeviceRing(device, SLOTS, self.config.width, index=len(self.ring_list), every=every)
            ring.set_state(self.step, self.step % every == 0 and not self.paused, 0)  # it starts mid-run
            self.rings[(device, every)] = ring
            self.ring_list.append(ring)
            self.fast.set_ring(ring.index, ring.ring, ring.state)
        buf = ring.ring
        row = ring.add_row(metric, timer)
        if ring.ring is not buf:  # grown: C++ hooks read the new buffer
            self.fast.set_ring(ring.index, ring.ring, ring.state)
        return row_id(ring.index, row)

    # -- writes (hot path) --------------------------------------------------------
    def write(self, name, kind, path, t, mtype, ci, replace=False, via_op=False, placement=None,
              groups=None) -> None:
        """Merge ``t`` into its row. ``replace``: the row keeps only the last
        write of the step (``param_grad``). ``via_op``: through the dispatcher
        op, traceable by compiled autograd (gradient hooks), logged here;
        else through the C++ sink, which logs it. ``placement``: declared
        by the caller (``tap(placement=...)``), used when the row is made.
        ``groups``: a ``hookcap.Groups`` the write is split by (else a
        ``Monitor(groups=...)`` glob's, if one matches)."""
        orig = t
        if type(t) is not torch.Tensor:
            t = plain_tensor(t)
        key = (name, kind, path, t.device, ci)
        if (groups is not None or self.grouped.specs) and type(orig) is torch.Tensor and \
                self.grouped.write(key, t, mtype, groups):
            return
        rid = self.rows.get(key)
        if rid is None and (rid := self.make_row(key, orig, t, mtype, placement)) is None:
            return
        if replace:
            if rid in self._replaced:
                ring, row = self.ring_of(rid), row_of(rid)
                _RESET_ROWS(ring.ring, ring.state, row, row + 1)
            else:
                self._replaced.add(rid)
        try:
            if via_op:
                ring = self.ring_of(rid)
                _OP_ACCUMULATE(t, ring.ring, ring.state, row_of(rid), *self.config.hist_args)
            else:
                self.fast.accumulate_row(t, rid)
        except Exception as e:  # telemetry must never take the run down
            self.skip_call(metric_name(*key[:3]), skip_reason(t) or f"{type(e).__name__}: {e}")
            return
        if via_op:
            self.note_order((rid,))

    def make_row(self, key, orig, t, mtype, placement=None) -> int | None:
        """The row of a write's ``key`` made for plain tensor ``t`` (``orig``:
        as given, whose placement the row keeps), or None (skipped, warned once)."""
        layout = self.new_row_layout(*key[:3], orig, placement)
        if layout is None:
            return None
        try:
            rid = self.register(key, t, mtype, layout=layout)
        except Exception as e:  # telemetry must never take the run down
            self.skip_call(metric_name(*key[:3]), f"{type(e).__name__}: {e}")
            return None
        return None if rid == SKIPPED else rid

    def write_rows(self, kind: str, items, mtype: str, replace: bool = False) -> None:
        """``write`` of ``(name, tensor)`` items of one kind, each its metric's
        only call of the step (call 0), in one ``accumulate_many`` call per
        ring (a GPU launches tensors alike 32 at a time). Items of grouped
        metrics go through ``write``; where the call fails, each tensor alone
        (so one bad tensor skips only its own metric)."""
        per_ring: dict[int, tuple[list, list, list]] = {}
        for name, orig in items:
            t = orig if type(orig) is torch.Tensor else plain_tensor(orig)
            if self.grouped.specs and self.grouped.matches(metric_name(name, kind, "")):
                self.write(name, kind, "", orig, mtype, 0, replace=replace)
                continue
            key = (name, kind, "", t.device, 0)
            rid = self.rows.get(key)
            if rid is None and (rid := self.make_row(key, orig, t, mtype)) is None:
                continue
            xs, rows, rids = per_ring.setdefault(ring_index_of(rid), ([], [], []))
            xs.append(t)
            rows.append(row_of(rid))
            rids.append(rid)
        for ring_i, (xs, rows, rids) in per_ring.items():
            ring = self.ring_list[ring_i]
            if replace:
                again = [r for rid, r in zip(rids, rows) if rid in self._replaced]
                self._replaced.update(rids)
                for begin, end in _runs(sorted(again)):  # rows written earlier this step start over
                    _RESET_ROWS(ring.ring, ring.state, begin, end)
            try:
                _OP_MANY(xs, ring.ring, ring.state, rows, *self.config.hist_args)
            except Exception:
                for x, r, rid in zip(xs, rows, rids):
                    try:
                        _OP_ACCUMULATE(x, ring.ring, ring.state, r, *self.config.hist_args)
                    except Exception as e:  # telemetry must never take the run down
                        metric = self._unnamed.get(rid, (None,))[0] or self.catalog.names[ring.metric_of_row[r]]
                        self.skip_call(metric, skip_reason(x) or f"{type(e).__name__}: {e}")
            self.note_order(rids)

    def note_order(self, rids) -> None:
        """Place rows written (or about to be) through Python at this point of the step's execution order."""
        for rid in rids:
            if rid not in self._order:
                self._order[rid] = None
                self.fast.note_python_write()

    def write_bins(self, name, kind, path, index, weight, bins: int, mtype, ci, placement=None) -> None:
        """Record integer ``index`` as ``bins`` groups (``accumulate_bins``):
        group ``b`` holds the values (``weight``'s, else 1.0) of the elements
        equal to ``b``. Tensor subclasses are read through their local part."""
        index, weight = (t if t is None or type(t) is torch.Tensor else plain_tensor(t) for t in (index, weight))
        self.grouped.write_bins((name, kind, path, index.device, ci), index, weight, bins, mtype, placement)

    def write_joint(self, name, kind, paths, ts, device, mtype, groups, op_on) -> bool:
        """Record the captures ``(name, kind, path)`` of ``paths`` (call 0;
        ``ts``: tensors of their shapes and dtypes), grouped by ``groups``, by
        one op call ``op_on(ring, rows)`` (``GroupedRows.write_joint``); False
        where the caller must write them one by one."""
        parts = [((name, kind, p, device, 0), t) for p, t in zip(paths, ts)]
        return self.grouped.write_joint(parts, mtype, groups, op_on)

    def write_updates(self, mtype, rule, hyper, items, gate: torch.Tensor | None = None) -> None:
        """The optimizer's step on each parameter of ``items`` = [(name, p,
        grad, a, b, step, outs)] (``hookcap._capture.optim``; one rule and one set of
        hyper-parameters): ``outs`` names, for each output of the
        ``accumulate_updates`` op (Δw, w before the step, Adam's ratio, the
        state tensors a and b), the ``(kind, path)`` of its row or None. One
        op call per ring; where it fails, each parameter alone (so one bad
        tensor skips only its own metrics). ``gate``: a device flag, nonzero
        where the calls must record nothing (DeviceRing.gated_state)."""
        per_ring: dict[int, list] = {}
        for name, p, grad, a, b, step, outs in items:
            orig = p
            if not (type(p) is nn.Parameter or type(p) is torch.Tensor):  # a DTensor's: its local shard
                p, grad, a, b = (t if t is None or type(t) is torch.Tensor else plain_tensor(t.detach())
                                 for t in (p, grad, a, b))
            rows, rids, ring = [], [], None
            for out in outs:
                if out is None:
                    rows.append(-1)
                    continue
                key = (name, out[0], out[1], p.device, 0)
                rid = self.rows.get(key)
                if rid is None:
                    try:  # a DTensor's placements, else Monitor(placements=...), as every other kind
                        layout = self.new_row_layout(*key[:3], orig)
                        rid = SKIPPED if layout is None else self.register(key, p.detach(), mtype, layout=layout)
                    except Exception as e:  # telemetry must never take the run down
                        self.skip_call(metric_name(*key[:3]), f"{type(e).__name__}: {e}")
                        rid = SKIPPED
                if rid == SKIPPED or (ring is not None and ring_index_of(rid) != ring):
                    rows.append(-1)  # one device, one ring: a second ring is never seen
                    continue
                ring = ring_index_of(rid)
                rows.append(row_of(rid))
                rids.append(rid)
            if rids:
                per_ring.setdefault(ring, []).append((name, p, grad, a, b, step, rows, rids, outs))
        for ring_i, batch in per_ring.items():
            ring = self.ring_list[ring_i]
            state = ring.state if gate is None else ring.gated_state(gate)
            cols = list(zip(*batch))
            try:
                _OP_UPDATES(list(cols[1]), list(cols[2]), list(cols[3]), list(cols[4]), list(cols[5]), hyper, rule,
                            ring.ring, state, [r for rows in cols[6] for r in rows], *self.config.hist_args)
            except Exception:
                for name, p, grad, a, b, step, rows, rids, outs in batch:
                    try:
                        _OP_UPDATE(p, grad, a, b, step, hyper, rule, ring.ring, state, rows,
                                   *self.config.hist_args)
                    except Exception as e:  # telemetry must never take the run down
                        for out in outs:
                            if out is not None:
                                self.skip_call(metric_name(name, *out), f"{type(e).__name__}: {e}")
                        rids.clear()
            for *_, rids, _outs in batch:
                self.note_order(rids)

    def capture_grad(self, name: str, path: str, t: torch.Tensor, mtype: str, ci: int) -> None:
        """Register ``t``'s gradient for its ``grad_output`` row through a C++
        tensor hook. The row is registered now, from the output's metadata
        (its gradient has the same shape, dtype and device); rows a backward
        never writes are left out of the step's record."""
        if self.grouped.specs and self.grouped.matches(metric_name(name, "grad_output", path)):
            t.register_hook(self.grouped.grad_hook(name, path, mtype, ci))
            return
        key = (name, "grad_output", path, t.device, ci)
        reason = skip_reason(t)
        if reason is not None:
            self.skip_call(metric_name(name, "grad_output", path), reason)
            return
        rid = self.rows.get(key)
        if rid is None:
            try:
                rid = self.register_row(key, t.device, tuple(t.shape), str(t.dtype), mtype, defer_name=True,
                                        layout=self.layout_of(name, "grad_output", path, t))
            except Exception as e:  # telemetry must never take the run down
                self.skip_call(metric_name(name, "grad_output", path), f"{type(e).__name__}: {e}")
                return
        if rid == SKIPPED or rid in self.skipped:
            return
        try:
            self.fast.capture_grad(t, rid)
        except Exception as e:  # telemetry must never take the run down
            self.skipped.add(rid)  # registering its hook fails: structural, not this value
            self.warn_once((name, "grad_output", path),
                           f"hookcap: {metric_name(name, 'grad_output', path)} is no longer recorded: "
                           f"{type(e).__name__}: {e}")

    def learn_fast_output(self, name: str, hid: int, ci: int, t: torch.Tensor, want_out: bool,
                          want_grad: bool) -> None:
        """A module call whose output is one plain tensor: once its rows exist,
        the C++ sink caches them and later calls take ``output_fast`` (the
        same work as ``write`` and ``capture_grad``, without Python: in a
        training step every Python line runs on cold caches)."""
        if not t.is_floating_point():
            return
        if self.grouped.specs and any(self.grouped.matches(metric_name(name, k, "")) for k in ("output", "grad_output")):
            return  # Channels: each recorded call computes more than the row
        dev = t.device
        out = self.rows.get((name, "output", "", dev, ci), SKIPPED) if want_out else None
        grad = self.rows.get((name, "grad_output", "", dev, ci), SKIPPED) if want_grad else None
        # Only once every wanted row exists (a gradient row appears at the
        # first call whose output requires grad).
        if out == SKIPPED or grad == SKIPPED:
            return
        self.fast.learn(hid, ci, t, NO_ROW if out is None else out, NO_ROW if grad is None else grad)

    # -- the step's execution order -------------------------------------------------
    def take_order(self) -> tuple[np.ndarray, list[tuple[str, str]]]:
        """Row ids (int64) in first-write order this step (the writes logged
        in C++ with Python's op-path writes placed where they happened),
        naming new gradient metrics in that order; and ``(module, message)``
        of each timing mark that failed."""
        rids, after, errors = self.fast.take()
        failed_timers = []
        for rid, timing, message in errors:
            if timing:
                failed_timers.append((self.catalog.timed[self.ring_of(rid).timer_of_row[row_of(rid)]], message))
                continue
            pending = self._unnamed.get(rid)
            metric = pending[0] if pending else self.catalog.names[self.ring_of(rid).metric_of_row[row_of(rid)]]
            self.skip_call(metric, message)
        order = np.fromiter(self._order, dtype=np.int64, count=len(self._order))
        if not len(rids):
            return order, failed_timers
        if after[0] == len(order):
            # The usual step: every C++ write came after the last Python write.
            merged = np.concatenate([order, rids]) if len(order) else rids
        else:
            py, out, seen, i = order.tolist(), [], set(), 0
            for rid, k in zip(rids.tolist(), after.tolist()):
                out.extend(py[i:k])
                i = max(i, k)
                if rid not in seen:
                    seen.add(rid)
                    out.append(rid)
            out.extend(py[i:])
            merged = np.array(out, dtype=np.int64)
        if self._unnamed:  # name new gradient metrics in execution order
            with self._lock:
                for rid in merged.tolist():
                    pending = self._unnamed.pop(rid, None)
                    if pending is not None:
                        self.ring_of(rid).name_row(row_of(rid), self.catalog.add(*pending))
        return merged, failed_timers

