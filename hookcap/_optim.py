"""The optimizer as a source of tensors: finding the ``torch.optim.Optimizer``
inside wrappers, and the ``optim_state`` capture kind (each watched
parameter's optimizer state after the step)."""

from __future__ import annotations

import logging

import torch

from ._recorder import Recorder

log = logging.getLogger("hookcap")
_warned_no_optimizer = False  # process-wide: a hint about the arguments, not about data


def innermost_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside wrappers (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, HF's
    wrappers: ``.optimizer`` / ``._optimizer``), else ``optimizer`` itself."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "step"):
            break
        optimizer = inner
    return optimizer


class OptimState:
    """``optim_state``: every floating tensor of ``optimizer.state[p]`` with
    ``p``'s shape (Adam's ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``;
    SGD's ``momentum_buffer``; any optimizer's), as metric
    ``{param}/state.{key}``, recorded at ``step()`` (which a Monitor given the
    optimizer runs right after the optimizer's step). Scalars (Adam's
    ``step``) and tensors of other shapes (factored second moments) are left
    out."""

    def __init__(self, recorder: Recorder, optimizer) -> None:
        global _warned_no_optimizer
        if optimizer is None and not _warned_no_optimizer:  # capture=hookcap.CAPTURE_KINDS: all there is
            _warned_no_optimizer = True
            log.warning("hookcap: capture 'optim_state' records the optimizer's state after its step: pass "
                        "Monitor(..., optimizer=opt); without it no state is recorded (logged once)")
        self.recorder = recorder
        self.optimizer = optimizer

    def record(self, params: list[tuple[str, torch.Tensor]]) -> None:
        if self.optimizer is None:
            return
        opt = innermost_optimizer(self.optimizer)
        state = getattr(opt, "state", None)
        if not state:
            return
        mtype = type(opt).__name__
        with torch.no_grad():
            for pname, p in params:
                st = state.get(p)
                if not st:
                    continue
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                        self.recorder.write(pname, "optim_state", str(key), v.detach(), mtype, 0)
