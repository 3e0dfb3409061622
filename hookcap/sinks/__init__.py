"""Sinks: consumers of drained steps, run in the drain (never in a hook).

A sink is any object with ``write(step: hookcap.drained.DrainedStep)`` and
``close()`` (and optionally ``bind_rank(rank)``, see :meth:`Sink.bind_rank`);
subclass :class:`Sink` for the ``stats=`` and ``every=`` options.
A sink that raises is reported once and disabled by the Monitor; training,
the other sinks and the history go on.

Built in: :class:`JSONL`, :class:`CSV`, :class:`TensorBoard` (needs
``tensorboard``), :class:`WandB` (needs ``wandb``), :class:`Callback`. The
optional packages are imported when such a sink is created, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .._layout import STAT_NAMES, TIMING_NAMES
from ..drained import DrainedStep


class Sink:
    """Base class. ``stats``: stat names to write (default: all of
    ``hookcap.STAT_NAMES``; ``"fwd_ms"``/``"bwd_ms"`` may be added, recorded by
    ``Monitor(timing=True)``, NaN otherwise);
    ``every``: write only steps whose number is a multiple of ``every``.

    ``rank``: the rank whose own records this sink receives, set by the
    Monitor through :meth:`bind_rank` in a multi-rank run; None for records
    merged across ranks and in a single process (the default)."""

    rank: int | None = None

    def __init__(self, stats: Iterable[str] | None = None, every: int = 1):
        stats = tuple(STAT_NAMES if stats is None else stats)
        bad = [s for s in stats if s not in STAT_NAMES and s not in TIMING_NAMES]
        if bad:
            raise ValueError(f"stats: unknown stat(s) {bad}; allowed: "
                             f"{', '.join(STAT_NAMES + TIMING_NAMES)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be an int >= 1, got {every!r}")
        self.stats = stats
        self.every = every

    def bind_rank(self, rank: int | None) -> None:
        """Called by the Monitor once in a multi-rank run (torch.distributed
        initialised, world size > 1), before the first write: ``rank`` when this
        sink will receive that rank's own records (``rank_sinks="all"``, or the
        per-rank fallback), None when it receives records merged across ranks.
        File sinks use it to keep ranks apart (see :class:`JSONL`). Duck-typed
        sinks may define it too; it is optional."""
        self.rank = rank

    def wants(self, step: DrainedStep) -> bool:
        return step.step % self.every == 0

    def write(self, step: DrainedStep) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


class Callback(Sink):
    """Calls ``fn(step: DrainedStep)`` for every written step."""

    def __init__(self, fn: Callable[[DrainedStep], None], stats=None, every: int = 1):
        super().__init__(stats, every)
        self.fn = fn

    def write(self, step: DrainedStep) -> None:
        self.fn(step)


from .jsonl import JSONL  # noqa: E402  (the submodules subclass Sink)
from .csv import CSV  # noqa: E402
from .tensorboard import TensorBoard  # noqa: E402
from .wandb import WandB  # noqa: E402

__all__ = ["CSV", "Callback", "JSONL", "Sink", "TensorBoard", "WandB"]
