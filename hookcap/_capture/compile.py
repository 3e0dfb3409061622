"""torch.compile support, and hookcap's process-global state.

Inside a compiled region a hook's body is traced into the graph, so it must
be traceable: no host-side cadence check (the kernels read the device's
enabled flag, so ``every`` causes no recompiles), no per-step Python
bookkeeping, and rows are registered by a function dynamo runs once at trace
time (``assume_constant_result``) with the row id baked into the graph.
Traced code writes through the ``record`` op, which names the row by the
Monitor's sink id and row id (two ints): the graph never holds the ring, so
graph breaks, eager writes between graphs and backward passes all see the
ring as it is when they run. Gradient kinds register a tensor hook bound to
its row (a ``functools.partial`` of a module-level function that dynamo
traces into the backward graph, or compiled autograd traces at backward).

Process-global state, all of it:

- ``_HOOKS``: the live Monitors' hook sets by id, so that traced code (which
  can only pass plain values) reaches its Monitor's rows (``hookcap.tap``
  traced: every attached Monitor's, :func:`tap_rows`).
- ``hookcap._rows.recorder.RECORDING``: the Recorders recording now, where an eager
  ``hookcap.tap`` writes.
- ``_compiled_autograd_config``: ``torch._dynamo.config.compiled_autograd`` as of
  the last ``attach()``/recording ``step()`` (reading it costs ~5 us: too
  much per hook).
- ``PYTHON_GRAD_HOOKS``: ``HOOKCAP_PYTHON_GRAD_HOOKS=1`` at import sends
  gradients through Python tensor hooks instead of the C++ ones (an escape
  hatch).
- dynamo's compile-start callback :func:`unpark_for_compile`, registered
  while some Monitor parks its hooks.
- ``torch._dynamo.config.skip_nnmodule_hook_guards``: False while some
  Monitor has module hooks (:func:`hold_hook_guards`), restored after.
- elsewhere: ``hookcap._host.ranks.HANDSHAKE_SEQ`` (c10d store keys of the rank
  handshakes), the atexit and SIGTERM/SIGINT handlers of ``dump_on_exit``
  (``hookcap._host.exit``), and the C++ table of gradient sinks
  (``csrc/grad_hooks.cpp``, one live entry per Monitor; ids are never reused,
  so a graph compiled for a Monitor that is gone finds no sink).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

import torch

from .._rows.config import metric_name
from .._rows.fastpath import row_of
from .._ops import RECORD_IS_EFFECTFUL, make_effectful
from .tree import tensor_leaves

_HOOKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Hooks
PYTHON_GRAD_HOOKS = os.environ.get("HOOKCAP_PYTHON_GRAD_HOOKS") == "1"
_compiled_autograd_config = False
_OP_ACCUMULATE = torch.ops.hookcap.accumulate.default
_RECORD = torch.ops.hookcap.record.default


def register(hooks) -> int:
    """Make a Monitor's hook set reachable from traced code; returns its key."""
    key = id(hooks)
    _HOOKS[key] = hooks
    return key


def refresh_compiled_autograd_config() -> bool:
    global _compiled_autograd_config
    cfg = sys.modules.get("torch._dynamo.config")
    _compiled_autograd_config = bool(cfg is not None and cfg.compiled_autograd)
    return _compiled_autograd_config


def compiled_autograd_on() -> bool:
    """Compiled autograd's context is active, or ``torch._dynamo.config.
    compiled_autograd`` was set as of the last ``attach()`` or ``step()``."""
    if _compiled_autograd_config:
        return True
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.compiled_autograd_enabled


def cpp_grad_hooks_ok() -> bool:
    """Whether gradients may go through C++ tensor hooks. Compiled autograd
    cannot trace C++ hooks: while it is on, Python hooks are used."""
    return not (PYTHON_GRAD_HOOKS or compiled_autograd_on())


def in_backward() -> bool:
    """Inside the autograd engine: forward hooks that fire there are
    activation-checkpoint recomputation, already recorded in the forward."""
    return torch._C._current_graph_task_id() != -1


