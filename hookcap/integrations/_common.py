"""What the framework callbacks share: checking the Monitor arguments early,
file names that keep ranks apart, and writing a resumed run whole."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._capture import portable as _portable
from ..history import History
from ..monitor import Monitor
from ..taps import tap

_SET_BY_CALLBACK = ("model", "optimizer", "start_step")


def check_monitor_kwargs(kwargs: dict) -> dict:
    """``ValueError`` naming the argument, at the callback's creation rather
    than at the first training step."""
    for k in _SET_BY_CALLBACK:
        if k in kwargs:
            raise ValueError(f"{k}: set by the callback; pass only the other Monitor arguments")
    Monitor(None, **kwargs)  # validates every argument; holds nothing
    return dict(kwargs)


def rank_suffix() -> str:
    """``""`` in a single process and on rank 0, else ``".rank{r}"``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() > 0:
        return f".rank{dist.get_rank()}"
    return ""


def dump_run(monitor: Monitor, earlier: History | None, path: str) -> str:
    """``monitor.dump(path)``, after ``earlier``: the steps of the run this one
    resumed from (``History.concat``). Returns the path written."""
    if earlier is None:
        return monitor.dump(path)
    return History.concat([earlier, monitor.history()]).save(path, extra=monitor._dump_extra())


def tap_loss(output, scale: int = 1) -> None:
    """Tap ``output``'s training loss (times ``scale``) as metric ``loss``:
    ``output`` is the loss tensor, or holds it under ``"loss"`` (a dict, a
    Hugging Face ``ModelOutput``) or as ``.loss``; anything else is left
    alone. No host sync: the tensor's statistics are computed where it lives."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
    if isinstance(loss, torch.Tensor):
        tap(loss.detach() * scale if scale != 1 else loss, "loss")


class LossTap:
    """A forward hook on ``model`` tapping the loss its training forwards
    return (a model that computes its own loss: Hugging Face models given
    ``labels``). Kept out of the model's copies and pickles, as a Monitor's
    hooks are; ``remove()`` takes it off."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handle = model.register_forward_hook(self._hook)
        _portable.own(model, [self.handle.id])

    @staticmethod
    def _hook(module, args, output) -> None:
        if module.training:
            tap_loss(output)

    def remove(self) -> None:
        self.handle.remove()
        _portable.disown(self.model, [self.handle.id])
