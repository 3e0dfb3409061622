// Host-side helpers of the compact step encoding (hookcap/_pack.py): the
// header columns and per-row histogram band (first and last non-empty bin),
// the band's gather into a narrow integer array, and the reset of CPU rows
// once read. One pass over the rows in C++ instead of several whole-matrix
// numpy passes: this runs in every recorded step() on the training thread,
// over thousands of rows.
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <exception>

#include "hookcap/op_checks.h"
#include "hookcap/stats_math.h"

namespace hookcap {
namespace {

// A borrowed buffer, released on scope exit.
struct Buffer {
  Py_buffer view{};
  bool ok = false;
  Buffer(PyObject* obj, bool writable, Py_ssize_t itemsize, const char* what) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view, flags) < 0) return;
    ok = true;
    if (itemsize && view.itemsize != itemsize) {
      PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items, got %zd", what, itemsize,
                   view.itemsize);
      release();
    }
  }
  void release() {
    if (ok) PyBuffer_Release(&view);
    ok = false;
  }
  ~Buffer() { release(); }
  Py_ssize_t n() const { return view.len / view.itemsize; }
};

// Band [a, b] of one row's bins h[lo_bin, nb) by a full scan; false if empty.
bool band_full(const int64_t* h, int64_t lo_bin, int64_t nb, int64_t& a, int64_t& b) {
  a = lo_bin;
  while (a < nb && h[a] == 0) ++a;
  if (a >= nb) return false;
  b = nb - 1;
  while (h[b] == 0) --b;
  return true;
}

// The same band, reading only the band's bins, for rows the kernels wrote:
// each binned element is in exactly one bin, so the bins from lo_bin sum to
// `expect`, and none lies above `start` (the bin of the largest magnitude).
// The scan runs down from `start` and stops once the sum is reached. Returns
// 0 (empty), 1 (band found) or -1 (the row breaks that rule: scan it whole).
int band_bounded(const int64_t* h, int64_t lo_bin, int64_t start, int64_t expect, int64_t& a,
                 int64_t& b) {
  if (expect == 0) return 0;
  int64_t i = start;
  while (i >= lo_bin && h[i] == 0) --i;
  if (i < lo_bin || expect < 0) return -1;
  b = i;
  int64_t sum = 0;
  for (; i >= lo_bin; --i) {
    if (h[i] < 0) return -1;
    sum += h[i];
    if (sum >= expect) break;
  }
  if (sum != expect) return -1;
  a = i;
  return 1;
}

// Elements a kernel row has binned: all but NaN and +-Inf.
int64_t binned_count(const int64_t* row) {
  return row[kCount] - row[kNan] - row[kPosInf] - row[kNegInf];
}

// The HistSpec of histogram op arguments args[0..3] (kind, lo, hi, bins) for
// rows `width` wide; false with a Python ValueError set when they do not fit.
bool hist_spec_of(PyObject* const* args, int64_t width, const char* who, HistSpec& spec) {
  const long long kind = PyLong_AsLongLong(args[0]);
  const double lo = PyFloat_AsDouble(args[1]), hi = PyFloat_AsDouble(args[2]);
  const long long bins = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return false;
  try {
    spec = make_hist_spec(kind, lo, hi, bins, width);
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ValueError, "%s: %s", who, e.what());
    return false;
  }
  return true;
}

// The highest bin a kernel row can have filled (see band_bounded): the bin of
// its abs-max (log2) or max (linear, signed log2); the last bin when that is
// not finite.
int64_t top_bin(const int64_t* row, const HistSpec& h, int64_t nb) {
  int64_t bin = -1;
  if (h.kind == kHistLog2) {
    bin = hist_bin(key_value(row[h.sign ? kMax : kAbsMax]), h);
  } else if (h.kind == kHistLinear) {
    bin = linear_bin(key_value(row[kMax]), h);
  }
  return bin < 0 || bin >= nb ? nb - 1 : bin;
}

struct ScanResult {
  int64_t total = 0, mx = 0, mn = 0;
  bool zeros_match = true;  // every row's bin 0 equals its zeros count
  int64_t whole = 0;  // kernel rows that broke band_bounded's rule (scanned whole)
};

