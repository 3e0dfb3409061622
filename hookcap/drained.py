"""One recorded step as detectors and sinks see it, on the host."""

from __future__ import annotations

import numpy as np

from . import _layout
from .histogram import Histogram
from ._rows.catalog import UpdateBases
from ._host.record import StepRecord


class DrainedStep:
    """The statistics of every metric written in one recorded step.

    Attributes:
        step: the step number.
        calls / calls_nonfinite: metric name of every module call in execution
            order, and whether that call saw NaN/Inf (finer than ``names``).
        names: metric names written in this step, in first-execution order
            (forward kinds in hook order, then backward kinds in backward order,
            then ``param`` kinds recorded at ``step()``).
        stats: stat name -> np.float64 [len(names)] (every name of
            ``hookcap.STAT_NAMES``, and ``fwd_ms``/``bwd_ms``: the owning
            module's durations with ``Monitor(timing=True)``, else NaN),
            aligned with ``names``.
        histogram_spec: the Monitor's Histogram (or None).
        metas: metric name -> ``{"module_type", "kind", "shape", "dtype"}``.
        rank: in a multi-rank run (torch.distributed initialised, world size
            > 1), the rank whose own data this step holds (what detectors see,
            and what sinks get with ``Monitor(rank_sinks="all")``); None for
            records merged across ranks and in a single process.
    """

    def __init__(self, rec: StepRecord, all_names: list[str], metas: dict,
                 histogram: Histogram | None, rank: int | None = None,
                 update_bases: np.ndarray | None = None):
        self.step = rec.step
        self.rank = rank
        # Execution order first; metrics written but missing from the order
        # (none in practice) keep their row order after it.
        # (Vectorised: thousands of metrics a step.)
        metrics, order = np.asarray(rec.metrics, np.int64), np.asarray(rec.order, np.int64)
        size = int(max(metrics.max(initial=-1), order.max(initial=-1))) + 1
        pos = np.full(size, -1, dtype=np.int64)
        pos[metrics] = np.arange(len(metrics))
        order = order[order >= 0]
        ordered = order[pos[order] >= 0]
        seen = np.zeros(size, dtype=bool)
        seen[ordered] = True
        ordered = np.concatenate([ordered, metrics[~seen[metrics]]])
        rows = pos[ordered]
        self._rows = rows
        self._rec = rec
        self.names = [all_names[m] for m in ordered.tolist()]
        self._index_cache = None
        self.stats = _layout.decode(rec.header[rows]) if len(rows) else _layout.decode(
            np.zeros((0, _layout.HEADER), dtype=np.int64))
        t = rec.time_ns[rows] / 1e6 if rec.time_ns is not None else np.full((len(rows), 2), np.nan)
        self.stats["fwd_ms"], self.stats["bwd_ms"] = t[:, 0], t[:, 1]
        # update_ratio: each {param}/update's l2norm over its {param}/update.base's, where
        # both are in this step (update_bases: _catalog.UpdateBases, indexed by metric).
        bases = UpdateBases(all_names)() if update_bases is None else update_bases
        local = np.full(len(bases), -1, dtype=np.int64)
        local[ordered] = np.arange(len(ordered))
        j = local[bases[ordered]]
        j[bases[ordered] < 0] = -1
        has = j >= 0
        l2 = self.stats["l2norm"]
        ratio = np.full(len(ordered), np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio[has] = l2[has] / l2[j[has]]
        self.stats["update_ratio"] = ratio
        self.histogram_spec = histogram
        self.metas = metas
        # Per call of each module, in execution order (a module called twice
        # appears twice): which metric, and whether that call saw NaN/Inf.
        self.calls = [all_names[m] for m in np.asarray(rec.calls).tolist()]
        self.calls_nonfinite = rec.calls_nonfinite

    @property
    def _index(self) -> dict[str, int]:
        if self._index_cache is None:
            self._index_cache = {n: i for i, n in enumerate(self.names)}
        return self._index_cache

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def stats_of(self, name: str) -> dict[str, float]:
        """All stats of one metric as plain floats."""
        i = self._index[name]
        return {k: float(v[i]) for k, v in self.stats.items()}

    def histogram(self, name: str) -> np.ndarray:
        """np.int64 [nbins] counts of one metric."""
        if self.histogram_spec is None:
            raise ValueError("recorded with histogram=None")
        r = self._rows[self._index[name]]
        out = np.zeros(self.histogram_spec.nbins, dtype=np.int64)
        lo, h = self._rec.hist_lo, self._rec.hist
        out[lo:lo + h.shape[1]] = h[r]
        return out

    def quantiles(self, q):
        """Every metric's quantiles at once, from its histogram: a
        :class:`hookcap.quantiles.Quantiles` with arrays [len(names)] for a
        float ``q``, [len(names), len(q)] for a sequence (of ``|x|`` for a
        log2 histogram; see ``History.quantile``)."""
        from .quantiles import from_stats

        spec = self.histogram_spec
        if spec is None:
            raise ValueError("recorded with histogram=None")
        lo, band = self.histogram_band()
        counts = np.zeros((len(self.names), spec.nbins), dtype=np.int64)
        counts[:, lo:lo + band.shape[1]] = band
        return from_stats(counts, spec, q, self.stats.__getitem__)

    def histogram_band(self) -> tuple[int, np.ndarray]:
        """Every metric's histogram at once: ``(offset, counts)`` with
        ``counts`` np.int64 ``[len(names), width]`` aligned with ``names``;
        ``counts[i, j]`` is the number of finite values of metric ``names[i]``
        in bin ``offset + j`` (bins as in ``histogram_spec``). Every bin outside
        ``offset`` … ``offset + width - 1`` is 0 for every metric of this step
        (the band is shared by the step, so a metric's own band is usually
        narrower; ``width`` may be 0). ``histogram(name)`` is row ``i`` placed
        at ``offset`` in ``nbins`` zeros; this accessor costs one gather instead
        of one call per metric."""
        if self.histogram_spec is None:
            raise ValueError("recorded with histogram=None")
        return int(self._rec.hist_lo), self._rec.hist[self._rows]

    def __repr__(self) -> str:
        r = "" if self.rank is None else f", rank={self.rank}"
        return f"DrainedStep(step={self.step}, metrics={len(self)}{r})"
