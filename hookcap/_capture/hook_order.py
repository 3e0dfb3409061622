"""Where hookcap's module hooks sit among a module's other hooks: last, so
that they record what the module returns after every other forward hook (a
tensor-parallel style's redistribution, FSDP2's, a user's) and what it
receives after every other pre-hook."""

from __future__ import annotations

from torch import nn


def move_last(mod: nn.Module, ids) -> bool:
    """Move the hooks ``ids`` (one hook set's, on ``mod``) of its forward hook
    and pre-hook dicts behind the others, keeping their own order; True if
    any moved."""
    moved = False
    for d in (mod._forward_hooks, mod._forward_pre_hooks):
        keys = list(d)
        ours = [k for k in keys if k in ids]
        if ours and keys[-len(ours):] != ours:
            for k in ours:
                d.move_to_end(k)
            moved = True
    return moved
