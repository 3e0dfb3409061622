"""The ``param_grad`` capture kind: each watched parameter's gradient once
accumulated, and, in a multi-rank run, a data-parallel wrapper's reduced
gradient read from ``.grad`` when the backward has ended."""

from __future__ import annotations

import torch

from .._rows.recorder import Recorder, is_dtensor, multi_rank


class ParamGrads:
    """Gradient hooks of the watched parameters. A DTensor's gradient (FSDP2,
    tensor parallel) is recorded as it accumulates. A plain parameter's is
    too in a single process; in a multi-rank run (asked once per step, so a
    process group created after ``attach()`` counts) DDP writes the reduced
    gradient into ``.grad`` after these hooks fired, so it is read once the
    backward has ended (``_queue_read``), else before the optimizer steps or
    at ``step()``. Each read replaces the step's row: with accumulation the
    last backward's gradient stays."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.plain: list[tuple[str, torch.Tensor]] = []  # read from .grad in a multi-rank run
        self.handles: list = []
        self._done = False  # this step's plain gradients were read
        self._multi: bool | None = None  # data_parallel() of this step
        self._queued = False  # an end-of-backward read is queued

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
                rec.write(pname, "param_grad", "", p.grad, "Parameter", 0, replace=True, via_op=True)

        return hook

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
        missing = []
        with torch.no_grad():
            for pname, p in self.plain:
                if p.grad is None:
                    missing.append(pname)
                else:
                    self.recorder.write(pname, "param_grad", "", p.grad, "Parameter", 0, replace=True)
        if at_step and missing and len(missing) == len(self.plain):
            self.recorder.warn_once("reduced grads", (
                "hookcap: param_grad in a multi-rank run is read from .grad when the backward ends; at this "
                "step() no backward had run since the last one and no watched parameter had a .grad"))
