"""Parquet sink: the full history as a dataset directory of complete part
files, readable by pandas, polars and DuckDB; and its reader for
``hookcap.load``."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from .._layout import MOMENT_NAMES, STAT_NAMES, TIMING_NAMES
from ..drained import DrainedStep
from ..histogram import Histogram
from ._base import COUNT_STATS, Sink, rank_path

FORMAT = "hookcap-parquet"
VERSION = 1
PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
# Written first under a dot-name (skipped by pyarrow datasets and by ``*.parquet``
# globs), then renamed: a reader never sees half a part file.
TMP_PREFIX = ".tmp-"
# A part's list offsets are int32: a group whose histogram values near that
# many is written early (only with very wide linear histograms).
MAX_HIST_VALUES = 1 << 30


def _import_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("hookcap.sinks.Parquet needs the pyarrow package: pip install pyarrow  "
                          "(or pip install 'hookcap[parquet]')") from e
    return pa, pq


def module_of(metric: str, kind: str) -> str:
    """The module part of a metric name built by ``hookcap._rows.config.metric_name``
    (``f"{module}/{kind}"``, or ``f"{module}/{kind}.{path}"`` for a tensor
    inside a nested value): everything before the first ``/{kind}`` that ends
    the name or is followed by ``.``. ``eval/`` metrics keep the prefix
    (``eval/fc/output`` -> ``eval/fc``)."""
    tail = "/" + kind
    i = metric.find(tail)
    while i >= 0:
        j = i + len(tail)
        if j == len(metric) or metric[j] == ".":
            return metric[:i]
        i = metric.find(tail, i + 1)
    return metric


def part_files(path: str) -> list[tuple[int, str]]:
    """``(seq, file)`` of every ``part-{seq:06d}.parquet`` in directory
    ``path``, by ``seq`` (empty when ``path`` does not exist)."""
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(path, e)) for e in entries if (m := PART_RE.match(e))]
    return sorted(found)


def _check_dir(path: str, append: bool) -> list[tuple[int, str]]:
    """The parts already in ``path``; refuses a file, and existing parts
    unless ``append``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"Parquet: {path!r} exists and is not a directory; the sink writes a "
                              "dataset directory of part files (e.g. 'run.parquet/')")
    parts = part_files(path)
    if parts and not append:
        raise FileExistsError(
            f"Parquet: {path!r} already holds {len(parts)} part file(s) (another run?); nothing is "
            "deleted: choose a new path, remove them, or pass append=True to add parts after them")
    return parts


