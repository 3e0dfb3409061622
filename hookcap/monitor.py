"""Monitor: attach to any model, record per-layer stats every step."""

from __future__ import annotations

import fnmatch
import functools
import itertools
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from . import _C, _layout
from ._park import HookPark
from ._ring import DeviceRing, next_host_state
from .anomaly import Anomaly, AnomalyError, NonFinite, Underflow, as_anomalies
from .drained import DrainedStep
from ._tree import floating_tensors
from .histogram import Histogram
from .history import History, HostStore, make_record

log = logging.getLogger("hookcap")

CAPTURE_KINDS = ("input", "output", "grad_input", "grad_output", "param", "param_grad")
_DEFAULT_HIST = Histogram.log2()
_SLOTS = 4
ROOT_NAME = "model"
RANK_SINKS = ("merged", "all")
# How long a multi-rank Monitor with rank_sinks="merged" waits, once at its
# first step(), for every rank's Monitor to answer before it falls back to
# per-rank sinks.
RANK_HANDSHAKE_TIMEOUT_S = 60.0
# rank_sinks="merged" merges the pending steps across ranks at every
# RANK_MERGE_EVERY-th step() (and at detach()): fewer, larger collectives
# (each costs ~1 ms of latency on gloo whatever its size).
RANK_MERGE_EVERY = 8
_HANDSHAKE_SEQ = itertools.count()  # Monitors of this process that reached the handshake


@dataclass
class _StepPlan:
    metrics: np.ndarray  # metric of each row of the step's concatenated rows
    call_rows: np.ndarray  # row of every call, in execution order
    calls: np.ndarray  # metric of every call, in execution order
    order: np.ndarray  # metrics in first-execution order
    groups: _layout.GroupPlan


def _in_backward() -> bool:
    # Forward hooks that fire inside the autograd engine are activation-
    # checkpoint recomputation: already recorded in the forward pass.
    return torch._C._current_graph_task_id() != -1


def _validate(capture, histogram, capacity, every, modules):
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
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity: must be an int >= 1 (steps kept on the host), got {capacity!r}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every: must be an int >= 1 (record every N-th step), got {every!r}")
    if modules is not None and not (
        isinstance(modules, str) or callable(modules) or isinstance(modules, (list, tuple))
    ):
        raise ValueError(
            "modules: expected None, a glob or list of globs over qualified names, a tuple of "
            f"nn.Module types, or callable(name, module) -> bool; got {type(modules).__name__}"
        )
    return capture


def _module_filter(modules) -> Callable[[str, nn.Module], bool]:
    if modules is None:
        return lambda name, m: next(m.children(), None) is None  # leaf modules
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


def _skip(*args):
    return None


def _example_names(model: nn.Module, k: int = 4) -> str:
    names = [q or ROOT_NAME for q, _ in model.named_modules()][:k]
    return ", ".join(repr(n) for n in names)


_SKIPPED = object()  # row-cache marker: this (metric, device, call) is not recorded
_OP_ACCUMULATE = torch.ops.hookcap.accumulate.default
_RESET_ROWS = torch.ops.hookcap.reset_rows.default
_TIME_MARK = torch.ops.hookcap.time_mark.default
_TIME_ERROR_FLAG = 1 << 62  # grad_hooks.cpp kTimeErrorFlag: an error token of a timing hook
_MONITORS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Monitor
# HOOKCAP_PYTHON_GRAD_HOOKS=1: gradients through Python tensor hooks, as
# before the C++ path existed (for comparison and as an escape hatch).
_PYTHON_GRAD_HOOKS = os.environ.get("HOOKCAP_PYTHON_GRAD_HOOKS") == "1"


# torch._dynamo.config.compiled_autograd as of the last attach() or step()
# of any Monitor: reading a dynamo config value costs ~5 us, too much per hook.
_CA_CONFIG = False


def _refresh_ca_config() -> bool:
    global _CA_CONFIG
    cfg = sys.modules.get("torch._dynamo.config")
    _CA_CONFIG = bool(cfg is not None and cfg.compiled_autograd)
    return _CA_CONFIG


def _compiled_autograd_on() -> bool:
    """Compiled autograd's context is active, or ``torch._dynamo.config.
    compiled_autograd`` was set as of the last ``attach()`` or ``step()``."""
    if _CA_CONFIG:
        return True
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.compiled_autograd_enabled


def _cpp_grad_hooks_ok() -> bool:
    """Whether gradients may go through C++ tensor hooks (grad_hooks.cpp).
    Compiled autograd cannot trace C++ hooks: while it is on, Python hooks
    are used."""
    return not (_PYTHON_GRAD_HOOKS or _compiled_autograd_on())


@torch._dynamo.assume_constant_result
def _compiled_row(mon_id: int, name: str, kind: str, path: str, device: str, shape: tuple,
                  dtype: str, mtype: str) -> tuple:
    """(ring index, row) of a metric, registering it. Run by dynamo at trace
    time only; its result is a constant of the compiled graph."""
    mon = _MONITORS.get(mon_id)
    if mon is None:
        return (0, -1)
    ring, row, _ = mon._register_row((name, kind, path, torch.device(device), 0), torch.device(device),
                                  shape, dtype, mtype)
    return (mon._ring_list.index(ring), row)


@torch._dynamo.assume_constant_result
def _hooks_traced(mon_id: int) -> int:
    """Run by dynamo when it traces one of a Monitor's hooks: from then on
    the Monitor keeps its module hooks in place during off-steps (the graph
    holds them already, and where dynamo guards on module hooks, i.e.
    ``skip_nnmodule_hook_guards=False``, removing them would recompile)."""
    mon = _MONITORS.get(mon_id)
    if mon is not None:
        mon._park_ok = False
    return 0


def _unpark_for_compile(args=None) -> None:
    """Dynamo's compile-start callback: a Monitor whose hooks are parked
    puts them back for good before the trace begins. With dynamo's default
    ``skip_nnmodule_hook_guards`` a graph traced without the hooks would never
    see them again, so its recorded steps would silently record nothing."""
    for mon in list(_MONITORS.values()):
        if mon._park.parked:
            mon._park_ok = False
            mon._park.unpark()


def _compile_callback_installed() -> bool:
    """Installs _unpark_for_compile (again: ``torch._dynamo.reset()`` clears
    the callbacks); False where dynamo has no callback API, and then nothing
    may be parked."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    starts = getattr(handler, "start_callbacks", None)
    if not isinstance(starts, list) or not callable(getattr(handler, "register_start_callback", None)):
        return False
    if _unpark_for_compile not in starts:
        handler.register_start_callback(_unpark_for_compile)
    return True


def _compiled_grad_hook(ring: DeviceRing, row: int, hargs: tuple, grad):
    """Tensor hook of a gradient kind registered inside a compiled region
    (bound to its ring and row; ``ring.ring`` is read at call time, so a grown
    ring is used). Returns the gradient unchanged (compiled autograd needs the
    explicit return); the kernel reads the device's enabled flag, as in the
    forward."""
    if grad is not None:
        torch.ops.hookcap.accumulate(grad, ring.ring, ring.state, row, *hargs)
    return grad


def _first_grad_input(args: tuple, kwargs: dict):
    """(position or keyword, tensor) of a call's first plain tensor argument
    that requires grad, else (None, None)."""
    for i, v in enumerate(args):
        if type(v) is torch.Tensor and v.requires_grad:
            return i, v
    for k, v in kwargs.items():
        if type(v) is torch.Tensor and v.requires_grad:
            return k, v
    return None, None


def _call_device(args, kwargs, mod: nn.Module) -> torch.device:
    """Where a module call runs: its first tensor argument's device, else its
    first parameter's or buffer's, else the CPU."""
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
    for t in itertools.chain(mod.parameters(), mod.buffers()):
        return t.device
    return torch.device("cpu")


def _inplace_grad_node(alias: torch.Tensor, node0):
    """The autograd node whose post-hook sees the gradient w.r.t. an input
    once the module modified ``alias`` (a view of that input, whose grad_fn
    was ``node0``) in place, else None. An in-place op on a view rebases the
    graph: hooks registered on the alias before it never fire; the base's new
    CopySlices node runs the module's backward and hands on the gradient
    w.r.t. the whole base."""
    base = alias._base
    if alias.grad_fn is node0 or base is None:
        return None
    node = base.grad_fn
    return node if type(node).__name__ == "CopySlices" else None


def _view_geometry(t: torch.Tensor, base: torch.Tensor):
    """None when ``t`` is ``base`` itself, else where ``t`` sits in ``base``:
    (size, stride, storage offset from base's, base shape, base stride)."""
    if t is base:
        return None
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset(),
            tuple(base.shape), tuple(base.stride()))


