"""SkipStep: a guard that decides on the device, before each optimizer step,
whether to apply it, from this step's loss and gradient norm against their
own trailing window (robust z-scores), and skips it with no host sync for
torch's fused optimizers (through the ``found_inf`` flag their step honours,
as ``GradScaler`` uses it)."""

from __future__ import annotations

import logging
import math

import torch

from ._capture import signals as _signals
from ._capture.optim import after_optimizer_step, before_optimizer_step, innermost_optimizer
from ._capture.scaler import record_skip

log = logging.getLogger("hookcap")

GRAD_NORM = "grad_norm"
LR = "lr"
_MAD_TO_SIGMA = 1.4826  # MAD x this = σ of a normal distribution
_REL_FLOOR = 1e-6  # the scale never falls below this x |median| (a signal constant over the window)
_LOG = 1024  # skipped step numbers kept on the device


class SkipStep:
    """Skip an optimizer step whose loss or gradient norm spikes, decided on
    the device. Given as ``Monitor(model, optimizer=opt, skip=SkipStep(...))``.

    Before each optimizer step, each signal's value this step is compared
    with the window of its last ``window`` values from applied steps: the
    step is skipped when a value is not finite, or, once ``warmup`` steps
    are in the window, when ``(value − median) / scale > z`` for any signal,
    with ``scale = 1.4826 · MAD`` (the median absolute deviation, σ for
    normal data; at least 1e-6 · |median|). One-sided: a value far *below*
    its window never skips. A skipped step's values stay out of the window.
    After ``patience`` skips in a row a finite level is a new regime (a
    schedule's restart, a new data mix): that step is applied and the window
    starts over from it (``warmup`` again).

    Args:
        z: robust z-score above which a step is skipped.
        window: values kept per signal (on the device).
        warmup: values in the window before z-scores count (non-finite values
            skip from the first step).
        signals: any of ``"grad_norm"`` (the global L2 norm of the
            optimizer's gradients, computed from them at the step; divided by
            GradScaler's scale where the step is handed one), ``"lr"`` (the
            largest learning rate of the optimizer's groups: a schedule's
            jump) and names of :func:`hookcap.tap` calls (``"loss"``: the
            mean of the step's ``tap(loss, "loss")`` values, taps under
            ``torch.no_grad()`` excepted). A tap not called in a step does
            not count that step.
        patience: the most steps skipped in a row.

    How the step is skipped: for torch optimizers with ``fused=True``, the
    flag goes in as the step's ``found_inf`` (combined with GradScaler's):
    no host sync, and parameters and state after the step equal a run that
    never saw the batch (the step count is not advanced). For other
    optimizers the flag is read on the host (a device sync on GPUs), and a
    skipped step runs with every gradient set to ``None`` (then put back),
    which torch optimizers skip entirely. In multi-rank runs the ranks'
    flags are all-reduced (max), so every rank skips the same steps. LR
    schedulers still step.

    Skips are recorded in metric ``optimizer/skipped`` (``History.skipped``)
    on recorded steps; :attr:`count` and :meth:`steps` cover every step.
    """

    def __init__(self, z: float = 6.0, window: int = 128, warmup: int = 64, signals=("loss", GRAD_NORM, LR),
                 patience: int = 4):
        if not (isinstance(z, (int, float)) and not isinstance(z, bool) and math.isfinite(z) and z > 0):
            raise ValueError(f"SkipStep: z must be a finite number > 0, got {z!r}")
        for arg, v in (("window", window), ("warmup", warmup), ("patience", patience)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SkipStep: {arg} must be an int >= 1, got {v!r}")
        if warmup > window:
            raise ValueError(f"SkipStep: warmup ({warmup}) must not exceed window ({window})")
        signals = (signals,) if isinstance(signals, str) else tuple(signals)
        if not signals or not all(isinstance(s, str) and s for s in signals) or len(set(signals)) < len(signals):
            raise ValueError(f"SkipStep: signals must be distinct non-empty names, got {signals!r}")
        self.z, self.window, self.warmup, self.signals = float(z), window, warmup, signals
        self.patience = patience
        self._taps = [s for s in signals if s not in (GRAD_NORM, LR)]
        self._seen: dict[str, list] = {}
        self._dev = None  # device tensors, made at the first step
        self._cols: dict[tuple, torch.Tensor] = {}  # signal columns seen together -> their device index
        self._optimizer = self._recorder = None
        self._handles: list = []
        self._before: dict = {}  # put back after the step: found_inf, gradients

    # -- results ---------------------------------------------------------------
    @property
    def count(self) -> int:
        """How many optimizer steps were skipped so far (a host read)."""
        return 0 if self._dev is None else int(self._dev["nskip"])

    def steps(self) -> list[int]:
        """The hookcap step numbers of the skipped steps (the last 1,024; a host read)."""
        if self._dev is None:
            return []
        n = int(self._dev["nskip"])
        log_ = self._dev["log"].tolist()
        return [log_[i % _LOG] for i in range(max(0, n - _LOG), n)]

    # -- wiring (Monitor) ------------------------------------------------------
    def attach(self, optimizer, recorder) -> "_Detach":
        """Hook ``optimizer``'s step (before the Monitor's own hooks: call
        first); the handle's ``remove()`` detaches the guard."""
        if self._optimizer is not None:
            raise ValueError("SkipStep: this guard is already attached to a Monitor")
        opt = innermost_optimizer(optimizer)
        self._optimizer, self._recorder = opt, recorder
        if not self._fused(opt):
            log.warning("hookcap: SkipStep with %s (not fused=True): its skip flag is read on the host before "
                        "each step (a device sync on GPUs); fused optimizers skip with no sync",
                        type(opt).__name__)
        _signals.WATCHERS.append(self)
        self._handles.append(before_optimizer_step(optimizer, self._before_step))
        return _Detach(self)

    def attach_after(self, optimizer):
        """Hook the step's end (after the Monitor's own post-step hooks: call
        last); returns the hook's handle."""
        return after_optimizer_step(optimizer, self._after_step)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self in _signals.WATCHERS:
            _signals.WATCHERS.remove(self)
        self._optimizer = self._recorder = None

    def saw_tap(self, name: str, x: torch.Tensor) -> None:
        """A :func:`hookcap.tap` call (every step, recorded or not; not under
        ``torch.no_grad()``: an evaluation's loss is not a training step's)."""
        if name in self._taps and torch.is_grad_enabled() and x.is_floating_point() and x.numel():
            self._seen.setdefault(name, []).append(x.detach().double().mean())

    # -- the decision ------------------------------------------------------------
    @staticmethod
    def _fused(opt) -> bool:
        groups = getattr(opt, "param_groups", None) or []
        return bool(groups) and isinstance(opt, torch.optim.Optimizer) and all(g.get("fused") for g in groups)

    def _grads(self, opt) -> list[torch.Tensor]:
        return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]

    def _values(self, opt, device) -> tuple[list[int], torch.Tensor] | None:
        cols, vals = [], []
        for i, s in enumerate(self.signals):
            if s == GRAD_NORM:
                grads = self._grads(opt)
                if not grads:
                    continue
                norm = torch.nn.utils.get_total_norm(grads, foreach=True)
                if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2, tensor parallel)
                    norm = norm.full_tensor()
                scale = getattr(opt, "grad_scale", None)
                v = norm.double() / scale.double() if isinstance(scale, torch.Tensor) else norm.double()
            elif s == LR:
                lrs = [g["lr"] for g in opt.param_groups if "lr" in g]
                if not lrs:
                    continue
                if any(isinstance(lr, torch.Tensor) for lr in lrs):  # tensor learning rates stay on the device
                    v = torch.stack([torch.as_tensor(lr, device=device).double().reshape(()) for lr in lrs]).max()
                else:
                    v = self._state(device)["lr"].fill_(max(float(lr) for lr in lrs))
            else:
                seen = self._seen.get(s)
                if not seen:
                    continue
                v = torch.stack([t.to(device) for t in seen]).mean()
            cols.append(i)
            vals.append(v.to(device))
        return (cols, torch.stack(vals)) if vals else None

    def _state(self, device) -> dict:
        if self._dev is None:
            n = len(self.signals)
            self._dev = {
                "hist": torch.full((self.window, n), math.nan, dtype=torch.float64, device=device),
                "n": torch.zeros((), dtype=torch.int64, device=device),
                "pos": torch.zeros(1, dtype=torch.int64, device=device),
                "nskip": torch.zeros((), dtype=torch.int64, device=device),
                "log": torch.full((_LOG,), -1, dtype=torch.int64, device=device),
                "step": torch.zeros(1, dtype=torch.int64, device=device),
                "run": torch.zeros((), dtype=torch.int64, device=device),  # skips in a row
                "lr": torch.zeros((), dtype=torch.float64, device=device),  # a host learning rate, filled in
            }
        return self._dev

    @torch.no_grad()
    def _decide(self, opt) -> torch.Tensor | None:
        """This step's skip flag (float32 0/1 on the parameters' device), or
        None where no signal was seen."""
        params = [p for g in opt.param_groups for p in g["params"]]
        if not params:
            return None
        device = params[0].device
        got = self._values(opt, device)
        self._seen.clear()
        if got is None:
            return None
        cols, x = got
        st = self._state(device)
        idx = self._cols.get(tuple(cols))
        if idx is None:  # made once per set of signals seen: no host-to-device copy per step
            idx = self._cols[tuple(cols)] = torch.tensor(cols, device=device)
        win = st["hist"].index_select(1, idx)  # [window, k]
        med = torch.nanmedian(win, dim=0).values
        mad = torch.nanmedian((win - med).abs(), dim=0).values
        scale = torch.maximum(_MAD_TO_SIGMA * mad, _REL_FLOOR * med.abs()).clamp_min(torch.finfo(torch.float64).tiny)
        over = ((x - med) / scale > self.z).any() & (st["n"] >= self.warmup)
        nonfinite = ~torch.isfinite(x).all()
        trip = over | nonfinite
        # After `patience` skips in a row, a finite level is a new regime: applied.
        flag = (trip & ((st["run"] < self.patience) | nonfinite)).to(torch.float32)
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        keep = flag.to(torch.int64)
        st["run"].mul_(keep).add_(keep)
        # A new regime: the window starts over (warmup again) from this step's values.
        regime = trip & (flag == 0)
        st["hist"].masked_fill_(regime, math.nan)
        st["n"].mul_(~regime)
        st["pos"].mul_(~regime)
        # The window takes this step's values unless it is skipped.
        row = st["hist"].index_select(0, st["pos"])  # [1, signals]
        new = row.clone()
        new[0, idx] = x
        st["hist"].index_copy_(0, st["pos"], torch.where(flag > 0, row, new))
        st["n"].add_(1 - keep).clamp_(max=self.window)
        st["pos"].add_(1 - keep).remainder_(self.window)
        # Skipped step numbers: the ring of the last _LOG.
        st["step"].fill_(self._recorder.step if self._recorder is not None else -1)
        at = st["nskip"].remainder(_LOG).view(1)
        st["log"].index_copy_(0, at, torch.where(flag > 0, st["step"], st["log"].index_select(0, at)))
        st["nskip"].add_(keep)
        return flag

    def _before_step(self) -> None:
        opt = self._optimizer
        if opt is None:
            return
        flag = self._decide(opt)
        self._before = {}
        if flag is None:
            return
        if self._recorder is not None and self._recorder.records("tap"):
            record_skip(self._recorder, flag, "SkipStep")
        if self._fused(opt):
            prev = getattr(opt, "found_inf", None)
            self._before["found_inf"] = prev
            opt.found_inf = flag if not isinstance(prev, torch.Tensor) else \
                torch.maximum(prev.to(flag.device, torch.float32), flag).to(prev.dtype)
        elif float(flag) > 0:  # the documented host read
            grads = {}
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        grads[p] = p.grad
                        p.grad = None
            self._before["grads"] = grads

    def _after_step(self) -> None:
        opt, before, self._before = self._optimizer, self._before, {}
        if opt is None:
            return
        if "found_inf" in before:
            if isinstance(before["found_inf"], torch.Tensor):
                opt.found_inf = before["found_inf"]
            else:
                vars(opt).pop("found_inf", None)
        for p, grad in before.get("grads", {}).items():
            p.grad = grad


class _Detach:
    def __init__(self, guard: SkipStep) -> None:
        self.guard = guard

    def remove(self) -> None:
        self.guard.detach()


def check_skip(skip, optimizer) -> None:
    """Monitor(skip=...)'s argument check."""
    if skip is None:
        return
    if not isinstance(skip, SkipStep):
        raise ValueError(f"skip: expected a hookcap.SkipStep, got {type(skip).__name__}")
    if optimizer is None:
        raise ValueError("skip: a SkipStep needs the Monitor's optimizer= (it guards that optimizer's steps)")
