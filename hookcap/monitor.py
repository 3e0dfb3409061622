"""Monitor: attach to any model, record per-layer stats every step.

The Monitor is a facade over parts that data flows through one way:
hooks (hookcap._capture: hooks, timing, compile, taps) -> recorder (rows of
the device rings, hookcap._rows) -> drain (hookcap._host.drain) -> consumers
(history store, detectors, anomalies, sinks; rank merging in front of the
sinks: hookcap._host.consumers, ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from . import io
from ._rows.catalog import Catalog
from ._rows.config import CAPTURE_KINDS, DEFAULT_CAPACITY, DEFAULT_HISTOGRAM, RANK_SINKS, ROOT_NAME, make_config
from ._host.consumers import Consumers, Sinks, check_on_anomaly
from ._host.drain import Drain
from ._host.exit import ExitDump
from ._capture.hooks import Hooks
from ._capture.optim import after_optimizer_step, before_optimizer_step, innermost_optimizer
from ._capture.scaler import ScalerUpdate, found_infs
from ._host.ranks import RankMerger
from ._rows.recorder import Recorder
from .anomaly import AnomalyError
from .histogram import Histogram
from .history import History
from .skip import check_skip

__all__ = ["CAPTURE_KINDS", "RANK_HANDSHAKE_TIMEOUT_S", "RANK_MERGE_EVERY", "RANK_SINKS", "ROOT_NAME",
           "Monitor"]

# How long a multi-rank Monitor with rank_sinks="merged" waits, once at its first step()
# (read then), for every rank's Monitor to answer before it falls back to per-rank sinks.
RANK_HANDSHAKE_TIMEOUT_S = 60.0
# rank_sinks="merged" merges the pending steps across ranks at every
# RANK_MERGE_EVERY-th step() (and at detach()): fewer, larger collectives
# (each costs ~1 ms of latency on gloo whatever its size). Read at each step().
RANK_MERGE_EVERY = 8


class Monitor:
    """Records per-layer statistics of a model into a device ring, every step.

    Args:
        model: the module to watch (its qualified names name the metrics; the
            root is ``"."``, which no child's qualified name can be).
        modules: ``None`` (every module that is a leaf, owns a parameter
            directly, e.g. ``nn.MultiheadAttention``, or is parametrized, e.g.
            by ``weight_norm``; parametrization internals excluded), a glob or
            list of globs over qualified names (fnmatch), an ``nn.Module`` type
            or tuple of types, or ``callable(name, module) -> bool``.
        capture: any of ``"input"`` (forward pre-hook, so in-place ops inside the
            module cannot alter it), ``"output"``, ``"grad_input"`` (the gradient
            the module sends to each floating input that requires grad),
            ``"grad_output"`` (gradient w.r.t. the module's outputs),
            ``"param"`` (values at ``step()``), ``"param_grad"`` (final
            accumulated gradient of each step; in a multi-rank run plain parameters'
            ``.grad`` when the backward ends, after DDP's reduction), ``"optim_state"``
            (``optimizer``'s state tensors after its step: ``{param}/state.{key}``), ``"update"``
            (``Δw`` of its step: ``{param}/update``; ``w`` before it: ``{param}/update.base``),
            ``"adam_ratio"`` (``g / (√v̂ + ε)`` of an Adam step), ``"attention"`` (inside each
            ``scaled_dot_product_attention``, per head) and ``"router"`` (MoE routing): docs/monitor.md.
        histogram: ``Histogram.log2()`` (default), ``Histogram.linear(...)`` or None.
        capacity: how much history the host keeps: a size in bytes (``"256MiB"``,
            ``"512MB"``, ``"2GiB"``; the default) or a number of recorded steps.
            The oldest steps are dropped first (``evicted_steps`` counts them).
        every: record every N-th step (an int >= 1); other steps launch nothing. Or per
            kind, ``{"output": 10, "param_grad": 1, "*": 1}`` (``"*"``: kinds not named; taps: ``"tap"``).
        optimizer: if given, each optimizer step closes a step (``step()`` calls
            do nothing). Wrappers (accelerate's, Lightning's) are followed to the
            innermost optimizer; one without step post-hooks has ``step`` wrapped.
        detectors: callables run on every drained step (default
            ``[hookcap.NonFinite()]``; ``[]`` for none; one detector alone is
            taken as a list of one).
        on_anomaly: ``"warn"`` (one log warning per metric and kind), ``"raise"``
            (``hookcap.AnomalyError`` from ``step()``: on CPU at the ``step()`` that
            closes the anomalous step; on CUDA at a later ``step()``, at most the
            ring depth (4 recorded steps) later), ``None``, or ``callable(Anomaly)``.
        sinks: consumers of drained steps (``hookcap.sinks.*``; one alone: a list of one).
        timing: also record how long each hooked module's forward and backward take, per step
            (``h["fwd_ms"]``, ``h["bwd_ms"]``: milliseconds, summed over the module's calls in the
            step, on each of its metrics; NaN where not measured). Device-side timestamps on CUDA
            (no host sync), the host's steady clock on CPU; what is timed: docs/monitor.md.
        dump_on_anomaly: path (or existing directory) for an automatic
            ``dump()`` at the first anomaly, and at the first of each later
            anomaly kind (``-{kind}`` added to the file name).
        dump_on_exit: path for a ``dump()`` when the process exits (atexit) or
            receives SIGTERM/SIGINT (the previous handler is chained, so the
            program's own handling, e.g. KeyboardInterrupt, still happens).
        rank_sinks: where sink records go in a multi-rank run (torch.distributed
            initialised, world size > 1). ``"merged"`` (default): rank 0's sinks
            receive each recorded step merged across all ranks (the math of
            ``history(all_ranks=True)``; every rank must create the Monitor and call
            ``step()`` and ``detach()`` alike; small host collectives every
            ``hookcap.monitor.RANK_MERGE_EVERY``-th step). ``"all"``: each rank's sinks
            receive its own records (file names and keys carry the rank). Details:
            docs/compile-and-distributed.md.
        eval_forwards: forwards of modules in eval mode (``module.training``
            False at the call; taps: the model's) never merge into a training
            step's rows. ``"separate"`` (default): metrics named
            ``f"eval/{qualname}/{kind}"``; ``"skip"``: not recorded;
            ``"merge"``: recorded like training forwards. Train-mode forwards
            under ``no_grad`` count as training (``mon.paused()`` leaves them out).
        start_step: the number of the first step (a resumed run; see also
            :meth:`state_dict`).
        update_snapshot: ``"update"`` of optimizers other than SGD, Adam, AdamW from a copy.
        moments: 2 (default) or 4: also the third and fourth central moments and
            ``skew``, ``kurtosis`` (Pearson, not excess) of captured tensors, in the
            same pass (``hookcap.MOMENT_NAMES``, docs/statistics.md).
        fused: retired: ``True`` raises ``ValueError`` (docs/design.md says why).
        grad_scaler: the ``torch.amp.GradScaler`` of the loop (with ``optimizer=``): its
            ``update()`` closes steps, so an iteration whose optimizer step it skipped is a
            step too (``update`` 0, ``History.skipped``); docs/loss-spikes.md.
        placements: ``{metric glob: "replicated" | "sharded" | "per_rank"}``: how plain
            tensors lie across ranks, for merged histories (first match wins): identical
            copies count once, or parts are summed; docs/compile-and-distributed.md.
        groups: ``{metric glob: hookcap.Groups(dim, size)}``: each group of slices (heads, experts) also
            recorded as ``f"{metric}[{g}]"`` (``History.groups``); ``hookcap.Channels(dim, top)``: outlier channels.
        skip: a ``hookcap.SkipStep`` (with ``optimizer=``): skip optimizer steps whose loss or
            gradient norm spikes, decided on the device; docs/anomalies.md.
        stream: ``"current"`` (default): CUDA statistics kernels run on the stream current at
            each capture; ``"side"``: on hookcap's own stream of the device, forked after each
            capture and joined at ``step()``, beside the model's next kernels (not inside a CUDA
            graph capture); docs/performance.md has what each costs.

    Metric names are ``f"{qualname}/{kind}"``, with ``.{path}`` appended for
    tensors inside tuples, lists, dicts and dataclasses (``"0"``, ``"1.attn"``,
    ``"logits"``; namedtuple items by field), ``f"{param_qualname}/param"`` /
    ``"/param_grad"``, and ``eval/`` before the name of an eval-mode forward.
    """

    def __init__(
        self,
        model: nn.Module,
        modules=None,
        capture=("output", "grad_output"),
        histogram: Histogram | None = DEFAULT_HISTOGRAM,
        capacity: int | str = DEFAULT_CAPACITY,
        every: int | dict = 1,
        optimizer: torch.optim.Optimizer | None = None,
        detectors=None,
        on_anomaly="warn",
        sinks=None,
        dump_on_anomaly=None,
        dump_on_exit=None,
        rank_sinks: str = "merged",
        timing: bool = False,
        eval_forwards: str = "separate",
        start_step: int = 0,
        update_snapshot: bool = False,
        moments: int = 2,
        fused: bool = False,
        placements: dict | None = None,
        grad_scaler=None,
        groups: dict | None = None,
        skip=None,
        stream: str = "current",
    ):
        if fused is not False:
            raise ValueError("fused: Monitor(fused=True) is retired: statistics fused into compiled "
                             "kernels measured slower than the op's own pass (docs/design.md); drop the argument")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
        config = make_config(capture, histogram, capacity, every, modules, timing, rank_sinks, eval_forwards,
                             update_snapshot, moments, placements, groups, stream)
        if not isinstance(start_step, int) or isinstance(start_step, bool) or start_step < 0:
            raise ValueError(f"start_step: expected an int >= 0 (the number of the first step), got {start_step!r}")
        if optimizer is not None and not callable(getattr(innermost_optimizer(optimizer), "step", None)):
            raise ValueError(f"optimizer: expected a torch optimizer or a wrapper of one, "
                             f"got {type(optimizer).__name__}")
        if grad_scaler is not None and (optimizer is None or not callable(getattr(grad_scaler, "update", None))):
            raise ValueError("grad_scaler: expected a torch.amp.GradScaler, given with optimizer=")
        check_skip(skip, optimizer)
        self.model, self.optimizer, self.grad_scaler, self._skip = model, optimizer, grad_scaler, skip
        self._config = config
        self._catalog = Catalog()
        self._recorder = Recorder(config, self._catalog, start_step)
        self._hooks = Hooks(config, self._recorder, model, optimizer)
        self._drain = Drain(config, self._catalog)
        self._sinks = Sinks(sinks)
        self._ranks = RankMerger(config, self._catalog, self._sinks)
        self._consumers = Consumers(config, self._catalog, self._sinks, self._ranks, detectors, on_anomaly,
                                    dump_on_anomaly, self.dump)
        self._exit = ExitDump(dump_on_exit, self.dump)
        self._attached = False
        self._with_depth = 0  # nested `with mon:` blocks; the outermost one detaches

    # -- settings and results (read-only unless stated) ----------------------------
    capture = property(lambda self: self._config.capture, doc="Capture kinds, as a tuple.")
    histogram = property(lambda self: self._config.histogram, doc="The Histogram spec, or None.")
    capacity = property(lambda self: self._config.capacity,
                        doc="The host history's bound as given: recorded steps (int) or bytes (str).")
    evicted_steps = property(lambda self: self._consumers.store.evicted,
                             doc="Recorded steps dropped from the host history by ``capacity``, oldest first.")
    history_bytes = property(lambda self: self._consumers.store.nbytes,
                             doc="Bytes the host history holds now (encoded steps).")
    every = property(lambda self: self._config.every, doc="``every`` as given: an int, or a dict per kind.")
    timing = property(lambda self: self._config.timing, doc="Whether module durations are recorded.")
    rank_sinks = property(lambda self: self._config.rank_sinks, doc="``'merged'`` or ``'all'``.")
    eval_forwards = property(lambda self: self._config.eval_forwards,
                             doc="``'separate'``, ``'skip'`` or ``'merge'``.")
    detectors = property(lambda self: self._consumers.detectors, doc="Detectors run on each drained step.")
    anomalies = property(lambda self: self._consumers.anomalies, doc="Every Anomaly found so far.")
    failed_sinks = property(lambda self: self._sinks.failed,
                            doc="``(sink, exception)`` of each sink disabled after it raised.")
    dropped_steps = property(lambda self: self._drain.dropped,
                             doc="Recorded steps dropped because the host fell a whole ring behind.")
    sinks = property(lambda self: self._sinks.active,
                     doc="The active sinks (a sink that raised moves to ``failed_sinks``).")

    @property
    def on_anomaly(self):
        """``"warn"``, ``"raise"``, None or a callable; settable."""
        return self._consumers.on_anomaly

    @on_anomaly.setter
    def on_anomaly(self, value) -> None:
        check_on_anomaly(value)
        self._consumers.on_anomaly = value

    dump_on_anomaly = property(lambda self: self._consumers.dump_on_anomaly,
                               lambda self, value: setattr(self._consumers, "dump_on_anomaly", value),
                               doc="Path (or directory) of the automatic dump at the first anomaly; settable.")

    @property
    def dump_on_exit(self):
        """Path of the dump at exit or SIGTERM/SIGINT; settable before ``attach()``."""
        return self._exit.path

    @dump_on_exit.setter
    def dump_on_exit(self, value) -> None:
        self._exit.path = value

    current_step = property(lambda self: self._recorder.step,
                            doc="The step being recorded now (steps start at 0).")

    @property
    def names(self) -> list[str]:
        """Metric names discovered so far, in first-execution order."""
        return list(self._catalog.names)

    # -- attach / detach --------------------------------------------------------
    def __enter__(self) -> Monitor:
        self.attach()
        self._with_depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._with_depth -= 1
        if self._with_depth == 0:
            self.detach()

    def attach(self) -> Monitor:
        """Register the hooks. Idempotent. On an error nothing stays registered."""
        if self._attached:
            return self
        self._attached = True
        self._recorder.set_attached(True)
        try:
            self._hooks.attach()
            if self._skip is not None:  # first: the Monitor's own hooks see the step's found_inf
                self._hooks.handles.append(self._skip.attach(self.optimizer, self._recorder))
            if self.optimizer is not None:
                if self._hooks.wants_pre_step:
                    self._hooks.handles.append(before_optimizer_step(self.optimizer,
                                                                     self._hooks.before_optimizer_step))
                if self.grad_scaler is None:
                    self._hooks.handles.append(after_optimizer_step(self.optimizer, self._optimizer_stepped))
                else:  # the scaler's update() closes steps: also iterations whose step it skipped
                    self._hooks.follow_optimizer(self.optimizer, pre=False)
                    self._hooks.handles.append(after_optimizer_step(self.optimizer, self._hooks.mark_stepped))
                    self._hooks.handles.append(ScalerUpdate(self.grad_scaler, self._scaler_updated))
            if self._skip is not None:  # last: puts back what its pre-step hook changed
                self._hooks.handles.append(self._skip.attach_after(self.optimizer))
        except BaseException:
            self._hooks.remove()
            self._attached = False
            self._recorder.set_attached(False)
            raise
        if self._exit.path is not None:
            self._exit.install()
        self._hooks.park_or_unpark(attached=True)
        return self

    def detach(self) -> None:
        """Remove every hook this Monitor added and close the sinks (the
        history stays readable). With ``rank_sinks="merged"`` in a multi-rank
        run this is a collective: every rank's ``detach()`` merges the steps
        still pending and rank 0 writes them before its sinks are closed."""
        rec = self._recorder
        if self._attached and rec.recording and not rec.capturing():
            # An open step holding records (an evaluation after the last step())
            # is closed, with no rank collective (ranks may differ here).
            taken = rec.take_order()
            if len(taken[0]) or taken[1]:
                self._step(taken)
        self._hooks.remove()
        was = self._attached
        self._attached = False
        self._recorder.set_attached(False)  # hooks of this step's graph stay quiet
        if was and (self._sinks.active or self._ranks.merging):
            self._consume(wait=True)
            if self._ranks.merging:
                self._ranks.merge(self._drain.watermark(self._recorder.step))
            self._sinks.close()

    # -- steps ------------------------------------------------------------------
    def step(self) -> None:
        """Close the current step and open the next. No host sync on CUDA.
        With ``rank_sinks="merged"`` in a multi-rank run, also a (host-only)
        collective on every rank: see the class docstring. With
        ``optimizer=`` the optimizer's steps close steps: this does nothing."""
        if self.optimizer is not None and self._attached:
            self._recorder.warn_once("manual step", (
                "hookcap: this Monitor was given optimizer=... and closes a step after each optimizer step "
                "by itself; step() calls do nothing (drop them, or drop optimizer=)"))
            return
        self._step(None)

    def _optimizer_stepped(self) -> None:
        self._step(None)  # the optimizer's post-step hook (optimizer=)

    def _scaler_updated(self) -> None:  # grad_scaler.update(), before its own work
        self._hooks.scaler_iteration(found_infs(self.grad_scaler, innermost_optimizer(self.optimizer)))
        self._step(None)

    def _step(self, taken) -> None:
        """step(); ``taken``: the step's log, taken by detach() (a close with no rank collective)."""
        closing = taken is not None
        rec, hooks = self._recorder, self._hooks
        if rec.capturing():
            # Closing a step copies a slot and polls events: not capturable. The step stays open.
            rec.warn_once("step in capture", "hookcap: step() while a CUDA graph is being captured does "
                                             "nothing (call it outside the capture, after each replay)")
            return
        if not self._attached:
            rec.warn_once("step unattached", "hookcap: step() on a Monitor that is not attached: it "
                                             "records nothing (call attach() or use `with mon:`)")
        if not self._ranks.decided and not closing:
            self._ranks.setup(RANK_HANDSHAKE_TIMEOUT_S)
        if recorded := rec.recording:  # the model as it is now: replaced parameters, added modules
            hooks.refresh(at_step_end=True)
        if rec.enabled:
            if self._attached:
                hooks.record_params()
            order, failed_timers = rec.take_order() if taken is None else taken  # even when dropped
            for module, message in failed_timers:
                hooks.timing.failed(module, RuntimeError(message))
            if self._attached or len(order):  # detached: detach() closed what it held
                self._drain.finish(rec.ring_list, rec.step, order, rec.module_recording or rec.paused)
        else:  # gradients that arrived in an off-step wrote nothing: forget them
            rec.fast.take()
        self._consume(wait=False)
        if not closing and self._ranks.due(rec.step, RANK_MERGE_EVERY):
            self._ranks.merge(self._drain.watermark(rec.step))
        rec.new_step(self._drain.advance(rec.ring_list, rec.step))
        hooks.new_step()
        hooks.park_or_unpark(self._attached)
        if rec.recording and not recorded:
            hooks.refresh()
        anomaly = self._consumers.raise_pending()
        if anomaly is not None:
            raise AnomalyError(anomaly)

    def _before_optimizer_step(self, optimizer=None) -> None:
        """Callbacks that see the optimizer's step coming (HF, Lightning): follow ``optimizer``."""
        if self._attached:
            if optimizer is not None:
                self._hooks.follow_optimizer(optimizer)
            self._hooks.before_optimizer_step()

    @contextlib.contextmanager
    def paused(self):
        """``with mon.paused():`` records nothing inside the block (forwards,
        backwards, compiled code) and costs nothing there: the module hooks
        are parked as on an off-step. Steps keep their numbers."""
        rec = self._recorder
        was = rec.paused
        rec.set_paused(True)
        self._hooks.park_or_unpark(self._attached)
        try:
            yield self
        finally:
            rec.set_paused(was)
            self._hooks.park_or_unpark(self._attached)

    def state_dict(self) -> dict:
        """What a resumed run needs (plain picklable, JSON-able data): the open step's
        number, each detector's state (Spike windows, Dead runs, ...) and the anomalies."""
        return {"format": "hookcap-monitor", "version": 1, "step": self.current_step,
                **self._consumers.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: the open step takes the saved
        number, the detectors (matched by position) their state, and
        ``anomalies`` becomes the saved list."""
        self._consumers.load_state_dict(state)
        self._recorder.jump_to(int(state["step"]))
        self._hooks.park_or_unpark(self._attached)

    def _consume(self, wait: bool) -> None:
        for record in self._drain.collect(self._recorder.ring_list, wait):
            if not len(record.metrics):
                self._recorder.warn_once("empty step", f"hookcap: recorded step {record.step} recorded nothing: "
                                         "no hooked module ran while the Monitor recorded (logged once)")
            self._consumers.consume(record)

    # -- reading ------------------------------------------------------------------
    def history(self, all_ranks: bool = False, group=None) -> History:
        """Every retained recorded step (waits for in-flight copies: the explicit read).

        ``all_ranks=True`` is a collective (every rank of ``group`` calls it):
        the result merges all ranks' statistics (counts, sums and histograms
        summed, extrema combined) with one packed MIN and one packed SUM
        all-reduce; metric rows agree even when a rank lacks a metric."""
        self._consume(wait=True)
        h = self._consumers.history()
        if all_ranks:
            from .distributed import merge_across_ranks

            h = merge_across_ranks(h, group)
        return h

    def dump(self, path) -> str:
        """Write every retained step of every metric, the metadata, execution order and
        anomalies to one file (read back with ``hookcap.load``); returns the path written."""
        self._consume(wait=True)
        return io.write(self._consumers.store.steps, self._catalog.names, self._catalog.metas,
                        self._config.histogram, path, extra=self._dump_extra())

    def _dump_extra(self) -> dict:
        return {"anomalies": [a.to_dict() for a in self.anomalies], "dropped_steps": self.dropped_steps,
                "evicted_steps": self.evicted_steps, "capture": list(self.capture), "every": self.every}

    # -- global capture -----------------------------------------------------------
    @classmethod
    def everything(cls, models: nn.Module | Iterable[nn.Module] | None = None, **kwargs) -> Monitor:
        """A Monitor of every module that runs in the process (global module
        hooks). Modules of ``models`` are named by their qualified names; any
        other module is named ``f"{ClassName}#{k}"`` in first-seen order."""
        kwargs.setdefault("modules", lambda name, mod: True)
        mon = cls(None, **kwargs)
        mon._hooks.capture_everything([models] if isinstance(models, nn.Module) else list(models or ()))
        return mon