def _input_obj(args, kwargs):
    """What "input" records: the single positional argument itself, else the
    positional arguments (paths 0, 1, ...) and keyword arguments (by name)."""
    if len(args) == 1 and not kwargs:
        return args[0]
    return {**dict(enumerate(args)), **kwargs} if kwargs else args


def _compiled_tensors(obj, path=""):
    """floating_tensors for traced code: tensors, tuples/lists, dicts."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)] if obj.is_floating_point() else []
    out = []
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out += _compiled_tensors(v, f"{path}.{i}" if path else str(i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += _compiled_tensors(v, f"{path}.{k}" if path else str(k))
    return out


class Monitor:
    """Records per-layer statistics of a model into a device ring, every step.

    Args:
        model: the module to watch (its qualified names name the metrics; the
            root is ``"model"``).
        modules: ``None`` (every leaf module), a glob or list of globs over
            qualified names (fnmatch), a tuple of ``nn.Module`` types, or
            ``callable(name, module) -> bool``.
        capture: any of ``"input"`` (forward pre-hook, so in-place ops inside the
            module cannot alter it), ``"output"``, ``"grad_input"`` (the gradient
            the module sends to each floating input that requires grad),
            ``"grad_output"`` (gradient w.r.t. the module's outputs),
            ``"param"`` (values at ``step()``), ``"param_grad"`` (final
            accumulated gradient of each step).
        histogram: ``Histogram.log2()`` (default), ``Histogram.linear(...)`` or None.
        capacity: recorded steps kept on the host (oldest dropped first).
        every: record every N-th step; other steps launch nothing.
        optimizer: if given, ``step()`` runs after each ``optimizer.step()``.
        detectors: callables run on every drained step (default
            ``[hookcap.NonFinite()]``; ``[]`` for none).
        on_anomaly: ``"warn"`` (one log warning per metric and kind), ``"raise"``
            (``hookcap.AnomalyError`` from ``step()``: on CPU at the ``step()`` that
            closes the anomalous step; on CUDA at a later ``step()``, at most the
            ring depth (4 recorded steps) later), ``None``, or ``callable(Anomaly)``.
        sinks: consumers of drained steps (``hookcap.sinks.*``).
        timing: also record how long each hooked module's forward and backward
            take, per step (``h["fwd_ms"]``, ``h["bwd_ms"]``: milliseconds,
            summed over the module's calls in the step, on every metric of
            that module; NaN where not measured). Device-side timestamps on
            CUDA (%globaltimer, stream-ordered: no host sync), the host's
            steady clock on CPU. Forward: from the module's forward pre-hook to
            its forward hook (hookcap's own stats work excluded). Backward:
            from the gradient w.r.t. its first output that requires grad to the
            gradient w.r.t. its first input that requires grad, so a module
            none of whose inputs requires grad (a first layer) has no
            ``bwd_ms``; a step whose marks do not pair up (a forward that
            raised, a backward that reached only one end) reads NaN, and so
            does code compiled by ``torch.compile`` or compiled autograd
            (module boundaries fused away). Costs a pre-hook and two timing
            ops per module call (four with backward).
        dump_on_anomaly: path (or existing directory) for an automatic
            ``dump()`` at the first anomaly.
        dump_on_exit: path for a ``dump()`` when the process exits (atexit) or
            receives SIGTERM/SIGINT (the previous handler is chained, so the
            program's own handling, e.g. KeyboardInterrupt, still happens).
        rank_sinks: where sink records go in a multi-rank run (torch.distributed
            initialised, world size > 1; otherwise both values behave alike:
            every record goes to this process's sinks, no collective runs).

            - ``"merged"`` (default): rank 0's sinks receive each recorded step
              merged across all ranks (counts, sums and histograms summed,
              extrema combined: the math of ``history(all_ranks=True)``), one
              record per step with ``DrainedStep.rank`` None; the sinks of
              other ranks receive nothing. Every rank must create the Monitor
              and call ``step()`` and ``detach()`` the same number of times:
              every ``hookcap.monitor.RANK_MERGE_EVERY``-th ``step()`` (8)
              runs one small ``all_gather_object`` plus one MIN and one SUM
              all-reduce of the steps due (on a gloo group of its own, host
              memory only: no device copy or sync, also under NCCL), so rank
              0's sinks receive steps in batches; ``detach()`` flushes the
              last steps (a collective).
              The collectives run only when some rank has sinks. At the first
              ``step()`` the ranks agree through the c10d store (waiting up to
              ``hookcap.monitor.RANK_HANDSHAKE_TIMEOUT_S``, 60 s); if some
              rank does not answer in time (e.g. only rank 0 created the
              Monitor), one warning is logged and this Monitor behaves like
              ``"all"``. A step is written once every rank has it complete
              (on CUDA the drain trails training by up to 4 recorded steps);
              detectors keep running on each rank's own data.
            - ``"all"``: each rank's sinks receive that rank's own records
              (``DrainedStep.rank`` = the rank); no collective runs. Sinks are
              told their rank by ``bind_rank(rank)`` before the first write:
              ``JSONL``/``CSV`` write ``path`` with ``{rank}`` replaced, or
              with ``.rank{r}`` before the extension (``stats.jsonl`` ->
              ``stats.rank1.jsonl``); ``TensorBoard`` writes under
              ``log_dir/rank{r}``; ``WandB`` prefixes its keys with ``rank{r}/``.

    Metric names are ``f"{qualname}/{kind}"``, with ``.{path}`` appended for
    tensors inside tuples, lists, dicts and dataclasses (``"0"``, ``"1.attn"``,
    ``"logits"``), and ``f"{param_qualname}/param"`` / ``"/param_grad"``.
    """

    def __init__(
        self,
        model: nn.Module,
        modules=None,
        capture=("output", "grad_output"),
        histogram: Histogram | None = _DEFAULT_HIST,
        capacity: int = 1024,
        every: int = 1,
        optimizer: torch.optim.Optimizer | None = None,
        detectors=None,
        on_anomaly="warn",
        sinks=None,
        dump_on_anomaly=None,
        dump_on_exit=None,
        rank_sinks: str = "merged",
        timing: bool = False,
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
        if not (isinstance(rank_sinks, str) and rank_sinks in RANK_SINKS):
            raise ValueError(f"rank_sinks: expected 'merged' (rank 0 writes records merged across "
                             f"ranks) or 'all' (every rank writes its own), got {rank_sinks!r}")
        self.capture = _validate(capture, histogram, capacity, every, modules)
        if not isinstance(timing, bool):
            raise ValueError(f"timing: expected True or False, got {timing!r}")
        self.timing = timing
        self.model = model
        self.histogram = histogram
        self.capacity = capacity
        self.every = every
        self.optimizer = optimizer
        self._filter = _module_filter(modules)
        self._modules_arg = modules
        self._all_params = modules is None
        self._hargs = (0, 0.0, 0.0, 0) if histogram is None else histogram.op_args()
        self._width = _layout.HEADER + (histogram.nbins if histogram is not None else 0)
        self._lock = threading.Lock()
        self._handles: list = []
        # Module hooks leave during off-steps (every > 1) for nn.Module's fast
        # call path (hookcap/_park.py); never once dynamo traced them (the
        # graph holds them already; with module-hook guards on, parking would
        # recompile).
        self._park = HookPark()
        self._park_ok = True
        self._attached = False
        self._global = False
        self.dropped_steps = 0
        self._warned_drop = False
        self._reader_stalled = False  # test hook: pretend the host reader is stuck
        self.detectors = [NonFinite()] if detectors is None else list(detectors)
        for d in self.detectors:
            if not callable(d):
                raise ValueError(f"detectors: {d!r} is not callable")
            if isinstance(d, Underflow):
                d.check_histogram(histogram)
        if not (on_anomaly in ("warn", "raise", None) or callable(on_anomaly)):
            raise ValueError(f"on_anomaly: expected 'warn', 'raise', None or a callable, got {on_anomaly!r}")
        self.on_anomaly = on_anomaly
        self.sinks = list(sinks or [])
        self.failed_sinks: list = []
        self.dump_on_anomaly = dump_on_anomaly
        self.anomalies: list[Anomaly] = []
        self._warned: set[tuple[str, str]] = set()
        self._warned_skips: set = set()
        self._raise: Anomaly | None = None
        self._dumped = False
        self.dump_on_exit = dump_on_exit
        self._exit_hooked = False
        # Multi-rank sinks (decided at the first step() that sees a process group).
        self.rank_sinks = rank_sinks
        self._ranks_decided = False
        self._rank: int | None = None  # this process's rank in a multi-rank run (DrainedStep.rank)
        self._merge_group = None  # gloo group: merged rank_sinks is on
        self._pending: list = []  # completed StepRecords not merged yet
        self._merge_names: list[str] = []  # union of all ranks' metric names (same on every rank)
        self._merge_metas: dict = {}
        self._names_sent = 0  # own metric names already sent to the other ranks
        self._inplace_modules: set[str] = set()  # timed modules seen modifying their input in place
        self._open_calls: list[list] = []  # timing/grad_input hooks' open forward calls, per module
        self._time_off: set[str] = set()  # modules whose timing failed (warned once)
        self._reset_recording_state()
        _MONITORS[id(self)] = self

    # -- recording state ------------------------------------------------------
    def _reset_recording_state(self):
        self._rings: dict[torch.device, DeviceRing] = {}
        self._ring_list: list[DeviceRing] = []  # the same rings, indexable from compiled code
        self._names: list[str] = []
        self._metric_index: dict[str, int] = {}
        self._metas: dict[str, dict] = {}
        self._rows: dict[tuple, tuple[DeviceRing, int]] = {}
        self._store = HostStore(self.capacity)
        self._step = 0
        self._slot = 0
        self._enabled = True
        # (ring id, row) of writes through the Python op wrapper, in first-write
        # order; every other write is logged by the C++ sink.
        self._order: dict[tuple[int, int], None] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._replace_rows: set[tuple[int, int]] = set()
        # Writes made in C++ (grad_hooks.cpp: gradients, forward outputs): the
        # sink holds this Monitor's rings and logs each write's row with the
        # number of rows Python had logged before it (_python_writes), which
        # places it in the execution order at _finish_step.
        old_sink = getattr(self, "_grad_sink", None)
        if old_sink is not None:
            _C._grad_sink_free(old_sink)
        self._python_writes = torch.zeros(1, dtype=torch.int64)
        self._python_writes_np = self._python_writes.numpy()
        self._grad_sink = _C._grad_sink_new(self._python_writes, *self._hargs)
        weakref.finalize(self, _C._grad_sink_free, self._grad_sink)  # releases the rings
        self._cpp_token: dict[tuple[int, int], int] = {}  # (ring id, row) -> ring index << 32 | row
        self._py_token: dict[int, tuple[int, int]] = {}  # and back
        self._cpp_skipped: set[int] = set()
        self._unnamed: dict[tuple[int, int], tuple[str, dict]] = {}  # rows awaiting a first write
        # Output hooks' ids in the sink's table of cached rows (_output_fast);
        # kept across resets, as the registered hooks keep theirs.
        self._hook_ids: dict[str, int] = getattr(self, "_hook_ids", {})
        self._expect: dict[int, set[int]] = {}
        self._partial: dict[int, list] = {}
        self._plans: dict[tuple, _StepPlan] = {}
        # timing=True: one timing row per (module, device); its ring row's
        # metric_of_row is -2 - (the module's index in _time_names).
        self._time_rows: dict[tuple[str, torch.device], tuple[DeviceRing, int, int]] = {}
        self._time_names: list[str] = []
        self._time_index: dict[str, int] = {}
        self._metric_module: dict[str, str] = {}  # metric name -> module (or param) name
        self._metric_time = np.empty(0, dtype=np.int64)  # metric index -> time index or -1
        self._metric_time_key = (0, 0)

    @property
    def current_step(self) -> int:
        """The step being recorded now (steps start at 0)."""
        return self._step

    # -- attach / detach --------------------------------------------------------
    def __enter__(self) -> Monitor:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def attach(self) -> Monitor:
        """Register the hooks. Idempotent."""
        if self._attached:
            return self
        self._attached = True
        _C._grad_sink_active(self._grad_sink, True)
        self._sync_recording(new_step=False)
        if self.dump_on_exit is not None:
            self._hook_exit()
        if self._global:
            self._attach_global()
            self._park_or_unpark()
            return self
        matched = 0
        for qual, mod in self.model.named_modules():
            name = qual or ROOT_NAME
            if self._filter(name, mod):
                self._hook_module(name, mod)
                matched += 1
        if matched == 0 and not self._all_params:
            self._attached = False
            self._sync_recording(new_step=False)
            raise ValueError(f"modules: {self._modules_arg!r} matched no module of the model "
                             f"(qualified names look like {_example_names(self.model)})")
        if "param" in self.capture or "param_grad" in self.capture:
            self._params = [(n, p) for n, p in self._watched_params() if p.is_floating_point()]
        if "param_grad" in self.capture:
            for pname, p in self._params:
                if p.requires_grad:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(self._param_grad_hook(pname)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(lambda *a, **k: self.step()))
        self._park_or_unpark()
        return self

    def detach(self) -> None:
        """Remove every hook this Monitor added and close the sinks (the
        history stays readable). With ``rank_sinks="merged"`` in a multi-rank
        run this is a collective: every rank's ``detach()`` merges the steps
        still pending and rank 0 writes them before its sinks are closed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._park.clear()
        self._open_calls.clear()
        was = self._attached
        self._attached = False
        _C._grad_sink_active(self._grad_sink, False)  # hooks of this step's graph stay quiet
        self._sync_recording(new_step=False)
        if was and (self.sinks or self._merge_group is not None):
            self._collect(wait=True)
            if self._merge_group is not None:
                self._merge_pending()
            for sink in list(self.sinks):
                try:
                    sink.close()
                except Exception as e:
                    log.error("hookcap: closing sink %r failed: %s: %s", sink, type(e).__name__, e)

    def _watched_params(self) -> Iterable[tuple[str, nn.Parameter]]:
        """All parameters when ``modules`` is None, else those owned directly by
        the selected modules."""
        if self._all_params:
            yield from self.model.named_parameters()
            return
        seen = set()
        for qual, mod in self.model.named_modules():
            if not self._filter(qual or ROOT_NAME, mod):
                continue
            for pn, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{qual}.{pn}" if qual else pn), p

    def _add_module_hook(self, handle) -> None:
        self._handles.append(handle)
        self._park.add(handle)

    def _hook_module(self, name: str, mod: nn.Module) -> None:
        mtype = type(mod).__name__
        add = self._add_module_hook
        if "input" in self.capture:
            add(mod.register_forward_pre_hook(self._input_hook(name, mtype), with_kwargs=True))
        if "output" in self.capture or "grad_output" in self.capture:
            add(mod.register_forward_hook(self._output_hook(name, mtype)))
        if "grad_input" in self.capture:
            pre, post = self._grad_input_hooks(name, mtype)
            add(mod.register_forward_pre_hook(pre, with_kwargs=True))
            add(mod.register_forward_hook(post))
        if self.timing:
            # The start mark last among the pre-hooks and the end mark first
            # among the forward hooks: the stats work stays out of the time.
            pre, post = self._timing_hooks(name)
            add(mod.register_forward_pre_hook(pre, with_kwargs=True))
            add(mod.register_forward_hook(post, prepend=True))

    # -- hooks (hot path) -------------------------------------------------------
    def _input_hook(self, name, mtype):
        def hook(mod, args, kwargs):
            if torch.compiler.is_compiling():
                _hooks_traced(id(self))
                self._compiled_write_all(name, "input", _input_obj(args, kwargs), mtype)
                return None
            if self._enabled and self._attached and not _in_backward():
                ci = self._call_index(name, "input")
                for path, t in floating_tensors(_input_obj(args, kwargs)):
                    self._write(name, "input", path, t, mtype, ci)
            return None

        return hook

    def _output_hook(self, name, mtype):
        want_out = "output" in self.capture
        want_grad = "grad_output" in self.capture
        hid = self._hook_id(name)
        output_fast = _C._output_fast

        def hook(mod, args, output):
            if torch.compiler.is_compiling():
                _hooks_traced(id(self))
                if want_out:
                    self._compiled_write_all(name, "output", output, mtype)
                if want_grad:
                    self._compiled_grad_hooks(name, "grad_output", output, mtype)
                return None
            # Steady state in one C call (grad_hooks.cpp): a cached plain
            # output is merged and its gradient hook registered there. It
            # also counts the call (ci) and says whether this step records.
            ci = output_fast(self._grad_sink, hid, output)
            if ci < 0:
                return None
            # Checkpoint recomputation: the values were recorded in the forward
            # pass; only reentrant checkpointing, whose first forward ran
            # without grad, needs the gradient hooks registered now (hooks on
            # a non-reentrant recomputation's discarded graph never fire).
            recompute = _in_backward()
            plain = type(output) is torch.Tensor
            if plain and output.is_floating_point():
                pairs = (("", output),)
            else:
                pairs = floating_tensors(output)
            for path, t in pairs:
                if want_out and not recompute:
                    self._write(name, "output", path, t, mtype, ci)
                if want_grad and t.requires_grad:
                    if type(t) is torch.Tensor and _cpp_grad_hooks_ok():
                        self._capture_grad(name, path, t, mtype, ci)
                    else:
                        t.register_hook(self._grad_tensor_hook(name, path, mtype, ci))
            if plain and not recompute:
                self._learn_fast_output(name, hid, ci, output, want_out, want_grad)
            return None

        return hook

    # A module call whose output is one plain tensor: once its rows exist,
    # the sink caches them and later calls take _output_fast (the same work
    # as _write and _capture_grad, without Python: in a training step every
    # Python line runs on cold caches).
    def _learn_fast_output(self, name, hid, ci, t, want_out, want_grad) -> None:
        if not t.is_floating_point():
            return
        dev = t.device
        out = self._rows.get((name, "output", "", dev, ci)) if want_out else None
        grad = self._rows.get((name, "grad_output", "", dev, ci)) if want_grad else None
        # Only once every wanted row exists (a gradient row appears at the
        # first call whose output requires grad).
        if (want_out and (out is None or out is _SKIPPED)) or (want_grad and (grad is None or grad is _SKIPPED)):
            return
        _C._fast_learn(self._grad_sink, hid, ci, t,
                       self._cpp_token[out[2]] if out is not None else -1,
                       self._cpp_token[grad[2]] if grad is not None else -1)

    def _capture_grad(self, name, path, t, mtype, ci):
        # The grad row is registered now, from the output's metadata (its
        # gradient has the same shape, dtype and device); rows a backward
        # never writes are left out of the step's record.
        key = (name, "grad_output", path, t.device, ci)
        hit = self._rows.get(key)
        if hit is None:
            hit = self._register(key, t, mtype, defer_name=True)
        if hit is _SKIPPED:
            return
        token = self._cpp_token[hit[2]]
        if token not in self._cpp_skipped:
            self._capture_grad_cpp(name, path, t, token)

    def _capture_grad_cpp(self, name, path, t, token):
        try:
            _C._capture_grad(t, self._grad_sink, token)
        except Exception as e:  # telemetry must never take the run down
            self._cpp_skipped.add(token)
            metric = f"{name}/grad_output.{path}" if path else f"{name}/grad_output"
            self._warn_once((name, "grad_output", path), f"hookcap: {metric} is no longer recorded: "
                                                         f"{type(e).__name__}: {e}")

    def _grad_tensor_hook(self, name, path, mtype, ci, kind="grad_output"):
        # Gradient w.r.t. one module output (or input alias). A tensor hook
        # rather than a full backward hook: it changes nothing in the graph, so
        # in-place ops after the module (ReLU(inplace=True)) keep working.
        def hook(grad):
            if self._enabled and self._attached and grad is not None:
                self._write(name, kind, path, grad, mtype, ci, via_op=True)
            return None

        return hook

    def _grad_input_hooks(self, name, mtype):
        # The module receives a view-alias of each input that requires grad;
        # the alias's gradient is exactly what this module sends back to that
        # input. (Full backward hooks wrap outputs in a custom Function and make
        # any later in-place op, e.g. ReLU(inplace=True), raise.) Values are
        # unchanged: an alias is the same memory. The forward hook catches a
        # module that modified its input in place (see _inplace_grad_node).
        open_calls: list = []  # per call in flight: [(alias, its grad_fn, view geometry, hook)]
        self._open_calls.append(open_calls)

        def alias(path, t, ci, made):
            a = t.view_as(t)
            fn = self._grad_tensor_hook(name, path, mtype, ci, kind="grad_input")
            a.register_hook(fn)
            made.append((a, a.grad_fn, _view_geometry(t, a._base), fn))
            return a

        def compiled_alias(path, t):
            a = t.view_as(t)
            self._compiled_grad_hooks(name, "grad_input", a, mtype, path)
            return a

        def pre(mod, args, kwargs):
            compiling = torch.compiler.is_compiling()
            if compiling:
                _hooks_traced(id(self))
            if not (torch.is_grad_enabled() and (compiling or (self._enabled and self._attached))):
                if not compiling:
                    open_calls.append(None)
                return None
            single = len(args) == 1 and not kwargs
            ci = 0 if compiling else self._call_index(name, "grad_input")
            made: list = []

            def wrap(path, v):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
                    return compiled_alias(path, v) if compiling else alias(path, v, ci, made)
                return v

            new_args = tuple(wrap("" if single else str(i), v) for i, v in enumerate(args))
            new_kwargs = {k: wrap(k, v) for k, v in kwargs.items()}
            if not compiling:
                open_calls.append(made or None)
            return new_args, new_kwargs

        def post(mod, args, output):
            if torch.compiler.is_compiling() or not open_calls:
                return None
            made = open_calls.pop()
            for a, node0, geom, fn in made or ():
                node = _inplace_grad_node(a, node0)
                if node is not None:
                    node.register_hook(functools.partial(self._inplace_grad_input, name, geom, fn))
            return None

        return pre, post

    def _inplace_grad_input(self, name, geom, fn, grad_inputs, grad_outputs):
        # grad_inputs[0]: the gradient w.r.t. the whole base of the input.
        g = grad_inputs[0] if grad_inputs else None
        if g is None:
            return None
        if geom is not None:  # the input is a view of a larger base: its part of g
            size, stride, offset, base_shape, base_stride = geom
            if tuple(g.shape) != base_shape or tuple(g.stride()) != base_stride:
                self._warn_once(("grad_input_inplace", name),
                                f"hookcap: {name}/grad_input not recorded: the module modifies a view of "
                                "a larger tensor in place and the gradient's layout differs from it")
                return None
            g = g.as_strided(size, stride, g.storage_offset() + offset)
        fn(g)
        return None

    def _timing_hooks(self, name):
        open_calls: list = []  # this module's forward calls in flight (nested calls stack)
        self._open_calls.append(open_calls)
        sink = self._grad_sink
        time_mark = _C._time_mark
        inplace = self._inplace_modules

        def grad_mark(t, ring, row, token, start) -> None:
            # A C++ tensor hook, or a Python one with HOOKCAP_PYTHON_GRAD_HOOKS=1.
            # A backward that compiled autograd compiles is not timed (NaN):
            # its module boundaries are fused and reordered like a compiled
            # forward's, and its first run would include the compile.
            if _compiled_autograd_on():
                return
            if _PYTHON_GRAD_HOOKS:
                t.register_hook(functools.partial(self._bwd_mark, name, ring, row, start))
            else:
                _C._time_grad_hook(t, sink, token, start)

        last: list = [None, None]  # the previous call's device and its (ring, row, token)

        def pre(mod, args, kwargs):
            if torch.compiler.is_compiling():
                _hooks_traced(id(self))
                return None
            if not (self._enabled and self._attached) or _in_backward() or name in self._time_off:
                open_calls.append(None)
                return None
            try:
                x = args[0] if args else None
                dev = x.device if type(x) is torch.Tensor else _call_device(args, kwargs, mod)
                if dev == last[0]:
                    ring, row, token = last[1]
                else:
                    if dev.type == "meta":
                        open_calls.append(None)
                        return None
                    last[1] = ring, row, token = self._time_row(name, dev)
                    last[0] = dev
                time_mark(sink, token, 0, True)
                new, end = None, None
                if torch.is_grad_enabled():
                    # The backward ends when the gradient w.r.t. the module's
                    # first input that requires grad is complete: seen on an
                    # alias of it (the same memory) that only this module uses.
                    key, v = _first_grad_input(args, kwargs)
                    if v is None:
                        pass
                    elif name in inplace and v._base is None:
                        # No alias for a module seen modifying its input in
                        # place: an alias would route the gradient through a
                        # CopySlices copy. A hook on the input itself survives
                        # an in-place op and sees the input's gradient (all its
                        # users' part).
                        grad_mark(v, ring, row, token, False)
                        end = (v, v.grad_fn)
                    else:
                        a = v.view_as(v)
                        grad_mark(a, ring, row, token, False)
                        if type(key) is int:
                            new = (args[:key] + (a,) + args[key + 1:], kwargs)
                        else:
                            new = (args, {**kwargs, key: a})
                        end = (a, a.grad_fn)
            except Exception as e:  # telemetry must never take the run down
                self._timing_failed(name, e)
                open_calls.append(None)
                return None
            open_calls.append((ring, row, token, end))
            return new

        def post(mod, args, output):
            if torch.compiler.is_compiling() or not open_calls:
                return None
            top = open_calls.pop()
            if top is None:
                return None
            ring, row, token, end = top
            try:
                time_mark(sink, token, 0, False)
                if end is not None:
                    node = _inplace_grad_node(*end)
                    if node is not None:  # the alias's own hook died with the in-place op
                        node.register_hook(functools.partial(self._bwd_node_mark, name, ring, row))
                        inplace.add(name)
                    if type(output) is torch.Tensor:
                        t = output if output.requires_grad else None
                    else:
                        t = next((v for _, v in floating_tensors(output) if v.requires_grad), None)
                    if t is not None:
                        grad_mark(t, ring, row, token, True)
            except Exception as e:
                self._timing_failed(name, e)
            return None

        return pre, post

    def _bwd_mark(self, name, ring, row, start, grad):
        # Python path. ring.ring is read now, not at registration: the ring
        # may have grown.
        if self._attached and name not in self._time_off:
            try:
                _TIME_MARK(ring.ring, ring.state, row, 1, start)
            except Exception as e:
                self._timing_failed(name, e)
        return None

    def _bwd_node_mark(self, name, ring, row, grad_inputs, grad_outputs):
        self._bwd_mark(name, ring, row, False, None)

    def _timing_failed(self, name, e: Exception) -> None:
        self._time_off.add(name)
        self._warn_once(("timing", name), f"hookcap: {name} is no longer timed: {type(e).__name__}: {e}")

    def _time_row(self, name: str, device: torch.device) -> tuple[DeviceRing, int, int]:
        """(ring, row, C++ token) of ``name``'s timing row on ``device``."""
        hit = self._time_rows.get((name, device))
        if hit is None:
            with self._lock:
                t = self._time_index.get(name)
                if t is None:
                    t = self._time_index[name] = len(self._time_names)
                    self._time_names.append(name)
                ring, row = self._add_row(device, -2 - t)
                hit = self._time_rows[(name, device)] = (ring, row, (ring.index << 32) | row)
        return hit

    def _param_grad_hook(self, pname):
        def hook(p):
            if self._enabled and self._attached and p.grad is not None:
                # Fires after every accumulation: the row is replaced so the
                # step keeps the final accumulated gradient, once.
                self._write(pname, "param_grad", "", p.grad, "Parameter", 0, replace=True, via_op=True)

        return hook

    # -- torch.compile path ------------------------------------------------------
    # Inside a compiled region the hook body is traced into the graph, so it
    # must be traceable: no host-side cadence check (the kernels read the
    # device's enabled flag, so `every` causes no recompiles), no per-step
    # Python bookkeeping, and rows are registered by a function that dynamo
    # runs once at trace time (assume_constant_result) with the row index
    # baked into the graph. Gradient kinds register a tensor hook bound to its
    # row (functools.partial of a module-level function: dynamo lifts it into
    # the backward, which calls it eagerly or, under compiled autograd, traces it).
    def _compiled_ring_row(self, name, kind, path, t, mtype):
        """(DeviceRing, row) of a metric inside a compiled region, or None."""
        ring_i, row = _compiled_row(id(self), name, kind, path, str(t.device), tuple(t.shape),
                                    str(t.dtype), mtype)
        return (self._ring_list[ring_i], row) if row >= 0 else None

    def _compiled_grad_hooks(self, name, kind, obj, mtype, prefix=None):
        tensors = ((prefix, obj),) if prefix is not None else _compiled_tensors(obj)
        for path, t in tensors:
            hit = self._compiled_ring_row(name, kind, path, t, mtype) if t.requires_grad else None
            if hit is not None:
                t.register_hook(functools.partial(_compiled_grad_hook, *hit, self._hargs))

    def _sync_recording(self, new_step: bool) -> None:
        # What the C++ forward fast path needs to know; a new step also
        # restarts its call counts.
        recording = self._enabled and self._attached
        # The compiled-autograd config matters only to a recording step; an
        # off-step skips reading it (~5 us warm, tens of us with the caches
        # cold after a backward pass).
        _C._grad_sink_recording(self._grad_sink, recording,
                                _PYTHON_GRAD_HOOKS or (recording and _refresh_ca_config()), new_step)

    def _hook_id(self, name: str) -> int:
        return self._hook_ids.setdefault(name, len(self._hook_ids))

    def _compiled_write_all(self, name, kind, obj, mtype):
        for path, t in _compiled_tensors(obj):
            hit = self._compiled_ring_row(name, kind, path, t, mtype)
            if hit is not None:
                ring, row = hit
                torch.ops.hookcap.accumulate(t, ring.ring, ring.state, row, *self._hargs)

    def _call_index(self, name: str, kind: str) -> int:
        # Each call of a module in a step writes its own row (merged by name
        # on the host), so a NaN from the 2nd call of a reused module is
        # placed at that call's position in the execution order.
        ci = self._calls.get((name, kind), 0)
        self._calls[(name, kind)] = ci + 1
        return ci

    def _write(self, name, kind, path, t, mtype, ci, replace=False, via_op=False):
        if type(t) is not torch.Tensor:
            t = self._plain(t)
            if t is None:
                return
        key = (name, kind, path, t.device, ci)
        hit = self._rows.get(key)
        if hit is None:
            hit = self._register(key, t, mtype)
        if hit is _SKIPPED:
            return
        ring, row, token = hit
        if replace:
            if token in self._replace_rows:
                _RESET_ROWS(ring.ring, ring.state, row, row + 1)
            else:
                self._replace_rows.add(token)
        try:
            if via_op:  # traceable by dynamo (compiled autograd runs these hooks)
                _OP_ACCUMULATE(t, ring.ring, ring.state, row, *self._hargs)
            else:  # logs the write in the sink's execution order
                _C._accumulate_row(t, self._grad_sink, self._cpp_token[token])
        except Exception as e:  # telemetry must never take the run down
            self._rows[key] = _SKIPPED
            self._warn_once(key[:3], f"hookcap: {key[0]}/{key[1]} is no longer recorded: "
                                     f"{type(e).__name__}: {e}")
            return
        if via_op and token not in self._order:
            self._order[token] = None
            self._python_writes_np[0] += 1

    def _warn_once(self, what, message: str) -> None:
        if what not in self._warned_skips:
            self._warned_skips.add(what)
            log.warning(message)

    def _plain(self, t):
        """A plain strided tensor to record for ``t``, or None to skip it."""
        if isinstance(t, nn.Parameter):
            return t.detach()
        to_local = getattr(t, "to_local", None)
        if callable(to_local):  # DTensor: record this rank's local shard
            return to_local()
        return t

    def _skip_reason(self, t) -> str | None:
        if t.layout != torch.strided:
            return f"layout {t.layout} is not supported"
        if t.is_quantized:
            return "quantized tensors are not supported"
        if t.is_nested:
            return "nested tensors are not supported"
        if t.device.type == "meta":
            return "meta tensors hold no values"
        if type(t) is not torch.Tensor:
            return f"tensor subclass {type(t).__name__} is not supported"
        return None

    def _register(self, key, t, mtype, defer_name=False):
        name, kind, path = key[:3]
        reason = self._skip_reason(t)
        if reason is not None:
            self._rows[key] = _SKIPPED
            metric = f"{name}/{kind}.{path}" if path else f"{name}/{kind}"
            self._warn_once((name, kind, path), f"hookcap: not recording {metric}: {reason}")
            return _SKIPPED
        return self._register_row(key, t.device, tuple(t.shape), str(t.dtype), mtype, defer_name)

    def _register_row(self, key, device, shape, dtype, mtype, defer_name=False):
        """The (ring, row, token) of a metric's call, created on first use.
        ``defer_name``: a row whose first write happens in C++ (a gradient)
        gets its metric name when that write is seen (``_execution_order``),
        so metrics never written stay out of ``names``, and names keep their
        first-execution order."""
        name, kind, path = key[:3]
        metric = f"{name}/{kind}.{path}" if path else f"{name}/{kind}"
        meta = {"module_type": mtype, "kind": kind, "shape": shape, "dtype": dtype}
        with self._lock:
            if key in self._rows:
                return self._rows[key]
            idx = self._metric_index.get(metric)
            if idx is None and defer_name:
                idx = -1  # named when first written
            elif idx is None:
                idx = self._new_metric(metric, meta)
            self._metric_module[metric] = name
            ring, row = self._add_row(device, idx)
            hit = (ring, row, (id(ring), row))  # the token names the row in _order
            self._cpp_token[hit[2]] = (ring.index << 32) | row
            self._py_token[(ring.index << 32) | row] = hit[2]
            if idx < 0:
                self._unnamed[hit[2]] = (metric, meta)
            self._rows[key] = hit
            return hit

    def _add_row(self, device: torch.device, idx: int) -> tuple[DeviceRing, int]:
        """A new row of ``device``'s ring (created on first use) owned by
        metric ``idx`` (-1: named later; <= -2: a timing row). Caller holds
        the lock."""
        ring = self._rings.get(device)
        if ring is None:
            ring = DeviceRing(device, _SLOTS, self._width)
            self._sync_ring_state(ring)
            self._rings[device] = ring
            self._ring_list.append(ring)
            ring.index = len(self._ring_list) - 1
            _C._grad_sink_ring(self._grad_sink, ring.index, ring.ring, ring.state)
        buf = ring.ring
        row = ring.add_row(idx)
        if ring.ring is not buf:  # grown: C++ hooks read the new buffer
            _C._grad_sink_ring(self._grad_sink, ring.index, ring.ring, ring.state)
        return ring, row

    def _new_metric(self, metric: str, meta: dict) -> int:
        idx = len(self._names)
        self._names.append(metric)
        self._metric_index[metric] = idx
        self._metas[metric] = meta
        return idx

    def _sync_ring_state(self, ring: DeviceRing) -> None:
        # A ring created mid-run starts at the Monitor's current step.
        ring.state.copy_(torch.tensor([self._step, int(self._enabled), self._slot]))
        torch.ops.hookcap.reset_slot(ring.ring, ring.state)

    # -- steps ------------------------------------------------------------------
    def step(self) -> None:
        """Close the current step and open the next. No host sync on CUDA.
        With ``rank_sinks="merged"`` in a multi-rank run, also a (host-only)
        collective on every rank: see the class docstring."""
        if not self._ranks_decided:
            self._setup_ranks()
        if self._enabled:
            if "param" in self.capture and self._attached:
                with torch.no_grad():
                    for pname, p in getattr(self, "_params", ()):
                        self._write(pname, "param", "", p.detach(), "Parameter", 0)
            self._finish_step()
        else:  # gradients that arrived in an off-step wrote nothing: forget them
            _C._grad_sink_take(self._grad_sink)
        self._collect(wait=False)
        if self._merge_group is not None and self._step % RANK_MERGE_EVERY == RANK_MERGE_EVERY - 1:
            self._merge_pending()  # the same step on every rank: step() counts agree
        step, enabled, slot = next_host_state(self._step, self._slot, self.every, _SLOTS)
        if enabled:
            for ring in self._rings.values():
                if not ring.is_cuda:
                    dropped = ring.drop_unread(slot)
                    if dropped is not None:
                        self._drop(dropped)
        for ring in self._rings.values():
            ring.advance(self.every)
        self._step, self._enabled, self._slot = step, enabled, slot
        self._order = {}
        self._python_writes_np[0] = 0
        self._calls = {}
        for open_calls in self._open_calls:  # a forward that raised never closed its call
            open_calls.clear()
        self._sync_recording(new_step=True)
        self._replace_rows.clear()
        self._park_or_unpark()
        if self._raise is not None:
            a, self._raise = self._raise, None
            raise AnomalyError(a)

    def _park_or_unpark(self) -> None:
        # Hooks out for a step that records nothing; in for one that records.
        if self._enabled or not (self._park_ok and self._attached):
            self._park.unpark()
        elif not self._park.parked and _compile_callback_installed():
            self._park.park()

    def _finish_step(self) -> None:
        order = self._execution_order()  # taken even when the step is dropped
        expect = set()
        for ring in self._rings.values():
            if ring.finish(self._step, self._slot):
                expect.add(id(ring))
            else:
                self._drop(self._step)
                return
        self._expect[self._step] = expect
        self._partial[self._step] = [order]

    def _execution_order(self) -> list:
        """Rows in first-write order: the writes logged in C++ with Python's
        op-path writes (``_order``) placed where they happened."""
        tokens, after, errors = _C._grad_sink_take(self._grad_sink)
        for token, message in errors:
            if token & _TIME_ERROR_FLAG:  # a backward timing mark (_C._time_grad_hook)
                token &= ~_TIME_ERROR_FLAG
                tidx = -2 - self._ring_list[token >> 32].metric_of_row[token & 0xFFFFFFFF]
                self._timing_failed(self._time_names[tidx], RuntimeError(message))
                continue
            self._cpp_skipped.add(token)
            ring = self._ring_list[token >> 32]
            t = (id(ring), token & 0xFFFFFFFF)
            metric = self._unnamed[t][0] if t in self._unnamed else \
                self._names[ring.metric_of_row[token & 0xFFFFFFFF]]
            self._warn_once(("cpp", token), f"hookcap: {metric} is no longer recorded: {message}")
        order = list(self._order)
        if not tokens:
            return order
        pyt = self._py_token
        if after[0] == len(order):
            # The usual step: every gradient came after the last Python write.
            merged = order + list(dict.fromkeys([pyt[t] for t in tokens]))
        else:
            merged, seen, i = [], set(), 0
            for token, k in zip(tokens, after):
                merged.extend(order[i:k])
                i = max(i, k)
                t = pyt[token]
                if t not in seen:
                    seen.add(t)
                    merged.append(t)
            merged.extend(order[i:])
        if self._unnamed:  # name new gradient metrics in execution order
            rings = {id(r): r for r in self._ring_list}
            with self._lock:
                for t in merged:
                    pending = self._unnamed.pop(t, None)
                    if pending is not None:
                        metric, meta = pending
                        idx = self._metric_index.get(metric)
                        rings[t[0]].metric_of_row[t[1]] = self._new_metric(metric, meta) if idx is None else idx
        return merged

    def _drop(self, step: int) -> None:
        self.dropped_steps += 1
        self._expect.pop(step, None)
        self._partial.pop(step, None)
        if not self._warned_drop:
            self._warned_drop = True
            log.warning("hookcap: the host fell behind; step %d was dropped (counted in "
                        "Monitor.dropped_steps; logged once)", step)

    def _collect(self, wait: bool) -> None:
        if self._reader_stalled and not wait:
            return
        for ring in self._rings.values():
            for step, rows in ring.ready(wait=wait):
                parts = self._partial.get(step)
                if parts is None:
                    continue  # dropped
                parts.append((id(ring), np.asarray(ring.metric_of_row[: rows.shape[0]], dtype=np.int64), rows))
                self._expect[step].discard(id(ring))
                if not self._expect[step]:
                    self._complete(step)

    def _step_plan(self, order, chunks, metrics) -> _StepPlan:
        """Execution order, per-call metric and row, and the merge plan of a
        step's rows: the same every step of a steady training loop, so cached
        by the step's call pattern."""
        key = (tuple(order), tuple((rid, len(m)) for rid, m, _ in chunks))
        plan = self._plans.get(key)
        if plan is not None and np.array_equal(plan.metrics, metrics):
            return plan
        offset, pos = {}, 0
        for rid, m, _ in chunks:
            offset[rid] = pos
            pos += len(m)
        call_rows = np.array([offset[rid] + row for rid, row in order], dtype=np.int64)
        calls = metrics[call_rows] if len(call_rows) else np.empty(0, np.int64)
        _, first = np.unique(calls, return_index=True)
        plan = _StepPlan(metrics.copy(), call_rows, calls, calls[np.sort(first)], _layout.GroupPlan(metrics))
        if len(self._plans) >= 8:  # patterns keep changing: keep only the newest
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _complete(self, step: int) -> None:
        order, *chunks = self._partial.pop(step)
        del self._expect[step]
        metrics = np.concatenate([m for _, m, _ in chunks]) if chunks else np.empty(0, np.int64)
        rows = np.concatenate([r for _, _, r in chunks]) if chunks else np.empty((0, self._width), np.int64)
        plan = self._step_plan(order, chunks, metrics)
        # Which calls saw NaN/Inf (one entry per call-row, in execution order).
        calls_bad = (rows[:, [_layout.NAN, _layout.POSINF, _layout.NEGINF]].sum(axis=1) > 0)[plan.call_rows]
        if not plan.groups.trivial:  # several calls or devices per metric
            metrics, rows = _layout.merge_groups(rows, metrics, plan.groups)
        timed = metrics <= -2
        time_rows = None
        if timed.any():  # timing rows (timing=True) are not metrics
            time_rows = (-2 - metrics[timed], rows[timed])
            metrics, rows = metrics[~timed], rows[~timed]
        rec = make_record(step, metrics, rows, plan.order, plan.calls, calls_bad)
        if self.timing:
            rec.time_ns = self._time_of(rec.metrics, time_rows)
        self._store.add(rec)
        sinks = self.sinks
        if self._merge_group is not None:  # the sinks get it merged across ranks (_merge_pending)
            self._pending.append(rec)
            sinks = ()
        # The default detector alone only cares about steps with NaN/Inf.
        quiet = not sinks and not calls_bad.any() and not rows[
            :, [_layout.NAN, _layout.POSINF, _layout.NEGINF]].any() and all(
            type(d) is NonFinite for d in self.detectors)
        if (self.detectors or sinks) and not quiet:
            drained = DrainedStep(rec, self._names, self._metas, self.histogram, self._rank)
            for det in self.detectors:
                for a in as_anomalies(det(drained)):
                    self._anomaly(a)
            if sinks:
                self._write_sinks(drained)

    def _time_of(self, metrics: np.ndarray, time_rows) -> np.ndarray:
        """float64 [len(metrics), 2]: (forward, backward) ns of the module
        owning each metric this step; NaN where not timed or incomplete."""
        out = np.full((len(metrics), 2), np.nan)
        if time_rows is None:
            return out
        key = (len(self._names), len(self._time_names))
        if key != self._metric_time_key:  # new metrics or timed modules
            self._metric_time = np.array(
                [self._time_index.get(self._metric_module.get(n), -1) for n in self._names], dtype=np.int64)
            self._metric_time_key = key
        tidx, rows = time_rows
        per_module = np.full((len(self._time_names), 2), np.nan)
        L = _layout
        for phase, (ns, open_, ends) in enumerate(((L.FWD_NS, L.FWD_OPEN, L.FWD_ENDS),
                                                    (L.BWD_NS, L.BWD_OPEN, L.BWD_ENDS))):
            ok = (rows[:, open_] == 0) & (rows[:, ends] > 0)
            per_module[tidx, phase] = np.where(ok, rows[:, ns].astype(np.float64), np.nan)
        t = self._metric_time[metrics]
        has = t >= 0
        out[has] = per_module[t[has]]
        return out

    def _write_sinks(self, drained: DrainedStep) -> None:
        for sink in list(self.sinks):
            try:
                if sink.wants(drained) if hasattr(sink, "wants") else True:
                    sink.write(drained)
            except Exception as e:  # a sink must never stop training
                self._disable_sink(sink, e)

    def _disable_sink(self, sink, e: Exception) -> None:
        self.sinks.remove(sink)
        self.failed_sinks.append((sink, e))
        log.error("hookcap: sink %r failed and was disabled: %s: %s (the history "
                  "keeps every step)", sink, type(e).__name__, e)

    # -- multi-rank sinks ---------------------------------------------------------
    def _setup_ranks(self) -> None:
        """Once, at the first step() that sees an initialised process group:
        where this Monitor's sink records go (see ``rank_sinks``)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return  # single process (so far): records go to the sinks as they are
        self._ranks_decided = True
        if dist.get_world_size() <= 1:
            return
        self._rank = dist.get_rank()
        if self.rank_sinks == "merged":
            decision = self._handshake()
            if decision == "none":
                return  # no rank has sinks: nothing to merge, no collective ever
            if decision == "merged":
                self._merge_group = dist.new_group(backend="gloo")
                self._bind_sinks(None)
                if self._rank != 0 and self.sinks:
                    log.info("hookcap: rank_sinks='merged': rank 0 writes the records merged across "
                             "ranks; the sinks of rank %d receive nothing (rank_sinks='all' gives "
                             "one stream per rank)", self._rank)
                return
        self._bind_sinks(self._rank)  # "all", or the fallback of "merged"

    def _bind_sinks(self, rank: int | None) -> None:
        for sink in list(self.sinks):
            bind = getattr(sink, "bind_rank", None)
            if callable(bind):
                try:
                    bind(rank)
                except Exception as e:
                    self._disable_sink(sink, e)

    def _handshake(self) -> str:
        """Agree with the other ranks' Monitors through the c10d store: each
        rank publishes whether it has sinks and waits for all the others; the
        first rank to decide writes the outcome, which every rank follows:
        "merged", "none" (every rank answered, none has sinks) or "local"
        (some rank did not answer in time: per-rank sinks)."""
        from datetime import timedelta

        dist = torch.distributed
        world, rank = dist.get_world_size(), self._rank
        base = f"hookcap/rank_sinks/{next(_HANDSHAKE_SEQ)}"
        keys = [f"{base}/{r}" for r in range(world)]
        timeout = RANK_HANDSHAKE_TIMEOUT_S
        missing: list[int] = []
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(keys[rank], "1" if self.sinks else "0")
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

    def _merge_pending(self) -> None:
        """Merged rank_sinks, on every rank at every RANK_MERGE_EVERY-th
        step() and at detach(): one all_gather_object of (watermark, pending
        steps, new metric names),
        then, for the steps every rank has complete, one MIN and one SUM
        all-reduce (skipped together when nothing is due or rank 0 has no
        sinks); rank 0 writes the merged records in step order."""
        from .distributed import merge_records, union_names

        dist = torch.distributed
        group = self._merge_group
        new = self._names[self._names_sent:]
        # Every recorded step <= watermark is complete here (or was dropped).
        watermark = min(self._partial) - 1 if self._partial else self._step
        info = {"watermark": watermark, "steps": [r.step for r in self._pending],
                "names": new, "metas": {n: self._metas[n] for n in new},
                "hist": repr(self.histogram), "write": bool(self.sinks)}
        infos = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, info, group=group)
        self._names_sent += len(new)
        union_names(infos, self._merge_names, self._merge_metas)
        if len({i["hist"] for i in infos}) != 1:
            self._unmerge("the ranks record with different histogram specs")
            return
        cut = min(i["watermark"] for i in infos)
        steps = sorted({s for i in infos for s in i["steps"] if s <= cut})
        due = [r for r in self._pending if r.step <= cut]
        self._pending = [r for r in self._pending if r.step > cut]
        if not steps or not infos[0]["write"]:
            return  # the same on every rank: all skip the all-reduces
        recs = merge_records(due, self._names, self.histogram, self._merge_names, steps, group)
        if self._rank == 0:
            for rec in recs:
                self._write_sinks(DrainedStep(rec, self._merge_names, self._merge_metas,
                                              self.histogram))

    def _unmerge(self, why: str) -> None:
        """Every rank at once (decided from the same gathered data): stop
        merging, write the pending records to this rank's own sinks."""
        log.error("hookcap: rank_sinks='merged': %s; this Monitor falls back to per-rank sinks", why)
        self._merge_group = None
        self._bind_sinks(self._rank)
        pending, self._pending = self._pending, []
        for rec in pending:
            self._write_sinks(DrainedStep(rec, self._names, self._metas, self.histogram, self._rank))

    def _hook_exit(self) -> None:
        """Dump at interpreter exit and on SIGTERM/SIGINT, chaining any
        existing handler. Registered once per Monitor."""
        if self._exit_hooked:
            return
        self._exit_hooked = True
        import atexit
        import signal

        ref = weakref.ref(self)

        def dump_now():
            mon = ref()
            if mon is not None and not mon._exit_dumped:
                mon._exit_dumped = True
                try:
                    mon.dump(mon.dump_on_exit)
                except Exception as e:
                    log.error("hookcap: dump_on_exit failed: %s: %s", type(e).__name__, e)

        self._exit_dumped = False
        atexit.register(dump_now)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                dump_now()
                if callable(prev):
                    return prev(signum, frame)
                if prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)
                return None

            signal.signal(sig, handler)

    def _anomaly(self, a: Anomaly) -> None:
        self.anomalies.append(a)
        if self.dump_on_anomaly is not None and not self._dumped:
            self._dumped = True
            try:
                self.dump(self._dump_path(a))
            except Exception as e:
                log.error("hookcap: dump_on_anomaly failed: %s: %s", type(e).__name__, e)
        if self.on_anomaly == "warn":
            if (a.name, a.kind) not in self._warned:
                self._warned.add((a.name, a.kind))
                log.warning("hookcap anomaly (%s): %s", a.kind, a.message)
        elif self.on_anomaly == "raise":
            if self._raise is None:
                self._raise = a
        elif callable(self.on_anomaly):
            self.on_anomaly(a)

    def _dump_path(self, a: Anomaly) -> str:
        import os

        p = os.fspath(self.dump_on_anomaly)
        if os.path.isdir(p) or p.endswith(os.sep):
            os.makedirs(p, exist_ok=True)
            return os.path.join(p, f"hookcap-anomaly-step{a.step}.npz")
        return p

    def dump(self, path) -> str:
        """Write every retained step of every metric, the metadata, execution
        order and anomalies to one file (read back with ``hookcap.load``)."""
        return self.history().save(path, extra={
            "anomalies": [a.to_dict() for a in self.anomalies],
            "dropped_steps": self.dropped_steps,
            "capture": list(self.capture),
            "every": self.every,
        })

    def history(self, all_ranks: bool = False, group=None) -> History:
        """Every retained recorded step (waits for in-flight copies: the explicit read).

        ``all_ranks=True`` is a collective (every rank of ``group`` calls it):
        the result merges all ranks' statistics (counts, sums and histograms
        summed, extrema combined) with one packed MIN and one packed SUM
        all-reduce; metric rows agree even when a rank lacks a metric."""
        self._collect(wait=True)
        h = History(self._store.records, self._names, self._metas, self.histogram)
        h.anomalies = list(self.anomalies)
        if all_ranks:
            from .distributed import merge_across_ranks

            h = merge_across_ranks(h, group)
        return h

    @property
    def names(self) -> list[str]:
        """Metric names discovered so far, in first-execution order."""
        return list(self._names)

    # -- global capture -----------------------------------------------------------
    @classmethod
    def everything(cls, models: nn.Module | Iterable[nn.Module] | None = None, **kwargs) -> Monitor:
        """A Monitor of every module that runs in the process (global module
        hooks). Modules of ``models`` are named by their qualified names; any
        other module is named ``f"{ClassName}#{k}"`` in first-seen order."""
        kwargs.setdefault("modules", lambda name, mod: True)
        mon = cls(None, **kwargs)
        mon._global = True
        if isinstance(models, nn.Module):
            models = [models]
        mon._global_names = weakref.WeakKeyDictionary()
        for model in models or ():
            for qual, mod in model.named_modules():
                mon._global_names[mod] = qual or ROOT_NAME
        mon._class_counts: dict[str, int] = {}
        return mon

    def _global_name(self, mod: nn.Module) -> str:
        name = self._global_names.get(mod)
        if name is None:
            cname = type(mod).__name__
            k = self._class_counts.get(cname, 0)
            self._class_counts[cname] = k + 1
            name = f"{cname}#{k}"
            self._global_names[mod] = name
        return name

    def _attach_global(self) -> None:
        from torch.nn.modules import module as mm

        def named(factory):
            cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

            def dispatch(mod, *args):
                fn = cache.get(mod)
                if fn is None:
                    name = self._global_name(mod)
                    fn = factory(name, type(mod).__name__) if self._filter(name, mod) else _skip
                    cache[mod] = fn
                return fn(mod, *args)

            return dispatch

        pairs: dict[tuple, tuple] = {}  # (kind, module name) -> its (pre, post) hooks sharing a stack

        def timing_of(n):
            if ("timing", n) not in pairs:
                pairs[("timing", n)] = self._timing_hooks(n)
            return pairs[("timing", n)]

        def grad_input_of(n, t):
            if ("grad_input", n) not in pairs:
                pairs[("grad_input", n)] = self._grad_input_hooks(n, t)
            return pairs[("grad_input", n)]

        def args_only(pre):
            # Global pre-hooks get no kwargs: adapt a (mod, args, kwargs) pre-hook.
            def hook(mod, args):
                res = pre(mod, args, {})
                return None if res is None else res[0]

            return hook

        if self.timing:  # global hooks run in registration order: the end mark first
            self._add_module_hook(mm.register_module_forward_hook(
                named(lambda n, t: timing_of(n)[1])))
        if "input" in self.capture:
            self._add_module_hook(mm.register_module_forward_pre_hook(
                named(lambda n, t: (lambda mod, args: self._input_hook(n, t)(mod, args, {})))))
        if "output" in self.capture or "grad_output" in self.capture:
            self._add_module_hook(mm.register_module_forward_hook(named(self._output_hook)))
        if "grad_input" in self.capture:
            self._add_module_hook(mm.register_module_forward_pre_hook(
                named(lambda n, t: args_only(grad_input_of(n, t)[0]))))
            self._add_module_hook(mm.register_module_forward_hook(
                named(lambda n, t: grad_input_of(n, t)[1])))
        if self.timing:  # ... and the start mark last
            self._add_module_hook(mm.register_module_forward_pre_hook(
                named(lambda n, t: args_only(timing_of(n)[0]))))

