"""JSON Lines sink: one line per (step, metric), streamed."""

from __future__ import annotations

import json
import math

import numpy as np

from ..drained import DrainedStep
# rank_path: documented as hookcap.sinks.jsonl.rank_path.
from ._base import COUNT_STATS, _TextFileSink, rank_path  # noqa: F401


def json_number(v: float) -> str:
    """A float as a JSON token that reads back to the same float: ``repr`` is
    the shortest round-trip form; NaN -> ``null``; +-Inf -> ``1e999`` /
    ``-1e999`` (valid JSON numbers that Python and JavaScript read as +-Infinity)."""
    if math.isnan(v):
        return "null"
    if math.isinf(v):
        return "1e999" if v > 0 else "-1e999"
    return repr(float(v))


def full_histogram(line: dict, nbins: int) -> np.ndarray:
    """np.int64 [nbins]: every bin's count from a JSONL line's ``hist_offset``
    and ``hist`` band (``nbins``: ``Histogram.nbins`` of its ``hist_spec``)."""
    out = np.zeros(nbins, dtype=np.int64)
    lo = int(line.get("hist_offset", 0))
    band = np.asarray(line["hist"], dtype=np.int64)
    out[lo:lo + band.size] = band
    return out


class JSONL(_TextFileSink):
    """``hookcap.sinks.JSONL(path, stats=None, every=1, append=False, histogram=False, quantiles=None)``

    One JSON object per line and per (step, metric), in execution order within
    a step: ``{"step": 3, "name": "fc/output", "count": 64, ..., "l2norm": 1.23}``;
    per-rank records of a multi-rank run also carry ``"rank": r`` after
    ``"step"`` (absent for merged and single-process records).
    Floats are written in their shortest round-trip form (they read back
    bit-exact); NaN is ``null``; count stats are integers. With
    ``histogram=True`` each line also holds ``"hist_offset"`` and ``"hist"``:
    the counts of bins ``hist_offset`` … ``hist_offset + len(hist) - 1``, the
    band from the first to the last non-empty bin (every other bin is 0;
    :func:`full_histogram` expands it), and ``"hist_spec"`` (``{"kind",
    "lo", "hi"[, "bins"][, "sub", "signed"]}``, ``hookcap.Histogram.to_dict``), so the line is
    readable on its own.
    ``append=True`` continues an existing file instead of truncating it.
    ``quantiles=[0.5, 0.99]`` adds ``"p50"``, ``"p50_err"``, ``"p99"``,
    ``"p99_err"`` after the stats (see :class:`hookcap.sinks.Sink`).
    """

    def __init__(self, path, stats=None, every=1, append=False, histogram=False, quantiles=None):
        super().__init__(path, stats, every, append, quantiles)
        self.histogram = bool(histogram)

    def write(self, step: DrainedStep) -> None:
        spec = step.histogram_spec if self.histogram else None
        spec_json = json.dumps(spec.to_dict()) if spec is not None else None
        cols = [(s, v, s in COUNT_STATS) for s, v in self.columns(step)]
        rank = getattr(step, "rank", None)
        head = f'"step": {int(step.step)}' + ("" if rank is None else f', "rank": {int(rank)}')
        lines = []
        for i, name in enumerate(step.names):
            parts = [head, f'"name": {json.dumps(name)}']
            for s, v, is_count in cols:
                x = float(v[i])
                parts.append(f'"{s}": ' + (str(int(x)) if is_count and math.isfinite(x) else json_number(x)))
            if spec is not None:
                h = step.histogram(name)
                nz = np.flatnonzero(h)
                lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
                parts.append(f'"hist_offset": {lo}')
                parts.append('"hist": [' + ", ".join(map(str, h[lo:hi].tolist())) + "]")
                parts.append(f'"hist_spec": {spec_json}')
            lines.append("{" + ", ".join(parts) + "}\n")
        self._write_text("".join(lines))
