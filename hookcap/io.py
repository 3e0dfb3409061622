"""The history file codec: step records, metric names and metadata, the
histogram spec and a JSON ``extra`` header in one self-describing, versioned
``.npz`` file (arrays + a JSON header). Building a History from them is
``hookcap.history``'s job."""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
from numpy.lib import format as npformat

from . import _layout
from ._host.pack import PackedStep
from ._host.record import StepRecord, pack_record
from .histogram import Histogram

FORMAT = "hookcap-history"
VERSION = 2  # 1: int64 rows and bands (still read)


def write(records, names: list[str], metas: dict, histogram: Histogram | None,
          path: str | os.PathLike, extra: dict | None = None) -> str:
    """Write ``records`` (StepRecords or PackedSteps whose metric indices refer
    to ``names``) to ``path`` (``.npz`` is appended if missing; missing parent
    folders are created). ``metas``: name ->
    ``{"module_type", "kind", "shape", "dtype"}``; ``extra``
    (JSON-serialisable) is stored in the header. Returns the path written.

    The steps are written in their compact encoding (``hookcap._host.pack``),
    streamed one after another into an uncompressed ``.npz``: no copy of the
    whole history is made, and the file is about the size of the host store.
    The file appears complete or not at all (written to a temporary name)."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    steps = [r if isinstance(r, PackedStep) else pack_record(r) for r in records]
    descs: dict[tuple, int] = {}
    desc_id = np.array([descs.setdefault(p.desc, len(descs)) for p in steps], dtype=np.int64)
    pats: dict[int, int] = {}  # id(array) -> pattern index: the store shares equal arrays
    pat_arrays: list[np.ndarray] = []
    pat = np.empty((len(steps), 3), dtype=np.int64)
    for s, p in enumerate(steps):
        for j, a in enumerate((p.metrics, p.order, p.calls)):
            i = pats.get(id(a))
            if i is None and pat_arrays and np.array_equal(pat_arrays[-1], a):
                i = len(pat_arrays) - 1
            if i is None:
                i = pats[id(a)] = len(pat_arrays)
                pat_arrays.append(a)
            pat[s, j] = i
    header = {
        "format": FORMAT,
        "version": VERSION,
        "layout_header": _layout.HEADER,
        "names": list(names),
        "metas": {n: {**metas[n], "shape": list(metas[n]["shape"])} for n in names},
        "histogram": None if histogram is None else histogram.to_dict(),
        "extra": extra or {},
        "descs": [[d[0], list(d[1]), None if d[2] is None else list(d[2]), d[3], d[4]] for d in descs],
    }
    small = {
        "steps": np.array([p.step for p in steps], dtype=np.int64),
        "desc_id": desc_id,
        "blob_len": np.array([p.blob.nbytes for p in steps], dtype=np.int64),
        "pat": pat,
        "pat_len": np.array([len(a) for a in pat_arrays], dtype=np.int64),
    }
    tmp = path + ".tmp.npz"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        _entry(zf, "meta_json", np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
        for name, a in small.items():
            _entry(zf, name, a)
        _entry(zf, "pat_data", pat_arrays, np.int64, (int(small["pat_len"].sum()),))
        _entry(zf, "blob", [p.blob for p in steps], np.uint8, (int(small["blob_len"].sum()),))
    os.replace(tmp, path)
    return path


def _entry(zf: zipfile.ZipFile, name: str, parts, dtype=None, shape=None) -> None:
    """One ``.npy`` member of the ``.npz``, written part by part (no concatenation)."""
    if isinstance(parts, np.ndarray):
        dtype, shape, parts = parts.dtype, parts.shape, [parts]
    with zf.open(name + ".npy", "w", force_zip64=True) as f:
        npformat.write_array_header_2_0(f, {"descr": npformat.dtype_to_descr(np.dtype(dtype)),
                                            "fortran_order": False, "shape": tuple(shape)})
        for a in parts:
            f.write(np.ascontiguousarray(a, dtype=dtype).data)


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
    old_h = int(header.get("layout_header", 16))  # every file before the key had 16
    if old_h > _layout.HEADER:
        raise ValueError(f"{path}: row layout of {old_h} header columns is newer than this hookcap; upgrade hookcap")
    if header["version"] >= 2:
        recs = _read_packed(header, a, old_h)
    else:
        recs = _read_v1(a, old_h)
    spec = header["histogram"]
    hist = Histogram.from_dict(spec)
    metas = {n: {**m, "shape": tuple(m["shape"])} for n, m in header["metas"].items()}
    return recs, header["names"], metas, hist, header.get("extra", {})


def _read_packed(header: dict, a: dict, old_h: int) -> list[StepRecord]:
    descs = [(d[0], tuple(d[1]), None if d[2] is None else (d[2][0], bool(d[2][1]), *d[2][2:]), d[3],
              bool(d[4])) for d in header["descs"]]
    fresh = None
    if old_h < _layout.HEADER:  # an older layout (before the wide float64 buckets): its blobs
        fresh = _layout.fresh_header()[old_h:].view(np.uint8)  # gain the columns as a reset row holds them
        descs = [(d[0], d[1] + (0,) * (_layout.HEADER - old_h), *d[2:]) for d in descs]  # 0: CONST
    ends = np.cumsum(a["pat_len"])
    pats = [a["pat_data"][e - n:e] for e, n in zip(ends, a["pat_len"])]
    recs, off = [], 0
    for s, step in enumerate(a["steps"]):
        n = int(a["blob_len"][s])
        m, o, c = (pats[i] for i in a["pat"][s])
        blob = a["blob"][off:off + n]
        if fresh is not None:  # sections after the constants keep their 8-byte alignment
            blob = np.concatenate([blob[:8 * old_h], fresh, blob[8 * old_h:]])
        p = PackedStep(int(step), blob, descs[int(a["desc_id"][s])], m, o, c)
        recs.append(StepRecord.from_packed(p))
        off += n
    return recs


def _read_v1(a: dict, old_h: int) -> list[StepRecord]:
    if old_h < _layout.HEADER:
        rows = a["rows"]
        fresh = np.broadcast_to(_layout.fresh_header()[old_h:], (len(rows), _layout.HEADER - old_h))
        a = {**a, "rows": np.concatenate([rows, fresh], axis=1)}
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
    return recs