@torch._dynamo.assume_constant_result
def _compiled_row(key: int, name: str, kind: str, path: str, device: str, shape: tuple,
                  dtype: str, mtype: str) -> int:
    """The row id of a metric, registering it (-1: the Monitor is gone). Run
    by dynamo at trace time only; its result is a constant of the graph."""
    hooks = _HOOKS.get(key)
    if hooks is None:
        return -1
    dev = torch.device(device)
    rec = hooks.recorder
    metric = metric_name(name, kind, path)
    if rec.grouped.matches(metric):
        rec.warn_once(("groups-compiled", metric), f"hookcap: {metric}: recorded whole inside torch.compile "
                      "(Monitor(groups=...) splits module outputs there, not gradients or taps)")
    return rec.register_row((name, kind, path, dev, 0), dev, shape, dtype, mtype,
                            layout=rec.plain_layout(name, kind, path))


@torch._dynamo.assume_constant_result
def tap_rows(name: str, device: str, ndim: int, dtype: str, placement: str | None = None) -> tuple:
    """``(hook set key, sink, row id, metric, ...)`` of tap ``name`` in every attached
    Monitor (a row each, registered now). Run by dynamo at trace time only:
    a graph taps into the Monitors attached when it was traced."""
    out = []
    dev = torch.device(device)
    for key, hooks in list(_HOOKS.items()):
        rec = hooks.recorder
        metric = rec.tap_name(name)  # the model's mode is a guard of the graph
        if rec.attached and metric is not None:
            rid = rec.register_row((metric, "tap", "", dev, 0), dev, (-1,) * ndim, dtype, "tap",
                                   layout=rec.plain_layout(metric, "tap", "", placement))
            if rid >= 0:
                out += [key, rec.fast.id, rid, metric]
    return tuple(out)


def write_tap(x, name: str, placement: str | None = None) -> None:
    """Traced: ``x`` into tap ``name``'s row of each Monitor (hookcap.tap)."""
    rows = tap_rows(name, str(x.device), x.dim(), str(x.dtype), placement)
    for i in range(0, len(rows), 4):
        if RECORD_IS_EFFECTFUL:
            _RECORD(x, rows[i + 1], rows[i + 2])
        else:
            write_all(_HOOKS[rows[i]], rows[i + 3], "tap", x, "tap")


@torch._dynamo.assume_constant_result
def hooks_traced(key: int) -> int:
    """Run by dynamo when it traces one of a Monitor's hooks: from then on
    the Monitor keeps its module hooks in place during off-steps (the graph
    holds them already, and where dynamo guards on module hooks, i.e.
    ``skip_nnmodule_hook_guards=False``, removing them would recompile)."""
    hooks = _HOOKS.get(key)
    if hooks is not None:
        hooks.park_ok = False
    return 0


_hook_guard_holders = 0
_hook_guards_before: bool | None = None


def hold_hook_guards() -> None:
    """While a Monitor has module hooks, dynamo guards every compiled graph on
    the hook dicts of the modules it inlines (``skip_nnmodule_hook_guards =
    False``). Without that, instances of one class share their compiled code:
    a graph traced for an unwatched instance runs a watched one (which then
    records nothing), and a graph traced for one Monitor's instance writes
    another's calls into that Monitor. With it, each distinct set of hooks
    gets its own graph."""
    global _hook_guard_holders, _hook_guards_before
    cfg = torch._dynamo.config
    if _hook_guard_holders == 0:
        _hook_guards_before = cfg.skip_nnmodule_hook_guards
        cfg.skip_nnmodule_hook_guards = False
    _hook_guard_holders += 1


def release_hook_guards() -> None:
    """The last Monitor with module hooks is gone: the user's setting returns
    (unless the user changed it meanwhile)."""
    global _hook_guard_holders
    _hook_guard_holders -= 1
    cfg = torch._dynamo.config
    if _hook_guard_holders == 0 and cfg.skip_nnmodule_hook_guards is False and _hook_guards_before is not None:
        cfg.skip_nnmodule_hook_guards = _hook_guards_before


def unpark_for_compile(args=None) -> None:
    """Dynamo's compile-start callback: a Monitor whose hooks are parked
    puts them back for good before the trace begins. With dynamo's default
    ``skip_nnmodule_hook_guards`` a graph traced without the hooks would never
    see them again, so its recorded steps would silently record nothing."""
    for hooks in list(_HOOKS.values()):
        if hooks.park.parked:
            hooks.park_ok = False
            hooks.park.unpark()


