"""The history file codec: step records, metric names and metadata, the
histogram spec and a JSON ``extra`` header in one self-describing, versioned
``.npz`` file (arrays + a JSON header). Building a History from them is
``hookcap.history``'s job."""

from __future__ import annotations

import json
import os

import numpy as np

from . import _layout
from ._record import StepRecord
from .histogram import Histogram

FORMAT = "hookcap-history"
VERSION = 1


def write(records: list[StepRecord], names: list[str], metas: dict, histogram: Histogram | None,
          path: str | os.PathLike, extra: dict | None = None) -> str:
    """Write ``records`` (StepRecords whose metric indices refer to ``names``)
    to ``path`` (``.npz`` is appended if missing; missing parent folders are
    created). ``metas``: name ->
    ``{"module_type", "kind", "shape", "dtype"}``; ``extra``
    (JSON-serialisable) is stored in the header. Returns the path written."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    recs = list(records)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "layout_header": _layout.HEADER,
        "names": list(names),
        "metas": {n: {**metas[n], "shape": list(metas[n]["shape"])} for n in names},
        "histogram": None if histogram is None else {
            "kind": histogram.kind, "lo": histogram.lo, "hi": histogram.hi, "bins": histogram.bins},
        "extra": extra or {},
    }
    arrays = {
        "steps": np.array([r.step for r in recs], dtype=np.int64),
        "n_metrics": np.array([len(r.metrics) for r in recs], dtype=np.int64),
        "metrics": _cat([r.metrics for r in recs], (0,)),
        "rows": _cat([r.header for r in recs], (0, _layout.HEADER)),
        "hist_lo": np.array([r.hist_lo for r in recs], dtype=np.int64),
        "hist_width": np.array([r.hist.shape[1] for r in recs], dtype=np.int64),
        "hist": _cat([r.hist.reshape(-1) for r in recs], (0,)),
        "n_order": np.array([len(r.order) for r in recs], dtype=np.int64),
        "order": _cat([r.order for r in recs], (0,)),
        "n_calls": np.array([len(r.calls) for r in recs], dtype=np.int64),
        "calls": _cat([r.calls for r in recs], (0,)),
        "calls_nonfinite": _cat([r.calls_nonfinite.astype(np.int64) for r in recs], (0,)),
    }
    if any(r.time_ns is not None for r in recs):  # Monitor(timing=True)
        arrays["time_ns"] = np.concatenate(
            [r.time_ns if r.time_ns is not None else np.full((len(r.metrics), 2), np.nan) for r in recs])
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, meta_json=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp, path)
    return path


def _cat(parts, empty_shape):
    return np.concatenate(parts) if parts else np.empty(empty_shape, dtype=np.int64)


def read(path: str | os.PathLike) -> tuple[list[StepRecord], list[str], dict, Histogram | None, dict]:
    """Read a file written by :func:`write`: ``(records, names, metas,
    histogram, extra)``. ``path`` may omit the ``.npz`` that :func:`write`
    appended."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".npz"):
        path += ".npz"
    with np.load(path) as z:
        if "meta_json" not in z.files:
            raise ValueError(f"{path}: not a hookcap history file")
        header = json.loads(bytes(z["meta_json"]).decode())
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a hookcap history file")
        if header["version"] > VERSION:
            raise ValueError(f"{path}: format version {header['version']} is newer than this hookcap "
                             f"({VERSION}); upgrade hookcap")
        a = {k: z[k] for k in z.files if k != "meta_json"}
    recs = []
    mi = hi = oi = ci = 0
    for s, step in enumerate(a["steps"]):
        k, w, no = int(a["n_metrics"][s]), int(a["hist_width"][s]), int(a["n_order"][s])
        nc = int(a["n_calls"][s])
        recs.append(StepRecord(
            int(step), a["metrics"][mi:mi + k], a["rows"][mi:mi + k], int(a["hist_lo"][s]),
            a["hist"][hi:hi + k * w].reshape(k, w), a["order"][oi:oi + no], a["calls"][ci:ci + nc],
            a["calls_nonfinite"][ci:ci + nc].astype(bool),
            a["time_ns"][mi:mi + k] if "time_ns" in a else None))
        mi, hi, oi, ci = mi + k, hi + k * w, oi + no, ci + nc
    spec = header["histogram"]
    hist = None
    if spec is not None:
        hist = Histogram.log2(int(spec["lo"]), int(spec["hi"])) if spec["kind"] == "log2" else \
            Histogram.linear(spec["lo"], spec["hi"], spec["bins"])
    metas = {n: {**m, "shape": tuple(m["shape"])} for n, m in header["metas"].items()}
    return recs, header["names"], metas, hist, header.get("extra", {})
