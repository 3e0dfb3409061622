"""The rows of grouped metrics (``Monitor(groups=...)``): a captured tensor
whose metric matches a glob is recorded as one row per group by one
``accumulate_groups`` call; each row is metric ``f"{metric}[{g}]"`` (meta
``group_of``, ``group``), and the drain merges them into ``metric`` itself
(``Catalog.group_index``), so the whole tensor costs no second read."""

from __future__ import annotations

import fnmatch

import torch

from ..groups import group_metric
from .config import metric_name
from .fastpath import SKIPPED, row_of

_OP_GROUPS = torch.ops.hookcap.accumulate_groups.default
_NONE = object()  # a key not looked at yet


class _Entry:
    __slots__ = ("extent", "dim", "size", "rows", "rids")

    def __init__(self, extent, dim, size, rows, rids):
        self.extent, self.dim, self.size, self.rows, self.rids = extent, dim, size, rows, rids


class GroupedRows:
    """Which captures are grouped, their rows, and their writes. ``rec``: the
    Recorder (rows, catalog, warnings and the step's write order)."""

    def __init__(self, rec) -> None:
        self.rec = rec
        self.specs = rec.config.groups
        self._entries: dict[tuple, _Entry | None] = {}

    def matches(self, metric: str) -> bool:
        """Whether ``metric`` is grouped (its glob matches)."""
        return any(fnmatch.fnmatchcase(metric, glob) for glob, _ in self.specs)

    def grad_hook(self, name: str, path: str, mtype: str, ci: int):
        """A tensor hook writing a grouped gradient through ``write`` (the C++
        gradient sink writes whole rows only)."""
        rec = self.rec

        def hook(grad):
            if rec.recording and grad is not None:
                rec.write(name, "grad_output", path, grad, mtype, ci, via_op=True)
            return None

        return hook

    def write(self, key: tuple, t: torch.Tensor, mtype: str, spec=None) -> bool:
        """Record ``t`` (capture ``key``) by groups: ``spec``'s, else a glob's;
        False where it is not grouped (the caller records it whole)."""
        e = self._entries.get(key, _NONE)
        if e is _NONE:
            e = self._entries[key] = self._make(key, t, mtype, spec)
        if e is None:
            return False
        rec = self.rec
        if t.shape[e.dim] != e.extent:  # another number of groups than the rows hold
            rec.skip_call(metric_name(*key[:3]), f"groups: dimension {e.dim} is {t.shape[e.dim]}, was {e.extent}")
            return True
        ring = rec.ring_of(e.rids[0])
        try:
            _OP_GROUPS(t, ring.ring, ring.state, e.rows, e.dim, e.size, *rec.config.hist_args)
        except Exception as ex:  # telemetry must never take the run down
            rec.skip_call(metric_name(*key[:3]), f"{type(ex).__name__}: {ex}")
            return True
        order = rec._order
        if e.rids[0] not in order:
            for rid in e.rids:
                order[rid] = None
            rec.fast.note_python_write()
        return True

    def _make(self, key: tuple, t: torch.Tensor, mtype: str, spec=None) -> _Entry | None:
        rec = self.rec
        name, kind, path, device = key[:4]
        metric = metric_name(name, kind, path)
        if spec is None:
            spec = next((g for glob, g in self.specs if fnmatch.fnmatchcase(metric, glob)), None)
        if spec is None or not t.is_floating_point():
            return None
        try:
            count = spec.count(tuple(t.shape))
        except ValueError as ex:
            rec.warn_once(("groups", metric), f"hookcap: {metric}: recorded whole, not by groups: {ex}")
            return None
        layout = rec.plain_layout(name, kind, path)
        dim = spec.dim % t.dim()
        shape = tuple(t.shape[:dim]) + (spec.size,) + tuple(t.shape[dim + 1:])
        # The whole metric first (names keep first-execution order), with no row of its own.
        rec.catalog.add(metric, {"module_type": mtype, "kind": kind, "shape": tuple(t.shape), "dtype": str(t.dtype),
                                 "groups": count, **layout})
        rec.catalog.module_of[metric] = name
        rids = []
        for g in range(count):
            gm = group_metric(metric, g)
            rid = rec.register_row((*key, "group", g), device, shape, str(t.dtype), mtype, layout=layout,
                                   metric=gm, extra={"group_of": metric, "group": g})
            if rid == SKIPPED:
                return None
            rids.append(rid)
        return _Entry(t.shape[dim], dim, spec.size, [row_of(r) for r in rids], rids)
