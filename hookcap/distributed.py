"""Merging histories across ranks (torch.distributed): counts, sums and
histograms add, extrema combine, moments are re-expressed about one common
shift — the same merge as repeated writes into one ring row, done with one
packed MIN all-reduce and one packed SUM all-reduce (plus one small object
all-gather to agree on metric names and steps).

Each metric's ``placement`` (its meta, ``hookcap._rows.tensors.placement_of``)
says how: ``"per_rank"`` (activations: each rank's own data) is summed; a
DTensor's local part is summed over the ranks whose meta says ``counted``
(coordinate 0 of each ``Replicate`` mesh dimension: ``Shard`` dimensions
add up to the whole tensor, replicas count once); a plain ``"replicated"``
parameter kind (DDP's parameters and gradients: the same tensor on every
rank) is counted once, from the lowest rank that has it, and ranks whose
copies differ (counts, extrema or histogram) are logged: replicas that
should be identical have diverged; a plain activation declared
``"replicated"`` counts once per distinct copy (ranks whose rows are
identical to a lower rank's add nothing: a tensor-parallel group's copies
count once, data-parallel groups' differing copies each count)."""

from __future__ import annotations

import numpy as np
import torch

import logging

from . import _layout
from ._host.record import StepRecord, make_record
from ._rows.config import PARAM_KINDS
from .history import History

log = logging.getLogger("hookcap")

_I64_MAX = np.iinfo(np.int64).max
# Columns a replica's copy must match bit for bit (sums may differ in their
# last bits: a GPU merges blocks in no fixed order).
_EXACT_COLS = [_layout.COUNT, _layout.NAN, _layout.POSINF, _layout.NEGINF, _layout.ZEROS,
               _layout.MIN, _layout.MAX, _layout.ABSMAX]
_SUM_COLS = [_layout.COUNT, _layout.NAN, _layout.POSINF, _layout.NEGINF, _layout.ZEROS, _layout.CALLS,
             _layout.BIG_N, _layout.SMALL_N, _layout.N4]
_F64_COLS = [_layout.SUM, _layout.SUMSQ] + [c for cols in _layout.MOMENT_SETS for c in cols[:2]] + \
    [_layout.S3, _layout.S4]


def _dense(records, local_names: list[str], nbins: int, names: list[str], steps: list[int]):
    """Raw int64 rows [S, M, width] of ``records`` (whose metric indices refer
    to ``local_names``) aligned to (steps, names), and which cells this rank
    wrote; cells a rank never wrote hold the values of a freshly reset row."""
    S, M = len(steps), len(names)
    rows = np.zeros((S, M, _layout.HEADER + nbins), dtype=np.int64)
    rows[..., : _layout.HEADER] = _layout.fresh_header()
    pos = {n: i for i, n in enumerate(names)}
    col = np.array([pos[n] for n in local_names], dtype=np.int64)
    srow = {s: i for i, s in enumerate(steps)}
    has = np.zeros((S, M), dtype=bool)
    for r in records:
        i = srow[r.step]
        m = col[r.metrics]
        rows[i, m, : _layout.HEADER] = r.header
        rows[i, m, _layout.HEADER + r.hist_lo: _layout.HEADER + r.hist_lo + r.hist.shape[1]] = r.hist
        has[i, m] = True
    return rows, has


def _fingerprint(rows: np.ndarray) -> np.ndarray:
    """A 62-bit hash of each row's exact columns and histogram (replicas'
    copies agree on it)."""
    cols = np.concatenate([rows[..., _EXACT_COLS], rows[..., _layout.HEADER:]], axis=-1).view(np.uint64)
    mult = (np.arange(cols.shape[-1], dtype=np.uint64) * np.uint64(2) + np.uint64(0x9E3779B97F4A7C15))
    with np.errstate(over="ignore"):
        h = np.bitwise_xor.reduce(cols * mult, axis=-1) if cols.shape[-1] else np.zeros(cols.shape[:-1], np.uint64)
    return (h & np.uint64((1 << 62) - 1)).astype(np.int64)


def _forget(rows: np.ndarray, cells) -> None:
    """Make ``cells`` (an index over the first two axes) of raw rows
    [S, M, width] as if this rank never wrote them (freshly reset rows: they
    add nothing to a merge)."""
    cells = cells if isinstance(cells, tuple) else (cells,)
    rows[cells + (slice(None, _layout.HEADER),)] = _layout.fresh_header()
    rows[cells + (slice(_layout.HEADER, None),)] = 0