class Parquet(Sink):
    """``hookcap.sinks.Parquet(path, every=1, stats=None, histogram=True, row_group_steps=64, append=False,
    quantiles=None)``

    The full history of a run on disk (the Monitor's in-memory history keeps
    only the newest ``capacity`` steps): use it for long runs. Needs pyarrow
    (``pip install 'hookcap[parquet]'``).

    **Layout**: ``path`` is a dataset *directory* (e.g. ``run.parquet/``,
    created with its parents at the first write). Every ``row_group_steps``
    written steps become one complete file ``part-{seq:06d}.parquet`` (one row
    group), written under a temporary dot-name, fsynced and renamed, so the
    directory only ever holds whole files: a crash or SIGKILL loses at most the
    steps of the open group (fewer than ``row_group_steps``). ``flush()`` and
    ``close()`` write the open group (a shorter part); a later write goes on
    with the next part. Keep other files out of the directory.

    An existing directory with part files is refused (``FileExistsError``,
    nothing is deleted) unless ``append=True``, which numbers new parts after
    the highest one.

    **Schema** (version 1), one row per (step, metric), the rows of a step in
    execution order (``DrainedStep.names``): ``step`` int64; ``rank`` int32
    (the rank of per-rank records, null for merged and single-process ones);
    ``name``, ``module``, ``kind`` strings (dictionary-encoded in the file;
    ``module`` is the metric name without its ``/kind`` suffix, see
    :func:`module_of`); one column per stat of ``stats`` (count stats
    ``count nan posinf neginf inf zeros finite`` int64, the others float64 in
    their units: ``fwd_ms``/``bwd_ms`` milliseconds; NaN kept); with
    ``histogram=True`` and a Monitor recording histograms, ``hist_offset``
    int32 and ``hist`` list<int64>: the counts of bins ``hist_offset`` …
    ``hist_offset + len(hist) - 1`` (first to last non-empty bin; every other
    bin is 0; an empty list and offset 0 when all are). Key-value metadata of
    every part: ``hookcap.format`` = ``"hookcap-parquet"``, ``hookcap.version``
    = ``"1"``, ``hookcap.histogram`` (JSON ``{"kind", "lo", "hi"[, "bins"]}``
    or ``null``), ``hookcap.metas`` (JSON ``{name: {"module_type", "kind",
    "shape", "dtype"}}`` of the part's metrics, in the Monitor's metric order).

    **Multiple ranks**: per-rank records (``Monitor(rank_sinks="all")``) go to
    :func:`rank_path` of ``path``: ``{rank}`` replaced, else ``.rank{r}``
    before the extension (``run.parquet`` -> ``run.rank1.parquet``).

    Read it back with ``hookcap.load(path)``, ``python -m hookcap report
    path``, ``pd.read_parquet(path)``, ``pl.read_parquet(f"{path}/*.parquet")``
    or DuckDB's ``read_parquet('{path}/*.parquet')``.
    """

    def __init__(self, path, every: int = 1, stats=None, histogram: bool = True, row_group_steps: int = 64,
                 append: bool = False, quantiles=None):
        super().__init__(stats, every, quantiles)
        if isinstance(row_group_steps, bool) or not isinstance(row_group_steps, int) or row_group_steps < 1:
            raise ValueError(f"row_group_steps: must be an int >= 1 (steps per part file), got {row_group_steps!r}")
        self._pa, self._pq = _import_pyarrow()
        p = os.fspath(path)
        self.path_template = p.rstrip("/" + os.sep) or p  # "run.parquet/" -> rank paths work
        self.path = self.path_template
        self.histogram = bool(histogram)
        self.row_group_steps = row_group_steps
        self.append = bool(append)
        if "{rank}" not in self.path:  # refuse a used directory now, not at the first write
            _check_dir(self.path, self.append)
        self._seq: int | None = None  # next part number, known once the directory is open
        # Per-name caches (names, their module and kind), filled once per new name.
        self._names: list[str] = []
        self._code: dict[str, int] = {}
        self._modules, self._mod_code, self._mod_of = [], {}, []
        self._kinds, self._kind_code, self._kind_of = [], {}, []
        self._meta_json: list[str] = []
        self._last_names: list[str] | None = None
        self._last_codes = np.empty(0, dtype=np.int32)
        self._metas: dict = {}
        self._reset()

    def _reset(self) -> None:
        self._steps: list[tuple[int, int | None, int]] = []  # (step, rank, metrics)
        self._codes: list[np.ndarray] = []
        self._cols: dict[str, list[np.ndarray]] = {s: [] for s in self.column_names()}
        self._hoff: list[np.ndarray] = []
        self._hlen: list[np.ndarray] = []
        self._hval: list[np.ndarray] = []
        self._nhist = 0
        self._spec: Histogram | None = None

    def bind_rank(self, rank: int | None) -> None:
        super().bind_rank(rank)
        self.path = rank_path(self.path_template, rank)

    def add_moments(self) -> None:
        super().add_moments()
        if not self._steps:  # nothing buffered yet: the columns follow the stats
            self._reset()

    # -- per step: numpy only, no loop over metrics ------------------------------
    def write(self, step: DrainedStep) -> None:
        if self._seq is None:
            self._open()
        spec = step.histogram_spec if self.histogram else None
        if self._steps and spec != self._spec:
            self._write_group()  # a part holds one histogram spec
        self._spec = spec
        names = step.names
        if names != self._last_names:  # list == list runs in C; the set rarely changes
            self._last_codes = np.fromiter((self._code_of(n, step.metas) for n in names), np.int32, len(names))
            self._last_names = list(names)
        self._metas = step.metas
        self._steps.append((int(step.step), getattr(step, "rank", None), len(names)))
        self._codes.append(self._last_codes)
        for s, v in self.columns(step):
            self._cols[s].append(v)
        if spec is not None:
            self._add_histograms(step)
        if len(self._steps) >= self.row_group_steps or self._nhist >= MAX_HIST_VALUES:
            self._write_group()

    def _add_histograms(self, step: DrainedStep) -> None:
        """Each metric's band from its first to its last non-zero bin, from the
        step's shared band, vectorised over metrics."""
        off, counts = step.histogram_band()
        m, w = counts.shape
        if m == 0 or w == 0:
            self._hoff.append(np.zeros(m, dtype=np.int32))
            self._hlen.append(np.zeros(m, dtype=np.int64))
            return
        nz = counts != 0
        first = nz.argmax(axis=1)  # 0 for a row of zeros: told apart by `has`
        has = nz[np.arange(m), first]
        last = w - 1 - nz[:, ::-1].argmax(axis=1)
        lens = np.where(has, last - first + 1, 0)
        self._hoff.append(np.where(has, first + off, 0).astype(np.int32))
        self._hlen.append(lens)
        # Gather each row's band from the flat counts: bands are a few bins
        # of the step's shared band, so indices beat a [m, w] mask.
        ends = np.cumsum(lens)
        idx = np.repeat(np.arange(m) * w + first - (ends - lens), lens) + np.arange(int(ends[-1]))
        vals = counts.reshape(-1)[idx]
        self._hval.append(vals)
        self._nhist += vals.size

    def _code_of(self, name: str, metas: dict) -> int:
        c = self._code.get(name)
        if c is None:
            meta = metas.get(name) or {}
            kind = str(meta.get("kind", ""))
            module = module_of(name, kind) if kind else name
            c = self._code[name] = len(self._names)
            self._names.append(name)
            self._mod_of.append(self._mod_code.setdefault(module, len(self._mod_code)))
            if len(self._mod_code) > len(self._modules):
                self._modules.append(module)
            self._kind_of.append(self._kind_code.setdefault(kind, len(self._kind_code)))
            if len(self._kind_code) > len(self._kinds):
                self._kinds.append(kind)
            self._meta_json.append(json.dumps(name) + ": " + json.dumps(
                {**meta, "shape": list(meta.get("shape", ()))}))
        return c

    # -- per group --------------------------------------------------------------
    def _open(self) -> None:
        parts = _check_dir(self.path, self.append)
        os.makedirs(self.path, exist_ok=True)
        for e in os.listdir(self.path):  # temporary files of a writer that was killed
            if e.startswith(TMP_PREFIX + "part-"):
                try:
                    os.remove(os.path.join(self.path, e))
                except OSError:
                    pass
        self._seq = parts[-1][0] + 1 if parts else 0

    def _dict_column(self, codes: np.ndarray, values: list[str]):
        """A dictionary array of ``values[codes]`` holding only the used values
        (O(rows): a presence mask, not a sort)."""
        pa = self._pa
        present = np.zeros(len(values), dtype=bool)
        present[codes] = True
        remap = (np.cumsum(present) - 1).astype(np.int32)
        return pa.DictionaryArray.from_arrays(pa.array(remap[codes]), pa.array(
            [values[i] for i in np.flatnonzero(present)], type=pa.string()))

    def _table(self):
        pa = self._pa
        n_rows = np.array([n for _, _, n in self._steps], dtype=np.int64)
        codes = np.concatenate(self._codes) if self._codes else np.empty(0, dtype=np.int32)
        ranks = [r for _, r, _ in self._steps]
        if all(r is None for r in ranks):
            rank = pa.nulls(len(codes), pa.int32())
        else:
            rank = pa.array(np.repeat([-1 if r is None else int(r) for r in ranks], n_rows).astype(np.int32),
                            mask=np.repeat([r is None for r in ranks], n_rows))
        cols = {
            "step": pa.array(np.repeat([s for s, _, _ in self._steps], n_rows).astype(np.int64)),
            "rank": rank,
            "name": self._dict_column(codes, self._names),
            "module": self._dict_column(np.asarray(self._mod_of, dtype=np.int64)[codes], self._modules),
            "kind": self._dict_column(np.asarray(self._kind_of, dtype=np.int64)[codes], self._kinds),
        }
        for s in self.column_names():
            v = np.concatenate(self._cols[s]) if self._cols[s] else np.empty(0)
            if s in COUNT_STATS:
                ok = np.isfinite(v)  # always, for records of a Monitor
                cols[s] = pa.array(np.where(ok, v, 0).astype(np.int64), mask=None if ok.all() else ~ok)
            else:
                cols[s] = pa.array(v, type=pa.float64())
        if self._spec is not None:
            lens = np.concatenate(self._hlen) if self._hlen else np.empty(0, dtype=np.int64)
            offsets = np.zeros(len(lens) + 1, dtype=np.int32)
            np.cumsum(lens, out=offsets[1:])
            vals = np.concatenate(self._hval) if self._hval else np.empty(0, dtype=np.int64)
            cols["hist_offset"] = pa.array(np.concatenate(self._hoff) if self._hoff else np.empty(0, np.int32))
            cols["hist"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals.astype(np.int64, copy=False)))
        present = np.zeros(len(self._names), dtype=bool)
        present[codes] = True
        return pa.table(cols), np.flatnonzero(present)

    def _write_group(self) -> None:
        if not self._steps:
            return
        table, used = self._table()
        used_set = set(used.tolist())
        # The Monitor's metric order (its metas dict), so hookcap.load restores History.names.
        order = [self._code[n] for n in self._metas if n in self._code and self._code[n] in used_set]
        order += sorted(used_set.difference(order))
        spec = None if self._spec is None else self._spec.to_dict()
        meta = {
            "hookcap.format": FORMAT,
            "hookcap.version": str(VERSION),
            "hookcap.histogram": json.dumps(spec),
            "hookcap.metas": "{" + ", ".join(self._meta_json[c] for c in order) + "}",
        }
        name = f"part-{self._seq:06d}.parquet"
        final, tmp = os.path.join(self.path, name), os.path.join(self.path, TMP_PREFIX + name)
        if os.path.exists(final):  # never overwrite: another writer uses this directory
            raise FileExistsError(f"Parquet: {final!r} appeared while this sink was writing {self.path!r}; "
                                  "is another sink or process writing there? Give each its own path")
        try:
            with open(tmp, "wb") as f:
                # store_schema=False: readers get plain string columns (not
                # categoricals); Parquet still dictionary-encodes them. Only
                # them: float stats are nearly all distinct, and trying a
                # dictionary for them doubles the encode time.
                with self._pq.ParquetWriter(f, table.schema, store_schema=False,
                                            use_dictionary=["name", "module", "kind"]) as w:
                    w.write_table(table, row_group_size=max(table.num_rows, 1))
                    w.add_key_value_metadata(meta)
                f.flush()
                os.fsync(f.fileno())  # the rename must not expose an empty file after a power loss
            os.replace(tmp, final)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        self._seq += 1
        self._reset()

    def flush(self) -> None:
        """Write the open group now (a part shorter than ``row_group_steps``)."""
        self._write_group()

    def close(self) -> None:
        self._write_group()

    def __repr__(self) -> str:
        return f"Parquet({self.path!r})"


