"""``HookcapCallback`` for the Hugging Face ``transformers.Trainer``."""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..history import History, load
from ..monitor import Monitor
from ._common import LossTap, check_monitor_kwargs, dump_run, rank_suffix

log = logging.getLogger("hookcap")


class HookcapCallback(TrainerCallback):
    """A Monitor on the model the Trainer trains.

    ``HookcapCallback(tap_loss=True, **monitor_kwargs)`` takes the
    :class:`hookcap.Monitor` arguments except ``model``, ``optimizer`` and
    ``start_step``, which it sets. ``.monitor`` is the Monitor (None before
    training starts).

    - ``tap_loss``: the loss each training forward of the model returns
      (``outputs.loss``: a model given ``labels``) is the metric ``loss``,
      tapped where it is computed (:func:`hookcap.tap`: no host sync); one
      value per micro-batch, before the Trainer divides it for gradient
      accumulation. A loss computed outside the model (a custom
      ``compute_loss``) is not seen: tap it there.

    - One hookcap step per optimizer step: the micro-batches of gradient
      accumulation merge into it. Steps are numbered as the Trainer numbers
      the step it logs the loss for (``state.global_step`` after the optimizer
      step: 1, 2, ...).
    - Evaluation runs the model in eval mode, so its forwards follow
      ``eval_forwards`` (default: ``eval/...`` metrics, never training rows),
      and lands in the step whose ``global_step`` the Trainer evaluates at (a
      step is closed when the next one begins, at a save, or at the end of
      training: the evaluation at the last step included).
    - At each checkpoint: ``hookcap.npz`` (the Monitor's dump) and
      ``hookcap_state.json`` (:meth:`Monitor.state_dict`) in the checkpoint
      folder; at the end of training ``hookcap.npz`` in ``output_dir``. On
      ranks other than 0 the names get ``.rank{r}`` before the extension.
    - ``trainer.train(resume_from_checkpoint=...)`` resumes from the
      checkpoint's ``hookcap_state.json`` (looked up in ``output_dir``):
      numbering and detector windows continue, and the checkpoint's
      ``hookcap.npz`` is carried on, so later checkpoints and the final
      ``hookcap.npz`` hold the whole run (``History.concat``).
    """

    def __init__(self, tap_loss: bool = True, **monitor_kwargs):
        self.monitor_kwargs = check_monitor_kwargs(monitor_kwargs)
        self.monitor: Monitor | None = None
        self.tap_loss = bool(tap_loss)
        self._loss_tap: LossTap | None = None
        self._open = False  # an optimizer step ended and its hookcap step is still open
        self._earlier: History | None = None  # the steps before a resumed checkpoint

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.monitor is None:
            self.monitor = Monitor(model, start_step=state.global_step + 1, **self.monitor_kwargs)
            if state.global_step > 0:
                self._resume(args, state)
        self.monitor.attach()
        if self.tap_loss and self._loss_tap is None and model is not None:
            self._loss_tap = LossTap(model)

    def _resume(self, args, state) -> None:
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
                            f"hookcap_state{rank_suffix()}.json")
        if not os.path.exists(path):
            log.warning("hookcap: resuming at step %d without %s: numbering continues, detector "
                        "windows start empty", state.global_step, path)
            return
        with open(path) as f:
            saved = json.load(f)
        # The Trainer's counter is the authority on numbering.
        self.monitor.load_state_dict({**saved, "step": state.global_step + 1})
        earlier = os.path.join(os.path.dirname(path), f"hookcap{rank_suffix()}.npz")
        if os.path.exists(earlier):
            self._earlier = load(earlier)  # written at this checkpoint: its steps end at global_step
        else:
            log.warning("hookcap: resuming without %s: the files written from now on hold the steps "
                        "from %d on", earlier, state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # Under DDP, param_grad is .grad as the optimizer sees it (reduced). The
        # optimizer kinds are recorded by the optimizer's own post-step hook,
        # before zero_grad() and the scheduler's step.
        if self.monitor is not None:
            self.monitor._before_optimizer_step(optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        # The Trainer evaluates and saves after this, at the same global_step:
        # the step is closed when the next begins (or at a save, or the end).
        self._open = self.monitor is not None

    def on_step_begin(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.monitor.step()

    def on_save(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._close()
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        suffix = rank_suffix()
        dump_run(self.monitor, self._earlier, os.path.join(folder, f"hookcap{suffix}.npz"))
        with open(os.path.join(folder, f"hookcap_state{suffix}.json"), "w") as f:
            json.dump(self.monitor.state_dict(), f)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        self._close()
        if self._loss_tap is not None:
            self._loss_tap.remove()
            self._loss_tap = None
        self.monitor.detach()
        dump_run(self.monitor, self._earlier, os.path.join(args.output_dir, f"hookcap{rank_suffix()}.npz"))
