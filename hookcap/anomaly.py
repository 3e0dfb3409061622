"""Anomaly detectors. They run on drained steps on the host, never in a hook.

A detector is any callable ``detector(step: DrainedStep)`` returning None, one
:class:`Anomaly` or an iterable of them.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .drained import DrainedStep
from .groups import split_group


@dataclass
class Anomaly:
    """One finding: at ``step``, metric ``name`` showed ``kind``
    (``"nonfinite"``, ``"spike"``, ``"underflow"``, ``"dead"``, ``"threshold"`` or a custom string);
    ``stats`` are that metric's stats at that step."""

    step: int
    name: str
    kind: str
    message: str
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "name": self.name, "kind": self.kind, "message": self.message,
                "stats": {k: (None if isinstance(v, float) and math.isnan(v) else v)
                          for k, v in self.stats.items()}}

    @staticmethod
    def from_dict(d: dict) -> Anomaly:
        stats = {k: (math.nan if v is None else v) for k, v in d.get("stats", {}).items()}
        return Anomaly(d["step"], d["name"], d["kind"], d["message"], stats)


class AnomalyError(RuntimeError):
    """Raised by ``Monitor.step()`` when ``on_anomaly="raise"``; ``.anomaly`` holds it."""

    def __init__(self, anomaly: Anomaly):
        super().__init__(anomaly.message)
        self.anomaly = anomaly


# Attention internals (capture "attention"): -inf there is a masked logit, or
# a query row with no allowed key, by construction, not a fault.
_MASKED_NEGINF = re.compile(r"/attn\.(logit|lse|entropy)(\[\d+\])?$")
# Channels' top/median ratio: +inf where the median channel is all zeros.
_RATIO_POSINF = re.compile(r"\.top_over_median$")


