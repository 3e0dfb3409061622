"""What changed in a watched model since the last look: modules added (or
replaced) and watched parameters replaced. Identity checks run in C loops
(about 0.1 us a module or parameter), so the look costs little at every
recorded step."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable

from torch import nn

from .._rows.config import ROOT_NAME, Config


class ModelWatch:
    """The model's modules and watched parameters as last seen."""

    def __init__(self) -> None:
        self._known: dict[int, weakref.ref] = {}  # id -> the module (an id may be reused)
        self._child_dicts: list[dict] = []
        self._children: list[tuple] = []
        self._slot_dicts: list[dict] = []  # each watched parameter's owner's _parameters,
        self._slot_attrs: list[str] = []  # its attribute there,
        self._slot_params: list = []  # and the tensor it held

    def look(self, model: nn.Module) -> None:
        """Every module of ``model`` and each one's children, as they are now."""
        modules = list(model.modules())
        self._known.update((id(m), weakref.ref(m)) for m in modules)
        self._child_dicts = [m._modules for m in modules]
        self._children = [tuple(d.values()) for d in self._child_dicts]

    def watch_params(self, slots: Iterable[tuple[nn.Module, str, object]]) -> None:
        """The parameters to follow: (owner module, attribute, tensor)."""
        slots = list(slots)
        self._slot_dicts = [m._parameters for m, _, _ in slots]
        self._slot_attrs = [a for _, a, _ in slots]
        self._slot_params = [p for _, _, p in slots]

    def params_replaced(self) -> bool:
        return any(map(operator.is_not, map(dict.get, self._slot_dicts, self._slot_attrs), self._slot_params))

    def new_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(qualified name, module) of each module not seen before, in
        ``named_modules`` order; they are seen from now on."""
        if not any(map(operator.ne, map(tuple, map(dict.values, self._child_dicts)), self._children)):
            return []
        new = [(qual or ROOT_NAME, mod) for qual, mod in model.named_modules()
               if (ref := self._known.get(id(mod))) is None or ref() is not mod]
        self.look(model)
        return new


def watched_params(model: nn.Module, config: Config) -> Iterable[tuple[str, nn.Parameter, nn.Module, str]]:
    """(name, parameter, owner module, attribute): all parameters when
    ``modules`` is None (a shared one once, by its first name), else those
    owned directly by the selected modules."""
    seen = set()
    for qual, mod in model.named_modules():
        if not config.all_params and not config.select(qual or ROOT_NAME, mod):
            continue
        for pn, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield (f"{qual}.{pn}" if qual else pn), p, mod, pn
