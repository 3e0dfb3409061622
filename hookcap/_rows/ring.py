"""Per-device ring of stats rows and its drain to the host.

One ``DeviceRing`` per device where captured tensors live. The ring holds a
few step slots; each metric owns one row. ``finish`` hands the slot of the
step that just ended to the host (CPU: a memcpy; CUDA: an async copy to pinned
memory on a side stream, polled by event), ``advance`` moves to the next step
on the device. Nothing here reads device memory on the training thread.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .. import _C, _layout, _ops
from ..functional import new_state

# A step tag no step has: the CPU advance() leaves rows tagged with the step it
# opens as they are (the host reset them after reading), so rows whose content
# is unknown (new memory, a moved step counter) must carry no real step's tag.
_UNTAGGED = -(1 << 62)

log = logging.getLogger("hookcap")

# DeviceRing.metric_of_row entries that are not a metric index:
UNNAMED = -1  # a metric's row named at its first write (a gradient written in C++)
TIMING = -2  # a timing row (Monitor(timing=True)); timer_of_row says whose


def next_host_state(step: int, slot: int, every: int, slots: int) -> tuple[int, bool, int]:
    """Host mirror of the device's next_state (csrc/hookcap/state.h)."""
    step += 1
    enabled = step % every == 0
    return step, enabled, (slot + 1) % slots if enabled else slot


def copies_to_wait(pending, resets: bool, slot: int) -> list:
    """The in-flight copies advance() must wait for: those of the slot it resets."""
    return [p for p in pending if resets and p.slot == slot and p.event is not None]


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph
    (then nothing may sync, copy from pageable memory or query an event)."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


# Ring buffers (and their step state) a CUDA graph captured writes into,
# parked when their DeviceRing is released: a graph that is replayed later
# still writes there, so they are never freed, and their address is never
# reused by another buffer (the extension's captured-ring registry holds it).
_PARKED: list[torch.Tensor] = []


def park_captured(buffers, captured) -> int:
    """Keep, for the process, each of ``buffers`` that ``captured(data_ptr)``
    says a CUDA graph wrote into. Returns how many were parked."""
    kept = [b for b in buffers if captured(b.data_ptr())]
    _PARKED.extend(kept)
    return len(kept)


def fill_state(state: torch.Tensor, step: int, enabled: bool, slot: int) -> None:
    """Write (step, enabled, slot) into a device state by fills: stream-ordered,
    no copy from pageable host memory (which would synchronise, and is not
    allowed while a CUDA graph is being captured)."""
    for i, v in enumerate((step, int(enabled), slot)):
        state[i].fill_(v)


def grow_ring(ring: torch.Tensor, state: torch.Tensor, more: int, keep_old: bool) -> torch.Tensor:
    """A ring of ``more`` rows holding ``ring``'s rows.

    ``keep_old``: the old buffer stays in use (a captured CUDA graph writes
    into it) and is folded into every drained slot, so the new buffer starts
    with its rows reset, not copied: a copy would count the current slot's
    writes twice. Writes queued on other streams land before the copy, and the
    old buffer is not reused before the copy has read it."""
    slots, rows, width = ring.shape
    grown = torch.empty((slots, more, width), dtype=torch.int64, device=ring.device)
    if keep_old:
        grown[:, :, _layout.STEP_TAG] = _UNTAGGED
        _ops.reset_rows(grown, state, 0, more)
        return grown
    if ring.is_cuda:
        _C._join_write_streams(ring.device.index)  # hook ops queued on side streams
        ring.record_stream(torch.cuda.current_stream(ring.device))
    grown[:, :rows].copy_(ring)
    grown[:, rows:, _layout.STEP_TAG] = _UNTAGGED
    _ops.reset_rows(grown, state, rows, more)
    return grown


def fold_retired(rows: np.ndarray, retired: list) -> np.ndarray:
    """Rows [n, width] of a slot merged with the same slot's rows [k <= n,
    width] of each retired ring (row i is the same metric in all), as if every
    write had gone into one row."""
    if not retired:
        return rows
    stacked = np.concatenate([rows, *retired])
    groups = np.concatenate([np.arange(len(rows)), *[np.arange(len(r)) for r in retired]])
    return _layout.merge_groups(stacked, groups)[1]


@dataclass
class _Pending:
    step: int
    slot: int
    nrows: int
    host: np.ndarray | None  # CPU: filled at finish
    slot_rows: np.ndarray | None = None  # CPU: every row of the slot (a view), reset once read
    pinned: torch.Tensor | None = None  # CUDA: copy target
    event: torch.cuda.Event | None = None
    source: torch.Tensor | None = None  # keeps the ring alive until the copy is done
    retired: list | None = None  # CUDA: (pinned copy, rows) of each retired ring's slot


