"""The optimizer as a source of tensors: finding the ``torch.optim.Optimizer``
inside wrappers, and the ``optim_state`` capture kind (each watched
parameter's optimizer state after the step)."""

from __future__ import annotations

import functools
import logging

import torch

from .._rows.recorder import Recorder
from . import scaler as _scaler
from .scaler import found_inf_of, record_skip

log = logging.getLogger("hookcap")
_warned_no_optimizer = False  # process-wide: a hint about the arguments, not about data


def innermost_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside wrappers (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, HF's
    wrappers: ``.optimizer`` / ``._optimizer``), else ``optimizer`` itself."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "step"):
            break
        optimizer = inner
    return optimizer


class _WrappedStep:
    """The ``step`` of an optimizer without step hooks (not a
    ``torch.optim.Optimizer``), wrapped once to call ``before`` and
    ``after`` callbacks; put back when the last one is removed."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.before: list = []
        self.after: list = []
        self._own = vars(optimizer).get("step")  # an instance attribute to put back, if any
        inner = optimizer.step

        @functools.wraps(inner)
        def step(*args, **kwargs):
            for fn in list(self.before):
                fn()
            out = inner(*args, **kwargs)
            for fn in list(self.after):
                fn()
            return out

        optimizer.step = step
        vars(optimizer)[_WRAPPED] = self

    @staticmethod
    def of(optimizer) -> "_WrappedStep":
        return vars(optimizer).get(_WRAPPED) or _WrappedStep(optimizer)

    def add(self, which: list, fn) -> "_StepHook":
        which.append(fn)
        return _StepHook(self, which, fn)

    def drop(self, which: list, fn) -> None:
        if fn in which:
            which.remove(fn)
        if not self.before and not self.after and vars(self.optimizer).get(_WRAPPED) is self:
            del vars(self.optimizer)[_WRAPPED]
            if self._own is not None:
                self.optimizer.step = self._own
            else:
                vars(self.optimizer).pop("step", None)


_WRAPPED = "_hookcap_wrapped_step"


class _StepHook:
    """A callback of a wrapped step; ``remove()`` takes it out."""

    def __init__(self, wrapped: _WrappedStep, which: list, fn) -> None:
        self._wrapped, self._which, self._fn = wrapped, which, fn

    def remove(self) -> None:
        self._wrapped.drop(self._which, self._fn)


def before_optimizer_step(optimizer, fn):
    """Call ``fn()`` before each step of ``optimizer`` (or of the optimizer it
    wraps); returns a handle with ``remove()``. An optimizer without step
    pre-hooks has its ``step`` wrapped."""
    opt = innermost_optimizer(optimizer)
    if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks"):
        return opt.register_step_pre_hook(lambda *a, **k: fn())
    if not callable(getattr(opt, "step", None)):
        raise ValueError(f"optimizer: {type(optimizer).__name__} has no step() to follow")
    wrapped = _WrappedStep.of(opt)
    return wrapped.add(wrapped.before, fn)


def after_optimizer_step(optimizer, fn):
    """Call ``fn()`` after each step of ``optimizer`` (or of the optimizer it
    wraps); returns a handle with ``remove()``."""
    opt = innermost_optimizer(optimizer)
    if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_post_hooks"):
        return opt.register_step_post_hook(lambda *a, **k: fn())
    if not callable(getattr(opt, "step", None)):
        raise ValueError(f"optimizer: {type(optimizer).__name__} has no step() to follow")
    wrapped = _WrappedStep.of(opt)
    return wrapped.add(wrapped.after, fn)


class OptimState:
    """``optim_state``: every floating tensor of ``optimizer.state[p]`` with
    ``p``'s shape (Adam's ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``;
    SGD's ``momentum_buffer``; any optimizer's), as metric
    ``{param}/state.{key}``, recorded at ``step()`` (which a Monitor given the
    optimizer runs right after the optimizer's step). Scalars (Adam's
    ``step``) and tensors of other shapes (factored second moments) are left
    out, also where a factored moment's shape happens to equal the
    parameter's (``_FACTORED``: Adafactor's ``col_var`` of a 1 x n weight)."""

    def __init__(self, recorder: Recorder, optimizer) -> None:
        global _warned_no_optimizer
        if optimizer is None and not _warned_no_optimizer:  # capture=hookcap.CAPTURE_KINDS: all there is
            _warned_no_optimizer = True
            log.warning("hookcap: capture 'optim_state' records the optimizer's state after its step: pass "
                        "Monitor(..., optimizer=opt); without it no state is recorded (logged once)")
        self.recorder = recorder
        self.optimizer = optimizer

    def record(self, params: list[tuple[str, torch.Tensor]], covered=frozenset()) -> None:
        """``covered``: the ``(param, key)`` pairs the update pass recorded
        already (:class:`OptimUpdates`)."""
        if self.optimizer is None:
            return
        opt = innermost_optimizer(self.optimizer)
        state = getattr(opt, "state", None)
        if not state:
            return
        mtype = type(opt).__name__
        with torch.no_grad():
            for pname, p in params:
                st = state.get(p)
                if not st:
                    continue
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape and \
                            (pname, key) not in covered and key not in _FACTORED:
                        self.recorder.write(pname, "optim_state", str(key), v.detach(), mtype, 0)


# Factored second moments by their keys (torch's Adafactor; HF's and timm's).
_FACTORED = frozenset({"row_var", "col_var", "exp_avg_sq_row", "exp_avg_sq_col"})


# -- capture kinds "update" and "adam_ratio" ------------------------------------------------

_RULE_SGD, _RULE_ADAM, _RULE_DIFF = 0, 1, 2  # csrc/hookcap/update_math.h
_NESTEROV, _MAXIMIZE, _DECOUPLED, _HAS_BUF = 1, 2, 4, 8
_RECOMPUTED = ("SGD", "Adam", "AdamW")  # exact classes: a subclass may step differently


def _host_float(v):
    """A hyper-parameter as a float without a host sync (None: a tensor on a device)."""
    if isinstance(v, torch.Tensor):
        return float(v) if v.device.type == "cpu" else None
    return float(v)


def _sgd_foreach(group: dict) -> bool:
    """Whether torch.optim.SGD steps this group with its foreach implementation."""
    if group.get("fused"):
        return False
    foreach = group.get("foreach")
    if foreach is None:  # torch's own default: foreach where every tensor is on a GPU
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(group["params"], group.get("differentiable", False), False)
    return bool(foreach)


def group_rule(opt, group: dict):
    """What the fused op needs of one parameter group, computed once per
    group and step: ``(family, rule, hypers, key)`` (``hypers``: the op's
    hyper lists by case, ``key``: the state key of the second moment or the
    SGD options), or a reason string where the group's step cannot be
    recomputed."""
    name = type(opt).__name__
    lr = _host_float(group["lr"])
    if lr is None:
        return f"{name}'s lr is a tensor on {group['lr'].device} (reading it would sync the host)"
    wd = float(group.get("weight_decay", 0.0))
    flags = _MAXIMIZE if group.get("maximize", False) else 0
    if name == "SGD":
        mom = float(group.get("momentum", 0.0))
        nesterov = bool(group.get("nesterov", False))
        flags |= _NESTEROV if nesterov else 0
        # torch's foreach SGD adds μ·buf into .grad in place here: .grad holds the step's d
        grad_is_d = nesterov and wd == 0 and not flags & _MAXIMIZE and _sgd_foreach(group)
        hypers = {
            "grad": (lr, wd, mom, 0.0, 0.0, 0.0, float(flags), 0.0),
            "buf": (lr, wd, mom, 0.0, 0.0, 0.0, float(flags | _HAS_BUF), 0.0),
            "d": (lr, 0.0, mom, 0.0, 0.0, 0.0, float(_HAS_BUF), 0.0),
        }
        return "sgd", _RULE_SGD, hypers, (mom != 0, nesterov, grad_is_d)
    betas = [_host_float(b) for b in group["betas"]]
    if None in betas:
        return f"{name}'s betas are tensors on a device (reading them would sync the host)"
    if group.get("decoupled_weight_decay", name == "AdamW"):
        flags |= _DECOUPLED
    hyper = (lr, wd, 0.0, betas[0], betas[1], float(group["eps"]), float(flags), 0.0)
    return "adam", _RULE_ADAM, {"adam": hyper}, ("max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq")


def param_call(g: tuple, state: dict, p: torch.Tensor, ratio: bool):
    """``(hyper, grad, a, b, step, a_key, b_key)`` of the fused op for
    parameter ``p`` of a group whose :func:`group_rule` is ``g``, or a reason
    string. ``a_key``/``b_key``: the state keys of ``a`` and ``b`` where they
    are the optimizer's state tensors as stored (else None). The step count
    goes as its tensor (the op reads a CPU one on the host, a GPU one in the
    kernel: no sync)."""
    family, _, hypers, key = g
    grad = p.grad
    if family == "sgd":
        momentum, nesterov, grad_is_d = key
        buf = state.get("momentum_buffer") if momentum else None
        if type(buf) is not torch.Tensor:
            return hypers["grad"], grad, None, None, None, None, None
        if nesterov and grad_is_d:
            return hypers["d"], None, grad, None, None, None, None
        # Δw = −lr·buf: no gradient read
        return hypers["buf"], (grad if nesterov else None), buf, None, None, "momentum_buffer", None
    m, v, step = state.get("exp_avg"), state.get(key), state.get("step")
    if m is None or v is None or step is None:
        return "it has no Adam state yet"
    if isinstance(step, torch.Tensor):
        return hypers["adam"], (grad if ratio else None), m, v, step, "exp_avg", key
    return hypers["adam"][:7] + (float(step),), (grad if ratio else None), m, v, None, "exp_avg", key


def _same_layout(t, p) -> bool:
    """Whether state tensor ``t`` can be read in the parameter's pass (the
    op's check: dtype, device, sizes and strides of ``p``)."""
    return t.dtype == p.dtype and t.device == p.device and t.shape == p.shape and t.stride() == p.stride()


