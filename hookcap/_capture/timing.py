"""``Monitor(timing=True)``: per-module forward and backward durations.

Forward: a mark at the module's forward pre-hook (the last pre-hook) and one
at its forward hook (the first forward hook), so hookcap's own stats work
stays out of the time. Backward: from the gradient w.r.t. the module's first
output that requires grad to the gradient w.r.t. its first input that
requires grad, seen by tensor hooks. Marks go to one timing row per (module,
device); the drain turns them into milliseconds (:func:`time_of`).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
from torch import nn

from . import compile as _compile
from .. import _layout
from .._rows.catalog import Catalog
from .._rows.fastpath import row_of
from .._rows.recorder import SKIPPED, Recorder
from .tree import tensor_leaves

_TIME_MARK = torch.ops.hookcap.time_mark.default


def first_grad_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call's first plain tensor argument that requires grad, else None."""
    for v in itertools.chain(args, kwargs.values()):
        if type(v) is torch.Tensor and v.requires_grad:
            return v
    return None


def call_device(args, kwargs, mod: nn.Module) -> torch.device:
    """Where a module call runs: its first tensor argument's device, else its
    first parameter's or buffer's, else the CPU."""
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
    for t in itertools.chain(mod.parameters(), mod.buffers()):
        return t.device
    return torch.device("cpu")


def inplace_grad_node(alias: torch.Tensor, node0):
    """The autograd node whose post-hook sees the gradient w.r.t. an input
    once the module modified ``alias`` (a view of that input, whose grad_fn
    was ``node0``) in place, else None. An in-place op on a view rebases the
    graph: hooks registered on the alias before it never fire; the base's new
    CopySlices node runs the module's backward and hands on the gradient
    w.r.t. the whole base."""
    base = alias._base
    if alias.grad_fn is node0 or base is None:
        return None
    node = base.grad_fn
    return node if type(node).__name__ == "CopySlices" else None