def union_names(infos, names: list[str] | None = None, metas: dict | None = None):
    """Metric names of all ranks' ``info["names"]`` (with ``info["metas"]``) in
    rank order, first seen first, appended to ``names``/``metas`` (in place
    when given). Identical on every rank given the same gathered infos."""
    names = [] if names is None else names
    metas = {} if metas is None else metas
    for i in infos:
        for n in i["names"]:
            if n not in metas:
                names.append(n)
                metas[n] = i["metas"][n]
    return names, metas


def replicated_names(metas: dict) -> set[str]:
    """The plain replicated parameter kinds (``placement == "replicated"``,
    not a DTensor's: DDP): counted once, from the lowest rank that has them."""
    return {n for n, m in metas.items()
            if m.get("placement") == "replicated" and "mesh" not in m and m.get("kind") in PARAM_KINDS}


def copies_names(metas: dict) -> set[str]:
    """The plain replicated activations (declared by ``Monitor(placements=...)``
    or ``tap(placement=...)``): ranks holding identical copies count once."""
    return {n for n, m in metas.items()
            if m.get("placement") == "replicated" and "mesh" not in m and m.get("kind") not in PARAM_KINDS}


def uncounted_names(metas: dict) -> set[str]:
    """This rank's DTensor metrics that it does not count in merges (its
    local part is a replica of another rank's: ``counted`` False)."""
    return {n for n, m in metas.items() if m.get("counted") is False}


