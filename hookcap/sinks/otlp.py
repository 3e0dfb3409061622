"""OTLP: live gauges for an OpenTelemetry collector (and from there
Prometheus, Grafana, Datadog ...), with a bounded number of series: per
layer group aggregates and the top offenders, not one series per metric."""

from __future__ import annotations

import logging

import numpy as np

from ..groups import split_group
from ._base import Sink

log = logging.getLogger("hookcap")

_CAPTURE = ("output", "input", "grad_output", "grad_input")  # kinds a tuple path may follow (".0", ".logits")
_SUM = frozenset(("count", "nan", "posinf", "neginf", "inf", "zeros", "finite"))  # summed over a group


def metric_kind(name: str) -> str:
    """The kind part of a metric name: what follows the module, without a
    group index or a tuple path (``"h.3.attn/attn.logit[2]"`` ->
    ``"attn.logit"``, ``"h.3/output.0"`` -> ``"output"``)."""
    name = split_group(name)[0]
    kind = name.rsplit("/", 1)[-1] if "/" in name else "tap"
    head = kind.split(".", 1)[0]
    return head if head in _CAPTURE else kind


def layer_group(name: str, depth: int) -> str:
    """The module path of ``name`` cut to ``depth`` dotted components (``"."``: the root, taps)."""
    if "/" not in name:
        return "."
    return ".".join(name.rsplit("/", 1)[0].split(".")[:depth]) or "."


