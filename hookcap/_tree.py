"""Find the floating-point tensors inside a module's inputs or outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import torch

_MAX_DEPTH = 8


def floating_tensors(obj, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every floating-point tensor in ``obj``.

    Paths join keys / indices with dots (``"0"``, ``"1.attn"``, ``"logits"``);
    a bare tensor has path ``""``. Tuples, lists, dicts (incl. HF ``ModelOutput``)
    and dataclasses are walked; None, non-tensors and non-floating tensors are
    skipped; generators are never consumed.
    """
    if isinstance(obj, torch.Tensor):
        # Quantized tensors hold real values too: yield them so the Monitor
        # can say (once) that it does not record them.
        if obj.is_floating_point() or obj.is_quantized:
            yield path, obj
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    join = (lambda k: f"{path}.{k}") if path else str
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from floating_tensors(v, join(k), depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from floating_tensors(v, join(i), depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from floating_tensors(getattr(obj, f.name, None), join(f.name), depth + 1)