def merge_records(records, local_names: list[str], spec, names: list[str], steps: list[int],
                  group=None, replicated=(), uncounted=(), copies=()) -> list[StepRecord]:
    """Collective (every rank of ``group``, with the same ``names`` and
    ``steps``): this rank's ``records`` (metric indices into ``local_names``;
    only steps in ``steps``) merged with every other rank's, one record per
    step of ``steps`` against ``names``. Counts, sums and histograms add,
    extrema combine, moments are re-expressed about one common shift: one
    packed MIN and one packed SUM all-reduce (and a small MIN all-reduce
    first where ``replicated`` metrics exist). Metrics named in ``replicated``
    are counted once (the lowest rank that has the step's row; see the module
    docstring); this rank's rows of metrics named in ``uncounted`` add nothing
    (another rank holds the same data); a row of a metric named in ``copies``
    adds nothing where a lower rank holds an identical row (same counts,
    extrema and histogram: one all-gather of their fingerprints). Execution order and per-call data are this rank's (empty for
    a step it lacks)."""
    import torch.distributed as dist

    nb = spec.nbins if spec is not None else 0
    rows, has = _dense(records, local_names, nb, names, steps)
    _forget(rows, (slice(None), np.array([n in uncounted for n in names], dtype=bool)))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    dup = [i for i, n in enumerate(names) if n in copies]
    if dup:  # the same on every rank (names and metas are): all gather or none do
        fp_dup = np.where(has[:, dup], _fingerprint(rows[:, dup]), -1)
        t = torch.from_numpy(np.ascontiguousarray(fp_dup)).to(device)
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        lower = np.zeros_like(fp_dup, dtype=bool)
        for g in gathered[:rank]:
            lower |= g.cpu().numpy() == fp_dup
        lower &= fp_dup >= 0
        for j, i in enumerate(dup):
            _forget(rows, (lower[:, j], i))
    rep = np.array([n in replicated for n in names], dtype=bool)
    rep_has = has & rep[None, :]
    fp = np.where(rep_has, _fingerprint(rows), _I64_MAX)
    # Replicated metrics: the lowest rank with the row owns it (a small MIN
    # all-reduce first, only where there are any: the others' extrema must
    # not enter the merge either, should their copies differ).
    owner = np.where(rep_has, rank, world)
    if rep.any():
        t = torch.from_numpy(np.ascontiguousarray(owner)).to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        owner = t.cpu().numpy()
        _forget(rows, rep[None, :] & (owner != rank))

    # 1) one MIN all-reduce: min key, -max key, -absmax key, and a common shift
    #    (the smallest set shift key; every rank's shift is a central value of
    #    its own data, so any of them keeps the merged variance well conditioned).
    shift_keys = [np.where(rows[..., cs] == _layout.SHIFT_UNSET, _I64_MAX,
                           _layout.order_key(rows[..., cs].view(np.float64))) for _, _, cs in _layout.MOMENT_SETS]
    # The fingerprint's min and max tell whether replicas' copies agree.
    mins = np.stack([rows[..., _layout.MIN], -rows[..., _layout.MAX], -rows[..., _layout.ABSMAX],
                     shift_keys[0], fp, np.where(rep_has, -fp, _I64_MAX)] + shift_keys[1:], axis=-1)
    t = torch.from_numpy(np.ascontiguousarray(mins)).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    mins = t.cpu().numpy()
    diverged = (owner < world) & (mins[..., 4] != -mins[..., 5])
    if diverged.any() and rank == 0:
        bad = [names[m] for m in np.unique(np.nonzero(diverged)[1])]
        log.warning("hookcap: replicated metrics differ across ranks (replicas diverged, or the tensor is "
                    "not replicated): %s%s; the merged history holds the lowest rank's copy",
                    ", ".join(bad[:5]), f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    # Each replicated row's data from its owner only.
    drop = rep[None, :] & (owner != rank)
    # Each set of moments' common shift (the ordinary values', then the wide buckets').
    keys = [mins[..., 3]] + [mins[..., 6 + i] for i in range(len(_layout.MOMENT_SETS) - 1)]
    has_shift = [k != _I64_MAX for k in keys]
    common = [np.where(h, _layout._unkey(np.where(h, k, 0)), 0.0) for h, k in zip(has_shift, keys)]

    # 2) one SUM all-reduce (float64: counts are exact below 2**53): counts,
    #    sums, moments re-expressed about the common shift, histogram bins.
    f = rows[..., [_layout.SUM, _layout.SUMSQ]].copy().view(np.float64)
    moments = [m[..., None] for cols, to in zip(_layout.MOMENT_SETS, common)
               for m in _layout.moments_about(rows, to, cols)]
    moments += [m[..., None] for m in _layout.moments4_about(rows, common[0])]
    sums = np.concatenate([rows[..., _SUM_COLS].astype(np.float64), f[..., 0:1], f[..., 1:2],
                           *moments, rows[..., _layout.HEADER:].astype(np.float64)], axis=-1)
    sums[drop] = 0.0
    t = torch.from_numpy(np.ascontiguousarray(sums)).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    sums = t.cpu().numpy()

    out = np.zeros_like(rows)
    out[..., _SUM_COLS] = np.rint(sums[..., : len(_SUM_COLS)]).astype(np.int64)
    k = len(_SUM_COLS)
    nf = len(_F64_COLS)
    out[..., _F64_COLS] = np.ascontiguousarray(sums[..., k:k + nf]).view(np.int64)
    out[..., _layout.HEADER:] = np.rint(sums[..., k + nf:]).astype(np.int64)
    out[..., _layout.MIN] = mins[..., 0]
    out[..., _layout.MAX] = -mins[..., 1]
    out[..., _layout.ABSMAX] = -mins[..., 2]
    for (_, _, cs), h, c in zip(_layout.MOMENT_SETS, has_shift, common):
        out[..., cs] = np.where(h, c.view(np.int64), _layout.SHIFT_UNSET)

    # Execution order of each step from this rank's records (rank 0's on rank 0).
    orders = {r.step: r for r in records}
    col = {n: i for i, n in enumerate(names)}
    remap = np.array([col[n] for n in local_names], dtype=np.int64)
    recs = []
    for i, step in enumerate(steps):
        mine = orders.get(step)
        order = remap[mine.order] if mine is not None else np.empty(0, np.int64)
        calls = remap[mine.calls] if mine is not None else None
        bad = mine.calls_nonfinite if mine is not None else None
        recs.append(make_record(step, np.arange(len(names)), out[i], order, calls, bad))
    return recs


def merge_across_ranks(h: History, group=None) -> History:
    """Collective: every rank of ``group`` must call it. Returns the History
    of all ranks' data merged (identical on every rank). Metric rows agree
    across ranks even when a rank lacks a metric; execution order and per-call
    data are rank 0's."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    info = {"names": list(h.names), "steps": h.steps.tolist(),
            "metas": {n: h.meta(n) for n in h.names}, "hist": repr(h.histogram_spec)}
    infos = [None] * world
    dist.all_gather_object(infos, info, group=group)
    if len({i["hist"] for i in infos}) != 1:
        raise ValueError("merge_across_ranks: ranks recorded with different histogram specs")
    names, metas = union_names(infos)
    steps = sorted({s for i in infos for s in i["steps"]})
    recs = merge_records(h._records, h.names, h.histogram_spec, names, steps, group, replicated_names(metas),
                         uncounted_names({n: h.meta(n) for n in h.names}), copies_names(metas))
    merged = History(recs, names, metas, h.histogram_spec)
    merged.anomalies = list(getattr(h, "anomalies", []))
    return merged