class DeviceRing:
    """``index``: the ring's position in its Monitor's ring list (the high
    part of its rows' ids, hookcap/_rows/fastpath.py)."""

    def __init__(self, device: torch.device, slots: int, width: int, index: int = 0, rows: int = 64,
                 every: int = 1):
        self.device = device
        self.index = index
        self.slots = slots
        # The ring's cadence (rows of kinds recorded every N-th step) and the
        # host's mirror of its device state: the open step's slot, and whether
        # that step is one of the ring's (its device flag may still be off: paused).
        self.every = every
        self.slot = 0
        self.on = False
        self.width = width
        self.is_cuda = device.type == "cuda"
        self.ring = torch.empty((slots, rows, width), dtype=torch.int64, device=device)
        self._host_view = None if self.is_cuda else self.ring.numpy()  # CPU: the ring as numpy
        self.state = new_state(device)
        self._gated = self._keep = None  # gated_state's buffers
        self._state_view = None if self.is_cuda else self.state.numpy()
        # CPU: steps whose slot the host has wholly reset after reading it
        # (reset_read); advance() opens them without visiting the rows.
        self._reset_for: set[int] = set()
        self.nrows = 0
        self.metric_of_row: list[int] = []  # metric index per row, or UNNAMED / TIMING
        self.rows_version = 0  # changes whenever metric_of_row or timer_of_row does
        self.timer_of_row: dict[int, int] = {}  # timing row -> timing index of its module
        self.pending: deque[_Pending] = deque()
        self._side = torch.cuda.Stream(device) if self.is_cuda else None
        self._pinned: dict[int, torch.Tensor] = {}
        # CUDA: earlier buffers of this ring that a CUDA graph captured writes
        # into (the graph keeps their address): kept alive, reset with the
        # ring and folded into each drained slot.
        self.retired: list[torch.Tensor] = []
        self.ring[:, :, _layout.STEP_TAG] = _UNTAGGED
        _ops.reset_slot(self.ring, self.state)

    # -- rows -----------------------------------------------------------------
    def add_row(self, metric: int, timer: int | None = None) -> int:
        """A new row for a metric index (or UNNAMED), or for the timing index
        ``timer`` (grows the ring outside the steady state)."""
        rows = self.ring.shape[1]
        if self.nrows == rows:
            # Grown by a quarter: every recorded step resets (and the host
            # reads) whole slots, so spare rows cost time every step.
            more = rows + max(64, rows // 4)
            captured = self.is_cuda and _C._captured_ring(self.ring.data_ptr())
            grown = grow_ring(self.ring, self.state, more, keep_old=captured)
            if captured:
                self._retire(self.ring)
            self.ring = grown
            self._host_view = None if self.is_cuda else grown.numpy()
            self._reset_for.clear()
            self._pinned.clear()
        row = self.nrows
        if timer is not None:
            self.timer_of_row[row] = timer
            metric = TIMING
        self.metric_of_row.append(metric)
        self.nrows += 1
        self.rows_version += 1
        return row

    def __del__(self):
        # Released (its Monitor closed or collected): buffers a CUDA graph
        # captured stay alive for replays of that graph.
        try:
            if self.is_cuda:
                ring = self.__dict__.get("ring")
                bufs = [b for b in (ring, *self.__dict__.get("retired", ())) if b is not None]
                if park_captured(bufs, _C._captured_ring):
                    _PARKED.append(self.state)  # the captured kernels read it
        except Exception:  # interpreter shutdown: nothing left to protect
            pass

    def _retire(self, old: torch.Tensor) -> None:
        self.retired.append(old)
        mb = sum(r.numel() for r in self.retired) * 8 / 2**20
        log.warning(
            "hookcap: the stats ring on %s grew after a CUDA graph captured hooks writing into it; "
            "the old ring is kept (%.1f MB in all) and folded into every recorded step, at the cost "
            "of one more copy and reset per step. Run the model eagerly once (every module and hook "
            "called) before capturing to avoid this.", self.device, mb)

    def name_row(self, row: int, metric: int) -> None:
        """Give an UNNAMED row its metric index."""
        self.metric_of_row[row] = metric
        self.rows_version += 1

    def set_state(self, step: int, enabled: bool, slot: int) -> None:
        """Put the device state at (step, enabled, slot) and reset that slot
        (a ring created mid-run, a resumed step counter)."""
        self.slot, self.on = slot, step % self.every == 0
        if self.is_cuda:
            fill_state(self.state, step, enabled, slot)
        else:
            self._state_view[:] = (step, int(enabled), slot)
        self._reset_for.clear()
        for buf in (self.ring, *self.retired):
            buf[:, :, _layout.STEP_TAG] = _UNTAGGED
            _ops.reset_slot(buf, self.state)

    def gated_state(self, skip: torch.Tensor) -> torch.Tensor:
        """This ring's state with writing off where ``skip`` (a one-element
        flag, nonzero: off; GradScaler's ``found_inf``) says so, made on the
        device from buffers kept between calls: an op given it records
        nothing on a skipped step, with no host read."""
        if self._gated is None:
            self._gated = torch.empty_like(self.state)
            self._keep = torch.empty((), dtype=torch.bool, device=self.state.device)
        torch.eq(skip.detach().reshape(()).to(self.state.device, non_blocking=True), 0, out=self._keep)
        self._gated.copy_(self.state)
        self._gated[1].mul_(self._keep)
        return self._gated

    def set_enabled(self, enabled: bool) -> None:
        """Whether the kernels write this step (also code compiled with the
        hooks inside, which reads only the device flag). Stream-ordered, no sync."""
        self.state[1].fill_(int(enabled))

    # -- drain ------------------------------------------------------------------
    def finish(self, step: int) -> bool:
        """Queue the open slot (holding step ``step``) for the host. Returns False
        if the step had to be dropped (its pinned buffer is still unread)."""
        n, slot = self.nrows, self.slot
        if not self.is_cuda:
            # A view, no copy: the host reads it in this step() (records copy
            # what they keep), and an unread slot is dropped before advance()
            # resets it (drop_unread).
            slot_rows = self._host_view[slot]
            self.pending.append(_Pending(step, slot, n, slot_rows[:n], slot_rows))
            return True
        if any(p.slot == slot for p in self.pending):
            return False  # host is a whole ring behind: drop rather than wait
        pinned = self._pinned.get(slot)
        if pinned is None or pinned.shape[0] < self.ring.shape[1]:
            pinned = torch.empty((self.ring.shape[1], self.width), dtype=torch.int64, pin_memory=True)
            self._pinned[slot] = pinned
        _C._join_write_streams(self.ring.device.index)  # after hook ops on other streams
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        retired = []
        for i, old in enumerate(self.retired):
            k = min(n, old.shape[1])
            buf = self._pinned.get((i, slot))
            if buf is None:
                buf = self._pinned[(i, slot)] = torch.empty((old.shape[1], self.width), dtype=torch.int64,
                                                            pin_memory=True)
            retired.append((buf, k))
        with torch.cuda.stream(self._side):
            pinned[:n].copy_(self.ring[slot, :n], non_blocking=True)
            for old, (buf, k) in zip(self.retired, retired):
                buf[:k].copy_(old[slot, :k], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._side)
        self.pending.append(_Pending(step, slot, n, None, pinned=pinned, event=ev, source=self.ring,
                                     retired=retired or None))
        return True

    def ready(self, wait: bool = False):
        """Yield (step, rows int64 [nrows, width], slot_rows) of drained slots,
        oldest first. CPU: ``rows`` is a view of the ring, and ``slot_rows``
        (every row of that slot) is for the host to reset once it has read
        them (see the drain); CUDA: ``rows`` is a host copy, ``slot_rows`` None."""
        while self.pending:
            p = self.pending[0]
            if p.event is not None:
                if not (wait or p.event.query()):
                    return
                p.event.synchronize()
                p.host = p.pinned[: p.nrows].numpy().copy()
                if p.retired:
                    p.host = fold_retired(p.host, [buf[:k].numpy() for buf, k in p.retired])
            self.pending.popleft()
            yield p.step, p.host, p.slot_rows

    def drop_unread(self, slot: int) -> int | None:
        """CPU: the slot is about to be reused while still unread — drop it.
        Returns the dropped step, if any."""
        for i, p in enumerate(self.pending):
            if p.slot == slot and p.event is None:
                del self.pending[i]
                return p.step
        return None

    def reset_read(self, slot_rows: np.ndarray, hist_args: tuple, step: int) -> None:
        """CPU: reset a slot's rows the host has just read (while they are in
        its cache) for ``step``, the next step that slot holds. Only the header
        and the histogram band are written; rows tagged ``step`` are known reset."""
        _C._rows_reset(slot_rows, *hist_args, step)
        view = self._host_view
        if slot_rows.shape == view.shape[1:]:  # a whole slot of this ring (not one grown since)
            offset = slot_rows.ctypes.data - view.ctypes.data
            if 0 <= offset < view.nbytes:
                if len(self._reset_for) > self.slots:  # steps never opened (a stopped run)
                    self._reset_for.clear()
                self._reset_for.add(step)

    def advance(self, resets: bool, slot: int) -> None:
        """Close the step on the device. ``resets``/``slot``: whether the step
        it opens is one of the ring's, and in which slot (the host's mirror of
        the state, ``next_host_state``)."""
        every, self.on, self.slot = self.every, resets, slot
        if self.is_cuda:
            # Writes of this step on other streams land before the state moves.
            _C._join_write_streams(self.ring.device.index)
            # The reset of a reused slot must not overtake its copy to the host;
            # copies of the other slots go on while the training stream runs.
            main = torch.cuda.current_stream(self.device)
            for p in copies_to_wait(self.pending, resets, slot):
                main.wait_event(p.event)
        else:
            # The state the op would compute, from the CPU state itself.
            st = self._state_view
            nstep, nenabled, nslot = next_host_state(int(st[0]), int(st[2]), every, self.slots)
            if nenabled and nstep in self._reset_for:
                # Every row of the slot is already reset for nstep (reset_read, and
                # no write since): the op would only move the state.
                self._reset_for.discard(nstep)
                st[:] = (nstep, 1, nslot)
                return
        _ops.advance(self.ring, self.state, every)
        if resets:
            for old in self.retired:  # the slot advance() just reset in the ring
                _ops.reset_slot(old, self.state)