// Flags of a header column over all rows (_rows_scan's colstat).
enum ColFlag : int64_t {
  kBitsF32 = 1,    // (doubles) each value, as double bits, is exactly a float32
  kKeyF32 = 2,     // (order keys) each value's double is exactly a float32
  kAbsMaxOf = 4,   // (abs-max column) each equals the key of absmax_of(min, max)
};

C10_ALWAYS_INLINE bool f32_exact(double v) {
  return dbits(static_cast<double>(static_cast<float>(v))) == dbits(v);
}

// Per-column min, max and ColFlag of the transposed header hd [kHeader, k]
// (the float32 flags only where _pack.py reads them: doubles, order keys).
void column_stats(const int64_t* hd, int64_t k, int64_t* colstat) {
  for (int64_t c = 0; c < kHeader; ++c) {
    const int64_t* col = hd + c * k;
    int64_t mn = INT64_MAX, mx = INT64_MIN;
    for (int64_t r = 0; r < k; ++r) {
      mn = col[r] < mn ? col[r] : mn;
      mx = col[r] > mx ? col[r] : mx;
    }
    const bool is_key = c == kMin || c == kMax || c == kAbsMax;
    const bool is_double = c == kShift || c == kS1 || c == kS2 || c == kSum || c == kSumSq ||
                           c == kBigShift || c == kBigS1 || c == kBigS2 || c == kSmallShift ||
                           c == kSmallS1 || c == kSmallS2 || c == kS3 || c == kS4;
    bool exact = mn != mx && (is_key || is_double);
    for (int64_t r = 0; r < k && exact; ++r) {
      exact = f32_exact(is_key ? key_value(col[r]) : bitsd(col[r]));
    }
    colstat[c * 3] = mn;
    colstat[c * 3 + 1] = mx;
    colstat[c * 3 + 2] = exact ? (is_key ? kKeyF32 : kBitsF32) : 0;
  }
  const int64_t *mins = hd + kMin * k, *maxs = hd + kMax * k, *amax = hd + kAbsMax * k;
  bool of = true;
  for (int64_t r = 0; r < k && of; ++r) {
    const double mn = key_value(mins[r]), mx = key_value(maxs[r]);
    of = order_key(-mn > mx ? -mn : mx) == amax[r];
  }
  if (of) colstat[kAbsMax * 3 + 2] |= kAbsMaxOf;
}

constexpr int64_t kAhead = 8;       // rows whose header is prefetched ahead
constexpr int64_t kBandAhead = 4;   // rows whose band top is prefetched ahead

// The loop of _rows_scan (see there).
ScanResult scan_rows(const int64_t* base, int64_t k, int64_t width, bool skip0, bool bounded,
                     const HistSpec& spec, int64_t* hd, int64_t* f, int64_t* l) {
  ScanResult res;
  const int64_t nb = width - kHeader;
  const int64_t lo_bin = skip0 ? 1 : 0;
  // top_bin of rows r .. r + kBandAhead - 1, at index (row % kBandAhead).
  int64_t tops[kBandAhead] = {};
  if (bounded) {
    for (int64_t r = 0; r < k && r < kBandAhead; ++r) tops[r] = top_bin(base + r * width, spec, nb);
  }
  bool any = false;
  for (int64_t r = 0; r < k; ++r) {
    const int64_t* row = base + r * width;
    // Rows come from a ring slot that is mostly out of cache: fetch headers
    // ahead, and the top of the band of a row whose header has arrived.
    if (r + kAhead < k) {
      __builtin_prefetch(row + kAhead * width);
      __builtin_prefetch(row + kAhead * width + 8);
    }
    const int64_t top = tops[r % kBandAhead];
    if (bounded && r + kBandAhead < k) {
      const int64_t* next = row + kBandAhead * width;
      const int64_t next_top = top_bin(next, spec, nb);
      tops[r % kBandAhead] = next_top;
      __builtin_prefetch(next + kHeader + next_top);
      if (next_top >= 8) __builtin_prefetch(next + kHeader + next_top - 8);
    }
    for (int64_t c = 0; c < kHeader; ++c) hd[c * k + r] = row[c];
    f[r] = l[r] = 0;
    if (nb <= 0) continue;
    const int64_t* h = row + kHeader;
    if (h[0] != row[kZeros]) {
      res.zeros_match = false;
      if (skip0) return res;  // the caller scans again, bin 0 included
    }
    int64_t a = 0, b = -1;
    int found = -1;
    if (bounded) {
      const int64_t expect = binned_count(row) - (skip0 ? row[kZeros] : 0);
      found = band_bounded(h, lo_bin, top, expect, a, b);
    }
    if (found < 0) {
      res.whole += bounded;
      found = band_full(h, lo_bin, nb, a, b) ? 1 : 0;
    }
    if (!found) continue;
    f[r] = a;
    l[r] = b - a + 1;
    res.total += b - a + 1;
    for (int64_t i = a; i <= b; ++i) {
      const int64_t v = h[i];
      if (!any) {
        res.mx = res.mn = v;
        any = true;
      }
      res.mx = v > res.mx ? v : res.mx;
      res.mn = v < res.mn ? v : res.mn;
    }
  }
  return res;
}

