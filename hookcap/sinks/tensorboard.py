"""TensorBoard sink: scalars per (metric, stat) and our device histograms via
TensorBoard's raw-bucket histogram API."""

from __future__ import annotations

import os

import numpy as np

from ..drained import DrainedStep
from ..histogram import Histogram
from ._base import Sink
from ._hist import band, finite_edges


def _import_tb():
    try:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import histogram_raw
        from tensorboard.compat.proto.summary_pb2 import Summary
    except ImportError as e:
        raise ImportError("hookcap.sinks.TensorBoard needs the tensorboard package: "
                          "pip install tensorboard  (or pip install 'hookcap[tensorboard]')") from e
    return SummaryWriter, histogram_raw, Summary


def bucket_limits(spec: Histogram) -> np.ndarray:
    """float64 [nbins]: the TensorBoard upper limit of each hookcap bin.

    TensorBoard buckets are given by their right edges (strictly increasing);
    bin i of ``spec`` gets ``finite_edges(spec)[i + 1]``. For log2 (bins of
    ``|x|``): the zero bin -> 0, underflow -> ``2**lo``, ``[2**e, 2**(e+1))`` ->
    ``2**(e+1)``, overflow -> ``2**(hi+1)``. For linear: underflow -> ``lo``,
    overflow -> ``hi + width``."""
    return finite_edges(spec)[1:]


class TensorBoard(Sink):
    """``hookcap.sinks.TensorBoard(log_dir, stats=None, every=1, histograms=True, prefix="", quantiles=None)``

    Writes, at ``global_step = step``, one scalar per metric and stat tagged
    ``f"{prefix}{name}/{stat}"`` and, when the Monitor records histograms, one
    histogram per metric tagged ``f"{prefix}{name}/hist"`` holding **our** bin
    counts (``SummaryWriter.add_histogram_raw``; bucket limits from
    :func:`bucket_limits`; only the band of non-empty bins is written, metrics
    with no finite value are skipped).

    log2 histograms are of ``|x|``: the histogram's ``min`` is the lower edge of
    the first non-empty bin (0 when there are zeros), ``max`` is ``absmax``,
    ``sum_squares`` is exact, ``sum`` is the signed sum of ``x`` (the sum of
    ``|x|`` is not recorded). TensorBoard draws the x axis linearly, so the
    octaves near the top of the range take most of the width.

    ``log_dir`` may also be an existing ``SummaryWriter`` (it is flushed, not
    closed, by ``close()``). Each step is written as one event and flushed.

    Per-rank records of a multi-rank run (``Monitor(rank_sinks="all")``) are
    written under ``{log_dir}/rank{r}`` (one TensorBoard run per rank); with
    ``log_dir=None`` the default ``runs/...`` folder name gets a ``_rank{r}``
    suffix. A ``SummaryWriter`` passed in is used as given (give each rank its own).
    """

    def __init__(self, log_dir=None, stats=None, every=1, histograms=True, prefix: str = "", quantiles=None):
        super().__init__(stats, every, quantiles)
        self._SummaryWriter, self._histogram_raw, self._Summary = _import_tb()
        if hasattr(log_dir, "add_scalar"):
            self.writer, self._owned, self.log_dir = log_dir, False, getattr(log_dir, "log_dir", None)
        else:
            self.writer, self._owned = None, True
            self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._base_log_dir = self.log_dir
        self.histograms = bool(histograms)
        self.prefix = prefix
        self._rank_dir = None  # "rank{r}" once bound to a rank (bind_rank)
        self._limits: dict[Histogram, np.ndarray] = {}
        # One event per step (scalars and histograms together) is ~8x faster
        # than one add_scalar per value; fall back to the public per-value
        # calls if a writer lacks the file-writer accessor.
        self._batched = True

    def bind_rank(self, rank: int | None) -> None:
        super().bind_rank(rank)
        if self._owned and self.writer is None:  # a writer in use keeps its folder
            self._rank_dir = None if rank is None else f"rank{int(rank)}"
            base = self._base_log_dir
            self.log_dir = base if base is None or rank is None else os.path.join(base, self._rank_dir)

    def _writer(self):
        if self.writer is None:
            if self.log_dir is None and self._rank_dir is not None:
                self.writer = self._SummaryWriter(comment=f"_{self._rank_dir}")
            else:
                self.writer = self._SummaryWriter(log_dir=self.log_dir)
            self.log_dir = self.writer.log_dir
        return self.writer

    def histogram_values(self, step: DrainedStep):
        """Yield ``(tag, kwargs for add_histogram_raw)`` for each metric of ``step``."""
        spec = step.histogram_spec
        if not self.histograms or spec is None:
            return
        limits = self._limits.get(spec)
        if limits is None:
            limits = self._limits[spec] = bucket_limits(spec)
        lower = spec.bin_edges
        st = step.stats
        for i, name in enumerate(step.names):
            counts = step.histogram(name)
            a, b = band(counts)
            if b == 0:
                continue  # no finite value: nothing to draw
            if spec.magnitudes:
                lo, hi = float(lower[a]), float(st["absmax"][i])
            else:
                lo, hi = float(st["min"][i]), float(st["max"][i])
            yield f"{self.prefix}{name}/hist", dict(
                min=lo, max=hi, num=int(counts.sum()), sum=float(st["sum"][i]),
                sum_squares=float(st["sumsq"][i]), bucket_limits=limits[a:b].tolist(),
                bucket_counts=counts[a:b].tolist())

    def write(self, step: DrainedStep) -> None:
        w = self._writer()
        s = int(step.step)
        cols = self.columns(step)
        scalars = [(f"{self.prefix}{name}/{stat}", float(v[i]))
                   for i, name in enumerate(step.names) for stat, v in cols]
        hists = list(self.histogram_values(step))
        if self._batched and hasattr(w, "_get_file_writer"):
            values = [self._Summary.Value(tag=t, simple_value=v) for t, v in scalars]
            for tag, kw in hists:
                values.extend(self._histogram_raw(tag, **kw).value)
            w._get_file_writer().add_summary(self._Summary(value=values), global_step=s)
        else:
            for t, v in scalars:
                w.add_scalar(t, v, global_step=s)
            for tag, kw in hists:
                w.add_histogram_raw(tag, global_step=s, **kw)
        w.flush()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            if self._owned:
                self.writer.close()
                self.writer = None
            else:
                self.writer.flush()

    def __repr__(self) -> str:
        return f"TensorBoard({self.log_dir!r})"