def compile_callback_installed() -> bool:
    """Installs :func:`unpark_for_compile` (again: ``torch._dynamo.reset()``
    clears the callbacks); False where dynamo has no callback API, and then
    nothing may be parked."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    starts = getattr(handler, "start_callbacks", None)
    if not isinstance(starts, list) or not callable(getattr(handler, "register_start_callback", None)):
        return False
    if unpark_for_compile not in starts:
        handler.register_start_callback(unpark_for_compile)
    return True


def _record_grad(sink: int, rid: int, grad):
    """Tensor hook of a gradient kind registered inside a compiled region:
    two ints, no tensor, so the traced backward saves nothing of the ring.
    Returns the gradient unchanged (compiled autograd needs the explicit return)."""
    if grad is not None:
        _RECORD(grad, sink, rid)
    return grad


def _grad_hook_on_ring(ring, row: int, hist_args: tuple, grad):
    """``_record_grad`` where torch cannot keep the record op (no effect API):
    the ring is captured, which is exact only for a graph without breaks."""
    if grad is not None:
        torch.ops.hookcap.accumulate(grad, ring.ring, ring.state, row, *hist_args)
    return grad


def _row(hooks, name, kind, path, t, mtype) -> int:
    """The row id of a metric inside a compiled region, or -1. Its shape
    meta reads -1 per dimension: sizes may be symbolic there (dynamic
    shapes), and dynamo cannot hand a symbolic size to a constant function."""
    return _compiled_row(hooks.key, name, kind, path, str(t.device), (-1,) * t.dim(), str(t.dtype), mtype)


@torch._dynamo.assume_constant_result
def _grouped(key: int, metric: str) -> bool:
    """Whether ``metric`` is grouped (``Monitor(groups=...)``); run at trace time."""
    hooks = _HOOKS.get(key)
    return hooks is not None and hooks.recorder.grouped.matches(metric)


@torch.library.custom_op("hookcap::write_grouped", mutates_args=())
def _write_grouped(t: torch.Tensor, key: int, name: str, kind: str, path: str, mtype: str) -> None:
    """A grouped capture in compiled code: opaque to the compiler, so it runs
    the eager write (its groups, Channels) at each call, on recorded steps."""
    hooks = _HOOKS.get(key)
    if hooks is not None and hooks.recorder.recording:
        hooks.recorder.write(name, kind, path, t.detach(), mtype, 0)


@_write_grouped.register_fake
def _(t, key, name, kind, path, mtype) -> None:
    return None


_GROUPED_IN_GRAPHS = make_effectful(torch.ops.hookcap.write_grouped.default)


def write_all(hooks, name: str, kind: str, obj, mtype: str) -> None:
    """Traced: merge every floating tensor of ``obj`` into its row (a
    grouped one through ``hookcap::write_grouped``)."""
    rec = hooks.recorder
    for path, t in tensor_leaves(obj, traced=True):
        if _GROUPED_IN_GRAPHS and _grouped(hooks.key, metric_name(name, kind, path)):
            _write_grouped(t, hooks.key, name, kind, path, mtype)
            continue
        rid = _row(hooks, name, kind, path, t, mtype)
        if rid < 0:
            continue
        if RECORD_IS_EFFECTFUL:
            _RECORD(t, rec.fast.id, rid)
        else:
            ring = rec.ring_of(rid)
            _OP_ACCUMULATE(t, ring.ring, ring.state, row_of(rid), *rec.config.hist_args)


def grad_hooks(hooks, name: str, kind: str, obj, mtype: str, path: str | None = None) -> None:
    """Traced: a gradient hook on every floating tensor of ``obj`` that
    requires grad (``path`` given: ``obj`` is that one tensor)."""
    rec = hooks.recorder
    tensors = ((path, obj),) if path is not None else tensor_leaves(obj, traced=True)
    for p, t in tensors:
        rid = _row(hooks, name, kind, p, t, mtype) if t.requires_grad else -1
        if rid < 0:
            continue
        if RECORD_IS_EFFECTFUL:
            t.register_hook(functools.partial(_record_grad, rec.fast.id, rid))
        else:
            t.register_hook(functools.partial(_grad_hook_on_ring, rec.ring_of(rid), row_of(rid),
                                              rec.config.hist_args))
