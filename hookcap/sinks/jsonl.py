"""JSON Lines sink: one line per (step, metric), streamed."""

from __future__ import annotations

import json
import math
import os

from ..drained import DrainedStep
from . import Sink

# Stats that are whole counts: written as JSON integers.
COUNT_STATS = frozenset(("count", "nan", "posinf", "neginf", "inf", "zeros", "finite"))


def json_number(v: float) -> str:
    """A float as a JSON token that reads back to the same float: ``repr`` is
    the shortest round-trip form; NaN -> ``null``; +-Inf -> ``1e999`` /
    ``-1e999`` (valid JSON numbers that Python and JavaScript read as +-Infinity)."""
    if math.isnan(v):
        return "null"
    if math.isinf(v):
        return "1e999" if v > 0 else "-1e999"
    return repr(float(v))


def histogram_spec_dict(spec) -> dict:
    d = {"kind": spec.kind, "lo": spec.lo, "hi": spec.hi}
    if spec.kind == "linear":
        d["bins"] = spec.bins
    return d


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

    def __init__(self, path, stats=None, every=1, append=False):
        super().__init__(stats, every)
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


class JSONL(_TextFileSink):
    """``hookcap.sinks.JSONL(path, stats=None, every=1, append=False, histogram=False)``

    One JSON object per line and per (step, metric), in execution order within
    a step: ``{"step": 3, "name": "fc/output", "count": 64, ..., "l2norm": 1.23}``;
    per-rank records of a multi-rank run also carry ``"rank": r`` after
    ``"step"`` (absent for merged and single-process records).
    Floats are written in their shortest round-trip form (they read back
    bit-exact); NaN is ``null``; count stats are integers. With
    ``histogram=True`` each line also holds ``"hist"`` (all bin counts) and
    ``"hist_spec"`` (``{"kind", "lo", "hi"[, "bins"]}``, see
    ``hookcap.Histogram``), so the line is readable on its own.
    ``append=True`` continues an existing file instead of truncating it.
    """

    def __init__(self, path, stats=None, every=1, append=False, histogram=False):
        super().__init__(path, stats, every, append)
        self.histogram = bool(histogram)

    def write(self, step: DrainedStep) -> None:
        spec = step.histogram_spec if self.histogram else None
        spec_json = json.dumps(histogram_spec_dict(spec)) if spec is not None else None
        cols = [(s, step.stats[s], s in COUNT_STATS) for s in self.stats]
        rank = getattr(step, "rank", None)
        head = f'"step": {int(step.step)}' + ("" if rank is None else f', "rank": {int(rank)}')
        lines = []
        for i, name in enumerate(step.names):
            parts = [head, f'"name": {json.dumps(name)}']
            for s, v, is_count in cols:
                x = float(v[i])
                parts.append(f'"{s}": ' + (str(int(x)) if is_count and math.isfinite(x) else json_number(x)))
            if spec is not None:
                parts.append('"hist": [' + ", ".join(map(str, step.histogram(name).tolist())) + "]")
                parts.append(f'"hist_spec": {spec_json}')
            lines.append("{" + ", ".join(parts) + "}\n")
        self._write_text("".join(lines))
