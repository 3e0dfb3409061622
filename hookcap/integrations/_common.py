"""What the framework callbacks share: checking the Monitor arguments early,
file names that keep ranks apart, and writing a resumed run whole."""

from __future__ import annotations

import torch

from ..history import History
from ..monitor import Monitor

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
