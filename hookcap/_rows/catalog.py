"""The metrics a Monitor has named: their indices, metadata and owning module,
and the modules it times. The recorder adds to it; the drain, the consumers
and rank merging read it."""

from __future__ import annotations

import numpy as np


class UpdateBases:
    """Of an append-only list of metric names: for each ``{param}/update``
    metric the index of its ``{param}/update.base``, -1 for every other
    metric (``capture="update"``'s ratio). Recomputed only when the list has
    grown, so reading it each step costs nothing."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._n = -1
        self._bases = np.empty(0, dtype=np.int64)

    def __call__(self) -> np.ndarray:
        if len(self.names) != self._n:
            base = {n: i for i, n in enumerate(self.names) if n.endswith("/update.base")}
            self._bases = np.array([base.get(n + ".base", -1) if n.endswith("/update") else -1
                                    for n in self.names], dtype=np.int64)
            self._n = len(self.names)
        return self._bases


class GroupIndex:
    """Of an append-only list of metric names and their metas: for each
    group metric (``f"{metric}[{g}]"``, meta ``group_of``) the index of its
    whole metric and its group number; -1 for every other metric.
    Recomputed only when the list has grown."""

    def __init__(self, names: list[str], metas: dict[str, dict]) -> None:
        self.names, self.metas = names, metas
        self._n = -1
        self.whole = self.group = np.empty(0, dtype=np.int64)

    def __call__(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(whole index, group number) per metric, or None while no metric is a group."""
        if len(self.names) != self._n:
            index = {n: i for i, n in enumerate(self.names)}
            of = [self.metas.get(n, {}).get("group_of") for n in self.names]
            self.whole = np.array([index.get(w, -1) if w is not None else -1 for w in of], dtype=np.int64)
            self.group = np.array([self.metas.get(n, {}).get("group", -1) for n in self.names], dtype=np.int64)
            self._n = len(self.names)
        return (self.whole, self.group) if (self.whole >= 0).any() else None


class Catalog:
    """``names[i]`` is metric ``i`` (first-execution order); ``metas[name]``
    its ``module_type``/``kind``/``shape``/``dtype`` as first seen;
    ``module_of[name]`` the module (or parameter) it belongs to.
    ``timed[t]`` is the module of timing index ``t`` (``timing=True``)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.metas: dict[str, dict] = {}
        self.module_of: dict[str, str] = {}
        self._index: dict[str, int] = {}
        self.timed: list[str] = []
        self._timed_index: dict[str, int] = {}
        self._time_of_metric = np.empty(0, dtype=np.int64)
        self._time_of_metric_key = (0, 0)
        self.update_bases = UpdateBases(self.names)
        self.group_index = GroupIndex(self.names, self.metas)

    def index(self, metric: str) -> int | None:
        return self._index.get(metric)

    def add(self, metric: str, meta: dict) -> int:
        """The index of ``metric``, named now if new."""
        idx = self._index.get(metric)
        if idx is None:
            idx = self._index[metric] = len(self.names)
            self.names.append(metric)
            self.metas[metric] = meta
        return idx

    def timing_index(self, module: str) -> int:
        """The timing index of ``module``, added if new."""
        t = self._timed_index.get(module)
        if t is None:
            t = self._timed_index[module] = len(self.timed)
            self.timed.append(module)
        return t

    def time_of_metric(self) -> np.ndarray:
        """int64 [len(names)]: the timing index of each metric's module, -1 if untimed."""
        key = (len(self.names), len(self.timed))
        if key != self._time_of_metric_key:  # new metrics or timed modules
            self._time_of_metric = np.array(
                [self._timed_index.get(self.module_of.get(n), -1) for n in self.names], dtype=np.int64)
            self._time_of_metric_key = key
        return self._time_of_metric
