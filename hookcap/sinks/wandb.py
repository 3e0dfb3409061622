"""Weights & Biases sink (optional extra: ``pip install 'hookcap[wandb]'``)."""

from __future__ import annotations

import numpy as np

from ..drained import DrainedStep
from ._base import Sink
from ._hist import band, finite_edges

MAX_BINS = 512  # wandb.Histogram's limit


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError("hookcap.sinks.WandB needs the wandb package: pip install wandb  "
                          "(or pip install 'hookcap[wandb]')") from e
    return wandb


def wandb_histogram_arrays(counts: np.ndarray, edges: np.ndarray):
    """The non-empty band of ``counts`` (int64 [nbins]) with its finite edges
    ([nbins + 1]), with adjacent bins summed in groups when the band is wider
    than W&B accepts. Returns ``(counts, edges)`` or None when all are zero."""
    a, b = band(counts)
    if b == 0:
        return None
    c, e = counts[a:b], edges[a:b + 1]
    if len(c) > MAX_BINS:
        k = -(-len(c) // MAX_BINS)
        pad = (-len(c)) % k
        c = np.concatenate([c, np.zeros(pad, c.dtype)]).reshape(-1, k).sum(axis=1)
        e = np.concatenate([e[:-1:k], e[-1:]])
    return c, e


class WandB(Sink):
    """``hookcap.sinks.WandB(run=None, stats=None, every=1, histograms=True, prefix="", quantiles=None)``

    Per step: ``run.log({f"{prefix}{name}/{stat}": value, ...}, step=step)``, plus
    ``f"{prefix}{name}/hist"`` as ``wandb.Histogram(np_histogram=(counts, edges))``
    with our bin counts (the band of non-empty bins; finite edges as in
    ``hookcap.sinks._hist.finite_edges``: log2 histograms are of ``|x|``, the
    exact-zero bin spans ``[-2**lo, 0]``). ``run=None`` uses ``wandb.run``
    (call ``wandb.init`` first). Works with ``mode="offline"``.

    W&B ignores data logged at a step lower than the run's current step. On
    CPU each step is logged at its own ``mon.step()``; on CUDA the drain trails
    training by up to 4 recorded steps, so if you also ``run.log(..., step=k)``
    yourself, log only after ``mon.step()`` of step ``k`` has drained or give
    hookcap its own run.

    Per-rank records of a multi-rank run (``Monitor(rank_sinks="all")``) are
    logged under ``f"rank{r}/{prefix}{name}/{stat}"`` (and ``.../hist``), so
    ranks never overwrite each other's keys, whether each rank has its own
    run or several ranks share one; merged and single-process records keep
    the plain keys.
    """

    def __init__(self, run=None, stats=None, every=1, histograms=True, prefix: str = "", quantiles=None):
        super().__init__(stats, every, quantiles)
        self._wandb = _import_wandb()
        self.run = run if run is not None else self._wandb.run
        if self.run is None:
            raise RuntimeError("hookcap.sinks.WandB: no run: call wandb.init(...) before creating "
                               "the sink, or pass run=")
        self.histograms = bool(histograms)
        self.prefix = prefix
        self._edges: dict = {}

    def payload(self, step: DrainedStep) -> dict:
        """The dict passed to ``run.log`` for ``step``."""
        rank = getattr(step, "rank", None)
        pre = self.prefix if rank is None else f"rank{int(rank)}/{self.prefix}"
        cols = self.columns(step)
        out = {f"{pre}{name}/{stat}": float(v[i]) for i, name in enumerate(step.names) for stat, v in cols}
        spec = step.histogram_spec
        if self.histograms and spec is not None:
            edges = self._edges.get(spec)
            if edges is None:
                edges = self._edges[spec] = finite_edges(spec)
            for name in step.names:
                arrs = wandb_histogram_arrays(step.histogram(name), edges)
                if arrs is not None:
                    out[f"{pre}{name}/hist"] = self._wandb.Histogram(
                        np_histogram=(arrs[0].tolist(), arrs[1].tolist()))
        return out

    def write(self, step: DrainedStep) -> None:
        self.run.log(self.payload(step), step=int(step.step))

    def __repr__(self) -> str:
        return f"WandB(run={getattr(self.run, 'name', self.run)!r})"