// _rows_scan(rows int64 [k, width], zero_bin, hist_kind, hist_lo, hist_hi,
// hist_bins, head int64 [kHeader, k] out, first int64 [k] out, lens int64
// [k] out, colstat int64 [kHeader, 3] out) -> (skip0, total band bins, max
// count, min count, rows scanned whole although hist_kind > 0).
// One pass over the rows: the header, transposed into head, each header
// column's min, max and ColFlag into colstat, and each row's histogram band
// (first and last non-empty bin). zero_bin: bin 0 counts zeros (log2), so it
// is left out of the bands (skip0) when it equals the zeros column in every
// row. hist_kind < 0: rows of any content (every bin is read); otherwise rows
// the kernels wrote with that histogram, whose band is found reading only the
// band (band_bounded).
PyObject* rows_scan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) return PyErr_Format(PyExc_TypeError, "_rows_scan takes 10 arguments");
  const int zero_bin = PyObject_IsTrue(args[1]);
  const long long kind = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  Buffer rows(args[0], false, 8, "rows"), head(args[6], true, 8, "head"),
      first(args[7], true, 8, "first"), lens(args[8], true, 8, "lens"),
      colstat(args[9], true, 8, "colstat");
  if (!rows.ok || !head.ok || !first.ok || !lens.ok || !colstat.ok) return nullptr;
  const Py_ssize_t k = first.n();
  if (rows.view.ndim != 2 || rows.view.shape[0] != k || lens.n() != k ||
      rows.view.shape[1] < kHeader || head.n() != kHeader * k || colstat.n() != kHeader * 3) {
    return PyErr_Format(PyExc_ValueError, "_rows_scan: shapes do not match");
  }
  const int64_t width = rows.view.shape[1];
  const bool bounded = kind > 0 && width > kHeader;
  HistSpec spec{};
  if (bounded && !hist_spec_of(args + 2, width, "_rows_scan", spec)) return nullptr;
  const auto* base = static_cast<const int64_t*>(rows.view.buf);
  auto* hd = static_cast<int64_t*>(head.view.buf);
  auto* f = static_cast<int64_t*>(first.view.buf);
  auto* l = static_cast<int64_t*>(lens.view.buf);
  bool skip0 = zero_bin && width > kHeader && k > 0;
  ScanResult res = scan_rows(base, k, width, skip0, bounded, spec, hd, f, l);
  if (skip0 && !res.zeros_match) {
    skip0 = false;
    res = scan_rows(base, k, width, skip0, bounded, spec, hd, f, l);
  }
  column_stats(hd, k, static_cast<int64_t*>(colstat.view.buf));
  return Py_BuildValue("(OLLLL)", skip0 ? Py_True : Py_False, static_cast<long long>(res.total),
                       static_cast<long long>(res.mx), static_cast<long long>(res.mn),
                       static_cast<long long>(res.whole));
}

