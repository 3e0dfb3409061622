"""The rows of grouped metrics (``Monitor(groups=...)``): a captured tensor
whose metric matches a glob is recorded as one row per group by one
``accumulate_groups`` call; each row is metric ``f"{metric}[{g}]"`` (meta
``group_of``, ``group``), and the drain merges them into ``metric`` itself
(``Catalog.group_index``), so the whole tensor costs no second read."""

from __future__ import annotations

import fnmatch

import torch

from ..groups import Channels, Groups, group_metric
from .config import metric_name
from .fastpath import SKIPPED, row_of

_OP_GROUPS = torch.ops.hookcap.accumulate_groups.default
_OP_BINS = torch.ops.hookcap.accumulate_bins.default
_NONE = object()  # a key not looked at yet
WHOLE = object()  # write(..., spec=WHOLE): not grouped, whatever the globs say
_PER_ELEMENT = Groups(dim=0, size=1)


class _Entry:
    """A grouped capture's rows: ``extent`` groups (bins), each ``size``
    slices along ``dim`` (None for bins)."""

    __slots__ = ("extent", "dim", "size", "rows", "rids")

    def __init__(self, extent, dim, size, rows, rids):
        self.extent, self.dim, self.size, self.rows, self.rids = extent, dim, size, rows, rids


