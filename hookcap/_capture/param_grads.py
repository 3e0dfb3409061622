"""The ``param_grad`` capture kind: each watched parameter's gradient once
accumulated, and, in a multi-rank run, a data-parallel wrapper's reduced
gradient read from ``.grad`` when the backward has ended. Either way the
gradients of a backward are recorded together when it ends, in one
``accumulate_many`` call per ring, at their places in the execution order."""

from __future__ import annotations

import torch

from . import compile as _compile
from .._rows.recorder import Recorder, is_dtensor, multi_rank


class ParamGrads:
    """Gradient hooks of the watched parameters. A DTensor's gradient (FSDP2,
    tensor parallel) is recorded as it accumulates. A plain parameter's is
    too in a single process; in a multi-rank run (asked once per step, so a
    process group created after ``attach()`` counts) DDP writes the reduced
    gradient into ``.grad`` after these hooks fired, so it is read once the
    backward has ended (``_queue_read``), else before the optimizer steps or
    at ``step()``. Each read replaces the step's row: with accumulation the
    last backward's gradient stays. A plain gradient whose hook is the
    parameter's only post-accumulate hook (no optimizer step in the
    backward), outside compiled autograd, is held until the backward ends
    and recorded with the others (``_held``); one changed in place by then
    is not recorded that step (warned once)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.plain: list[tuple[str, torch.Tensor]] = []  # read from .grad in a multi-rank run
        self.handles: list = []
        self._done = False  # this step's plain gradients were read
        self._multi: bool | None = None  # data_parallel() of this step
        self._queued = False  # an end-of-backward read is queued
        self._held: dict[int, tuple[str, torch.Tensor, int]] = {}  # row id -> (name, gradient, its version)
        self._flush_queued = False

    def bind(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Hook ``params`` (those of an earlier binding unhooked)."""
        self.remove()
        self.plain = []
        for pname, p in params:
            if not p.requires_grad:
                continue
            plain = not is_dtensor(p)
            if plain:
                self.plain.append((pname, p))
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(pname, plain)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def new_step(self) -> None:
        self._done = False
        self._multi = None
        self._held.clear()  # a backward that raised never ended
        self._flush_queued = False

    def data_parallel(self) -> bool:
        """Whether plain parameters are replicas across ranks (a multi-rank
        run): asked once per step."""
        if self._multi is None:
            self._multi = multi_rank()
        return self._multi

    def read_from_grad(self) -> set[str]:
        """Names whose gradient is read from ``.grad`` this step (not
        recorded by the hooks): the plain parameters of a multi-rank run."""
        return set() if not self.data_parallel() else {n for n, _ in self.plain}

    def _hook(self, pname: str, plain: bool):
        rec = self.recorder

        def hook(p):
            if rec.records("param_grad") and p.grad is not None:
                if plain and self.data_parallel():
                    self._queue_read()
                    return
                # Fires after every accumulation: the row is replaced so the
                # step keeps the final accumulated gradient, once.
                if not self._hold(pname, p):
                    rec.write(pname, "param_grad", "", p.grad, "Parameter", 0, replace=True, via_op=True)

        return hook

    def _hold(self, pname: str, p) -> bool:
        """Hold ``p``'s gradient for the end of the backward (its place in
        the execution order taken now); False where it must be written now."""
        if torch.compiler.is_compiling() or not _compile.cpp_grad_hooks_ok():  # traced (compiled autograd): now
            return False
        g = p.grad
        if type(g) is not torch.Tensor or len(p._post_accumulate_grad_hooks) != 1 or self.recorder.grouped.specs:
            return False
        rec = self.recorder
        key = (pname, "param_grad", "", g.device, 0)
        rid = rec.rows.get(key)
        if rid is None:
            rid = rec.make_row(key, g, g, "Parameter")
            if rid is None:
                return True  # not recordable: skipped (warned once)
        rec.note_order([rid])
        self._held[rid] = (pname, g, g._version)
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        return True

    def _flush(self) -> None:
        """The backward has ended: its held gradients, in one call per ring."""
        held, self._held = self._held, {}
        self._flush_queued = False
        items = []
        for pname, g, version in held.values():
            if g._version != version:
                self.recorder.warn_once(("grad changed", pname), (
                    f"hookcap: {pname}/param_grad: the gradient was changed in place after it accumulated and "
                    "before the backward ended; that step's value is not recorded (warned once)"))
            else:
                items.append((pname, g))
        with torch.no_grad():
            self.recorder.write_rows("param_grad", items, "Parameter", replace=True)

    def _queue_read(self) -> None:
        """Read ``.grad`` once the backward has ended, after the data-parallel
        reduction: DDP queues its finalize (which writes the reduced
        gradient) as an autograd end-of-backward callback during the
        backward; this queues one that, when it runs, queues the read, which
        the engine runs after every callback queued before it."""
        if self._queued:
            return
        self._queued = True
        engine = torch.autograd.Variable._execution_engine

        def after_the_others():
            engine.queue_callback(self._backward_ended)

        engine.queue_callback(after_the_others)

    def _backward_ended(self) -> None:
        self._queued = False
        self._done = False  # a later backward (accumulation) reads again: the row is replaced
        self.read()

    def read(self, at_step: bool = False) -> None:
        """``param_grad`` of the plain parameters from ``.grad`` in a
        multi-rank run (the reduced gradient), unless read this step
        already: at the end of each backward, else before the optimizer
        steps or at ``step()``."""
        if not self.plain or self._done or not self.recorder.records("param_grad") or not self.data_parallel():
            return
        self._done = True
        missing = [pname for pname, p in self.plain if p.grad is None]
        with torch.no_grad():
            self.recorder.write_rows("param_grad", [(pname, p.grad) for pname, p in self.plain if p.grad is not None],
                                     "Parameter", replace=True)
        if at_step and missing and len(missing) == len(self.plain):
            self.recorder.warn_once("reduced grads", (
                "hookcap: param_grad in a multi-rank run is read from .grad when the backward ends; at this "
                "step() no backward had run since the last one and no watched parameter had a .grad"))