// _rows_reset(rows int64 [k, width], hist_kind, hist_lo, hist_hi, hist_bins,
// tag): put rows just read back into their reset state for step `tag`
// (reset_value), writing only what can differ from it: the header and the
// histogram band (band_bounded; a row that breaks its rule is zeroed whole).
// While the host has just read these rows they are in cache, so this costs a
// fraction of the reset advance() would do over the whole slot; advance()
// skips rows already reset for the step it opens.
PyObject* rows_reset(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) return PyErr_Format(PyExc_TypeError, "_rows_reset takes 6 arguments");
  const long long tag = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  Buffer rows(args[0], true, 8, "rows");
  if (!rows.ok) return nullptr;
  if (rows.view.ndim != 2 || rows.view.shape[1] < kHeader) {
    return PyErr_Format(PyExc_ValueError, "_rows_reset: rows must be [k, width >= %d]",
                        static_cast<int>(kHeader));
  }
  const int64_t k = rows.view.shape[0], width = rows.view.shape[1], nb = width - kHeader;
  HistSpec spec{};
  if (nb > 0 && !hist_spec_of(args + 1, width, "_rows_reset", spec)) return nullptr;
  int64_t fresh[kHeader];
  for (int64_t c = 0; c < kHeader; ++c) fresh[c] = reset_value(c, tag);
  auto* base = static_cast<int64_t*>(rows.view.buf);
  for (int64_t r = 0; r < k; ++r) {
    int64_t* row = base + r * width;
    if (r + kAhead < k) {  // rows read a while ago may have left the cache
      __builtin_prefetch(row + kAhead * width, 1);
      __builtin_prefetch(row + kAhead * width + 8, 1);
    }
    if (nb > 0) {
      int64_t* h = row + kHeader;
      int64_t a = 0, b = -1;
      const int found = band_bounded(h, 0, top_bin(row, spec, nb), binned_count(row), a, b);
      if (found < 0) {
        a = 0;
        b = nb - 1;
      }
      if (found != 0) std::memset(h + a, 0, static_cast<size_t>(b - a + 1) * sizeof(int64_t));
    }
    std::memcpy(row, fresh, sizeof(fresh));
  }
  Py_RETURN_NONE;
}

template <typename T>
void gather(const int64_t* base, int64_t width, int64_t header, Py_ssize_t k, const int64_t* f,
            const int64_t* l, void* out) {
  T* o = static_cast<T*>(out);
  for (Py_ssize_t r = 0; r < k; ++r) {
    const int64_t* h = base + r * width + header + f[r];
    for (int64_t i = 0; i < l[r]; ++i) *o++ = static_cast<T>(h[i]);
  }
}

// _hist_gather(rows, header, first, lens, out): the band counts of every row,
// concatenated into out (1-, 2-, 4- or 8-byte items; the caller chose a width
// that holds the max count from _hist_bands).
PyObject* hist_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) return PyErr_Format(PyExc_TypeError, "_hist_gather takes 5 arguments");
  const long long header = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  Buffer rows(args[0], false, 8, "rows"), first(args[2], false, 8, "first"),
      lens(args[3], false, 8, "lens"), out(args[4], true, 0, "out");
  if (!rows.ok || !first.ok || !lens.ok || !out.ok) return nullptr;
  const Py_ssize_t k = first.n();
  if (rows.view.ndim != 2 || rows.view.shape[0] != k || lens.n() != k) {
    return PyErr_Format(PyExc_ValueError, "_hist_gather: shapes do not match");
  }
  const auto* f = static_cast<const int64_t*>(first.view.buf);
  const auto* l = static_cast<const int64_t*>(lens.view.buf);
  int64_t total = 0;
  for (Py_ssize_t r = 0; r < k; ++r) {
    if (f[r] < 0 || l[r] < 0 || header + f[r] + l[r] > rows.view.shape[1]) {
      return PyErr_Format(PyExc_ValueError, "_hist_gather: band of row %zd out of range", r);
    }
    total += l[r];
  }
  if (total != out.n()) return PyErr_Format(PyExc_ValueError, "_hist_gather: out has the wrong size");
  const auto* base = static_cast<const int64_t*>(rows.view.buf);
  const int64_t width = rows.view.shape[1];
  switch (out.view.itemsize) {
    case 1: gather<uint8_t>(base, width, header, k, f, l, out.view.buf); break;
    case 2: gather<uint16_t>(base, width, header, k, f, l, out.view.buf); break;
    case 4: gather<uint32_t>(base, width, header, k, f, l, out.view.buf); break;
    case 8: gather<int64_t>(base, width, header, k, f, l, out.view.buf); break;
    default: return PyErr_Format(PyExc_TypeError, "_hist_gather: out items must be 1, 2, 4 or 8 bytes");
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"_rows_scan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rows_scan)),
     METH_FASTCALL, nullptr},
    {"_rows_reset", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rows_reset)),
     METH_FASTCALL, nullptr},
    {"_hist_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(hist_gather)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* host_pack_methods() { return kMethods; }

}  // namespace hookcap