class OptimUpdates:
    """``update`` and ``adam_ratio`` (and, for the optimizers it recomputes,
    the ``optim_state`` tensors the step read): what the optimizer's step did
    to each watched parameter, recorded at ``step()`` right after the
    optimizer's step. ``update``: ``{param}/update`` holds the statistics of
    ``Δw = w_after − w_before`` and ``{param}/update.base`` those of
    ``w_before`` (``History.update_ratio`` divides their norms).
    ``adam_ratio``: ``{param}/adam_ratio``, the statistics of ``g / (√v̂ + ε)``.

    For ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (every option, foreach
    and fused) they are recomputed element by element from the parameter,
    its gradient and the optimizer's state after the step, in one pass of
    the ``accumulate_updates`` op per parameter group that also records
    ``exp_avg``, the second moment and ``momentum_buffer`` for
    ``optim_state``: no copy, no update tensor, no host sync, each tensor
    read once.
    Other optimizers' updates need ``Monitor(update_snapshot=True)``: a copy
    of each watched parameter, allocated once and refreshed before the
    optimizer's step on recorded steps only; without it they are skipped with
    one warning naming the optimizer."""

    def __init__(self, recorder: Recorder, optimizer, kinds: tuple[str, ...], snapshot: bool) -> None:
        global _warned_no_optimizer
        stepped = tuple(k for k in kinds if k != "optim_state")  # OptimState warns for its own
        if optimizer is None and stepped and not _warned_no_optimizer:
            _warned_no_optimizer = True
            log.warning("hookcap: capture %s follows the optimizer's step: pass Monitor(..., optimizer=opt); "
                        "without it nothing is recorded (logged once)", " and ".join(map(repr, stepped)))
        self.recorder = recorder
        self.optimizer = optimizer
        self.kinds = kinds
        self.snapshot = snapshot
        self._copies: dict[str, torch.Tensor] = {}
        self._copied: set[str] = set()
        self.skip_recorded = False  # this iteration's GradScaler flag is recorded (a fused step)

    def _recomputes(self, opt) -> bool:
        """Whether the op recomputes ``opt``'s step (torch's own SGD, Adam, AdamW)."""
        return isinstance(opt, torch.optim.Optimizer) and type(opt).__name__ in _RECOMPUTED and \
            type(opt).__module__.startswith("torch.optim")

    @property
    def copies(self) -> bool:
        """Whether copies may be taken before the optimizer's step (16-bit
        parameters' ``update``, or ``update_snapshot``)."""
        return "update" in self.kinds

    def before_step(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Before the optimizer's step on a recorded step: refresh the copies
        of the parameters whose ``update`` is read against one: all with
        ``update_snapshot=True`` and an optimizer the op cannot recompute;
        bfloat16 and float16 ones always (their applied update differs from
        the step's formula by their rounding, which decides whether a weight
        moved at all)."""
        self._copied.clear()
        if not ("update" in self.kinds and self.recorder.records("update")):
            return
        opt = innermost_optimizer(self.optimizer)
        found_inf = found_inf_of(opt)
        # A fused step under GradScaler on a GPU: whether it was skipped is known
        # on the device only, so Δw is read against copies (0 where skipped).
        every = (self.snapshot and not self._recomputes(opt)) or \
            (found_inf is not None and not _scaler.flag_on_host(found_inf))
        with torch.no_grad():
            for pname, p in params:
                if not (every or p.dtype in _STORED_LOW):
                    continue
                c = self._copies.get(pname)
                if c is None or c.shape != p.shape or c.dtype != p.dtype or c.device != p.device:
                    c = self._copies[pname] = torch.empty_like(p, memory_format=torch.preserve_format)
                c.copy_(p)
                self._copied.add(pname)

    def record_skipped(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """A step GradScaler skipped: ``update`` is exactly 0 (``w − w``, no
        tensor made), ``update.base`` is ``w``; no ``adam_ratio``."""
        if "update" in self.kinds and self.recorder.records("update"):
            with torch.no_grad():
                self.recorder.write_updates("GradScaler", _RULE_DIFF, [0.0] * 8,
                                            [(n, p, None, p.detach(), None, None, _UPDATE_OUTS) for n, p in params])

    def record(self, params: list[tuple[str, torch.Tensor]]) -> set:
        """Record this step's kinds; returns the ``(param, state key)`` pairs
        of ``optim_state`` recorded here (the rest is :class:`OptimState`'s)."""
        covered: set = set()
        if self.optimizer is None:
            return covered
        opt = innermost_optimizer(self.optimizer)
        recomputed = self._recomputes(opt)
        want_update, want_ratio = "update" in self.kinds, "adam_ratio" in self.kinds
        want_state = "optim_state" in self.kinds
        if not recomputed and not self._copied:
            if (want_update or want_ratio) and not (self.snapshot and want_update):
                self.recorder.warn_once(("update", type(opt).__name__), (
                    f"hookcap: capture {self.kinds!r}: {type(opt).__name__} is not SGD, Adam or AdamW, whose "
                    "steps hookcap recomputes; its updates need Monitor(update_snapshot=True) (one copy of the "
                    "watched parameters), adam_ratio needs Adam or AdamW: nothing recorded"))
            return covered
        mtype = type(opt).__name__
        stepped = [k for k in ("update", "adam_ratio") if k in self.kinds]
        found_inf = found_inf_of(opt)
        # A fused step under GradScaler unscales .grad in place, unless it skipped the step.
        ratio_gate = None
        if found_inf is not None:
            record_skip(self.recorder, found_inf, "GradScaler")
            self.skip_recorded = True
            if _scaler.flag_on_host(found_inf):  # a host read costs no device sync here
                if float(found_inf) != 0.0:
                    self.record_skipped(params)
                    return covered
            else:
                # Known on the device only: Δw is read against copies (0 where
                # skipped), and the ratio, whose gradients a skipped step leaves
                # scaled, goes to calls that record nothing where found_inf is set.
                ratio_gate = found_inf
        # One op call per (rule, hyper-parameters): a parameter group's
        # parameters, each with its rows; the loop over them runs in C++.
        batches: dict[tuple, list] = {}
        with torch.no_grad():
            # Δw against a copy (update_snapshot, 16-bit parameters): exactly what the step changed.
            for pname, p in params:
                if pname in self._copied and (not recomputed or p.grad is not None):
                    batches.setdefault((_RULE_DIFF, (0.0,) * 8, False), []).append(
                        (pname, p, None, self._copies[pname], None, None, _UPDATE_OUTS))
            if recomputed:
                names = {id(p): pname for pname, p in params}
                for group in opt.param_groups:
                    g = group_rule(opt, group)
                    adam = not isinstance(g, str) and g[0] == "adam"
                    for p in group["params"]:
                        pname = names.get(id(p))
                        if pname is None or p.grad is None:
                            continue  # not watched, or not stepped by the optimizer at this step
                        call = g if isinstance(g, str) else param_call(g, opt.state.get(p, {}), p,
                                                                       want_ratio and adam)
                        if isinstance(call, str):
                            for kind in stepped:
                                self.recorder.warn_once(("update", pname, kind),
                                                        f"hookcap: {pname}/{kind} not recorded: {call}")
                            continue  # optim_state: OptimState's
                        hyper, grad, a, b, step, a_key, b_key = call
                        outs = list(_UPDATE_OUTS if want_update and pname not in self._copied else _NO_OUTS)
                        if want_ratio:
                            if adam:
                                outs[2] = ("adam_ratio", "")
                            else:
                                self.recorder.warn_once(("update", pname, "adam_ratio"),
                                                        f"hookcap: {pname}/adam_ratio not recorded: "
                                                        "adam_ratio needs Adam or AdamW")
                        if want_state:
                            for i, t, key in ((3, a, a_key), (4, b, b_key)):
                                if key is not None and _same_layout(t, p):
                                    outs[i] = ("optim_state", key)
                                    covered.add((pname, key))
                        if ratio_gate is not None and outs[2] is not None:
                            gated = [None, None, outs[2], None, None]
                            batches.setdefault((g[1], hyper, True), []).append((pname, p, grad, a, b, step, gated))
                            outs[2] = None
                        if any(outs):
                            batches.setdefault((g[1], hyper, False), []).append((pname, p, grad, a, b, step, outs))
            for (rule, hyper, gated), items in batches.items():
                self.recorder.write_updates(mtype, rule, list(hyper), items, gate=ratio_gate if gated else None)
        return covered


_STORED_LOW = (torch.bfloat16, torch.float16)  # parameters whose update is read against a copy
_NO_OUTS = (None,) * 5  # the op's outputs: Δw, w before, Adam's ratio, state a, state b
_UPDATE_OUTS = (("update", ""), ("update", "base"), None, None, None)
