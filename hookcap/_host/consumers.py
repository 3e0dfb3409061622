"""What happens to a drained step on the host: the history store keeps it,
detectors look at it, anomalies are reported (warn, raise, callback, a dump),
and sinks receive it — directly, or merged across ranks by the rank merger
that stands in front of them."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable

from .._rows.catalog import Catalog
from .._rows.config import Config
from .record import HostStore, StepRecord
from ..anomaly import Anomaly, NonFinite, Underflow, as_anomalies
from ..drained import DrainedStep

log = logging.getLogger("hookcap")


def as_list(value, what: str, one) -> list:
    """``value`` (None, an iterable, or a single object that ``one`` accepts:
    wrapped) as a list; anything else is a TypeError that names ``what``."""
    if value is None:
        return []
    if one(value):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{what}: expected a list (or one {what[:-1]}), got {type(value).__name__}") from None


class Sinks:
    """The Monitor's sinks. A sink that raises is disabled (logged once) and
    kept in ``failed`` with its error; training and the history go on."""

    def __init__(self, sinks):
        self.active: list = as_list(sinks, "sinks", one=lambda s: hasattr(s, "write"))
        self.failed: list = []

    def write(self, drained: DrainedStep) -> None:
        for sink in list(self.active):
            try:
                if sink.wants(drained) if hasattr(sink, "wants") else True:
                    sink.write(drained)
            except Exception as e:  # a sink must never stop training
                self.disable(sink, e)

    def disable(self, sink, e: Exception) -> None:
        self.active.remove(sink)
        self.failed.append((sink, e))
        log.error("hookcap: sink %r failed and was disabled: %s: %s (the history "
                  "keeps every step)", sink, type(e).__name__, e)

    def alert(self, anomaly, dump: str | None, history) -> None:
        """Sinks with ``alert(anomaly, dump, history)`` (hookcap.sinks.Webhook) hear of an anomaly."""
        for sink in list(self.active):
            if callable(getattr(sink, "alert", None)):
                try:
                    sink.alert(anomaly, dump, history)
                except Exception as e:
                    self.disable(sink, e)

    def bind_rank(self, rank: int | None) -> None:
        for sink in list(self.active):
            bind = getattr(sink, "bind_rank", None)
            if callable(bind):
                try:
                    bind(rank)
                except Exception as e:
                    self.disable(sink, e)

    def close(self) -> None:
        for sink in list(self.active):
            try:
                sink.close()
            except Exception as e:
                log.error("hookcap: closing sink %r failed: %s: %s", sink, type(e).__name__, e)


def check_on_anomaly(value) -> None:
    """``ValueError`` naming the argument unless ``value`` is a valid ``on_anomaly``."""
    if not (value in ("warn", "raise", None) or callable(value)):
        raise ValueError(f"on_anomaly: expected 'warn', 'raise', None or a callable, got {value!r}")


class Consumers:
    """Store, detectors and anomaly handling of one Monitor. ``ranks`` (a
    rank merger) decides whether the sinks get a step now or merged later;
    ``dump(path)`` writes the Monitor's flight record (``dump_on_anomaly``)."""

    def __init__(self, config: Config, catalog: Catalog, sinks: Sinks, ranks, detectors, on_anomaly,
                 dump_on_anomaly, dump: Callable[[str], str]):
        self.config = config
        self.catalog = catalog
        self.store = HostStore(config.capacity)
        self.detectors = [NonFinite()] if detectors is None else as_list(detectors, "detectors", one=callable)
        for d in self.detectors:
            if not callable(d):
                raise ValueError(f"detectors: {d!r} is not callable")
            if isinstance(d, Underflow):
                d.check_histogram(config.histogram)
        for s in sinks.active:
            if config.moments == 4 and callable(getattr(s, "add_moments", None)):
                s.add_moments()
            if getattr(s, "quantiles", ()) and config.histogram is None:
                raise ValueError(f"{type(s).__name__}(quantiles=...) needs histograms: pass Monitor(histogram=...) "
                                 "(quantiles are estimated from them), or drop quantiles=")
        check_on_anomaly(on_anomaly)
        self.on_anomaly = on_anomaly
        self.dump_on_anomaly = dump_on_anomaly
        self.sinks = sinks
        self.ranks = ranks
        self.anomalies: list[Anomaly] = []
        # Weak: the Monitor owns this object, and a bound method would make a cycle.
        self._dump = weakref.WeakMethod(dump) if hasattr(dump, "__self__") else (lambda: dump)
        self._dumped: dict[str, str | None] = {}  # anomaly kind -> its dump_on_anomaly file
        self._warned: set[tuple[str, str]] = set()
        self._raise: Anomaly | None = None

    def consume(self, rec: StepRecord) -> None:
        self.store.add(rec)
        direct = not self.ranks.hold(rec)  # merged rank_sinks: the sinks get it later, merged
        sinks = direct and bool(self.sinks.active)
        # The default detector alone only cares about steps with NaN/Inf.
        quiet = not sinks and all(type(d) is NonFinite for d in self.detectors) and not rec.any_nonfinite()
        if (self.detectors or sinks) and not quiet:
            drained = DrainedStep(rec, self.catalog.names, self.catalog.metas, self.config.histogram,
                                  self.ranks.rank, self.catalog.update_bases())
            for det in self.detectors:
                for a in as_anomalies(det(drained)):
                    self._report(a)
            if sinks:
                self.sinks.write(drained)

    def raise_pending(self) -> Anomaly | None:
        """The first anomaly not raised yet (``on_anomaly="raise"``), once."""
        a, self._raise = self._raise, None
        return a

    def _report(self, a: Anomaly) -> None:
        self.anomalies.append(a)
        if self.dump_on_anomaly is not None and a.kind not in self._dumped:
            first = not self._dumped
            self._dumped[a.kind] = None
            try:
                dump = self._dump()
                if dump is not None:
                    self._dumped[a.kind] = dump(self._dump_path(a, first))
            except Exception as e:
                log.error("hookcap: dump_on_anomaly failed: %s: %s", type(e).__name__, e)
        if self.sinks.active:
            self.sinks.alert(a, self._dumped.get(a.kind), self.history)
        if self.on_anomaly == "warn":
            if (a.name, a.kind) not in self._warned:
                self._warned.add((a.name, a.kind))
                log.warning("hookcap anomaly (%s): %s", a.kind, a.message)
        elif self.on_anomaly == "raise":
            if self._raise is None:
                self._raise = a
        elif callable(self.on_anomaly):
            self.on_anomaly(a)

    def history(self):
        """The steps drained so far, with the anomalies, as a :class:`hookcap.History`."""
        from ..history import History

        h = History(self.store.records(), self.catalog.names, self.catalog.metas, self.config.histogram)
        h.anomalies = list(self.anomalies)
        return h

    def _dump_path(self, a: Anomaly, first: bool) -> str:
        """The first dump: ``path`` (a file), or ``hookcap-anomaly-step{N}.npz`` in
        it (a directory); the first of each later kind adds ``-{kind}`` to the name."""
        p = os.fspath(self.dump_on_anomaly)
        tag = "" if first else f"-{a.kind}"
        if os.path.isdir(p) or p.endswith(os.sep):
            os.makedirs(p, exist_ok=True)
            return os.path.join(p, f"hookcap-anomaly-step{a.step}{tag}.npz")
        root, ext = os.path.splitext(p)
        return f"{root}{tag}{ext}"

    def state_dict(self) -> dict:
        """The detectors' states (None for one without ``state_dict``) and the anomalies so far."""
        return {"detectors": [d.state_dict() if callable(getattr(d, "state_dict", None)) else None
                              for d in self.detectors],
                "anomalies": [a.to_dict() for a in self.anomalies]}

    def load_state_dict(self, state: dict) -> None:
        """Detectors (matched by position) and anomalies from ``Monitor.state_dict()``."""
        if not (isinstance(state, dict) and state.get("format") == "hookcap-monitor"):
            raise ValueError("state: expected a dict from Monitor.state_dict()")
        if state.get("version", 0) > 1:
            raise ValueError(f"state: version {state['version']} is newer than this hookcap (1)")
        if len(state["detectors"]) != len(self.detectors):
            raise ValueError(f"state: saved with {len(state['detectors'])} detectors, this Monitor "
                             f"has {len(self.detectors)}")
        for det, s in zip(self.detectors, state["detectors"]):
            if s is not None and callable(getattr(det, "load_state_dict", None)):
                det.load_state_dict(s)
        self.anomalies[:] = [Anomaly.from_dict(d) for d in state["anomalies"]]
