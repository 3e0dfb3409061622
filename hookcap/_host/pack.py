"""Lossless compact encoding of one recorded step for the host store and the
history file: what a step costs to keep is what its numbers need, not 8
bytes per header value and per histogram bin.

- Header columns, each chosen per step: a constant; small integers as an
  offset from the column's minimum in 1, 2 or 4 bytes; doubles (and the
  ordered keys of min/max) as float32 when every value of the column is
  exactly a float32 (extrema of float32/bf16/fp16 tensors always are); the
  abs-max key left out when it equals max(-min, max) for every row; else raw.
- Histograms: per row the band from its first to its last non-empty bin, in
  the narrowest unsigned width that fits the step's counts; the log2 zero bin
  is left out when it equals the zeros count (it always does).
Decoding gives back the int64 rows bit for bit; ``pack`` checks each choice
on the values themselves, so an encoding never loses a bit."""

from __future__ import annotations

import numpy as np

from .. import _C, _layout

H = _layout.HEADER
_F64_LIST = [_layout.SUM, _layout.SUMSQ] + [c for cols in _layout.MOMENT_SETS for c in cols] + \
    [_layout.S3, _layout.S4]
_KEY_LIST = [_layout.MIN, _layout.MAX, _layout.ABSMAX]
_F64_SET, _KEY_SET = frozenset(_F64_LIST), frozenset(_KEY_LIST)
# Column flags of _C._rows_scan (csrc/host_pack.cpp ColFlag).
_C_BITS_F32, _C_KEY_F32, _C_ABSMAX_OF = 1, 2, 4

# Column codes.
CONST, U8, U16, U32, RAW, F32, KEY32, ABSMAX = range(8)
_UINT = {U8: np.uint8, U16: np.uint16, U32: np.uint32}
_ITEM = {CONST: 0, U8: 1, U16: 2, U32: 4, RAW: 8, F32: 4, KEY32: 4, ABSMAX: 0}
_U_OF_WIDTH = ((0xFF, U8), (0xFFFF, U16), (0xFFFFFFFF, U32))

_descs: dict[tuple, tuple] = {}  # interned descriptors: a steady run shares one


def _uint_code(span: int) -> int:
    for limit, code in _U_OF_WIDTH:
        if span <= limit:
            return code
    return RAW


