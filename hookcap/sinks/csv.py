"""CSV sink: header ``step,name,<stats...>``, one row per (step, metric)."""

from __future__ import annotations

import csv
import io
import math
import os

from ..drained import DrainedStep
from ._base import COUNT_STATS, _TextFileSink


class CSV(_TextFileSink):
    """``hookcap.sinks.CSV(path, stats=None, every=1, append=False, quantiles=None)``

    Columns ``step,name`` then the chosen stats (default: all of
    ``hookcap.STAT_NAMES``), one row per (step, metric) in execution order.
    Floats are written in their shortest round-trip form (``float(cell)``
    gives the value back bit-exact; NaN is ``nan``, +-Inf ``inf``/``-inf``, which
    ``float`` and pandas read); count stats are integers. ``append=True``
    continues an existing file (its header must match; no second header).
    Per-rank records of a multi-rank run go to one file per rank (``{rank}``
    in ``path``, else ``run.rank1.csv``; see ``hookcap.sinks.jsonl.rank_path``),
    with the same columns. ``quantiles=[0.5, 0.99]`` adds the columns
    ``p50,p50_err,p99,p99_err`` after the stats (see :class:`hookcap.sinks.Sink`).
    """

    def _header(self) -> list[str]:
        return ["step", "name", *self.column_names()]

    def _open(self):
        self._has_header = False
        if self.append or self._opened_once:
            # Appending: keep the existing header, refuse one that differs
            # (rows would land under the wrong columns).
            if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
                with open(self.path, encoding="utf-8", newline="") as f:
                    first = next(csv.reader(f), None)
                if first != self._header():
                    raise ValueError(f"CSV sink: {self.path} has columns {first}, expected "
                                     f"{self._header()}; write to a new file or pass the same stats=")
                self._has_header = True
        return super()._open()

    def _preamble(self) -> str:
        if self._has_header:
            return ""
        self._has_header = True
        return self._row(self._header())

    @staticmethod
    def _row(cells) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(cells)
        return buf.getvalue()

    def write(self, step: DrainedStep) -> None:
        cols = [(v, s in COUNT_STATS) for s, v in self.columns(step)]
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for i, name in enumerate(step.names):
            row = [int(step.step), name]
            for v, is_count in cols:
                x = float(v[i])
                row.append(int(x) if is_count and math.isfinite(x) else repr(x))
            w.writerow(row)
        self._write_text(buf.getvalue())
