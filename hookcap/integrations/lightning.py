"""``HookcapCallback`` for ``lightning.pytorch`` (Lightning 2)."""

from __future__ import annotations

import os
import tempfile

from lightning.pytorch import Callback

from ..history import History, load
from ..monitor import Monitor
from ._common import check_monitor_kwargs, dump_run, rank_suffix, tap_loss


class HookcapCallback(Callback):
    """A Monitor on the LightningModule being fit.

    ``HookcapCallback(tap_loss=True, **monitor_kwargs)`` takes the
    :class:`hookcap.Monitor` arguments except ``model``, ``optimizer`` and
    ``start_step``, which it sets. ``.monitor`` is the Monitor (None before
    ``fit`` starts).

    - ``tap_loss``: the loss each training batch returns (``outputs`` of
      ``on_train_batch_end``: the tensor or its ``"loss"``) is the metric
      ``loss`` (:func:`hookcap.tap`: no host sync), one value per batch, as
      ``training_step`` returned it (automatic optimization divides it by
      ``accumulate_grad_batches``; the callback multiplies back: exact for a
      power of two, else within one rounding).

    - One hookcap step per optimizer step (``accumulate_grad_batches``
      micro-batches merge into it), numbered as Lightning logs them:
      ``trainer.global_step`` during the step's training batches (0, 1, ...).
    - The sanity check and validation loops run the module in eval mode, so
      their forwards follow ``eval_forwards`` (default: ``eval/...`` metrics,
      never training rows).
    - Checkpoints carry :meth:`Monitor.state_dict` and the history so far as
      this callback's state; ``fit(ckpt_path=...)`` resumes numbering and
      detector windows, and :meth:`history` holds the whole run.
    - At the end of ``fit``: ``hookcap.npz`` (the whole run) in
      ``trainer.default_root_dir``; on ranks other than 0 the name gets
      ``.rank{r}`` before the extension.
    """

    def __init__(self, tap_loss: bool = True, **monitor_kwargs):
        self.monitor_kwargs = check_monitor_kwargs(monitor_kwargs)
        self.monitor: Monitor | None = None
        self.tap_loss = bool(tap_loss)
        self._loaded: dict | None = None  # a checkpoint's state, until the Monitor exists
        self._earlier: History | None = None  # the steps before the checkpoint this fit resumed from

    def history(self) -> History:
        """The whole run: the steps of the fit this one resumed from (as its
        checkpoint holds them), then this fit's (``self.monitor.history()``)."""
        parts = [h for h in (self._earlier, self.monitor.history() if self.monitor else None) if h is not None]
        if not parts:
            raise ValueError("HookcapCallback.history: nothing recorded yet (fit has not started)")
        return History.concat(parts)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.monitor is None:
            self.monitor = Monitor(pl_module, start_step=trainer.global_step, **self.monitor_kwargs)
        self.monitor.attach()

    def on_train_start(self, trainer, pl_module) -> None:
        # A resumed fit restores its step counter after on_fit_start, so a
        # checkpoint's state is applied here, numbered by Lightning's counter
        # (the sanity check's eval forwards of a resumed fit go with the
        # renumbered step).
        mon, state = self.monitor, self._loaded
        self._loaded = None
        if mon is not None and (state is not None or mon.current_step != trainer.global_step):
            mon.load_state_dict({**(state or mon.state_dict()), "step": trainer.global_step})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Under DDP, param_grad is .grad as the optimizer sees it (reduced).
        if self.monitor is not None:
            self.monitor._before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mon = self.monitor
        if mon is not None and self.tap_loss and outputs is not None:
            # Into the step this batch trained, as training_step returned it:
            # automatic optimization hands it over divided by accumulate_grad_batches.
            k = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            tap_loss(outputs, scale=k)
        if mon is not None and trainer.global_step > mon.current_step:  # an optimizer step ran
            mon.step()

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.detach()  # closes a last validation's step
            dump_run(self.monitor, self._earlier, os.path.join(trainer.default_root_dir, f"hookcap{rank_suffix()}.npz"))

    def state_dict(self) -> dict:
        if self.monitor is None:
            return dict(self._loaded or {})
        state = self.monitor.state_dict()
        with tempfile.TemporaryDirectory() as d:
            with open(dump_run(self.monitor, self._earlier, os.path.join(d, "h.npz")), "rb") as f:
                state["history_npz"] = f.read()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        state_dict = dict(state_dict)
        blob = state_dict.pop("history_npz", None)
        if blob is not None:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "h.npz")
                with open(path, "wb") as f:
                    f.write(blob)
                self._earlier = load(path)
        if self.monitor is not None:
            self._loaded = None
            self.monitor.load_state_dict(state_dict)
        else:
            self._loaded = dict(state_dict)
