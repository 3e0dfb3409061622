"""Sinks: consumers of drained steps, run in the drain (never in a hook).

A sink is any object with ``write(step: hookcap.drained.DrainedStep)`` and
``close()`` (and optionally ``bind_rank(rank)``, see :meth:`Sink.bind_rank`);
subclass :class:`Sink` for the ``stats=`` and ``every=`` options.
A sink that raises is reported once and disabled by the Monitor; training,
the other sinks and the history go on.

Built in: :class:`JSONL`, :class:`CSV`, :class:`Parquet` (needs ``pyarrow``),
:class:`TensorBoard` (needs ``tensorboard``), :class:`WandB` (needs ``wandb``),
:class:`OTLP` (needs ``opentelemetry-sdk``: live gauges, bounded series),
:class:`Webhook` (posts anomalies), :class:`Callback`. The optional packages are imported when such a sink is
created, not here.
"""

from __future__ import annotations

from ._base import Callback, Sink
from .csv import CSV
from .jsonl import JSONL
from .otlp import OTLP
from .parquet import Parquet
from .tensorboard import TensorBoard
from .wandb import WandB
from .webhook import Webhook

__all__ = ["CSV", "Callback", "JSONL", "OTLP", "Parquet", "Sink", "TensorBoard", "WandB", "Webhook"]