class NonFinite:
    """NaN or +-Inf values. Reports the FIRST metric in execution order that
    holds any (forward kinds in hook order, then backward kinds in backward
    order), i.e. where the non-finite values appeared, not where they spread.
    In attention internals (``{module}/attn.logit``, ``.lse``, ``.entropy``)
    -Inf marks masked positions and is not counted, nor is +Inf in
    ``Channels``' ``.top_over_median`` (a median channel of zeros).

    Each metric is reported once, at the first step it is that first
    offender; a run that stays diverged adds no anomaly per step. ``counts``
    (metric name -> steps) counts every recorded step in which a metric held
    NaN/Inf, reported or not."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.reported: set[str] = set()

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "reported": sorted(self.reported)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}
        self.reported = set(state["reported"])

    def _masked(self, names) -> tuple[np.ndarray, np.ndarray]:
        """bool per metric: whether its -Inf, and its +Inf, are by design."""
        key = (id(names), len(names))
        if getattr(self, "_masked_key", None) != key:
            self._masked_key = key
            self._masked_of = tuple(np.array([bool(p.search(n)) for n in names], dtype=bool)
                                    for p in (_MASKED_NEGINF, _RATIO_POSINF))
        return self._masked_of

    def __call__(self, step: DrainedStep):
        neg_ok, pos_ok = self._masked(step.names)
        masked = neg_ok | pos_ok
        neginf = np.where(neg_ok, 0, step.stats["neginf"]) if neg_ok.any() else step.stats["neginf"]
        posinf = np.where(pos_ok, 0, step.stats["posinf"]) if pos_ok.any() else step.stats["posinf"]
        bad = np.flatnonzero((step.stats["nan"] + posinf + neginf) > 0)
        if bad.size == 0:
            return None
        for i in bad:
            name = step.names[i]
            self.counts[name] = self.counts.get(name, 0) + 1
        # Per-call order first: a module called twice is placed where the
        # call that produced the NaN ran, not where its first call ran.
        hit = np.flatnonzero(step.calls_nonfinite)
        if masked.any():  # calls whose only non-finite values are masked logits
            named = {step.names[i] for i in bad}
            hit = hit[[step.calls[j] in named for j in hit]] if hit.size else hit
        first = step.calls[hit[0]] if hit.size else step.names[bad[0]]
        if first in self.reported:
            return None
        self.reported.add(first)
        s = step.stats_of(first)
        more = f"; {bad.size - 1} later metric(s) affected" if bad.size > 1 else ""
        return Anomaly(step.step, first, "nonfinite",
                       f"step {step.step}: first non-finite values in {first} "
                       f"({int(s['nan'])} NaN, {int(s['posinf'])} +Inf, {int(s['neginf'])} -Inf of "
                       f"{int(s['count'])}){more}", s)


class _Watch:
    """Which metric names a detector watches: ``metrics``, a glob or list of
    globs (fnmatch; None: all), and ``groups``: None for metrics and groups
    alike (globs over their names), True for the groups of the metrics the
    globs match (each head, each expert), False for whole metrics only.
    Decided once per name."""

    def __init__(self, who: str, metrics, groups) -> None:
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not (isinstance(metrics, (list, tuple)) and all(isinstance(m, str) for m in metrics)):
            raise ValueError(f"{who}: metrics must be None, a glob or a list of globs, got {metrics!r}")
        if groups not in (None, True, False):
            raise ValueError(f"{who}: groups must be None, True or False, got {groups!r}")
        self.metrics = None if metrics is None else tuple(metrics)
        self.groups = groups
        self._seen: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        w = self._seen.get(name)
        if w is None:
            metric, g = split_group(name)
            if self.groups is not None and (g is not None) != self.groups:
                w = False
            else:
                target = metric if self.groups else name
                w = self.metrics is None or any(fnmatch.fnmatchcase(target, m) for m in self.metrics)
            self._seen[name] = w
        return w


class Spike:
    """A metric's ``stat`` jumps more than ``z`` robust standard deviations
    (1.4826 x median absolute deviation) above the median of its last
    ``window`` recorded values; silent for the first ``warmup`` values.
    ``metrics``: a glob or list of globs over metric names (fnmatch) that it
    watches, e.g. ``Spike("max", metrics="loss")`` for a tapped loss; None:
    every metric. ``groups``: None (default) watches metrics and their groups
    (``f"{metric}[{g}]"``) alike; True the groups of the metrics ``metrics``
    matches (``Spike("max", metrics="*/attn.logit", groups=True)``: each
    head's max logit); False whole metrics only. ``Spike("update_ratio")``
    watches ``‖Δw‖ / ‖w_before‖`` of each parameter recorded with
    ``capture="update"``."""

    def __init__(self, stat: str = "l2norm", z: float = 6.0, window: int = 100, warmup: int = 20,
                 metrics: str | list[str] | None = None, groups: bool | None = None):
        from ._layout import STAT_NAMES

        if stat not in STAT_NAMES + ("update_ratio",):
            raise ValueError(f"Spike: stat must be one of {', '.join(STAT_NAMES)} or update_ratio, got {stat!r}")
        if z <= 0 or window < 2 or warmup < 1 or warmup > window:
            raise ValueError("Spike: need z > 0, window >= 2 and 1 <= warmup <= window")
        self.stat, self.z, self.window, self.warmup = stat, z, window, warmup
        self._watches = _Watch("Spike", metrics, groups)
        self.metrics = self._watches.metrics
        self._hist: dict[str, deque] = {}

    def state_dict(self) -> dict:
        """Each metric's window of recent values (a resumed run continues them)."""
        return {"window": {k: list(v) for k, v in self._hist.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._hist = {k: deque(map(float, v), maxlen=self.window) for k, v in state["window"].items()}

    def __call__(self, step: DrainedStep):
        out = []
        vals = step.stats[self.stat]
        for i, name in enumerate(step.names):
            v = float(vals[i])
            if not math.isfinite(v) or not self._watches(name):
                continue
            h = self._hist.get(name)
            if h is None:
                h = self._hist[name] = deque(maxlen=self.window)
            if len(h) >= self.warmup:
                arr = np.fromiter(h, dtype=np.float64)
                med = float(np.median(arr))
                scale = 1.4826 * float(np.median(np.abs(arr - med)))
                # A perfectly flat history has MAD 0: judge against a tiny relative floor.
                scale = max(scale, 1e-6 * abs(med), 1e-30)
                if v > med + self.z * scale:
                    out.append(Anomaly(step.step, name, "spike",
                                       f"step {step.step}: {name} {self.stat} = {v:.4g}, "
                                       f"{(v - med) / scale:.1f} robust std above its median "
                                       f"{med:.4g}", step.stats_of(name)))
            h.append(v)
        return out


class Underflow:
    """More than ``frac`` of a metric's finite non-zero values have magnitude
    below ``below`` (read from the log2 histogram: bins wholly below it)."""

    def __init__(self, frac: float = 0.5, below: float = 2.0**-14):
        if not 0 < frac <= 1 or not below > 0:
            raise ValueError("Underflow: need 0 < frac <= 1 and below > 0")
        self.frac, self.below = frac, below
        self._mask = None

    def check_histogram(self, histogram) -> None:
        if histogram is None or histogram.kind != "log2":
            raise ValueError("Underflow needs the Monitor's histogram to be Histogram.log2(...)")

    def __call__(self, step: DrainedStep):
        spec = step.histogram_spec
        self.check_histogram(spec)
        if self._mask is None:
            edges = spec.unsigned.bin_edges  # bin i covers [edges[i], edges[i+1]) of |x|
            self._mask = edges[1:] <= self.below
            self._mask[0] = False  # exact zeros are not "non-zero values"
        out = []
        nonzero = step.stats["finite"] - step.stats["zeros"]
        for i, name in enumerate(step.names):
            if nonzero[i] <= 0:
                continue
            small = spec.fold(step.histogram(name))[self._mask].sum()
            share = small / nonzero[i]
            if share > self.frac:
                out.append(Anomaly(step.step, name, "underflow",
                                   f"step {step.step}: {share:.0%} of {name}'s non-zero values are "
                                   f"below {self.below:.3g}", step.stats_of(name)))
        return out


class _Runs:
    """A detector that fires once a condition has held for ``steps``
    consecutive recorded steps: each metric's current run (its state)."""

    def __init__(self) -> None:
        self._run: dict[str, int] = {}

    def state_dict(self) -> dict:
        return {"run": dict(self._run)}

    def load_state_dict(self, state: dict) -> None:
        self._run = {str(k): int(v) for k, v in state["run"].items()}

    def _extend(self, name: str, holds: bool) -> int:
        """The run of ``name`` after this step (0 where the condition broke it)."""
        n = self._run[name] = self._run.get(name, 0) + 1 if holds else 0
        return n


class Dead(_Runs):
    """A metric stays at ``zero_frac >= zero_frac`` for ``steps`` consecutive
    recorded steps (e.g. dead ReLUs). Fires once per run of such steps."""

    def __init__(self, zero_frac: float = 0.99, steps: int = 50):
        if not 0 < zero_frac <= 1 or steps < 1:
            raise ValueError("Dead: need 0 < zero_frac <= 1 and steps >= 1")
        super().__init__()
        self.zero_frac, self.steps = zero_frac, steps

    def __call__(self, step: DrainedStep):
        out = []
        zf = step.stats["zero_frac"]
        for i, name in enumerate(step.names):
            if self._extend(name, zf[i] >= self.zero_frac) == self.steps:
                out.append(Anomaly(step.step, name, "dead",
                                   f"step {step.step}: {name} has been >= {self.zero_frac:.0%} "
                                   f"zeros for {self.steps} recorded steps", step.stats_of(name)))
        return out


class Threshold(_Runs):
    """A metric's ``stat`` above ``above`` or below ``below`` for ``steps``
    consecutive recorded steps; fires once per run of such steps (again
    after a step back inside the bounds). ``metrics`` and ``groups`` select
    what it watches as :class:`Spike`'s do. E.g. ``Threshold("max",
    above=100, metrics="*/attn.logit", groups=True)`` (a head's max logit
    past MuonClip's τ), ``Threshold("count", below=1, steps=50,
    metrics="*/router.tokens", groups=True)`` (an expert no token reached
    for 50 recorded steps). A NaN ``stat`` (no finite value) is outside no
    bound."""

    def __init__(self, stat: str, above: float | None = None, below: float | None = None,
                 metrics: str | list[str] | None = None, groups: bool | None = None, steps: int = 1):
        from ._layout import MOMENT_NAMES, STAT_NAMES

        if stat not in STAT_NAMES + MOMENT_NAMES:
            raise ValueError(f"Threshold: stat must be one of {', '.join(STAT_NAMES + MOMENT_NAMES)}, got {stat!r}")
        if above is None and below is None:
            raise ValueError("Threshold: give above=, below= or both")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"Threshold: steps must be an int >= 1, got {steps!r}")
        super().__init__()
        self.stat, self.above, self.below, self.steps = stat, above, below, steps
        self._watches = _Watch("Threshold", metrics, groups)

    def __call__(self, step: DrainedStep):
        if self.stat not in step.stats:
            return []
        out = []
        vals = step.stats[self.stat]
        for i, name in enumerate(step.names):
            if not self._watches(name):
                continue
            v = float(vals[i])
            side = "above" if self.above is not None and v > self.above else \
                "below" if self.below is not None and v < self.below else None
            n = self._extend(name, side is not None)
            if side is not None and n == self.steps:
                bound = self.above if side == "above" else self.below
                more = f" for {n} recorded steps" if n > 1 else ""
                out.append(Anomaly(step.step, name, "threshold",
                                   f"step {step.step}: {name} {self.stat} = {v:.4g}, {side} {bound:.4g}{more}",
                                   step.stats_of(name)))
        return out


def as_anomalies(result) -> list[Anomaly]:
    """Normalise a detector's return value."""
    if result is None:
        return []
    if isinstance(result, Anomaly):
        return [result]
    out = list(result)
    for a in out:
        if not isinstance(a, Anomaly):
            raise TypeError(f"a detector returned {type(a).__name__}, expected hookcap.Anomaly")
    return out