class OTLP(Sink):
    """Gauges over OTLP/HTTP to ``endpoint`` (an OpenTelemetry collector's
    ``/v1/metrics``), exported every ``interval_s`` from the SDK's own
    thread. Needs ``pip install 'hookcap[otlp]'`` (opentelemetry-sdk and its
    OTLP/HTTP exporter).

    Series (gauges, attributes in braces):

    - ``hookcap.<stat>{group, kind}`` for each of ``stats``: the stat over
      each layer group (the module path cut to ``depth`` components; by
      default the deepest cut with at most ``max_groups`` groups) and metric
      kind (``output``, ``grad_output``, ``param_grad``, ``attn.logit`` ...):
      the largest value, except ``rms`` (over all elements), ``mean``
      (element-weighted) and counts (summed).
    - ``hookcap.top.absmax{rank, metric}``: the ``top`` metrics with the
      largest absmax this step, ``rank`` 0 first.
    - ``hookcap.step``; ``hookcap.otlp.failed_exports`` (exports the
      collector refused or could not be reached for).

    At most ``max_groups × kinds × len(stats) + top + 2`` series per export
    (:meth:`series_bound`, with the kinds the run has), however many
    metrics the model has. ``rank``: in multi-rank runs only this rank's
    Monitor exports (with the default merged sinks, records merged across
    ranks reach rank 0's sinks). A failing collector never reaches training:
    each export replaces the last values (no queue grows), and the SDK
    retries in its thread; failures are counted."""

    def __init__(self, endpoint: str = "http://localhost:4318/v1/metrics", *, stats=("rms", "absmax", "nan", "inf"),
                 top: int = 8, depth: int | None = None, max_groups: int = 64, interval_s: float = 10.0,
                 timeout_s: float = 10.0, service: str = "hookcap", headers: dict | None = None, every: int = 1,
                 rank: int = 0):
        super().__init__(stats, every)
        for arg, v in (("top", top), ("max_groups", max_groups)):
            if not isinstance(v, int) or v < (0 if arg == "top" else 1):
                raise ValueError(f"OTLP: {arg} must be an int >= {0 if arg == 'top' else 1}, got {v!r}")
        if depth is not None and (not isinstance(depth, int) or depth < 1):
            raise ValueError(f"OTLP: depth must be an int >= 1 or None, got {depth!r}")
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.metrics import Observation
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
        except ImportError as e:
            raise ImportError("hookcap.sinks.OTLP needs the OpenTelemetry SDK: "
                              "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "
                              "(or pip install 'hookcap[otlp]')") from e
        self.endpoint, self.top, self.depth, self.max_groups = endpoint, top, depth, max_groups
        self.export_rank = rank
        self.failed_exports = 0
        sink = self

        class _Counted(OTLPMetricExporter):
            def export(self, metrics_data, timeout_millis: float = 10_000, **kw):
                try:
                    result = super().export(metrics_data, timeout_millis=timeout_millis, **kw)
                except Exception as e:  # the reader's thread: counted, never raised into training
                    result, why = MetricExportResult.FAILURE, e
                else:
                    why = None
                if result != MetricExportResult.SUCCESS:
                    sink.failed_exports += 1
                    if sink.failed_exports == 1:
                        log.warning("hookcap: OTLP export to %s failed (%s); counted in "
                                    "hookcap.otlp.failed_exports, logged once", sink.endpoint, why or result)
                return result

        exporter = _Counted(endpoint=endpoint, timeout=timeout_s, headers=headers)
        self._reader = PeriodicExportingMetricReader(exporter, export_interval_millis=int(interval_s * 1000),
                                                     export_timeout_millis=int(timeout_s * 1000))
        self._provider = MeterProvider(resource=Resource.create({"service.name": service}),
                                       metric_readers=[self._reader])
        meter = self._provider.get_meter("hookcap")
        self._gauges = {s: meter.create_gauge(f"hookcap.{s}") for s in self.stats}
        self._top = meter.create_gauge("hookcap.top.absmax")
        self._step = meter.create_gauge("hookcap.step")
        meter.create_observable_gauge("hookcap.otlp.failed_exports",
                                      callbacks=[lambda _opts: [Observation(self.failed_exports)]])
        self._names: list[str] | None = None
        self._plan = None  # (group index [M], kind index [M], groups, kinds) for the names seen
        self._kinds: set[str] = set()

    def wants(self, step) -> bool:
        return super().wants(step) and (self.rank is None or self.rank == self.export_rank)

    def series_bound(self) -> int:
        """The most series one export carries, with the kinds seen so far."""
        return self.max_groups * max(1, len(self._kinds)) * len(self.stats) + self.top + 2

    def _plan_for(self, names: list[str]):
        if self._names != names:
            depth = self.depth
            if depth is None:  # the deepest cut with at most max_groups groups
                depth = 1
                while depth < 16 and len({layer_group(n, depth + 1) for n in names}) <= self.max_groups:
                    depth += 1
            groups = [layer_group(n, depth) for n in names]
            if len(set(groups)) > self.max_groups:  # depth given too deep: fold the rest into one group
                keep = set(sorted(set(groups), key=groups.index)[:self.max_groups - 1])
                groups = [g if g in keep else "(other)" for g in groups]
            kinds = [metric_kind(n) for n in names]
            self._kinds.update(kinds)
            gu, gi = np.unique(groups, return_inverse=True)
            ku, ki = np.unique(kinds, return_inverse=True)
            self._names, self._plan = list(names), (gi, ki, gu, ku)
        return self._plan

    def write(self, step) -> None:
        gi, ki, gu, ku = self._plan_for(list(step.names))
        cells = gi * len(ku) + ki
        ncell = len(gu) * len(ku)
        count = np.nan_to_num(step.stats["count"], nan=0.0)
        for stat in self.stats:
            v = np.asarray(step.stats[stat], dtype=np.float64)
            ok = ~np.isnan(v)
            if stat in _SUM:
                agg = np.bincount(cells[ok], v[ok], minlength=ncell)
            elif stat in ("rms", "mean"):
                w = count[ok] * (v[ok] ** 2 if stat == "rms" else v[ok])
                with np.errstate(invalid="ignore", divide="ignore"):
                    agg = np.bincount(cells[ok], w, minlength=ncell) / np.bincount(cells[ok], count[ok],
                                                                                     minlength=ncell)
                agg = np.sqrt(agg) if stat == "rms" else agg
            else:
                agg = np.full(ncell, -np.inf)
                np.maximum.at(agg, cells[ok], v[ok])
            seen = np.bincount(cells[ok], minlength=ncell) > 0
            for c in np.flatnonzero(seen):
                self._gauges[stat].set(float(agg[c]), {"group": str(gu[c // len(ku)]), "kind": str(ku[c % len(ku)])})
        if self.top:
            a = np.nan_to_num(np.asarray(step.stats["absmax"], dtype=np.float64), nan=-np.inf)
            order = np.argsort(-a, kind="stable")[:self.top]
            for r, j in enumerate(order):
                if a[j] > -np.inf:  # recorded (+inf included: an overflow is an offender)
                    self._top.set(float(a[j]), {"rank": r, "metric": step.names[j]})
        self._step.set(step.step)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export now (blocks up to ``timeout_s``); True if the export went through."""
        before = self.failed_exports
        ok = self._provider.force_flush(int(timeout_s * 1000))
        return bool(ok) and self.failed_exports == before

    def close(self) -> None:
        try:
            self._provider.force_flush(5_000)
        finally:
            self._provider.shutdown()

