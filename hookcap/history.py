"""The read view of recorded steps: :class:`History`, and :func:`load` to
read one back from a file."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from . import _layout, io
from .anomaly import Anomaly
from .histogram import Histogram


class History:
    """Recorded statistics: ``h.steps`` (np.int64 [S], recorded steps only),
    ``h.names`` (list[str] [M], first-execution order), ``h[stat]`` -> np.float64
    [S, M] with NaN where a metric was not recorded (with
    ``Monitor(timing=True)`` also ``h["fwd_ms"]``, ``h["bwd_ms"]``: the owning
    module's forward / backward milliseconds that step, summed over its calls), ``h.histogram(name)`` ->
    np.int64 [S, B], ``h.bin_edges``, ``h.last(n)``, ``h.meta(name)``,
    ``h.to_pandas()``."""

    def __init__(self, records, names, metas, histogram: Histogram | None):
        # Nothing is decoded here: a statistic's [S, M] array is decoded from
        # the steps' compact records when first read, one step at a time, and
        # kept; a histogram is decoded for its one metric on every call.
        self._records = list(records)
        self.names: list[str] = list(names)
        self._metas = dict(metas)
        self._histogram = histogram
        self.anomalies: list[Anomaly] = []  # set by Monitor.history and load
        self.extra: dict = {}
        self._index = {n: i for i, n in enumerate(self.names)}
        self.steps = np.array([r.step for r in self._records], dtype=np.int64)
        self._timed = any(r.time_ns is not None for r in self._records)
        # moments=4: some row holds third and fourth moments
        self._moments4 = any(bool((r.header_column(_layout.N4) > 0).any()) for r in self._records)
        self._stats = _Columns(self)
        self._recorded_cells = None

    @property
    def _recorded(self) -> np.ndarray:
        """bool [S, M]: whether each metric was written at each step."""
        if self._recorded_cells is None:
            out = np.zeros((len(self._records), len(self.names)), dtype=bool)
            for s, r in enumerate(self._records):
                out[s, r.metrics] = r.header_column(_layout.CALLS) > 0
            self._recorded_cells = out
        return self._recorded_cells

    @_recorded.setter
    def _recorded(self, value) -> None:
        self._recorded_cells = value

    def _decode(self, stat: str) -> np.ndarray:
        """float64 [S, M] of one statistic, NaN where not recorded."""
        out = np.full((len(self._records), len(self.names)), np.nan)
        if stat in _layout.TIMING_NAMES:
            col = _layout.TIMING_NAMES.index(stat)
            for s, r in enumerate(self._records):
                if r.time_ns is not None:
                    out[s, r.metrics] = r.time_ns[:, col] / 1e6
            out[~self._recorded] = np.nan
            return out
        cols = _STAT_COLUMNS[stat] + (_layout.CALLS,)
        for s, r in enumerate(self._records):
            rows = np.zeros((len(r.metrics), _layout.HEADER), dtype=np.int64)
            for c in cols:  # only the columns this statistic reads
                rows[:, c] = r.header_column(c)
            v = _layout.decode(rows)[stat]
            written = rows[:, _layout.CALLS] > 0  # NaN where a row was not written (no S x M mask)
            out[s, r.metrics] = v if written.all() else np.where(written, v, np.nan)
        return out

    def _decode_all(self) -> None:
        """Every statistic in one pass over the steps (what reading them all needs)."""
        cols = self._stats
        todo = [k for k in cols._names if k not in cols._done and k not in _layout.TIMING_NAMES]
        if not todo:
            return
        outs = {k: np.full((len(self._records), len(self.names)), np.nan) for k in todo}
        for s, r in enumerate(self._records):
            d = _layout.decode(r.header_now())
            for k in todo:
                outs[k][s, r.metrics] = d[k]
        rec = self._recorded
        for k, v in outs.items():
            v[~rec] = np.nan
            cols._done[k] = v

    @property
    def stat_names(self) -> tuple[str, ...]:
        """``hookcap.STAT_NAMES``, then ``m3``, ``m4``, ``skew``, ``kurtosis`` if
    recorded with ``moments=4``, and ``fwd_ms``, ``bwd_ms`` if recorded with timing."""
        return tuple(self._stats)

    @property
    def bin_edges(self) -> np.ndarray | None:
        return None if self._histogram is None else self._histogram.bin_edges

    @property
    def histogram_spec(self) -> Histogram | None:
        return self._histogram

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, stat: str) -> bool:
        return stat in self._stats

    def __getitem__(self, stat: str) -> np.ndarray:
        try:
            return self._stats[stat]
        except KeyError:
            if stat in _layout.TIMING_NAMES:
                raise KeyError(f"{stat!r}: this history has no timing (recorded without Monitor(timing=True), "
                               "or merged across ranks, which leaves timing out)") from None
            raise KeyError(f"unknown stat {stat!r}; available: {', '.join(self._stats)}") from None

    def column(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"unknown metric {name!r}") from None

    def groups(self, name: str, stat: str) -> np.ndarray:
        """np.float64 [S, G]: statistic ``stat`` of each group of metric
        ``name`` (``Monitor(groups=...)``: group ``g`` is metric
        ``f"{name}[{g}]"``), NaN where not recorded; ``self[stat]`` keeps
        ``name``'s own column, the whole tensor's value. ``KeyError`` if
        ``name`` was not recorded by groups."""
        cols = sorted((m["group"], self._index[n]) for n, m in self._metas.items()
                      if m.get("group_of") == name and n in self._index)
        if not cols:
            raise KeyError(f"{name!r} has no groups (Monitor(groups={{glob: hookcap.Groups(dim, size)}}))")
        return self[stat][:, [c for _, c in cols]]

    def update_ratio(self, param: str) -> np.ndarray:
        """np.float64 [S]: ``‖Δw‖ / ‖w_before‖`` of parameter ``param`` (its
        qualified name) at each step, from ``capture="update"``'s
        ``{param}/update`` and ``{param}/update.base`` l2norms; NaN where not
        recorded. ``KeyError`` if ``param``'s update was never recorded."""
        num, den = (self.column(f"{param}/update{s}") for s in ("", ".base"))
        norms = self["l2norm"]
        with np.errstate(divide="ignore", invalid="ignore"):
            return norms[:, num] / norms[:, den]

    @property
    def skipped(self) -> np.ndarray:
        """np.bool_ [S]: whether ``torch.amp.GradScaler`` or
        ``hookcap.SkipStep`` skipped the optimizer's step at each step
        (metric ``optimizer/skipped``: its max > 0; GradScaler's recorded for
        fused optimizers, and for any with ``Monitor(grad_scaler=...)``); all
        False where not recorded."""
        if "optimizer/skipped" not in self._index:
            return np.zeros(len(self), dtype=bool)
        return np.nan_to_num(self["max"][:, self.column("optimizer/skipped")], nan=0.0) > 0

    def quantile(self, name: str, q) -> "Quantiles":
        """Quantiles of one metric's finite values at each step, from its
        histogram: a :class:`hookcap.quantiles.Quantiles` whose ``value``,
        ``lower``, ``upper`` and ``rel_error`` are float64 [S] for a float
        ``q``, [S, len(q)] for an array (NaN where not recorded). With an
        unsigned log2 histogram these are quantiles of ``|x|``
        (``of == "|x|"``). The true
        quantile lies in ``[lower, upper]``; ``rel_error`` is the guaranteed
        relative error of ``value`` (docs/statistics.md#quantiles)."""
        from .quantiles import from_stats

        if self._histogram is None:
            raise ValueError("History.quantile needs histograms: this history was recorded with histogram=None")
        m = self.column(name)
        return from_stats(self.histogram(name), self._histogram, q, lambda s: self[s][:, m])

    def fp8_fit(self, name: str, fmt: str = "e4m3", scaling="amax"):
        """How one metric's values would fit an FP8 format at each step: a
        :class:`hookcap.fp8.FP8Fit` with bounded fractions [S] that would
        underflow to zero, become subnormal or saturate when cast as
        ``x * s`` (``scaling="amax"``: ``s = max / absmax`` per step, as
        per-tensor current scaling does; or a float ``s``). ``fmt``:
        ``"e4m3"`` or ``"e5m2"``. Needs a log2 histogram; exact where the
        thresholds fall on bin edges, but for halfway ties (docs/statistics.md#fp8-fit)."""
        from .fp8 import fit

        if self._histogram is None:
            raise ValueError("History.fp8_fit needs histograms: this history was recorded with histogram=None")
        return fit(self.histogram(name), self._histogram, self["absmax"][:, self.column(name)], fmt, scaling)

    def histogram(self, name: str) -> np.ndarray:
        """np.int64 [S, B] histogram counts of one metric (zeros where not recorded)."""
        if self._histogram is None:
            raise ValueError("this history was recorded with histogram=None")
        m = self.column(name)
        out = np.zeros((len(self._records), self._histogram.nbins), dtype=np.int64)
        for s, r in enumerate(self._records):
            hit = np.flatnonzero(r.metrics == m)
            if hit.size:
                lo, counts = r.metric_band(int(hit[0]))
                out[s, lo:lo + len(counts)] = counts
        return out

    def order(self, step: int) -> list[str]:
        """Metric names in the order they were first written during ``step``."""
        for r in self._records:
            if r.step == step:
                return [self.names[i] for i in r.order]
        raise KeyError(f"step {step} is not in this history")

    def last(self, n: int) -> History:
        """A History of the newest ``n`` recorded steps."""
        return History(self._records[-n:] if n > 0 else [], self.names, self._metas, self._histogram)

    @staticmethod
    def concat(histories) -> History:
        """One History of several recorded one after another (a run and its
        resumption from a checkpoint, say): their steps in order, each value
        unchanged. Metric names are the union in first-appearance order, a
        name's metadata as first seen; ``anomalies`` are joined and ``extra`` is
        the last one's. ``ValueError`` if the histograms differ, a step
        repeats or goes back, or a history was loaded from Parquet (no raw
        step records)."""
        from ._host.record import StepRecord

        histories = list(histories)
        if not histories:
            raise ValueError("History.concat: no history given")
        spec = histories[0]._histogram
        names: list[str] = []
        index: dict[str, int] = {}
        metas: dict = {}
        records = []
        last = None
        for h in histories:
            if isinstance(h, _ColumnHistory) or not isinstance(h, History):
                raise ValueError("History.concat: each history must hold step records (one of Monitor.history(), "
                                 "hookcap.load of an .npz file), not decoded statistics from Parquet")
            if h._histogram != spec:
                raise ValueError(f"History.concat: histograms differ ({spec!r} and {h._histogram!r})")
            if len(h.steps) and last is not None and h.steps[0] <= last:
                raise ValueError(f"History.concat: step {int(h.steps[0])} does not follow step {last}: the "
                                 "histories overlap or are out of order")
            for n in h.names:
                if n not in index:
                    index[n] = len(names)
                    names.append(n)
                    metas[n] = h._metas[n]
            to = np.array([index[n] for n in h.names], dtype=np.int64)
            for r in h._records:
                records.append(StepRecord(r.step, to[r.metrics], r.header, r.hist_lo, r.hist, to[r.order],
                                          to[r.calls], r.calls_nonfinite, r.time_ns))
            if len(h.steps):
                last = int(h.steps[-1])
        out = History(records, names, metas, spec)
        out.anomalies = [a for h in histories for a in h.anomalies]
        out.extra = dict(histories[-1].extra)
        return out

    def meta(self, name: str) -> dict:
        """``module_type``, ``kind``, ``shape``, ``dtype`` as first seen."""
        self.column(name)
        return dict(self._metas[name])

    def to_pandas(self):
        """Long format: one row per (step, metric) that was recorded."""
        import pandas as pd

        self._decode_all()
        s_idx, m_idx = np.nonzero(self._recorded)
        data = {"step": self.steps[s_idx], "name": np.array(self.names, dtype=object)[m_idx]}
        for k, v in self._stats.items():
            data[k] = v[s_idx, m_idx]
        return pd.DataFrame(data)

    def save(self, path, extra: dict | None = None) -> str:
        """Write this history to one ``.npz`` file (``.npz`` is appended if
        missing); ``extra`` (JSON-serialisable) is stored in its header. Read it
        back with ``hookcap.load``. Returns the path written."""
        return io.write(self._records, self.names, self._metas, self._histogram, path, extra)

    def _same_view(self, other: History) -> bool:
        """Equal names, steps, metadata, stats and histograms."""
        for h in (self, other):
            h._decode_all()
        return (
            self.names == other.names
            and np.array_equal(self.steps, other.steps)
            and self._metas == other._metas
            and self._histogram == other._histogram
            and self._stats.keys() == other._stats.keys()
            and all(np.array_equal(self[k], other[k], equal_nan=True) for k in self._stats)
            and all(np.array_equal(self.histogram(n), other.histogram(n)) for n in self.names
                    if self._histogram is not None)
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, History):
            return NotImplemented
        return (
            self._same_view(other)
            and all(np.array_equal(a.order, b.order) and np.array_equal(a.calls, b.calls)
                    and np.array_equal(a.calls_nonfinite, b.calls_nonfinite)
                    for a, b in zip(self._records, other._records))
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"History(steps={len(self)}, metrics={len(self.names)})"

    def _step_orders(self) -> list[list[str]]:
        """``order`` of every recorded step, by position (one pass)."""
        return [[self.names[i] for i in r.order] for r in self._records]

    @classmethod
    def _from_columns(cls, steps, names, metas, histogram: Histogram | None, stats: dict, recorded,
                      orders, hist=None) -> History:
        """A History of decoded statistics (what ``hookcap.load`` reads from a
        Parquet dataset) instead of raw step records: ``steps`` int64 [S];
        ``names`` [M]; ``metas`` name -> meta; ``stats`` stat -> float64 [S, M]
        (a subset of the stats is allowed; NaN where not recorded);
        ``recorded`` bool [S, M]; ``orders`` int64 metric indices per step in
        execution order; ``hist`` None or ``(offset, length, start, values)``:
        int64 [S, M] arrays placing each cell's counts of bins ``offset`` …
        ``offset + length - 1`` at ``values[start:start + length]``. It has no
        per-call data (``calls``), and ``save()`` is not supported."""
        return _ColumnHistory(steps, names, metas, histogram, stats, recorded, orders, hist)


_FINITE = (_layout.COUNT, _layout.NAN, _layout.POSINF, _layout.NEGINF)
# Moments: with the wide float64 buckets, which join every moment statistic.
_MOMENTS = _FINITE + (_layout.SUM, _layout.SUMSQ, _layout.S1, _layout.S2) + _layout.WIDE_COLS
# The header columns each statistic is decoded from (_layout.decode).
_STAT_COLUMNS = {
    "count": (_layout.COUNT,), "nan": (_layout.NAN,), "posinf": (_layout.POSINF,),
    "neginf": (_layout.NEGINF,), "inf": (_layout.POSINF, _layout.NEGINF), "zeros": (_layout.ZEROS,),
    "finite": _FINITE, "sum": _MOMENTS, "sumsq": _MOMENTS,
    "min": _FINITE + (_layout.MIN,), "max": _FINITE + (_layout.MAX,),
    "absmax": _FINITE + (_layout.ABSMAX,), "mean": _MOMENTS,
    "std": _MOMENTS, "rms": _MOMENTS,
    "l2norm": _MOMENTS, "zero_frac": (_layout.COUNT, _layout.ZEROS),
    "crest": _MOMENTS + (_layout.ABSMAX,),
}
_STAT_COLUMNS.update({k: _MOMENTS + (_layout.N4, _layout.S3, _layout.S4, _layout.SHIFT)
                      for k in _layout.MOMENT_NAMES})


class _Columns(Mapping):
    """A History's statistics by name, each decoded on first read and kept."""

    def __init__(self, history: History) -> None:
        self._h = history
        self._names = (_layout.STAT_NAMES + (_layout.MOMENT_NAMES if history._moments4 else ())
                       + (_layout.TIMING_NAMES if history._timed else ()))
        self._done: dict[str, np.ndarray] = {}

    def __getitem__(self, stat: str) -> np.ndarray:
        if stat not in self._names:
            raise KeyError(stat)
        if stat not in self._done:
            self._done[stat] = self._h._decode(stat)
        return self._done[stat]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _ColumnHistory(History):
    """A :class:`History` built from decoded statistics (see
    ``History._from_columns``): the same public view, no raw records."""

    def __init__(self, steps, names, metas, histogram, stats, recorded, orders, hist=None):
        self._records = None  # none: the methods that read records are overridden here
        self.names = list(names)
        self._metas = dict(metas)
        self._histogram = histogram
        self.anomalies = []
        self.extra = {}
        self._index = {n: i for i, n in enumerate(self.names)}
        self.steps = np.asarray(steps, dtype=np.int64)
        self._recorded = np.asarray(recorded, dtype=bool)
        known = _layout.STAT_NAMES + _layout.MOMENT_NAMES + _layout.TIMING_NAMES
        self._stats = {k: np.asarray(stats[k], dtype=np.float64) for k in known if k in stats}
        if "crest" not in self._stats and "absmax" in self._stats and "rms" in self._stats:
            self._stats["crest"] = _layout.crest(self._stats["absmax"], self._stats["rms"])  # older files
        self._timed = "fwd_ms" in self._stats
        self._moments4 = "kurtosis" in self._stats
        self._orders = [np.asarray(o, dtype=np.int64) for o in orders]
        self._hist = hist if histogram is not None else None

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, stat: str) -> np.ndarray:
        if stat in self._stats or stat not in _layout.STAT_NAMES + _layout.TIMING_NAMES:
            return super().__getitem__(stat)
        why = " (or recorded without Monitor(timing=True))" if stat in _layout.TIMING_NAMES else ""
        raise KeyError(f"{stat!r} was not written to this file: its sink was given stats= without it{why}; "
                       f"available: {', '.join(self._stats)}")

    def _decode_all(self) -> None:
        pass  # decoded when read from Parquet

    def histogram(self, name: str) -> np.ndarray:
        if self._histogram is None:
            raise ValueError("this history was recorded with histogram=None (or written without histograms)")
        m = self.column(name)
        out = np.zeros((len(self.steps), self._histogram.nbins), dtype=np.int64)
        if self._hist is None:
            return out
        offset, length, start, values = self._hist
        n = length[:, m]
        rows = np.repeat(np.arange(len(n)), n)
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        out[rows, np.repeat(offset[:, m], n) + within] = values[np.repeat(start[:, m], n) + within]
        return out

    def order(self, step: int) -> list[str]:
        hit = np.flatnonzero(self.steps == step)
        if not hit.size:
            raise KeyError(f"step {step} is not in this history")
        return [self.names[i] for i in self._orders[hit[0]]]

    def _step_orders(self) -> list[list[str]]:
        return [[self.names[i] for i in o] for o in self._orders]

    def last(self, n: int) -> History:
        k = slice(max(len(self.steps) - n, 0), None) if n > 0 else slice(0, 0)
        hist = None if self._hist is None else tuple(a[k] for a in self._hist[:3]) + (self._hist[3],)
        return _ColumnHistory(self.steps[k], self.names, self._metas, self._histogram,
                              {s: v[k] for s, v in self._stats.items()}, self._recorded[k],
                              self._orders[k], hist)

    def save(self, path, extra: dict | None = None) -> str:
        raise ValueError("this History was loaded from Parquet: it holds decoded statistics, not the raw "
                         "step records that History.save writes to .npz; keep the Parquet dataset (or "
                         "export with h.to_pandas())")

    def __eq__(self, other) -> bool:
        """Like ``History.__eq__`` without the per-call data a Parquet file does
        not hold (``calls``, ``calls_nonfinite``); also decides comparisons with
        a record History (Python asks the subclass first)."""
        if not isinstance(other, History):
            return NotImplemented
        return self._same_view(other) and self._step_orders() == other._step_orders()

    __hash__ = None


def load(path: str | os.PathLike) -> History:
    """Read a History written by :meth:`History.save` (or ``Monitor.dump``),
    with its ``extra`` header and the ``anomalies`` stored there; or a
    Parquet dataset directory written by ``hookcap.sinks.Parquet`` (a
    directory, or a path ending in ``.parquet``): its stats, histograms and
    execution order, without per-call data or anomalies."""
    p = os.fspath(path)
    if os.path.isdir(p) or p.rstrip("/" + os.sep).endswith(".parquet"):
        from .sinks.parquet import read_dataset  # pyarrow only when needed

        return History._from_columns(**read_dataset(p))
    records, names, metas, histogram, extra = io.read(path)
    h = History(records, names, metas, histogram)
    h.extra = extra
    h.anomalies = [Anomaly.from_dict(d) for d in extra.get("anomalies", [])]
    return h
