"""What every sink builds on: the :class:`Sink` base class, :class:`Callback`,
and the lazily opened, per-rank text file that JSONL and CSV write."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np

from .._layout import MOMENT_NAMES, STAT_NAMES, TIMING_NAMES
from ..drained import DrainedStep
from ..quantiles import check_q, column_name

# Stats that are whole counts: text sinks write them as integers.
COUNT_STATS = frozenset(("count", "nan", "posinf", "neginf", "inf", "zeros", "finite"))


class Sink:
    """Base class. ``stats``: stat names to write (default: all of
    ``hookcap.STAT_NAMES``; ``"fwd_ms"``/``"bwd_ms"`` may be added, recorded by
    ``Monitor(timing=True)``, and ``hookcap.MOMENT_NAMES`` (``"skew"``,
    ``"kurtosis"``, ...), recorded by ``Monitor(moments=4)``, which adds them
    to a sink made without ``stats=``: NaN otherwise);
    ``every``: write only steps whose number is a multiple of ``every``;
    ``quantiles``: probabilities in [0, 1] whose quantiles each step carries
    as two more columns, ``p50`` (the estimate, see
    :func:`hookcap.quantiles.column_name`) and ``p50_err`` (its guaranteed
    relative error bound), estimated from the Monitor's histogram (of ``|x|``
    for a log2 histogram; the Monitor needs ``histogram=`` set).

    ``rank``: the rank whose own records this sink receives, set by the
    Monitor through :meth:`bind_rank` in a multi-rank run; None for records
    merged across ranks and in a single process (the default)."""

    rank: int | None = None

    def __init__(self, stats: Iterable[str] | None = None, every: int = 1, quantiles=None):
        given = stats is not None
        stats = tuple(STAT_NAMES if stats is None else stats)
        known = STAT_NAMES + MOMENT_NAMES + TIMING_NAMES
        bad = [s for s in stats if s not in known]
        if bad:
            raise ValueError(f"stats: unknown stat(s) {bad}; allowed: {', '.join(known)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be an int >= 1, got {every!r}")
        self.stats = stats
        self._stats_default = not given  # stats=None: follows what the Monitor records (add_moments)
        self.every = every
        self.quantiles = () if quantiles is None else tuple(float(q) for q in check_q(quantiles)[0])

    def column_names(self) -> list[str]:
        """The stats written, then two columns per quantile (value, bound)."""
        out = list(self.stats)
        for q in self.quantiles:
            out += [column_name(q), column_name(q) + "_err"]
        return out

    def columns(self, step: DrainedStep) -> list[tuple[str, np.ndarray]]:
        """``(column, float64 [len(step.names)])`` for each of
        :meth:`column_names`: ``step.stats`` and the quantile columns."""
        out = [(s, step.stats[s]) for s in self.stats]
        if self.quantiles:
            if step.histogram_spec is None:
                raise ValueError(f"{type(self).__name__}(quantiles=...) needs histograms: the Monitor "
                                 "was created with histogram=None")
            qs = step.quantiles(self.quantiles)
            for j, q in enumerate(self.quantiles):
                out += [(column_name(q), qs.value[:, j]), (column_name(q) + "_err", qs.rel_error[:, j])]
        return out

    def add_moments(self) -> None:
        """Called by a ``Monitor(moments=4)`` before the first write: a sink
        made without ``stats=`` also writes ``hookcap.MOMENT_NAMES``. Optional
        for duck-typed sinks."""
        if getattr(self, "_stats_default", False) and not set(MOMENT_NAMES) <= set(self.stats):
            self.stats = tuple(self.stats) + MOMENT_NAMES

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

    def __init__(self, fn: Callable[[DrainedStep], None], stats=None, every: int = 1, quantiles=None):
        super().__init__(stats, every, quantiles)
        self.fn = fn

    def write(self, step: DrainedStep) -> None:
        self.fn(step)


def rank_path(path: str, rank: int | None) -> str:
    """The file a sink of ``rank`` writes: ``{rank}`` in ``path`` is replaced
    by the rank; otherwise ``.rank{r}`` goes before the extension
    (``stats.jsonl`` -> ``stats.rank1.jsonl``). ``rank=None``: ``path`` as given."""
    if rank is None:
        return path
    if "{rank}" in path:
        return path.replace("{rank}", str(int(rank)))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{int(rank)}{ext}"


class _TextFileSink(Sink):
    """Opens ``path`` lazily at the first write (creating parent folders),
    writes each step with one ``write`` and flushes it, so the data is on disk
    without ``close()``. After ``close()`` a later write appends.

    In a multi-rank run with per-rank records (``Monitor(rank_sinks="all")``)
    each rank writes its own file, named by :func:`rank_path`: ``{rank}`` in
    the path is replaced by the rank, else ``.rank{r}`` is inserted before the
    extension (``stats.jsonl`` -> ``stats.rank1.jsonl``); ``self.path`` is the
    file actually written. Records merged across ranks and single-process runs
    write ``path`` as given."""

    def __init__(self, path, stats=None, every=1, append=False, quantiles=None):
        super().__init__(stats, every, quantiles)
        self.path_template = os.fspath(path)
        self.path = self.path_template
        self.append = bool(append)
        self._f = None
        self._opened_once = False

    def bind_rank(self, rank: int | None) -> None:
        super().bind_rank(rank)
        self.path = rank_path(self.path_template, rank)

    def _open(self):
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        mode = "a" if (self.append or self._opened_once) else "w"
        f = open(self.path, mode, encoding="utf-8", newline="")
        self._opened_once = True
        return f

    def _write_text(self, text: str) -> None:
        if self._f is None:
            self._f = self._open()
            text = self._preamble() + text
        try:
            self._f.write(text)
            self._f.flush()
        except BaseException:
            # A failed write (disk full, ...) disables the sink in the Monitor,
            # which then never calls close(): release the file now.
            f, self._f = self._f, None
            try:
                f.close()
            except OSError:
                pass
            raise

    def _preamble(self) -> str:
        return ""

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            f.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"
