"""``HookcapCallback`` for ``lightning.pytorch`` (Lightning 2)."""

from __future__ import annotations

from lightning.pytorch import Callback

from ..monitor import Monitor
from ._common import check_monitor_kwargs


class HookcapCallback(Callback):
    """A Monitor on the LightningModule being fit.

    ``HookcapCallback(**monitor_kwargs)`` takes the :class:`hookcap.Monitor`
    arguments except ``model``, ``optimizer`` and ``start_step``, which it
    sets. ``.monitor`` is the Monitor (None before ``fit`` starts).

    - One hookcap step per optimizer step (``accumulate_grad_batches``
      micro-batches merge into it), numbered as Lightning logs them:
      ``trainer.global_step`` during the step's training batches (0, 1, ...).
    - The sanity check and validation loops run the module in eval mode, so
      their forwards follow ``eval_forwards`` (default: ``eval/...`` metrics,
      never training rows).
    - Checkpoints carry :meth:`Monitor.state_dict` as this callback's state;
      ``fit(ckpt_path=...)`` resumes numbering and detector windows.
    """

    def __init__(self, **monitor_kwargs):
        self.monitor_kwargs = check_monitor_kwargs(monitor_kwargs)
        self.monitor: Monitor | None = None
        self._loaded: dict | None = None  # a checkpoint's state, until the Monitor exists

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
            self.monitor._before_optimizer_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mon = self.monitor
        if mon is not None and trainer.global_step > mon.current_step:  # an optimizer step ran
            mon.step()

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.detach()

    def state_dict(self) -> dict:
        if self.monitor is not None:
            return self.monitor.state_dict()
        return dict(self._loaded or {})

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.monitor is not None:
            self._loaded = None
            self.monitor.load_state_dict(state_dict)
        else:
            self._loaded = dict(state_dict)
