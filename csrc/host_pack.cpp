// Host-side helpers of the compact step encoding (hookcap/_pack.py): the
// per-row histogram band (first and last non-empty bin) and its gather into
// a narrow integer array. One pass over the rows in C++ instead of several
// whole-matrix numpy passes: this runs in every recorded step() on the
// training thread, over thousands of rows.
#include <Python.h>

#include <cstdint>
#include <cstring>

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

// _hist_bands(rows int64 [k, width], header, skip0, first int64 [k] out,
// lens int64 [k] out) -> (total band bins, max count, min count). Bin b of
// row r is rows[r, header + b]; skip0: bin 0 is left out of the band.
PyObject* hist_bands(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) return PyErr_Format(PyExc_TypeError, "_hist_bands takes 5 arguments");
  const long long header = PyLong_AsLongLong(args[1]);
  const int skip0 = PyObject_IsTrue(args[2]);
  if (PyErr_Occurred()) return nullptr;
  Buffer rows(args[0], false, 8, "rows"), first(args[3], true, 8, "first"),
      lens(args[4], true, 8, "lens");
  if (!rows.ok || !first.ok || !lens.ok) return nullptr;
  const Py_ssize_t k = first.n();
  if (rows.view.ndim != 2 || rows.view.shape[0] != k || lens.n() != k ||
      rows.view.shape[1] < header) {
    return PyErr_Format(PyExc_ValueError, "_hist_bands: shapes do not match");
  }
  const int64_t width = rows.view.shape[1];
  const int64_t nb = width - header;
  const int64_t lo_bin = skip0 ? 1 : 0;
  const auto* base = static_cast<const int64_t*>(rows.view.buf);
  auto* f = static_cast<int64_t*>(first.view.buf);
  auto* l = static_cast<int64_t*>(lens.view.buf);
  int64_t total = 0, mx = 0, mn = 0;
  bool any = false;
  for (Py_ssize_t r = 0; r < k; ++r) {
    const int64_t* h = base + r * width + header;
    int64_t a = lo_bin;
    while (a < nb && h[a] == 0) ++a;
    if (a >= nb) {
      f[r] = l[r] = 0;
      continue;
    }
    int64_t b = nb - 1;
    while (h[b] == 0) --b;
    f[r] = a;
    l[r] = b - a + 1;
    total += b - a + 1;
    for (int64_t i = a; i <= b; ++i) {
      const int64_t v = h[i];
      if (!any) {
        mx = mn = v;
        any = true;
      }
      mx = v > mx ? v : mx;
      mn = v < mn ? v : mn;
    }
  }
  return Py_BuildValue("(LLL)", static_cast<long long>(total), static_cast<long long>(mx),
                       static_cast<long long>(mn));
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
    {"_hist_bands", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(hist_bands)),
     METH_FASTCALL, nullptr},
    {"_hist_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(hist_gather)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* host_pack_methods() { return kMethods; }

}  // namespace hookcap
