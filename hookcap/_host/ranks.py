"""Where sink records go in a multi-rank run (``Monitor(rank_sinks=...)``):
a handshake through the c10d store at the first ``step()`` that sees a process
group, then either per-rank sinks, or records merged across ranks in front
of rank 0's sinks every few steps (``hookcap.monitor.RANK_MERGE_EVERY``; see
the Monitor's docstring for the contract)."""

from __future__ import annotations

import itertools
import logging
from datetime import timedelta

import torch

from .._rows.catalog import Catalog, UpdateBases
from .._rows.config import Config
from .record import StepRecord
from ..drained import DrainedStep

log = logging.getLogger("hookcap")

# Process-global: Monitors of this process that reached the handshake (each
# handshake's c10d store keys are unique, and equal on every rank).
HANDSHAKE_SEQ = itertools.count()


class RankMerger:
    """``rank``: this process's rank in a multi-rank run, else None.
    ``merging``: rank 0's sinks receive records merged across ranks."""

    def __init__(self, config: Config, catalog: Catalog, sinks):
        self.config = config
        self.catalog = catalog
        self.sinks = sinks
        self.rank: int | None = None
        self.decided = False
        self._group = None  # the gloo group of merged rank_sinks
        self._pending: list[StepRecord] = []  # completed records not merged yet
        self._names: list[str] = []  # union of all ranks' metric names (same on every rank)
        self._update_bases = UpdateBases(self._names)
        self._metas: dict = {}
        self._names_sent = 0  # own metric names already sent to the other ranks

    @property
    def merging(self) -> bool:
        return self._group is not None

    def hold(self, rec: StepRecord) -> bool:
        """Keep ``rec`` for the next merge (True) or let the sinks have it now."""
        if self._group is None:
            return False
        self._pending.append(rec)
        return True

    def due(self, step: int, every: int) -> bool:
        """The ``step()`` closing ``step`` merges, merging every ``every``
        steps: the same step on every rank (step() counts agree)."""
        return self._group is not None and step % every == every - 1

    def setup(self, timeout_s: float) -> None:
        """Once, at the first step() that sees an initialised process group:
        where this Monitor's sink records go (see ``rank_sinks``)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return  # single process (so far): records go to the sinks as they are
        self.decided = True
        if dist.get_world_size() <= 1:
            return
        self.rank = dist.get_rank()
        if self.config.rank_sinks == "merged":
            decision = self._handshake(timeout_s)
            if decision == "none":
                return  # no rank has sinks: nothing to merge, no collective ever
            if decision == "merged":
                self._group = dist.new_group(backend="gloo")
                self.sinks.bind_rank(None)
                if self.rank != 0 and self.sinks.active:
                    log.info("hookcap: rank_sinks='merged': rank 0 writes the records merged across "
                             "ranks; the sinks of rank %d receive nothing (rank_sinks='all' gives "
                             "one stream per rank)", self.rank)
                return
        self.sinks.bind_rank(self.rank)  # "all", or the fallback of "merged"

    def _handshake(self, timeout: float) -> str:
        """Agree with the other ranks' Monitors through the c10d store: each
        rank publishes whether it has sinks and waits for all the others; the
        first rank to decide writes the outcome, which every rank follows:
        "merged", "none" (every rank answered, none has sinks) or "local"
        (some rank did not answer in time: per-rank sinks)."""
        dist = torch.distributed
        world, rank = dist.get_world_size(), self.rank
        base = f"hookcap/rank_sinks/{next(HANDSHAKE_SEQ)}"
        keys = [f"{base}/{r}" for r in range(world)]
        missing: list[int] = []
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(keys[rank], "1" if self.sinks.active else "0")
            try:
                store.wait(keys, timedelta(seconds=timeout))
                want = "merged" if any(store.get(k) == b"1" for k in keys) else "none"
            except RuntimeError:  # timed out (c10d DistStoreError)
                want = "local"
            decision = store.compare_set(f"{base}/decision", "", want).decode()
            if decision == "local":
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except Exception as e:
            log.warning("hookcap: rank_sinks='merged': the c10d store handshake failed (%s: %s); "
                        "this Monitor falls back to per-rank sinks", type(e).__name__, e)
            return "local"
        if decision == "local":
            who = (f"rank(s) {missing} did not answer within {timeout:g} s" if missing else
                   f"another rank gave up waiting (RANK_HANDSHAKE_TIMEOUT_S = {timeout:g} s)")
            log.warning("hookcap: rank_sinks='merged' needs a Monitor on every rank calling step() "
                        "and detach(); %s, so this Monitor (rank %d) falls back to per-rank sinks, "
                        "as with rank_sinks='all' (pass rank_sinks='all' to skip this wait)",
                        who, rank)
        return decision

    def merge(self, watermark: int) -> None:
        """On every rank at every due step() and at detach():
        one all_gather_object of (watermark, pending steps, new metric names),
        then, for the steps every rank has complete, one MIN and one SUM
        all-reduce (skipped together when nothing is due or rank 0 has no
        sinks); rank 0 writes the merged records in step order. ``watermark``:
        every recorded step up to it is complete on this rank (or dropped)."""
        from ..distributed import copies_names, merge_records, replicated_names, uncounted_names, union_names

        dist = torch.distributed
        group = self._group
        names, metas, histogram = self.catalog.names, self.catalog.metas, self.config.histogram
        new = names[self._names_sent:]
        info = {"watermark": watermark, "steps": [r.step for r in self._pending],
                "names": new, "metas": {n: metas[n] for n in new},
                "hist": repr(histogram), "write": bool(self.sinks.active)}
        infos = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, info, group=group)
        self._names_sent += len(new)
        union_names(infos, self._names, self._metas)
        if len({i["hist"] for i in infos}) != 1:
            self._unmerge("the ranks record with different histogram specs")
            return
        cut = min(i["watermark"] for i in infos)
        steps = sorted({s for i in infos for s in i["steps"] if s <= cut})
        due = [r for r in self._pending if r.step <= cut]
        self._pending = [r for r in self._pending if r.step > cut]
        if not steps or not infos[0]["write"]:
            return  # the same on every rank: all skip the all-reduces
        recs = merge_records(due, names, histogram, self._names, steps, group, replicated_names(self._metas),
                             uncounted_names(metas), copies_names(self._metas))
        if self.rank == 0:
            for rec in recs:
                self.sinks.write(DrainedStep(rec, self._names, self._metas, histogram,
                                             update_bases=self._update_bases()))

    def _unmerge(self, why: str) -> None:
        """Every rank at once (decided from the same gathered data): stop
        merging, write the pending records to this rank's own sinks."""
        log.error("hookcap: rank_sinks='merged': %s; this Monitor falls back to per-rank sinks", why)
        self._group = None
        self.sinks.bind_rank(self.rank)
        pending, self._pending = self._pending, []
        for rec in pending:
            self.sinks.write(DrainedStep(rec, self.catalog.names, self.catalog.metas,
                                         self.config.histogram, self.rank, self.catalog.update_bases()))

