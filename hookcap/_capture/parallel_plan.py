"""Where a tensor-parallel module's plain output lies across ranks, read
from the parallel style that ``parallelize_module`` applied to it.

torch exposes no public record of a module's plan: ``distribute_module``
registers a forward hook that closes over the style's output function (a
``functools.partial`` of ``_prepare_output_fn(output_layouts,
use_local_output, ...)``) and the device mesh. This module reads those two
from the hook's closure; anything else (another style, another torch) gives
None, and the output keeps the default placement (``per_rank``) unless
``Monitor(placements=...)`` says otherwise."""

from __future__ import annotations

import functools

import torch.nn as nn


def output_placements(mod: nn.Module):
    """``(device_mesh, placements)`` of ``mod``'s output as its parallel
    style hands it on as a plain tensor (``use_local_output=True``), or None."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Placement
    except ImportError:  # a torch without distributed tensors
        return None
    for hook in mod._forward_hooks.values():
        mesh = out_fn = None
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, DeviceMesh):
                mesh = value
            elif isinstance(value, functools.partial):
                out_fn = value
        if mesh is None or out_fn is None:
            continue
        if not getattr(out_fn.func, "__name__", "").endswith("_prepare_output_fn"):
            continue
        args = out_fn.args
        if (len(args) >= 2 and isinstance(args[0], (tuple, list)) and args[0]
                and all(isinstance(p, Placement) for p in args[0]) and args[1] is True):
            return mesh, tuple(args[0])
    return None
