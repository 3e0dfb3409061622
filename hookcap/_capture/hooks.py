"""The hooks a Monitor registers: module forward (pre-)hooks per capture kind,
tensor hooks for gradients, parameter hooks, global module hooks
(``Monitor.everything``), and parking them out of PyTorch's hook dicts during
steps that record nothing. Hooks hand tensors to the recorder; they decide
nothing else."""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from . import compile as _compile, portable as _portable
from .attention import AttentionCapture
from .router import RouterCapture
from .parallel_plan import output_placements
from .._rows.config import (EVAL_PREFIX, PARAM_KINDS, ROOT_NAME, Config, example_names, metric_name,
                            parametrization_internals)
from .follow import ModelWatch, watched_params
from .optim import OptimState, OptimUpdates, after_optimizer_step, before_optimizer_step
from .park import HookPark
from .._rows.fastpath import DONE
from .._rows.recorder import Recorder, is_dtensor
from .hook_order import move_last
from .param_grads import ParamGrads
from .scaler import iteration_ended
from .timing import Timing, inplace_grad_node
from .tree import input_obj, tensor_leaves, view_geometry

log = logging.getLogger("hookcap")


def _skip(*args):
    return None


def _by_mode(train, ev):
    """A hook running ``train`` for modules in train mode, else ``ev`` (None: nothing)."""
    def hook(mod, *args):
        return train(mod, *args) if mod.training else None if ev is None else ev(mod, *args)
    return hook


def _give_back_guard(guard: list) -> None:
    """Release a hook set's hold on dynamo's hook guards, once."""
    if guard[0]:
        guard[0] = False
        _compile.release_hook_guards()


