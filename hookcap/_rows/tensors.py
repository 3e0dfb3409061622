"""What a captured tensor is to the recorder: whether it can be recorded
(``skip_reason``), the plain tensor read for it (``plain_tensor``), and how
its data lie across ranks (``placement_of``: the metric's placement meta)."""

from __future__ import annotations

import torch
from torch import nn

from .config import PARAM_KINDS


def multi_rank() -> bool:
    """Whether torch.distributed runs this process as one of several ranks."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def placement_of(kind: str, t) -> dict:
    """How a metric's data lie across ranks, for the merged history and sinks
    (the metric's meta, docs/compile-and-distributed.md's placement table).

    A DTensor (any kind) by its placements, one per mesh dimension:
    ``"sharded"`` if some dimension is ``Shard``, else ``"replicated"``;
    ``"mesh"`` names the placements, and ``"counted"`` says whether this
    rank's local part counts in merged histories: only a rank at coordinate 0
    of every ``Replicate`` dimension does (``Shard`` dimensions are summed).
    ``"partial"``: some dimension is ``Partial`` (each rank holds an
    unreduced term; not recorded). A plain tensor: ``"replicated"`` for a
    parameter kind in a multi-rank run (DDP: the same tensor on every rank,
    counted once, from the lowest rank) and ``"per_rank"`` otherwise (each
    rank's own data, summed)."""
    if is_dtensor(t):
        return mesh_layout(t.device_mesh, t.placements)
    if kind in PARAM_KINDS and multi_rank():
        return {"placement": "replicated"}
    return {"placement": "per_rank"}


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (duck-typed: no import of torch.distributed)."""
    return callable(getattr(t, "to_local", None)) and getattr(t, "placements", None) is not None


def mesh_layout(mesh, placements) -> dict:
    """The layout (see ``placement_of``) of a rank's local part of a tensor
    placed as ``placements`` on ``mesh`` (a DTensor's, or a tensor-parallel
    module's plain output as its parallel style placed it)."""
    coord = mesh.get_coordinate()
    layout = {"mesh": "(" + ", ".join(map(repr, placements)) + ")"}
    if any(p.is_partial() for p in placements):
        return {"placement": "partial", **layout, "counted": False}
    counted = coord is not None and all(c == 0 for p, c in zip(placements, coord) if p.is_replicate())
    sharded = any(p.is_shard() for p in placements)
    return {"placement": "sharded" if sharded else "replicated", **layout, "counted": counted}


PARTIAL_SKIP = ("its DTensor placement {mesh} holds an unreduced partial sum on each rank (reduced by the "
                "framework later, e.g. inside the optimizer step); hookcap adds no collective to reduce it")


def plain_tensor(t):
    """A plain strided tensor to record for ``t`` (a Parameter's data, a
    DTensor's local shard, an AsyncCollectiveTensor's result after a
    device-side wait), else ``t`` itself."""
    if isinstance(t, nn.Parameter):
        return t.detach()
    if is_dtensor(t):  # this rank's local shard (itself maybe still in flight)
        t = t.to_local()
    trigger_wait = getattr(t, "trigger_wait", None)
    if callable(trigger_wait):  # AsyncCollectiveTensor: the collective's result (waited on the device)
        return trigger_wait()
    return t


# The dtypes the kernels dispatch on (csrc/hookcap/op_checks.h).
_SUPPORTED_DTYPES = frozenset(
    [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)])


def _is_functorch_wrapped(t) -> bool:
    f = getattr(torch._C, "_functorch", None)
    return f is not None and f.is_functorch_wrapped_tensor(t)


def skip_reason(t) -> str | None:
    """Why ``t`` cannot be recorded, or None."""
    if t.layout != torch.strided:
        return f"layout {t.layout} is not supported"
    if t.is_quantized:
        return "quantized tensors are not supported"
    if t.is_nested:
        return "nested tensors are not supported"
    if t.device.type == "meta":
        return "meta tensors hold no values"
    if _is_functorch_wrapped(t):
        return "a tensor inside a torch.func transform (grad, vjp, jacrev, vmap) has no storage to read"
    if type(t) is not torch.Tensor:
        return f"tensor subclass {type(t).__name__} is not supported"
    if t.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {t.dtype} is not supported"
    return None