class GroupedRows:
    """Which captures are grouped, their rows, and their writes. ``rec``: the
    Recorder (rows, catalog, warnings and the step's write order)."""

    def __init__(self, rec) -> None:
        self.rec = rec
        self.specs = rec.config.groups
        self._entries: dict[tuple, _Entry | Channels | None] = {}  # None: recorded whole

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
        if spec is WHOLE:
            return False
        e = self._entry(key, t, mtype, spec)
        if e is None:
            return False
        if isinstance(e, Channels):
            self._channels(key, t, mtype, e)
            return False  # the tensor itself is recorded whole as well
        rec = self.rec
        if t.shape[e.dim] != e.extent * e.size:  # another number of groups than the rows hold
            rec.skip_call(metric_name(*key[:3]), f"groups: dimension {e.dim} is {t.shape[e.dim]}, was {e.extent * e.size}")
            return True
        hist = rec.config.hist_args
        self._call(key, e, lambda ring: _OP_GROUPS(t, ring.ring, ring.state, e.rows, e.dim, e.size, *hist))
        return True

    def write_bins(self, key: tuple, index: torch.Tensor, weight: torch.Tensor | None, bins: int, mtype: str,
                   placement: str | None = None) -> None:
        """Record ``index`` (capture ``key``: integer, e.g. a router's top-k
        expert choices) as ``bins`` groups: group ``b`` gets the values
        (``weight``'s, or 1.0) of the elements equal to ``b``, so its count
        is the bincount."""
        e = self._entries.get(key, _NONE)
        if e is _NONE:
            dtype = str((weight if weight is not None else index).dtype)
            made = self._register(key, bins, tuple(index.shape), dtype, mtype, placement=placement)
            e = self._entries[key] = None if made is None else _Entry(bins, None, None, *made)
        if e is None:
            return
        if e.extent != bins:
            self.rec.skip_call(metric_name(*key[:3]), f"bins: {bins}, was {e.extent}")
            return
        if not index.is_contiguous():
            index = index.contiguous()  # router choices: tokens x k integers, small
        if weight is not None and not weight.is_contiguous():
            weight = weight.contiguous()
        hist = self.rec.config.hist_args
        self._call(key, e, lambda ring: _OP_BINS(index, weight, ring.ring, ring.state, e.rows, *hist))

    def write_joint(self, parts, mtype: str, spec, op_on) -> bool:
        """Record captures that one op call writes together: ``parts`` are
        ``(key, t)`` (``t``: the capture, or any tensor of its shape and
        dtype), each grouped by ``spec``; ``op_on(ring, rows)``: the call,
        ``rows`` each part's rows in order. False, with nothing written,
        where a part is not grouped alike or the parts' rows lie in
        different rings: the caller then writes each part itself."""
        entries = []
        for key, t in parts:
            e = self._entry(key, t, mtype, spec)
            if not isinstance(e, _Entry) or e.dim is None or t.shape[e.dim] != e.extent * e.size:
                return False
            entries.append(e)
        rec = self.rec
        ring = rec.ring_of(entries[0].rids[0])
        if any(rec.ring_of(e.rids[0]) is not ring for e in entries[1:]):
            return False
        try:
            op_on(ring, [e.rows for e in entries])
        except Exception as ex:  # telemetry must never take the run down
            for key, _ in parts:
                rec.skip_call(metric_name(*key[:3]), f"{type(ex).__name__}: {ex}")
            return True
        for e in entries:
            self._ordered(e)
        return True

    def _channels(self, key: tuple, t: torch.Tensor, mtype: str, spec: Channels) -> None:
        """``spec.summarize(t)``'s metrics, ``f"{metric}.{suffix}"`` (a
        top-k's one group per rank)."""
        name, kind, path, _, ci = key[:5]
        try:
            with torch.no_grad():
                parts = spec.summarize(t.detach())
        except Exception as ex:  # telemetry must never take the run down
            self.rec.skip_call(metric_name(name, kind, path), f"channels: {type(ex).__name__}: {ex}")
            return
        for suffix, v, by_rank in parts:
            self.rec.write(name, kind, f"{path}.{suffix}" if path else suffix, v, mtype, ci,
                           groups=_PER_ELEMENT if by_rank else WHOLE)

    def _call(self, key: tuple, e: _Entry, op_on) -> None:
        """``op_on(ring)``: the op call writing ``e``'s rows of that ring;
        then its rows join the step's write order."""
        rec = self.rec
        try:
            op_on(rec.ring_of(e.rids[0]))
        except Exception as ex:  # telemetry must never take the run down
            rec.skip_call(metric_name(*key[:3]), f"{type(ex).__name__}: {ex}")
            return
        self._ordered(e)

    def _ordered(self, e: _Entry) -> None:
        """``e``'s rows join the step's write order (once a step)."""
        order = self.rec._order
        if e.rids[0] not in order:
            for rid in e.rids:
                order[rid] = None
            self.rec.fast.note_python_write()

    def _entry(self, key: tuple, t: torch.Tensor, mtype: str, spec):
        """Capture ``key``'s entry, made from ``t`` on first sight."""
        e = self._entries.get(key, _NONE)
        if e is _NONE:
            e = self._entries[key] = self._make(key, t, mtype, spec)
        return e

    def _make(self, key: tuple, t: torch.Tensor, mtype: str, spec=None) -> _Entry | None:
        rec = self.rec
        name, kind, path, device = key[:4]
        metric = metric_name(name, kind, path)
        if spec is None:
            spec = next((g for glob, g in self.specs if fnmatch.fnmatchcase(metric, glob)), None)
        if spec is None or not t.is_floating_point():
            return None
        if isinstance(spec, Channels):
            return spec
        try:
            count = spec.count(tuple(t.shape))
        except ValueError as ex:
            rec.warn_once(("groups", metric), f"hookcap: {metric}: recorded whole, not by groups: {ex}")
            return None
        dim = spec.dim % t.dim()
        shape = tuple(t.shape[:dim]) + (spec.size,) + tuple(t.shape[dim + 1:])
        made = self._register(key, count, tuple(t.shape), str(t.dtype), mtype, shape)
        return None if made is None else _Entry(count, dim, spec.size, *made)

    def _register(self, key: tuple, count: int, shape: tuple, dtype: str, mtype: str,
                  group_shape: tuple | None = None, placement: str | None = None) -> tuple[list, list] | None:
        """The whole metric of capture ``key`` (no row of its own) and a row
        per group (meta shape ``group_shape``, else the whole's: a bin's
        elements are picked from all of it): ``(rows, row ids)``, or None
        where a row cannot be made (a CUDA graph capture)."""
        rec = self.rec
        name, kind, path, device = key[:4]
        metric = metric_name(name, kind, path)
        layout = rec.plain_layout(name, kind, path, placement)
        # The whole metric first (names keep first-execution order).
        rec.catalog.add(metric, {"module_type": mtype, "kind": kind, "shape": shape, "dtype": dtype,
                                 "groups": count, **layout})
        rec.catalog.module_of[metric] = name
        rids = []
        for g in range(count):
            gm = group_metric(metric, g)
            rid = rec.register_row((*key, "group", g), device, group_shape or shape, dtype, mtype, layout=layout,
                                   metric=gm, extra={"group_of": metric, "group": g})
            if rid == SKIPPED:
                return None
            rids.append(rid)
        return [row_of(r) for r in rids], rids