class Hooks:
    """All hooks of one Monitor. ``handles`` removes them; ``park`` holds
    those parked on off-steps; ``park_ok`` turns False for good once dynamo
    traced them. ``key``: this hook set's key in hookcap._capture.compile."""

    def __init__(self, config: Config, recorder: Recorder, model: nn.Module | None, optimizer=None):
        self.config = config
        self.recorder = recorder
        self.model = model
        self.optim_state = OptimState(recorder, optimizer) if "optim_state" in config.capture else None
        # One pass per parameter for all three: optim_state's tensors that the step read go with it.
        kinds = tuple(k for k in ("update", "adam_ratio", "optim_state") if k in config.capture)
        self.updates = OptimUpdates(recorder, optimizer, kinds, config.update_snapshot) if kinds else None
        self.optimizer_followed = False  # follow_optimizer(): the optimizer's own hooks record its kinds
        self.optimizer_stepped = False  # with grad_scaler=: the optimizer stepped since the scaler's last update
        self.key = _compile.register(self)
        self.handles: list = []
        # Module hooks leave during off-steps (every > 1) for nn.Module's fast
        # call path (hookcap/_capture/park.py); never once dynamo traced them (the
        # graph holds them already; with module-hook guards on, parking would
        # recompile).
        self.park = HookPark()
        self.park_ok = True
        self.open_calls: list[list] = []  # per pre/post hook pair: its forward calls in flight
        self.timing = Timing(recorder, self.open_calls, self.key)
        self.attention = (AttentionCapture(recorder, lambda: _compile.hooks_traced(self.key))
                          if "attention" in config.capture else None)
        self.router = (RouterCapture(recorder, lambda: _compile.hooks_traced(self.key))
                       if "router" in config.capture else None)
        self.params: list[tuple[str, torch.Tensor]] = []
        self.grads = ParamGrads(recorder)  # param_grad
        # Monitor.everything: module -> name, and per-class counters for unnamed modules.
        self.global_names: weakref.WeakKeyDictionary | None = None
        self._class_counts: dict[str, int] = {}
        # Modules with hooks of this set, and their handle ids: kept out of copies and pickles.
        self._owned: list[tuple[weakref.ref, list[int]]] = []
        self._hooked: dict[str, tuple[weakref.ref, list[int]]] = {}  # module name -> (module, our hook ids)
        recorder.plan_layout = self._plan_layout
        recorder.in_eval = (lambda: not model.training) if model is not None else (lambda: False)
        # The model as last seen (to follow replaced parameters and added modules), and the
        # watched parameters' gradient hooks.
        self.watch = ModelWatch()
        # [guards held]: whether this set holds _compile.hold_hook_guards (while attached);
        # a set dropped without remove() gives them back when collected.
        self._guard = [False]
        weakref.finalize(self, _give_back_guard, self._guard)

    # -- registration -------------------------------------------------------------
    def attach(self) -> None:
        """Register every hook; ``ValueError`` if ``modules`` matched no module."""
        if self.global_names is not None:
            self._attach_global()
            return
        cfg = self.config
        if self.attention is not None:
            self.attention.install()
        internals = parametrization_internals(self.model) if cfg.modules is None else set()
        matched = 0
        for qual, mod in self.model.named_modules():
            name = qual or ROOT_NAME
            if self.attention is not None and id(mod) not in internals:  # every module: which calls attention
                pre, post = self.attention.module_hooks(name)
                self._add(mod.register_forward_pre_hook(pre))
                self._add(mod.register_forward_hook(post, always_call=True))
            if self.router is not None and id(mod) not in internals and (cfg.modules is None or cfg.select(name, mod)):
                self._add(mod.register_forward_hook(self._phased(self.router.hook, name, type(mod).__name__)))
            if id(mod) not in internals and cfg.select(name, mod):
                self._hook_module(name, mod)
                matched += 1
        if matched == 0 and not cfg.all_params:
            raise ValueError(f"modules: {cfg.modules!r} matched no module of the model "
                             f"(qualified names look like {example_names(self.model)})")
        self.watch.look(self.model)
        if self.handles and not self._guard[0]:
            _compile.hold_hook_guards()
            self._guard[0] = True
        self._bind_params()
        self.keep_last()
        if not self.handles and not self.grads.handles and not (self.params and {"param", "optim_state", "update", "adam_ratio"} & set(cfg.capture)):
            self.recorder.warn_once("hooked nothing", f"hookcap: the Monitor hooked nothing (capture="
                                    f"{cfg.capture!r}, modules={cfg.modules!r}): it will record nothing")

    def remove(self) -> None:
        if self.attention is not None:
            self.attention.uninstall()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.grads.remove()
        for ref, ids in self._owned:
            if (mod := ref()) is not None:
                _portable.disown(mod, ids)
        self._owned.clear()
        _give_back_guard(self._guard)
        self.park.clear()
        self.open_calls.clear()

    def new_step(self) -> None:
        self.grads.new_step()
        for open_calls in self.open_calls:  # a forward that raised never closed its call
            open_calls.clear()

    def park_or_unpark(self, attached: bool) -> None:
        """Hooks out for a step that records nothing (an off-step, a paused
        block); in for one that records."""
        if self.recorder.module_recording or not (self.park_ok and attached):
            self.park.unpark()
        elif not self.park.parked and _compile.compile_callback_installed():
            self.park.park()

    def record_params(self) -> None:
        """``param``: each watched parameter's values, at ``step()``; the optimizer's kinds (unless a
        followed optimizer's own post-step hook records them); reduced gradients not recorded yet."""
        if "param" in self.config.capture and self.recorder.records("param"):
            with torch.no_grad():
                self.recorder.write_rows("param", [(pname, p.detach()) for pname, p in self.params], "Parameter")
        if not self.optimizer_followed:
            self.record_optimizer()
        self.grads.read(at_step=True)

    def record_optimizer(self) -> None:
        """``optim_state``, ``update`` and ``adam_ratio``: right after the optimizer's step."""
        if not any(map(self.recorder.records, ("update", "adam_ratio", "optim_state"))):
            return
        covered = self.updates.record(self.params) if self.updates is not None else frozenset()
        if self.optim_state is not None:
            self.optim_state.record(self.params, covered)

    def follow_optimizer(self, optimizer, pre: bool = True) -> None:
        """For callbacks that step the Monitor themselves (HF, Lightning) and
        ``grad_scaler=``: the optimizer kinds read ``optimizer``, recorded by
        its own step hooks right after its step (before ``zero_grad`` and the
        scheduler), not at ``step()``; ``pre``: its copies too. Once."""
        if self.optimizer_followed or (self.optim_state is None and self.updates is None):
            return
        for part in (self.optim_state, self.updates):
            if part is not None:
                part.optimizer = optimizer
        self.optimizer_followed = True
        self.handles.append(after_optimizer_step(optimizer, self.record_optimizer))
        if pre and self.updates is not None and self.updates.copies:
            self.handles.append(before_optimizer_step(optimizer, lambda: self.updates.before_step(self.params)))

    def mark_stepped(self) -> None:
        self.optimizer_stepped = True  # the optimizer's post-step hook, with grad_scaler=

    def scaler_iteration(self, infs) -> None:
        """``grad_scaler.update()``, once per loop iteration (scaler.iteration_ended)."""
        iteration_ended(self.recorder, self.updates, self.params, self.optimizer_stepped, infs)
        self.optimizer_stepped = False

    @property
    def wants_pre_step(self) -> bool:
        """Whether anything runs before the optimizer's step."""
        return bool(self.grads.plain) or (self.updates is not None and self.updates.copies)

    def before_optimizer_step(self) -> None:
        """Right before the optimizer steps: reduced gradients, update copies."""
        self.grads.read()
        if self.updates is not None:
            self.updates.before_step(self.params)

    def _bind_params(self) -> None:
        """The watched parameters as the model holds them now, and their gradient hooks (not an earlier's)."""
        cfg = self.config
        self.params = []
        self.grads.bind([])
        if not set(PARAM_KINDS) & set(cfg.capture):
            self.watch.watch_params([])
            return
        found = list(watched_params(self.model, cfg))
        self.watch.watch_params((owner, attr, p) for _, p, owner, attr in found)
        self.params = [(pname, p) for pname, p, _, _ in found if p.is_floating_point()]
        if "param_grad" in cfg.capture:
            self.grads.bind(self.params)

    def refresh(self, at_step_end: bool = False) -> None:
        """At the end of a recorded step and before one that records: follow parameters replaced since
        (``to_empty()``, ``load_state_dict(assign=True)``, a new ``nn.Parameter``) and hook modules added
        since. At a step's end, a replaced parameter's ``.grad`` (which its new binding's hook did not
        see) is its ``param_grad`` for the step. O(modules + parameters) identity checks."""
        if self.global_names is not None or self.model is None:
            return
        new = self.watch.new_modules(self.model)
        stale = self.watch.params_replaced()
        parked = bool(new or stale) and self.park.parked  # a step of parameter kinds only (per-kind every)
        if parked:
            self.park.unpark()
        if new:
            cfg = self.config
            internals = parametrization_internals(self.model) if cfg.modules is None else set()
            hooked = []
            for name, mod in new:
                if id(mod) not in internals and cfg.select(name, mod):
                    self._hook_module(name, mod)
                    hooked.append(name)
            if hooked:
                log.info("hookcap: hooked %d module(s) added after attach(): %s", len(hooked),
                         ", ".join(hooked[:10]) + (" ..." if len(hooked) > 10 else ""))
        if new or stale:
            # parallelize_module / fully_shard replace parameters and add hooks: ours go last again.
            if self.keep_last():
                log.info("hookcap: moved this Monitor's module hooks behind hooks added after attach() "
                         "(it records what each module returns after them)")
            before = {id(p) for _, p in self.params}
            self._bind_params()
            swapped = [n for n, p in self.params if id(p) not in before]
            if at_step_end and swapped and "param_grad" in self.config.capture:
                # Gradients read from .grad in a multi-rank run are not the hooks' to write.
                by_hook = set(swapped) - self.grads.read_from_grad()
                with torch.no_grad():
                    for pname, p in self.params:
                        if pname in by_hook and p.grad is not None:
                            self.recorder.write(pname, "param_grad", "", p.grad, "Parameter", 0, replace=True)
            if swapped:
                log.info("hookcap: following %d parameter(s) replaced or added since attach(): %s",
                         len(swapped), ", ".join(swapped[:10]) + (" ..." if len(swapped) > 10 else ""))
        if parked:
            self.park.park()

    def _plan_layout(self, name: str):
        """(mesh, placements) of module ``name``'s plain outputs under its
        tensor-parallel style, or None."""
        ref, _ = self._hooked.get(name, (lambda: None, None))
        mod = ref()
        return None if mod is None else output_placements(mod)

    def keep_last(self) -> bool:
        """This set's module hooks behind hooks added after them
        (``hook_order.move_last``); True if any moved. Not while parked."""
        if self.park.parked:
            return False
        mods = [(ref(), ids) for ref, ids in self._owned]
        return any([move_last(mod, ids) for mod, ids in mods if mod is not None])  # a list: move them all

    def behind_others(self, name: str, mod: nn.Module) -> bool:
        """Whether ``mod`` has forward hooks added after this set's (moved
        behind them now, for its next calls)."""
        _, ids = self._hooked.get(name, (None, None))
        return bool(ids) and not self.park.parked and move_last(mod, ids)

    def _add(self, handle) -> None:
        self.handles.append(handle)
        self.park.add(handle)

    def _hook_module(self, name: str, mod: nn.Module) -> None:
        first = len(self.handles)
        self._register_module_hooks(name, mod)
        ids = [h.id for h in self.handles[first:]]
        self._hooked[name] = (weakref.ref(mod), ids)
        if ids:
            _portable.own(mod, ids)
            self._owned.append((weakref.ref(mod), ids))

    def _register_module_hooks(self, name: str, mod: nn.Module) -> None:
        mtype = type(mod).__name__
        capture = self.config.capture
        if self.config.timing:
            # The end mark before hookcap's other forward hooks and the start
            # mark after its pre-hooks: the stats work stays out of the time.
            # (Registration order, not prepend=True: dynamo in torch 2.11
            # builds guards on a prepended hook that fail.)
            timing_pre, timing_post = self._phased(self.timing.hooks, name)
            self._add(mod.register_forward_hook(timing_post))
        if "input" in capture:
            self._add(mod.register_forward_pre_hook(self._phased(self._input_hook, name, mtype), with_kwargs=True))
        if "output" in capture or "grad_output" in capture:
            self._add(mod.register_forward_hook(self._output_hook(name, mtype)))
        if "grad_input" in capture:
            pre, post = self._phased(self._grad_input_hooks, name, mtype)
            self._add(mod.register_forward_pre_hook(pre, with_kwargs=True))
            self._add(mod.register_forward_hook(post))
        if self.config.timing:
            self._add(mod.register_forward_pre_hook(timing_pre, with_kwargs=True))

    def _phased(self, factory, name: str, *args):
        """``factory(name, *args)``'s hook, or (pre, post) pair, split by the
        module's mode at each call: train mode records under ``name``, eval
        mode as ``eval_forwards`` says (under ``eval/{name}``, or not at all)."""
        train = factory(name, *args)
        mode = self.config.eval_forwards
        if mode == "merge":
            return train
        ev = factory(EVAL_PREFIX + name, *args) if mode == "separate" else None
        if isinstance(train, tuple):
            return tuple(_by_mode(t, None if ev is None else e) for t, e in zip(train, ev or train))
        return _by_mode(train, ev)

    # -- hooks (hot path) ---------------------------------------------------------
    def _input_hook(self, name, mtype):
        rec = self.recorder

        def hook(mod, args, kwargs):
            if torch.compiler.is_compiling():
                _compile.hooks_traced(self.key)
                _compile.write_all(self, name, "input", input_obj(args, kwargs), mtype)
                return None
            if rec.records("input") and not _compile.in_backward():
                ci = rec.call_index(name, "input")
                for path, t in tensor_leaves(input_obj(args, kwargs)):
                    rec.write(name, "input", path, t, mtype, ci)
            return None

        return hook

    def _output_hook(self, name, mtype, phase_split=True):
        rec = self.recorder
        want_out, want_grad = "output" in self.config.capture, "grad_output" in self.config.capture
        hid = rec.hook_id(name)
        output_fast = rec.fast.output_fast
        # The eval split inlined (not _phased): this is the hottest hook.
        mode = self.config.eval_forwards
        split = phase_split and mode != "merge"
        ev = self._output_hook(EVAL_PREFIX + name, mtype, False) if split and mode == "separate" else _skip
        # Closure cells. Dynamo folds both to True; only is_compiling holds under
        # a non-strict torch.export, whose fake outputs the C call passes on.
        tracing, is_compiling = torch.compiler.is_dynamo_compiling, torch.compiler.is_compiling

        def traced(output):
            _compile.hooks_traced(self.key)
            if want_out:
                _compile.write_all(self, name, "output", output, mtype)
            if want_grad:
                _compile.grad_hooks(self, name, "grad_output", output, mtype)

        def hook(mod, args, output):
            # What dynamo traces, and eval-mode calls. Eager train-mode calls
            # reach the C hook only, which calls tail where it does not finish.
            if split and not mod.training:
                return ev(mod, args, output)
            if tracing():
                return traced(output)
            # Steady state in one C call (grad_hooks.cpp): a cached plain
            # output is merged and its gradient hook registered there. It
            # also counts the call (ci) and says whether this step records.
            ci = output_fast(hid, output)
            return None if ci == DONE else tail(mod, output, ci)

        def tail(mod, output, ci):
            if is_compiling():
                return traced(output)
            if ci < 0:  # NOT_RECORDING; else the call's index
                return None
            # Checkpoint recomputation: the values were recorded in the forward
            # pass; only reentrant checkpointing, whose first forward ran
            # without grad, needs the gradient hooks registered now (hooks on
            # a non-reentrant recomputation's discarded graph never fire).
            recompute = _compile.in_backward()
            plain = type(output) is torch.Tensor
            if not plain and is_dtensor(output) and self.behind_others(name, mod):
                # A DTensor still to be redistributed by a parallel style hooked after
                # this Monitor attached: not what the module returns. Later calls see it.
                rec.warn_once(("behind", name), f"hookcap: {name}: a call before this Monitor's hooks "
                              "moved behind hooks added after attach() (parallelize_module?) is not recorded")
                return None
            if plain and output.is_floating_point():
                pairs = (("", output),)
            else:
                pairs = tensor_leaves(output)
            for path, t in pairs:
                if want_out and not recompute:
                    rec.write(name, "output", path, t, mtype, ci)
                if want_grad and t.requires_grad:
                    if type(t) is torch.Tensor and _compile.cpp_grad_hooks_ok():
                        rec.capture_grad(name, path, t, mtype, ci)
                    else:
                        t.register_hook(self._grad_tensor_hook(name, path, mtype, ci))
            if plain and not recompute:
                rec.learn_fast_output(name, hid, ci, output, want_out, want_grad)
            return None

        if not phase_split:  # the eval hook: called by `hook` above
            return hook
        return rec.fast.forward_hook(hid, split, hook, tail)

    def _grad_tensor_hook(self, name, path, mtype, ci, kind="grad_output"):
        # Gradient w.r.t. one module output (or input alias). A tensor hook
        # rather than a full backward hook: it changes nothing in the graph, so
        # in-place ops after the module (ReLU(inplace=True)) keep working.
        rec = self.recorder

        def hook(grad):
            if grad is not None and rec.records(kind):
                rec.write(name, kind, path, grad, mtype, ci, via_op=True)
            return None

        return hook

    def _grad_input_hooks(self, name, mtype):
        # The module receives a view-alias of each input that requires grad;
        # the alias's gradient is exactly what this module sends back to that
        # input. (Full backward hooks wrap outputs in a custom Function and make
        # any later in-place op, e.g. ReLU(inplace=True), raise.) Values are
        # unchanged: an alias is the same memory. The forward hook catches a
        # module that modified its input in place (see inplace_grad_node).
        rec = self.recorder
        open_calls: list = []  # per call in flight: [(alias, its grad_fn, view geometry, hook)]
        self.open_calls.append(open_calls)

        def alias(path, t, ci, made):
            a = t.view_as(t)
            fn = self._grad_tensor_hook(name, path, mtype, ci, kind="grad_input")
            a.register_hook(fn)
            made.append((a, a.grad_fn, view_geometry(t, a._base), fn))
            return a

        def compiled_alias(path, t):
            a = t.view_as(t)
            _compile.grad_hooks(self, name, "grad_input", a, mtype, path)
            return a

        def pre(mod, args, kwargs):
            compiling = torch.compiler.is_compiling()
            if compiling:
                _compile.hooks_traced(self.key)
            if not (torch.is_grad_enabled() and (compiling or rec.records("grad_input"))):
                if not compiling:
                    open_calls.append(None)
                return None
            single = len(args) == 1 and not kwargs
            ci = 0 if compiling else rec.call_index(name, "grad_input")
            made: list = []
            # A tensor passed several times gets one alias, recorded at its
            # first position: modules test identity (MultiheadAttention's
            # `query is key` picks its self-attention path).
            # (`is`, not id(): under dynamo id() of a tensor would be guarded on.)
            aliases: list[tuple[torch.Tensor, torch.Tensor]] = []

            def wrap(path, v):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
                    for seen, a in aliases:
                        if seen is v:
                            return a
                    a = compiled_alias(path, v) if compiling else alias(path, v, ci, made)
                    aliases.append((v, a))
                    return a
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
                node = inplace_grad_node(a, node0)
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
                self.recorder.warn_once(
                    ("grad_input_inplace", name),
                    f"hookcap: {metric_name(name, 'grad_input')} not recorded: the module modifies a "
                    "view of a larger tensor in place and the gradient's layout differs from it")
                return None
            g = g.as_strided(size, stride, g.storage_offset() + offset)
        fn(g)
        return None

    # -- global capture (Monitor.everything) ----------------------------------------
    def capture_everything(self, models: Iterable[nn.Module]) -> None:
        """Hook every module that runs in the process; modules of ``models``
        are named by their qualified names, any other ``f"{ClassName}#{k}"``."""
        self.global_names = weakref.WeakKeyDictionary()
        for model in models:
            for qual, mod in model.named_modules():
                self.global_names[mod] = qual or ROOT_NAME

    def _global_name(self, mod: nn.Module) -> str:
        name = self.global_names.get(mod)
        if name is None:
            cname = type(mod).__name__
            k = self._class_counts.get(cname, 0)
            self._class_counts[cname] = k + 1
            name = f"{cname}#{k}"
            self.global_names[mod] = name
        return name

    def _attach_global(self) -> None:
        from torch.nn.modules import module as mm

        def named(factory):
            cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

            def dispatch(mod, *args):
                fn = cache.get(mod)
                if fn is None:
                    name = self._global_name(mod)
                    fn = factory(name, type(mod).__name__) if self.config.select(name, mod) else _skip
                    cache[mod] = fn
                return fn(mod, *args)

            return dispatch

        pairs: dict[tuple, tuple] = {}  # (kind, module name) -> its (pre, post) hooks sharing a stack

        def timing_of(n):
            if ("timing", n) not in pairs:
                pairs[("timing", n)] = self._phased(self.timing.hooks, n)
            return pairs[("timing", n)]

        def grad_input_of(n, t):
            if ("grad_input", n) not in pairs:
                pairs[("grad_input", n)] = self._phased(self._grad_input_hooks, n, t)
            return pairs[("grad_input", n)]

        def args_only(pre):
            # Global pre-hooks get no kwargs: adapt a (mod, args, kwargs) pre-hook.
            def hook(mod, args):
                res = pre(mod, args, {})
                return None if res is None else res[0]

            return hook

        capture = self.config.capture
        if self.config.timing:  # global hooks run in registration order: the end mark first
            self._add(mm.register_module_forward_hook(named(lambda n, t: timing_of(n)[1])))
        if "input" in capture:
            self._add(mm.register_module_forward_pre_hook(named(lambda n, t: args_only(self._phased(self._input_hook, n, t)))))
        if "output" in capture or "grad_output" in capture:
            self._add(mm.register_module_forward_hook(named(self._output_hook)))
        if "grad_input" in capture:
            self._add(mm.register_module_forward_pre_hook(
                named(lambda n, t: args_only(grad_input_of(n, t)[0]))))
            self._add(mm.register_module_forward_hook(named(lambda n, t: grad_input_of(n, t)[1])))
        if self.config.timing:  # ... and the start mark last
            self._add(mm.register_module_forward_pre_hook(named(lambda n, t: args_only(timing_of(n)[0]))))
