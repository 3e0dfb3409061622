"""Copies and pickles of a watched module carry none of hookcap's hooks.

A deep copy (``copy.deepcopy``: EMA and teacher copies, ``AveragedModel``) and
a pickle (``torch.save(model)``, ``pickle.dumps``) both take a module's state
from its ``__getstate__``. While a Monitor has hooks on a module, an instance
attribute ``__getstate__`` hands over that state without hookcap's entries in
the module's hook dicts (the user's own hooks stay). So a copy records nothing
into the original's Monitor, a pickle needs no hookcap to load, and neither
holds a hook that ``detach()`` could not reach. Parameters need nothing: a
copied or unpickled Parameter has no gradient hooks. The hot path is untouched.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from torch import nn

# The module's hook dicts keyed by hook-handle id (ids are process-unique).
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

_ids: set[int] = set()  # ids of every live hookcap module hook, all Monitors
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> hook sets on it


class _StateWithoutHooks:
    """The module's own ``__getstate__``, less hookcap's hooks and itself."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self):
        mod = self.module()
        state = type(mod).__getstate__(mod)
        if not isinstance(state, dict):
            return state
        state = dict(state)
        state.pop("__getstate__", None)
        for key in HOOK_DICTS:
            hooks = state.get(key)
            if hooks and any(i in _ids for i in hooks):
                state[key] = OrderedDict((i, h) for i, h in hooks.items() if i not in _ids)
        return state


def own(module: nn.Module, ids: list[int]) -> None:
    """Hook-handle ``ids`` (one Monitor's, on ``module``) stay out of its copies."""
    _ids.update(ids)
    n = _owners.get(module, 0)
    if n == 0 and "__getstate__" not in module.__dict__:
        module.__dict__["__getstate__"] = _StateWithoutHooks(module)
    _owners[module] = n + 1


def disown(module: nn.Module, ids: list[int]) -> None:
    """The hooks ``ids`` were removed: the module's state is its own again
    once no Monitor has hooks on it."""
    _ids.difference_update(ids)
    n = _owners.get(module, 0) - 1
    if n > 0:
        _owners[module] = n
        return
    _owners.pop(module, None)
    if isinstance(module.__dict__.get("__getstate__"), _StateWithoutHooks):
        del module.__dict__["__getstate__"]