class Timing:
    """The timing hooks of one Monitor. ``open_calls``: per hooked module,
    the forward calls in flight (cleared at each step: a forward that raised
    never closed its call)."""

    def __init__(self, recorder: Recorder, open_calls: list, key: int):
        self.recorder = recorder
        self.key = key  # the Monitor's key in hookcap._capture.compile
        self.open_calls = open_calls
        self.inplace: set[str] = set()  # modules seen modifying their input in place
        self.off: set[str] = set()  # modules whose timing failed (warned once)

    def failed(self, name: str, e: Exception) -> None:
        self.off.add(name)
        self.recorder.warn_once(("timing", name), f"hookcap: {name} is no longer timed: {type(e).__name__}: {e}")

    def hooks(self, name: str):
        """(forward pre-hook with kwargs, forward hook) timing module ``name``."""
        rec = self.recorder
        fast = rec.fast
        open_calls: list = []  # this module's forward calls in flight (nested calls stack)
        self.open_calls.append(open_calls)
        inplace, off = self.inplace, self.off

        def grad_mark(t, rid, start) -> None:
            # A backward that compiled autograd compiles is not timed (NaN):
            # its module boundaries are fused and reordered like a compiled
            # forward's, and its first run would include the compile.
            if _compile.compiled_autograd_on():
                return
            if _compile.PYTHON_GRAD_HOOKS:
                t.register_hook(functools.partial(self._python_mark, name, rid, start))
            else:
                fast.time_grad_hook(t, rid, start)

        last: list = [None, None]  # the previous call's device and its row id

        def pre(mod, args, kwargs):
            if torch.compiler.is_compiling():
                _compile.hooks_traced(self.key)
                return None
            if not rec.records("timing") or _compile.in_backward() or name in off:
                open_calls.append(None)
                return None
            try:
                x = args[0] if args else None
                dev = x.device if type(x) is torch.Tensor else call_device(args, kwargs, mod)
                if dev == last[0]:
                    rid = last[1]
                else:
                    if dev.type == "meta":
                        open_calls.append(None)
                        return None
                    rid = rec.time_row(name, dev)
                    if rid == SKIPPED:  # not recordable now (first seen inside a CUDA graph capture)
                        open_calls.append(None)
                        return None
                    last[1], last[0] = rid, dev
                fast.time_mark(rid, 0, True)
                new, end = None, None
                if torch.is_grad_enabled():
                    # The backward ends when the gradient w.r.t. the module's
                    # first input that requires grad is complete: seen on an
                    # alias of it (the same memory) that only this module uses.
                    v = first_grad_input(args, kwargs)
                    if v is None:
                        pass
                    elif name in inplace and v._base is None:
                        # No alias for a module seen modifying its input in
                        # place: an alias would route the gradient through a
                        # CopySlices copy. A hook on the input itself survives
                        # an in-place op and sees the input's gradient (all its
                        # users' part).
                        grad_mark(v, rid, False)
                        end = (v, v.grad_fn)
                    else:
                        a = v.view_as(v)
                        grad_mark(a, rid, False)
                        # Every occurrence, so identity tests inside the module
                        # (MultiheadAttention's `query is key`) still hold.
                        new = (tuple(a if x is v else x for x in args),
                               {k: a if x is v else x for k, x in kwargs.items()})
                        end = (a, a.grad_fn)
            except Exception as e:  # telemetry must never take the run down
                self.failed(name, e)
                open_calls.append(None)
                return None
            open_calls.append((rid, end))
            return new

        def post(mod, args, output):
            if torch.compiler.is_compiling() or not open_calls:
                return None
            top = open_calls.pop()
            if top is None:
                return None
            rid, end = top
            try:
                fast.time_mark(rid, 0, False)
                if end is not None:
                    node = inplace_grad_node(*end)
                    if node is not None:  # the alias's own hook died with the in-place op
                        node.register_hook(functools.partial(self._node_mark, name, rid))
                        inplace.add(name)
                    if type(output) is torch.Tensor:
                        t = output if output.requires_grad else None
                    else:
                        t = next((v for _, v in tensor_leaves(output) if v.requires_grad), None)
                    if t is not None:
                        grad_mark(t, rid, True)
            except Exception as e:
                self.failed(name, e)
            return None

        return pre, post

    def _python_mark(self, name, rid, start, grad):
        # HOOKCAP_PYTHON_GRAD_HOOKS=1. The ring is read now, not at
        # registration: it may have grown.
        if self.recorder.attached and name not in self.off:
            try:
                ring = self.recorder.ring_of(rid)
                _TIME_MARK(ring.ring, ring.state, row_of(rid), 1, start)
            except Exception as e:
                self.failed(name, e)
        return None

    def _node_mark(self, name, rid, grad_inputs, grad_outputs):
        self._python_mark(name, rid, False, None)


def time_of(catalog: Catalog, metrics: np.ndarray, timers: np.ndarray | None,
            rows: np.ndarray | None) -> np.ndarray:
    """float64 [len(metrics), 2]: (forward, backward) ns of the module owning
    each metric this step, from the step's timing rows (``timers``: the timing
    index of each row); NaN where not timed or incomplete."""
    out = np.full((len(metrics), 2), np.nan)
    if timers is None:
        return out
    per_module = np.full((len(catalog.timed), 2), np.nan)
    L = _layout
    for phase, (ns, open_, ends) in enumerate(((L.FWD_NS, L.FWD_OPEN, L.FWD_ENDS),
                                                (L.BWD_NS, L.BWD_OPEN, L.BWD_ENDS))):
        ok = (rows[:, open_] == 0) & (rows[:, ends] > 0)
        per_module[timers, phase] = np.where(ok, rows[:, ns].astype(np.float64), np.nan)
    t = catalog.time_of_metric()[metrics]
    has = t >= 0
    out[has] = per_module[t[has]]
    return out