def read_dataset(path) -> dict:
    """Read a dataset directory written by :class:`Parquet` (or one part file)
    into the arguments of ``History._from_columns``: ``steps`` int64 [S] (one
    entry per step written: a step number written twice, by an appended
    resumed run, appears twice), ``names`` [M] (the Monitor's metric order),
    ``metas``, ``histogram`` (spec or None), ``stats`` {stat: float64 [S, M],
    NaN where not written}, ``recorded`` bool [S, M], ``orders`` (int64 metric
    indices per step, execution order), ``hist`` (None, or ``(offset, length,
    start, values)``: int64 [S, M] arrays locating each cell's band in the flat
    int64 ``values``)."""
    pa, pq = _import_pyarrow()
    path = os.fspath(path)
    files = [path] if os.path.isfile(path) else [f for _, f in part_files(path)]
    if not files:
        what = "does not exist" if not os.path.exists(path) else "holds no part-*.parquet file"
        raise FileNotFoundError(f"{path}: {what} (a hookcap Parquet dataset directory)")
    tables, metas, spec_json = [], {}, None
    for f in files:
        pf = pq.ParquetFile(f)
        kv = {k.decode(): v.decode() for k, v in (pf.metadata.metadata or {}).items()}
        if kv.get("hookcap.format") != FORMAT:
            raise ValueError(f"{f}: not a hookcap Parquet file (no hookcap.format={FORMAT!r} metadata)")
        if int(kv["hookcap.version"]) > VERSION:
            raise ValueError(f"{f}: format version {kv['hookcap.version']} is newer than this hookcap "
                             f"({VERSION}); upgrade hookcap")
        if spec_json is None or spec_json == "null":
            spec_json = kv["hookcap.histogram"]
        elif kv["hookcap.histogram"] not in ("null", spec_json):
            raise ValueError(f"{f}: histogram spec {kv['hookcap.histogram']} differs from the other parts' "
                             f"{spec_json}")
        for n, m in json.loads(kv["hookcap.metas"]).items():
            metas.setdefault(n, {**m, "shape": tuple(m["shape"])})
        tables.append(pf.read())
    t = pa.concat_tables(tables, promote_options="default")
    spec = Histogram.from_dict(json.loads(spec_json))
    col = lambda c: t[c].to_numpy(zero_copy_only=False)  # noqa: E731
    names = list(metas)
    name_col = t["name"].combine_chunks()
    if isinstance(name_col.type, pa.DictionaryType):
        name_col = name_col.cast(pa.string())
    enc = name_col.dictionary_encode()
    for n in enc.dictionary.to_pylist():
        if n not in metas:  # a part without metas for it: keep it, metadata unknown
            metas[n] = {}
            names.append(n)
    index = {n: i for i, n in enumerate(names)}
    m_of = np.array([index[n] for n in enc.dictionary.to_pylist()], dtype=np.int64)
    mcol = m_of[enc.indices.to_numpy(zero_copy_only=False)] if len(t) else np.empty(0, dtype=np.int64)
    step = col("step").astype(np.int64)
    rank = t["rank"].fill_null(-1).to_numpy(zero_copy_only=False) if "rank" in t.column_names \
        else np.zeros(len(t), dtype=np.int64)
    part = np.repeat(np.arange(len(tables)), [len(x) for x in tables])
    # A step is a run of rows with one (part, step, rank): groups hold whole steps.
    new = np.r_[True, (step[1:] != step[:-1]) | (rank[1:] != rank[:-1]) | (part[1:] != part[:-1])] \
        if len(t) else np.empty(0, dtype=bool)
    block = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    S, M = len(starts), len(names)
    recorded = np.zeros((S, M), dtype=bool)
    recorded[block, mcol] = True
    stats = {}
    for s in STAT_NAMES + MOMENT_NAMES + TIMING_NAMES:
        if s in t.column_names:
            a = np.full((S, M), np.nan)
            a[block, mcol] = np.asarray(col(s), dtype=np.float64)
            stats[s] = a
    hist = None
    if spec is not None and "hist" in t.column_names:
        h = t["hist"].combine_chunks()
        lens = np.asarray(h.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
        offset, length, start = (np.zeros((S, M), dtype=np.int64) for _ in range(3))
        offset[block, mcol] = t["hist_offset"].fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        length[block, mcol] = lens
        start[block, mcol] = np.cumsum(lens) - lens
        values = np.asarray(h.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        hist = (offset, length, start, values)
    orders = np.split(mcol, starts[1:]) if S else []
    return dict(steps=step[starts], names=names, metas=metas, histogram=spec, stats=stats,
                recorded=recorded, orders=orders, hist=hist)
