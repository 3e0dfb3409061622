"""Loss scaling (``torch.amp.GradScaler``): which optimizer steps it skipped,
recorded on the device as metric ``optimizer/skipped`` (``History.skipped``),
and one hookcap step per loop iteration when the scaler skips a non-fused
optimizer's step (it then never calls ``optimizer.step()``)."""

from __future__ import annotations

import torch

from .._rows.recorder import Recorder

SKIPPED = "optimizer/skipped"  # per step: > 0 where the scaler skipped the optimizer's step


def record_skip(recorder: Recorder, found_inf: torch.Tensor, mtype: str) -> None:
    """``found_inf`` (GradScaler's flag, 1.0 where a gradient was not finite)
    into metric ``optimizer/skipped``: no host read."""
    recorder.write(SKIPPED, "tap", "", found_inf.detach(), mtype, recorder.call_index(SKIPPED, "tap"))


def found_inf_of(optimizer) -> torch.Tensor | None:
    """The ``found_inf`` flag GradScaler hands a fused optimizer's step (an
    attribute set for the duration of that step), else None."""
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf if isinstance(found_inf, torch.Tensor) else None


def flag_on_host(found_inf: torch.Tensor) -> bool:
    """Whether reading ``found_inf`` costs no device sync (a CPU tensor)."""
    return found_inf.device.type == "cpu"


def found_infs(scaler, optimizer) -> list[torch.Tensor]:
    """The scaler's per-device inf flags for ``optimizer`` this iteration
    (empty before its ``step``, or with the scaler disabled)."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    state = states.get(id(optimizer)) or {}
    return [t for t in (state.get("found_inf_per_device") or {}).values() if isinstance(t, torch.Tensor)]


def iteration_ended(recorder: Recorder, updates, params, stepped: bool, infs) -> None:
    """At ``grad_scaler.update()`` (once per loop iteration): a step the
    scaler skipped without calling the optimizer (a non-fused one:
    ``stepped`` False) records an update of 0; the scaler's inf flags
    ``infs`` go to ``optimizer/skipped`` unless a fused step recorded its
    own. ``updates``: the Monitor's ``OptimUpdates``, or None."""
    if recorder.records("update") or recorder.records("tap"):
        if not stepped and updates is not None:
            updates.record_skipped(params)
        if not (updates is not None and updates.skip_recorded):
            for t in infs:
                record_skip(recorder, t, "GradScaler")
    if updates is not None:
        updates.skip_recorded = False


class ScalerUpdate:
    """``scaler.update`` wrapped: ``before()`` runs first, once per loop
    iteration. ``remove()`` restores it."""

    def __init__(self, scaler, before) -> None:
        if not callable(getattr(scaler, "update", None)):
            raise ValueError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._own = vars(scaler).get("update")  # an instance attribute to put back, if any
        inner = scaler.update

        def update(*args, **kwargs):
            before()
            return inner(*args, **kwargs)

        scaler.update = update

    def remove(self) -> None:
        if self._own is not None:
            self.scaler.update = self._own
        else:
            vars(self.scaler).pop("update", None)
