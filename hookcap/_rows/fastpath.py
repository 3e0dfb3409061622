"""The compiled hook entry points (``csrc/grad_hooks.cpp``) and the one
identity of a ring row.

A row id is ``ring_index << ROW_BITS | row``: the ring's index in its
Monitor's ring list and the row within that ring. Python and C++ name rows
only this way; this module is the only place in Python that builds or
splits one.

:class:`FastPath` is a Monitor's C++ gradient sink: it holds the Monitor's
rings and its histogram arguments, merges forward outputs and gradients into
rows without Python in the loop, and logs every write it makes so the host
can rebuild the step's execution order. Its hot entry points are plain
partials of the C functions (no Python frame per call).
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

from .. import _C

ROW_BITS: int = _C.ROW_BITS
NO_ROW = -1  # a part of a module call that is not recorded (FastPath.learn)
SKIPPED = -1  # Recorder.register's answer for a call that is not recorded
_ROW_MASK = (1 << ROW_BITS) - 1


def row_id(ring_index: int, row: int) -> int:
    """The id of ``row`` of the Monitor's ring ``ring_index``."""
    return (ring_index << ROW_BITS) | row


def ring_index_of(rid: int) -> int:
    return rid >> ROW_BITS


def row_of(rid: int) -> int:
    return rid & _ROW_MASK


# output_fast's answers besides a call index (grad_hooks.cpp kNotRecording, kDone).
NOT_RECORDING = -2
DONE = -1


@torch.compiler.substitute_in_graph(_C._output_hook, skip_signature_check=True)
def _traced_output_hook(ctx, mod, args, output):
    """What dynamo traces where a module calls the C forward hook
    (:meth:`FastPath.forward_hook`): its Python hook, ``ctx[3]``."""
    return ctx[3](mod, args, output)


class FastPath:
    """One Monitor's C++ sink. ``python_writes`` counts the op-path writes
    Python logged itself this step (a CPU int64 the C++ side reads), so each
    C++ write is placed after the Python writes that preceded it."""

    def __init__(self, hist_args: tuple):
        self._python_writes = torch.zeros(1, dtype=torch.int64)
        self._python_writes_np = self._python_writes.numpy()
        self.id = sid = _C._grad_sink_new(self._python_writes, *hist_args)
        weakref.finalize(self, _C._grad_sink_free, sid)  # releases the rings
        # Hot paths: partials of the C functions.
        self.output_fast = _C._output_fast_for(sid)  # (hook id, output) -> int
        self.accumulate_row = functools.partial(_C._accumulate_row, sid)  # (tensor, rid)
        self.capture_grad = functools.partial(_C._capture_grad, sid)  # (tensor, rid) -> bool
        self.time_mark = functools.partial(_C._time_mark, sid)  # (rid, phase, start)
        self.time_grad_hook = functools.partial(_C._time_grad_hook, sid)  # (tensor, rid, start) -> bool

    def forward_hook(self, hook_id: int, split: bool, hook, tail):
        """The forward hook to register for hook ``hook_id``: C, with no
        Python frame where ``output_fast`` finishes the call. ``hook(mod,
        args, output)`` takes eval-mode calls when ``split`` (and is what
        dynamo traces); ``tail(mod, output, ci)`` takes the calls that
        ``output_fast`` answered with ``ci`` (not ``DONE``)."""
        return functools.partial(_C._output_hook, (self.id, hook_id, split, hook, tail))

    def set_ring(self, index: int, ring: torch.Tensor, state: torch.Tensor) -> None:
        """The ring (and state) the sink writes for ring ``index``; again after it grows."""
        _C._grad_sink_ring(self.id, index, ring, state)

    def set_active(self, active: bool) -> None:
        """Hooks already registered do nothing while inactive (after detach)."""
        _C._grad_sink_active(self.id, active)

    def set_recording(self, recording: bool, force_python_grad: bool, new_step: bool) -> None:
        """What the forward fast path needs to know; ``new_step`` restarts its call counts."""
        _C._grad_sink_recording(self.id, recording, force_python_grad, new_step)

    def learn(self, hook_id: int, call: int, output: torch.Tensor, out_rid: int, grad_rid: int) -> None:
        """Cache a module call's rows (``NO_ROW`` where not recorded) for ``output_fast``."""
        _C._fast_learn(self.id, hook_id, call, output, out_rid, grad_rid)

    def op_writes(self) -> int:
        """Writes so far that went through the dispatcher (the op) rather
        than straight to the kernel: 0 for plain dense tensors unless a
        profiler or a Python dispatch mode watches ops."""
        return _C._grad_sink_op_writes(self.id)

    def note_python_write(self) -> None:
        self._python_writes_np[0] += 1

    def take(self) -> tuple[np.ndarray, np.ndarray, list[tuple[int, bool, str]]]:
        """The step's log, cleared: row ids written in C++ in order of their
        first write (int64, each once), the number of Python-logged writes
        before each (int64), and ``(rid,
        timing, message)`` of each hook that failed. Also restarts the Python
        write count."""
        self._python_writes_np[0] = 0
        rids, after, errors = _C._grad_sink_take(self.id)
        return np.frombuffer(rids, dtype=np.int64), np.frombuffer(after, dtype=np.int64), errors
