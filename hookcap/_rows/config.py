"""A Monitor's settings: argument validation, the module filter, metric
naming and the constants every part of the Monitor shares."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import nn

from .. import _layout, _ops
from ..groups import check_groups
from ..histogram import Histogram

CAPTURE_KINDS = ("input", "output", "grad_input", "grad_output", "param", "param_grad", "optim_state",
                 "update", "adam_ratio", "attention", "router")
# Kinds read from the parameters at step() (no module hook).
PARAM_KINDS = ("param", "param_grad", "optim_state", "update", "adam_ratio")
DEFAULT_HISTOGRAM = Histogram.log2()
# The root module's name: "." is no qualified name of a child (those are
# non-empty, dot-joined attribute names), so the root never merges with one
# (HF's *ForCausalLM has a child called "model").
ROOT_NAME = "."
RANK_SINKS = ("merged", "all")
EVAL_FORWARDS = ("separate", "skip", "merge")
STREAMS = ("current", "side")  # Monitor(stream=...)
PLACEMENTS = ("replicated", "sharded", "per_rank")  # Monitor(placements=...), tap(placement=...)
EVAL_PREFIX = "eval/"  # metrics of forwards of modules in eval mode, eval_forwards="separate"
SLOTS = 4  # step slots per device ring: the drain may trail training by this many recorded steps
# Monitor(every={...}) keys besides the capture kinds: taps and the default.
EVERY_EXTRA_KEYS = ("tap", "*")
# Kinds recorded by module hooks (parked while none of them records).
MODULE_KINDS = ("input", "output", "grad_input", "grad_output", "attention", "router")
# A row's kind where it differs from the capture kind whose cadence it follows.
_CADENCE_KIND = {"attn": "attention"}


def metric_name(name: str, kind: str, path: str = "") -> str:
    """``f"{name}/{kind}"`` (a tap's: ``name`` itself; optimizer state:
    ``f"{name}/state"``), with ``.{path}`` for a tensor inside a nested value
    (optimizer state: its key)."""
    base = name if kind == "tap" else f"{name}/state" if kind == "optim_state" else f"{name}/{kind}"
    return f"{base}.{path}" if path else base


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_CAPACITY = "256MiB"


def parse_capacity(capacity) -> tuple[int | None, int | None]:
    """``capacity`` -> (max steps, max bytes), one of them None. An int is a
    number of recorded steps; a string is a size in bytes: ``"512MB"`` (10**6),
    ``"256MiB"`` (2**20), also kB/GB/TB, KiB/GiB/TiB, or plain bytes."""
    if isinstance(capacity, (int, np.integer)) and not isinstance(capacity, bool):
        if capacity < 1:
            raise ValueError(f"capacity: a step count must be >= 1, got {capacity!r}")
        return int(capacity), None
    if isinstance(capacity, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", capacity)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n >= 1:
                return None, n
    raise ValueError(f"capacity: expected a number of recorded steps (an int >= 1) or a size in "
                     f"bytes such as '512MB' or '256MiB', got {capacity!r}")


@dataclass(frozen=True)
class Config:
    """What a Monitor records, validated once."""

    capture: tuple[str, ...]
    histogram: Histogram | None
    capacity: int | str  # recorded steps, or a byte size ("512MB")
    every: int | dict  # as given: Monitor.every
    timing: bool
    rank_sinks: str
    eval_forwards: str
    modules: object  # the ``modules`` argument as given (for messages)
    select: Callable[[str, nn.Module], bool]  # which modules are hooked
    hist_args: tuple  # the histogram's op arguments (kind, lo, hi, bins)
    width: int  # int64 values per ring row: header + bins
    update_snapshot: bool = False  # "update" of other optimizers from a copy taken before their step
    moments: int = 2  # 4: also the third and fourth moments (hist_args carries the op's flag)
    placements: tuple[tuple[str, str], ...] = ()  # (metric glob, placement): Monitor(placements=...)
    groups: tuple = ()  # (metric glob, hookcap.Groups): Monitor(groups=...)
    # Per-kind cadence (Monitor(every={...})): kind -> N, and N for every other kind.
    cadence: tuple[tuple[str, int], ...] = ()
    default_every: int = 1

    def every_of(self, kind: str) -> int:
        """Every how many steps rows of ``kind`` (a row kind: ``"attn"`` rows
        follow ``"attention"``) are recorded."""
        kind = _CADENCE_KIND.get(kind, kind)
        for k, n in self.cadence:
            if k == kind:
                return n
        return self.default_every

    def kinds_in_use(self) -> tuple[str, ...]:
        """The kinds whose rows this Monitor can write (timing rows aside:
        they only time the module kinds' metrics)."""
        return self.capture + ("tap",)

    def records_step(self, step: int) -> bool:
        """Whether some kind in use records ``step``."""
        return any(step % self.every_of(k) == 0 for k in self.kinds_in_use())

    @property
    def all_params(self) -> bool:
        """``modules=None``: ``param``/``param_grad`` cover every parameter."""
        return self.modules is None


def make_config(capture, histogram, capacity, every, modules, timing, rank_sinks,
                eval_forwards="separate", update_snapshot=False, moments=2, placements=None,
                groups=None, stream="current") -> Config:
    """Validate the Monitor's arguments; ``ValueError`` naming the argument."""
    if isinstance(capture, str):
        capture = (capture,)
    capture = tuple(capture)
    bad = [c for c in capture if c not in CAPTURE_KINDS]
    if bad or not capture:
        raise ValueError(f"capture: unknown kind(s) {bad or capture!r}; allowed: {', '.join(CAPTURE_KINDS)}")
    if histogram is not None and not isinstance(histogram, Histogram):
        raise ValueError(
            "histogram: expected hookcap.Histogram.log2(...), Histogram.linear(...) or None, "
            f"got {type(histogram).__name__}"
        )
    parse_capacity(capacity)
    cadence, default_every = check_every(every, capture)
    if modules is not None and not (
        isinstance(modules, str) or callable(modules) or isinstance(modules, (list, tuple))
    ):
        raise ValueError(
            "modules: expected None, a glob or list of globs over qualified names, a tuple of "
            f"nn.Module types, or callable(name, module) -> bool; got {type(modules).__name__}"
        )
    if not isinstance(timing, bool):
        raise ValueError(f"timing: expected True or False, got {timing!r}")
    if not (isinstance(rank_sinks, str) and rank_sinks in RANK_SINKS):
        raise ValueError(f"rank_sinks: expected 'merged' (rank 0 writes records merged across "
                         f"ranks) or 'all' (every rank writes its own), got {rank_sinks!r}")
    if not (isinstance(eval_forwards, str) and eval_forwards in EVAL_FORWARDS):
        raise ValueError(f"eval_forwards: expected 'separate' (eval-mode forwards recorded as eval/... "
                         f"metrics), 'skip' or 'merge', got {eval_forwards!r}")
    if not isinstance(update_snapshot, bool):
        raise ValueError(f"update_snapshot: expected True or False, got {update_snapshot!r}")
    if not (isinstance(stream, str) and stream in STREAMS):
        raise ValueError(f"stream: expected 'current' (statistics kernels on the stream current at the "
                         f"capture) or 'side' (on hookcap's side stream of the device), got {stream!r}")
    hist_args = _ops.hist_args(histogram, check_moments(moments), side_stream=stream == "side")
    width = _layout.HEADER + (histogram.nbins if histogram is not None else 0)
    every = dict(every) if isinstance(every, dict) else every
    return Config(capture, histogram, capacity, every, timing, rank_sinks, eval_forwards, modules,
                  module_filter(modules), hist_args, width, update_snapshot, moments,
                  check_placements(placements), check_groups(groups), cadence, default_every)


def _check_n(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what}: must be an int >= 1 (record every N-th step), got {n!r}")
    return int(n)


def check_every(every, capture: tuple) -> tuple[tuple[tuple[str, int], ...], int]:
    """``every`` (an int, or ``{kind: N}`` over capture kinds, ``"tap"`` and
    ``"*"`` for every kind not named, default 1) as ((kind, N), ...) and the
    default N; ``ValueError`` naming what is wrong. Timing rows (which give
    the module's metrics their times) follow the module kinds: every step
    one of them records (the gcd of their N)."""
    if not isinstance(every, dict):
        return (), _check_n(every, "every")
    cadence = {}
    for kind, n in every.items():
        if kind not in CAPTURE_KINDS + EVERY_EXTRA_KEYS:
            raise ValueError(f"every: unknown key {kind!r}; allowed: capture kinds "
                             f"({', '.join(CAPTURE_KINDS)}), 'tap' and '*' (every other kind)")
        if kind in CAPTURE_KINDS and kind not in capture:
            raise ValueError(f"every: {kind!r} is not captured (capture={capture!r})")
        cadence[kind] = _check_n(n, f"every[{kind!r}]")
    default = cadence.pop("*", 1)
    module = [cadence.get(k, default) for k in capture if k in MODULE_KINDS]
    cadence["timing"] = math.gcd(*module) if module else default
    return tuple(cadence.items()), default


def check_placements(placements) -> tuple[tuple[str, str], ...]:
    """``Monitor(placements={metric glob: placement})`` as (glob, placement)
    pairs, first match wins; ``ValueError`` naming what is wrong."""
    if placements is None:
        return ()
    if not isinstance(placements, dict):
        raise ValueError(f"placements: expected a dict {{metric glob: {' | '.join(map(repr, PLACEMENTS))}}}, "
                         f"got {type(placements).__name__}")
    for glob, placement in placements.items():
        check_placement(placement, f"placements[{glob!r}]")
        if not isinstance(glob, str) or not glob:
            raise ValueError(f"placements: keys are globs over metric names (non-empty str), got {glob!r}")
    return tuple(placements.items())


def check_placement(placement, what: str = "placement") -> str:
    """``placement`` if it is one of PLACEMENTS, else ``ValueError``."""
    if not (isinstance(placement, str) and placement in PLACEMENTS):
        raise ValueError(f"{what}: expected 'replicated' (the same data on the ranks that hold it: counted "
                         f"once), 'sharded' or 'per_rank' (each rank's own part: summed), got {placement!r}")
    return placement


def check_moments(moments) -> int:
    """``moments`` (2 or 4), or ``ValueError``."""
    if isinstance(moments, bool) or moments not in (2, 4):
        raise ValueError(f"moments: expected 2 (mean and std) or 4 (also skew and kurtosis), got {moments!r}")
    return moments


def module_filter(modules) -> Callable[[str, nn.Module], bool]:
    """``select(qualified_name, module) -> bool`` for the ``modules`` argument."""
    if modules is None:
        return default_module
    if isinstance(modules, type):  # a bare module type, as a 1-tuple
        modules = (modules,)
    if isinstance(modules, str):
        modules = [modules]
    if isinstance(modules, (list, tuple)) and modules and all(isinstance(t, type) for t in modules):
        types = tuple(modules)
        return lambda name, m: isinstance(m, types)
    if isinstance(modules, (list, tuple)):
        if not all(isinstance(g, str) for g in modules):
            raise ValueError("modules: a list must hold only glob strings or only nn.Module types")
        globs = list(modules)
        return lambda name, m: any(fnmatch.fnmatchcase(name, g) for g in globs)
    return modules


def default_module(name: str, m: nn.Module) -> bool:
    """``modules=None``: a leaf, or a module that owns a parameter directly
    (``nn.MultiheadAttention``), is parametrized (``weight_norm``,
    ``spectral_norm``) or wraps a ``base_layer`` (PEFT's adapted layers, e.g.
    a LoRA ``Linear``: its output is base + adapter, the layer's effective
    output). Parametrization internals are excluded by
    :func:`parametrization_internals`."""
    if next(m.children(), None) is None:
        return True
    return (next(m.parameters(recurse=False), None) is not None or "parametrizations" in m._modules
            or "base_layer" in m._modules)


def parametrization_internals(model: nn.Module) -> set[int]:
    """``id`` of every module inside a parametrization container of ``model``
    (``m.parametrizations``): they compute a parameter, not an activation."""
    out: set[int] = set()
    for m in model.modules():
        p = m._modules.get("parametrizations")
        if p is not None:
            out.update(id(x) for x in p.modules())
    return out


def example_names(model: nn.Module, k: int = 4) -> str:
    """A few qualified module names of ``model``, for error messages."""
    names = [q or ROOT_NAME for q, _ in model.named_modules()][:k]
    return ", ".join(repr(n) for n in names)
