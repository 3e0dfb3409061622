"""The one walker over nested module inputs and outputs: which tensors a
value holds, and the path that names each in a metric."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

_MAX_DEPTH = 8


def tensor_leaves(obj, floating_only: bool = True, traced: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor)]`` for the tensors inside ``obj``, in order.

    Paths join keys / indices with dots (``"0"``, ``"1.attn"``, ``"logits"``);
    a bare tensor has path ``""``; a namedtuple's items are named by field.
    Tuples, lists, mappings (incl. HF
    ``ModelOutput``) and dataclasses are walked, at most 8 levels deep; None
    and other values are skipped; generators are never consumed.

    ``floating_only``: only floating-point tensors (and quantized ones, which
    hold real values: the Monitor says once that it does not record them).
    ``traced``: the form dynamo traces (plain dicts, tuples and lists only),
    for hooks running inside ``torch.compile``.
    """
    out: list = []
    _walk(obj, "", 0, floating_only, traced, out)
    return out


def _walk(obj, path: str, depth: int, floating_only: bool, traced: bool, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        if not floating_only or obj.is_floating_point() or (not traced and obj.is_quantized):
            out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, dict) or (not traced and isinstance(obj, Mapping)):
        items = obj.items()
    elif isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a namedtuple
        items = zip(type(obj)._fields, obj)
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif not traced and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    else:
        return
    for k, v in items:
        _walk(v, f"{path}.{k}" if path else str(k), depth + 1, floating_only, traced, out)


def view_geometry(t: torch.Tensor, base: torch.Tensor):
    """None when ``t`` is ``base`` itself, else where ``t`` sits in ``base``:
    (size, stride, storage offset from base's, base shape, base stride)."""
    if t is base:
        return None
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset(),
            tuple(base.shape), tuple(base.stride()))


def input_obj(args, kwargs):
    """What "input" records: the single positional argument itself, else the
    positional arguments (paths 0, 1, ...) and keyword arguments (by name)."""
    if len(args) == 1 and not kwargs:
        return args[0]
    return {**dict(enumerate(args)), **kwargs} if kwargs else args