def _absmax_key(min_keys: np.ndarray, max_keys: np.ndarray) -> np.ndarray:
    """The abs-max key as the kernels' absmax_of derives it: max(-min, max)."""
    mn, mx = _layout._unkey(min_keys), _layout._unkey(max_keys)
    return _layout.order_key(np.where(-mn > mx, -mn, mx))


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class PackedStep:
    """One recorded step, encoded. ``nbytes``: bytes of its own data (the
    metric, order and call index arrays are shared with the step before when
    equal; see HostStore). Decoding methods return fresh arrays."""

    __slots__ = ("step", "blob", "desc", "metrics", "order", "calls")

    def __init__(self, step, blob, desc, metrics, order, calls):
        self.step = step
        self.blob = blob  # np.uint8 [n]
        self.desc = desc  # (k, column codes, hist desc, n nonfinite bytes, has time)
        self.metrics, self.order, self.calls = metrics, order, calls

    @property
    def nbytes(self) -> int:
        return self.blob.nbytes

    def _sections(self):
        """Yield (name, dtype, count, byte offset) of each section of the blob."""
        k, codes, hist, n_bad, has_time = self.desc
        off = 0
        yield "consts", np.int64, H, off
        off += 8 * H
        for c, code in enumerate(codes):
            n = _ITEM[code] * k
            if n:
                yield c, None, k, off
                off = _pad8(off + n)
        if hist is not None:
            _, _, lo_code, n_counts, cnt_code = hist
            dt = _UINT[lo_code]
            yield "first", dt, k, off
            off = _pad8(off + k * dt().itemsize)
            yield "len", dt, k, off
            off = _pad8(off + k * dt().itemsize)
            dt = _UINT.get(cnt_code, np.int64)
            yield "counts", dt, n_counts, off
            off = _pad8(off + n_counts * dt().itemsize)
        if n_bad:
            yield "bad", np.uint8, n_bad, off
            off = _pad8(off + n_bad)
        if has_time:
            yield "time", np.float64, 2 * k, off

    def _view(self, dtype, count, off):
        return np.frombuffer(self.blob, dtype=dtype, count=count, offset=off)

    def header(self) -> np.ndarray:
        """int64 [k, HEADER], bit for bit the rows that were packed."""
        k, codes = self.desc[0], self.desc[1]
        out = np.empty((k, H), dtype=np.int64)
        consts = None
        for name, dt, count, off in self._sections():
            if name == "consts":
                consts = self._view(np.int64, H, off)
            elif isinstance(name, int):
                code = codes[name]
                if code == RAW:
                    out[:, name] = self._view(np.int64, count, off)
                elif code == F32:
                    out[:, name] = self._view(np.float32, count, off).astype(np.float64).view(np.int64)
                elif code == KEY32:
                    out[:, name] = _layout.order_key(self._view(np.float32, count, off).astype(np.float64))
                else:
                    out[:, name] = self._view(_UINT[code], count, off).astype(np.int64) + consts[name]
        for c, code in enumerate(codes):
            if code == CONST:
                out[:, c] = consts[c]
            elif code == ABSMAX:
                out[:, c] = _absmax_key(out[:, _layout.MIN], out[:, _layout.MAX])
        return out

    def column(self, c: int) -> np.ndarray:
        """int64 [k]: header column ``c`` alone (what ``header()[:, c]`` holds)."""
        k, codes = self.desc[0], self.desc[1]
        code = codes[c]
        if code == CONST:
            return np.full(k, self._view(np.int64, H, 0)[c], dtype=np.int64)
        if code == ABSMAX:
            return _absmax_key(self.column(_layout.MIN), self.column(_layout.MAX))
        for name, dt, count, off in self._sections():
            if name != c:
                continue
            if code == RAW:
                return self._view(np.int64, count, off).copy()
            if code == F32:
                return self._view(np.float32, count, off).astype(np.float64).view(np.int64)
            if code == KEY32:
                return _layout.order_key(self._view(np.float32, count, off).astype(np.float64))
            return self._view(_UINT[code], count, off).astype(np.int64) + self._view(np.int64, H, 0)[c]
        raise AssertionError(f"column {c}: no section")

    def metric_band(self, j: int) -> tuple[int, np.ndarray]:
        """(first bin, int64 counts) of row ``j``'s non-empty band of bins,
        decoding that row alone."""
        hist = self.desc[2]
        if hist is None:
            return 0, np.zeros(0, dtype=np.int64)
        sec = {name: (dt, count, off) for name, dt, count, off in self._sections() if isinstance(name, str)}
        first = self._view(*sec["first"])
        lens = self._view(*sec["len"])
        start = int(lens[:j].sum(dtype=np.int64))
        n = int(lens[j])
        dt, _, off = sec["counts"]
        counts = self._view(dt, n, off + start * np.dtype(dt).itemsize).astype(np.int64)
        lo = int(first[j]) if n else 0
        if hist[1]:  # zeros in bin 0, from the header's ZEROS column
            z = int(self.column(_layout.ZEROS)[j])
            if z:
                if n == 0:
                    return 0, np.array([z], dtype=np.int64)
                band = np.zeros(lo + n, dtype=np.int64)
                band[lo:] = counts
                band[0] = z
                return 0, band
        return lo, counts

    def histogram(self, header: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """(first bin, int64 [k, width]): the step's band of every non-empty bin."""
        hist = self.desc[2]
        k = self.desc[0]
        if hist is None:
            return 0, np.zeros((k, 0), dtype=np.int64)
        zero_from_zeros = hist[1]
        sec = {name: (dt, count, off) for name, dt, count, off in self._sections() if isinstance(name, str)}
        first = self._view(*sec["first"]).astype(np.int64)
        lens = self._view(*sec["len"]).astype(np.int64)
        counts = self._view(*sec["counts"])
        zeros = None
        if zero_from_zeros:
            zeros = (self.header() if header is None else header)[:, _layout.ZEROS]
        has = lens > 0
        lo = int(first[has].min()) if has.any() else 0
        hi = int((first + lens)[has].max()) if has.any() else 0
        if zeros is not None and zeros.any():
            lo, hi = 0, max(hi, 1)
        out = np.zeros((k, hi - lo), dtype=np.int64)
        if len(counts):
            starts = np.repeat(np.arange(k) * (hi - lo) + first - lo, lens)
            within = np.arange(len(counts)) - np.repeat(np.cumsum(lens) - lens, lens)
            out.reshape(-1)[starts + within] = counts
        if zeros is not None and zeros.any():
            out[:, 0] = zeros
        return lo, out

    def calls_nonfinite(self) -> np.ndarray:
        n_calls = len(self.calls)
        for name, dt, count, off in self._sections():
            if name == "bad":
                return np.unpackbits(self._view(dt, count, off), count=n_calls).astype(bool)
        return np.zeros(n_calls, dtype=bool)

    def time_ns(self) -> np.ndarray | None:
        for name, dt, count, off in self._sections():
            if name == "time":
                return self._view(dt, count, off).reshape(-1, 2).copy()
        return None

    def any_nonfinite(self) -> bool:
        """Whether any metric or call of the step saw NaN/Inf (decodes nothing
        when the NaN/Inf columns are constant, as in a healthy step)."""
        if self.desc[3]:
            return True
        codes = self.desc[1]
        consts = self._view(np.int64, H, 0)
        cols = (_layout.NAN, _layout.POSINF, _layout.NEGINF)
        if all(codes[c] == CONST for c in cols):
            return bool(any(consts[c] for c in cols))
        return bool(self.header()[:, list(cols)].any())


def pack(step: int, metrics, rows: np.ndarray, order, calls, calls_nonfinite, time_ns,
         zero_bin: bool, hist_args=None) -> PackedStep:
    """Encode raw rows [k, width] (header + histogram bins; C-contiguous or
    not) of one step. ``zero_bin``: the histogram's bin 0 counts zeros (log2),
    so it may be left out when it equals the zeros column. ``hist_args``: the
    rows are as the kernels wrote them with this histogram (its op arguments),
    so each band is found reading only the band; None: rows of any content."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows)
    k, width = rows.shape
    nb = width - H
    # One pass over the rows: the header transposed ([H, k], a contiguous
    # column each) and every row's histogram band.
    head = np.empty((H, k), dtype=np.int64)
    first, lens = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
    colstat = np.empty((H, 3), dtype=np.int64)  # per column: min, max, flags (_C_*)
    kind, lo, hi, bins = hist_args if hist_args is not None and nb else (-1, 0.0, 0.0, 0)
    zero_from_zeros, total, cmax_h, cmin_h, _ = _C._rows_scan(rows, zero_bin, kind, float(lo), float(hi),
                                                              bins, head, first, lens, colstat)
    parts: list[tuple[int, np.ndarray]] = []  # (offset, array) to copy into the blob
    codes = [CONST] * H
    data: dict[int, np.ndarray] = {}
    if k:
        consts = colstat[:, 0].copy()
        for c, (cmin, cmax, flags) in enumerate(colstat.tolist()):
            if cmin == cmax:
                continue
            if c in _F64_SET:  # doubles: float32 where every value is exactly one
                codes[c], data[c] = ((F32, head[c].view(np.float64).astype(np.float32))
                                     if flags & _C_BITS_F32 else (RAW, head[c]))
            elif c in _KEY_SET:  # order keys of min/max/abs-max
                if c == _layout.ABSMAX and flags & _C_ABSMAX_OF:
                    codes[c] = ABSMAX  # rebuilt from min and max
                elif flags & _C_KEY_F32:
                    codes[c], data[c] = KEY32, _layout._unkey(head[c]).astype(np.float32)
                else:
                    codes[c], data[c] = RAW, head[c]
            else:
                code = _uint_code(cmax - cmin)  # Python ints: no wrap
                codes[c], data[c] = (RAW, head[c]) if code == RAW else (code, (head[c] - cmin).astype(_UINT[code]))
    else:
        consts = np.zeros(H, dtype=np.int64)
    off = 8 * H
    for c in range(H):
        if c in data:
            parts.append((off, data[c]))
            off = _pad8(off + data[c].nbytes)
    hist_desc = None
    if nb:
        cnt_code = _uint_code(cmax_h) if cmin_h >= 0 else RAW
        counts = np.empty(total, dtype=_UINT.get(cnt_code, np.int64))
        _C._hist_gather(rows, H, first, lens, counts)
        lo_code = U8 if nb <= 0xFF else (U16 if nb <= 0xFFFF else U32)
        for a in (first.astype(_UINT[lo_code]), lens.astype(_UINT[lo_code]), counts):
            parts.append((off, a))
            off = _pad8(off + a.nbytes)
        hist_desc = (nb, zero_from_zeros, lo_code, len(counts), cnt_code)
    bad = np.asarray(calls_nonfinite, dtype=bool)
    n_bad = 0
    if bad.any():
        packed_bad = np.packbits(bad)
        n_bad = len(packed_bad)
        parts.append((off, packed_bad))
        off = _pad8(off + n_bad)
    if time_ns is not None:
        t = np.ascontiguousarray(time_ns, dtype=np.float64)
        parts.append((off, t))
        off += t.nbytes
    blob = np.empty(off, dtype=np.uint8)
    blob[: 8 * H] = np.ascontiguousarray(consts, dtype=np.int64).view(np.uint8)
    for o, a in parts:
        blob[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    desc = (k, tuple(codes), hist_desc, n_bad, time_ns is not None)
    desc = _descs.setdefault(desc, desc)
    return PackedStep(int(step), blob, desc, np.asarray(metrics, dtype=np.int64),
                      np.asarray(order, dtype=np.int64), np.asarray(calls, dtype=np.int64))
