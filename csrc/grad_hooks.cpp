// Gradient capture with no Python in the backward pass. The Monitor's forward
// hook hands each output that will receive a gradient to capture_grad, which
// registers a C++ tensor hook; when the gradient arrives, the hook merges its
// statistics into the output's grad row through the dispatcher (the same
// accumulate op, CPU or CUDA kernel) and logs the row for the host's
// execution order. Python keeps every decision (which rows exist, when a
// Monitor records); this file only removes the interpreter from the per-
// gradient path: a Python tensor hook costs ~10-20 us per gradient in a real
// training step (cold caches), this path a few. The forward hooks' steady
// state is one call of output_fast (rows cached per module call); their
// general path enters the same op through _accumulate_row. Every write made
// here is logged for the execution order.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cpu/stats_cpu.h"
#include "hookcap/op_checks.h"
#include "hookcap/row_id.h"

namespace hookcap {
#ifdef HOOKCAP_WITH_CUDA
// The statistics op's CUDA launch after its checks (cuda/stats_launch.cu).
void accumulate_row_cuda(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, int64_t row,
                         const HistSpec& h, bool side);
#endif
namespace {

using AccumulateFn = void(const at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          double, double, int64_t);

struct RingRef {
  at::Tensor ring, state;
  bool direct = false;  // ring and state checked: writes may skip the dispatcher (accumulate_into)
  HistSpec hist{};      // the sink's histogram arguments for this ring's width
  CpuRing cpu;          // a direct CPU ring's pointers and shape
  bool side = false;    // CUDA launches on the side stream (kSideStreamFlag)
};

// Decoding a row id (hookcap/row_id.h).
constexpr int64_t ring_of(int64_t rid) { return rid >> kRowBits; }
constexpr int64_t row_of(int64_t rid) { return rid & ((int64_t{1} << kRowBits) - 1); }

constexpr int64_t kNoRow = -1;  // "no row": that part of a call is not recorded

// A hook's failure, reported to Python at the step's end.
struct HookError {
  int64_t rid;
  bool timing;  // a timing mark's row failed (else a metric's row)
  std::string message;
};

// The write log's lock: held for two appends, and taken on every write
// (one locked exchange to lock, a plain store to unlock: half a mutex).
class SpinLock {
 public:
  void lock() {
    while (held_.exchange(true, std::memory_order_acquire)) {
      while (held_.load(std::memory_order_relaxed)) std::this_thread::yield();
    }
  }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// One per Monitor: its rings (by the Monitor's ring index), histogram
// arguments, and what the hooks report back (order log, errors).
struct GradSink {
  std::mutex mu;
  std::vector<RingRef> rings;
  int64_t hist_kind = 0, hist_bins = 0;
  double hist_lo = 0, hist_hi = 0;
  at::Tensor python_writes;  // int64 [1]: rows Python has logged this step
  const int64_t* python_writes_at = nullptr;  // its value
  std::atomic<bool> active{true};
  mutable std::atomic<int64_t> op_writes{0};  // writes through the dispatcher, not direct (_grad_sink_op_writes)
  SpinLock log_mu;                           // guards the log below
  std::vector<int64_t> log_rids, log_after;  // row id, Python rows logged before it
  std::vector<HookError> errors;
  std::unordered_set<int64_t> skipped;  // row ids whose gradient hook could not be registered
  // Forward fast path (output_fast); touched only under the GIL.
  bool recording = false;         // the Monitor is attached and records this step
  bool force_python_grad = false;  // Python gradient hooks (env or compiled-autograd config)
  struct FastRows {
    bool valid = false;
    c10::Device device{c10::kCPU};
    int64_t out = kNoRow, grad = kNoRow;  // row ids
  };
  std::vector<std::vector<FastRows>> fast;  // [hook id][call index]
  std::vector<int64_t> calls;               // [hook id]: calls this step
};

std::mutex g_mu;
// Process-global table of the live sinks by id. Ids are never reused: a graph
// compiled for a Monitor that is gone still names its sink id (the record
// op), and must then find nothing rather than another Monitor's rows. Freed
// entries are erased, so the table holds only the Monitors alive.
std::unordered_map<int64_t, std::shared_ptr<GradSink>> g_sinks;
int64_t g_next_sink = 0;
// output_fast's sink: the last one it looked up, kept under the GIL (the
// table's Python writers, _grad_sink_new and _grad_sink_free, hold it too;
// free drops it). Saves the table's lock and lookup on every module call.
int64_t g_fast_id = -1;
std::shared_ptr<GradSink> g_fast_sink;

std::shared_ptr<GradSink> sink_of(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sinks.find(id);
  return it == g_sinks.end() ? nullptr : it->second;
}

// Whether x is a plain CPU or CUDA tensor whose memory holds its values:
// not a view with a lazy negation or conjugation, an efficient zero tensor,
// a Python subclass, a functional or batched wrapper (their dispatch keys
// make the dispatcher resolve them first). Every dense tensor carries the
// autograd, inplace-or-view and autocast keys, which the op falls through.
bool plain_dense(const at::Tensor& x) {
  const c10::DispatchKeySet ks = x.key_set() - c10::autograd_dispatch_keyset - c10::autocast_dispatch_keyset -
                                 c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
  return ks == c10::DispatchKeySet(c10::DispatchKey::CPU) || ks == c10::DispatchKeySet(c10::DispatchKey::CUDA);
}

// The accumulate op into `row` of `ref`. Throws what the op's checks throw.
// A plain input on the ring's device goes to its kernel directly: the ring
// and state passed their checks when set (_grad_sink_ring: direct), the
// histogram arguments were put in launch form then, and the dispatcher's
// round trip would cost as much as a small tensor's statistics. Anything
// else goes through the dispatcher (its device mismatch error), and so does
// every call while a Python dispatch mode or a profiler watches ops: they
// see the op as before. direct_write says which: a direct write runs no
// Python code.
bool direct_write(const RingRef& ref, const at::Tensor& x) {
  return ref.direct && plain_dense(x) && x.device() == ref.ring.device() &&
         !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
         // The dispatcher's own test for observers of an op call (a profiler):
         // per thread, without at::hasCallbacks' lock and copy of the global list.
         !at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
}

void accumulate_into(const GradSink& s, RingRef& ref, int64_t row, const at::Tensor& x, bool direct) {
  if (direct) {
    if (x.is_cpu()) {
      check_accumulate_dtype(x);
      check_row_in_rows("accumulate", row, ref.cpu.rows);  // row >= 0: a row id's low bits
      accumulate_row_cpu(x, ref.cpu, row, ref.hist);
      return;
    }
    check_accumulate_input(x, ref.ring, row);
#ifdef HOOKCAP_WITH_CUDA
    if (x.is_cuda()) {
      accumulate_row_cuda(x, ref.ring, ref.state, row, ref.hist, ref.side);
      return;
    }
#endif
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookcap::accumulate", "")
                       .typed<AccumulateFn>();
  s.op_writes.fetch_add(1, std::memory_order_relaxed);
  op.call(x, ref.ring, ref.state, row, s.hist_kind, s.hist_lo, s.hist_hi, s.hist_bins);
}

void accumulate_into(const GradSink& s, RingRef& ref, int64_t row, const at::Tensor& x) {
  accumulate_into(s, ref, row, x, direct_write(ref, x));
}

using TimeMarkFn = void(at::Tensor&, const at::Tensor&, int64_t, int64_t, bool);

// The time_mark op on `row` of `ref` (timing=True), through the dispatcher.
void time_mark_into(RingRef& ref, int64_t row, int64_t phase, bool start) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookcap::time_mark", "")
                       .typed<TimeMarkFn>();
  op.call(ref.ring, ref.state, row, phase, start);
}

// An exception's message without the C++ backtrace c10::Error may carry.
std::string message_of(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// Logs a row's write for the host's execution order, with the number of
// rows Python logged itself (op-path writes) before it.
void log_write(GradSink& s, int64_t rid) {
  std::lock_guard<SpinLock> lock(s.log_mu);
  s.log_rids.push_back(rid);
  s.log_after.push_back(*s.python_writes_at);
}

// Whether `rid` names one of the sink's rings. Caller holds s.mu.
bool has_ring(const GradSink& s, int64_t rid) {
  return rid >= 0 && ring_of(rid) < static_cast<int64_t>(s.rings.size());
}

// The ring `rid` names, read now: the ring may have grown since a hook was
// registered.
RingRef ring_now(GradSink& s, int64_t rid) {
  std::lock_guard<std::mutex> lock(s.mu);
  return s.rings[ring_of(rid)];
}

// One write into the ring `rid` names (read now: it may have grown since a
// hook was registered), logged for the step's execution order. A failure is
// kept for Python rather than raised: telemetry must never take the run down.
void write_logged(GradSink& s, int64_t rid, const at::Tensor& grad) {
  if (!grad.defined() || !s.active.load(std::memory_order_relaxed)) return;
  RingRef ref = ring_now(s, rid);
  try {
    TORCH_CHECK(grad.layout() == c10::kStrided, "layout ", grad.layout(), " is not supported");
    TORCH_CHECK(!grad.is_nested(), "nested tensors are not supported");
    TORCH_CHECK(!grad.is_quantized(), "quantized tensors are not supported");
    accumulate_into(s, ref, row_of(rid), grad);
  } catch (const std::exception& e) {
    // This write is not recorded; the row stays for later ones.
    std::lock_guard<std::mutex> lock(s.mu);
    s.errors.push_back({rid, false, message_of(e)});
    return;
  }
  log_write(s, rid);
}

// The live sink `sink` names, checked to hold the ring of `rid` (an error
// naming `op` if not), under one lock; null where the Monitor is gone. What
// the record op (compiled code) writes through.
std::shared_ptr<GradSink> sink_with_ring(int64_t sink, int64_t rid, const char* op) {
  auto s = sink_of(sink);
  if (!s) return nullptr;
  std::lock_guard<std::mutex> lock(s->mu);
  TORCH_CHECK(has_ring(*s, rid), op, ": no ring ", ring_of(rid), " in sink ", sink);
  return s;
}

// The record op (CPU and CUDA kernel; a no-op Meta kernel in ops.cpp): x
// merged into the row named by rid of the sink named by `sink`, the ring read
// now, the write logged. Compiled code calls it (torch.compile hooks): the
// graph holds two ints, never the ring, so no snapshot of the ring is saved
// for backward and nothing is written back over later writes.
void record_kernel(const at::Tensor& x, int64_t sink, int64_t rid) {
  if (auto s = sink_with_ring(sink, rid, "hookcap.record")) write_logged(*s, rid, x);
}

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("record", &record_kernel);
}
TORCH_LIBRARY_IMPL(hookcap, CUDA, m) {
  m.impl("record", &record_kernel);
}

bool unpack_tensor(PyObject* o, at::Tensor& out, const char* what) {
  if (!THPVariable_Check(o)) {
    PyErr_Format(PyExc_TypeError, "hookcap: %s must be a Tensor", what);
    return false;
  }
  out = THPVariable_Unpack(o);
  return true;
}

// The sink named by a Python int; null (Python error set) if freed.
std::shared_ptr<GradSink> sink_arg(PyObject* o) {
  auto s = sink_of(PyLong_AsLongLong(o));
  if (!s && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "hookcap: gradient sink was freed");
  return s;
}

// The ring a row id names, or nullopt (Python error set).
std::optional<RingRef> checked_ring(GradSink& s, int64_t rid) {
  std::lock_guard<std::mutex> lock(s.mu);
  if (!has_ring(s, rid)) {
    PyErr_Format(PyExc_ValueError, "hookcap: no ring %lld in the sink", static_cast<long long>(ring_of(rid)));
    return std::nullopt;
  }
  return s.rings[ring_of(rid)];
}

// Arguments (sink id, tensor, row id) of _accumulate_row and _capture_grad,
// with the ring the row id names. Empty (Python error set) if any is invalid.
struct RowArgs {
  std::shared_ptr<GradSink> sink;
  at::Tensor t;
  int64_t rid = 0;
  RingRef ref;
};

std::optional<RowArgs> row_args(PyObject* const* args, Py_ssize_t nargs, const char* fn) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", fn);
    return std::nullopt;
  }
  RowArgs a;
  a.sink = sink_arg(args[0]);
  if (!a.sink) return std::nullopt;
  if (!unpack_tensor(args[1], a.t, "the tensor")) return std::nullopt;
  a.rid = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return std::nullopt;
  auto ref = checked_ring(*a.sink, a.rid);
  if (!ref) return std::nullopt;
  a.ref = std::move(*ref);
  return a;
}

// _grad_sink_new(python_writes, hist_kind, hist_lo, hist_hi, hist_bins) -> id
PyObject* grad_sink_new(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) return PyErr_Format(PyExc_TypeError, "_grad_sink_new takes 5 arguments");
  auto s = std::make_shared<GradSink>();
  if (!unpack_tensor(args[0], s->python_writes, "python_writes")) return nullptr;
  s->hist_kind = PyLong_AsLongLong(args[1]);
  s->hist_lo = PyFloat_AsDouble(args[2]);
  s->hist_hi = PyFloat_AsDouble(args[3]);
  s->hist_bins = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (s->python_writes.scalar_type() != at::kLong || s->python_writes.numel() < 1 ||
      !s->python_writes.is_cpu()) {
    return PyErr_Format(PyExc_ValueError, "python_writes must be a CPU int64 tensor");
  }
  s->python_writes_at = s->python_writes.data_ptr<int64_t>();
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t id = g_next_sink++;
  g_sinks.emplace(id, std::move(s));
  return PyLong_FromLongLong(id);
}

// _grad_sink_ring(id, ring_index, ring, state): set (or replace, after growth)
PyObject* grad_sink_ring(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) return PyErr_Format(PyExc_TypeError, "_grad_sink_ring takes 4 arguments");
  auto s = sink_of(PyLong_AsLongLong(args[0]));
  const int64_t index = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (!s || index < 0 || index > 0xffff) return PyErr_Format(PyExc_ValueError, "bad sink or ring index");
  RingRef ref;
  if (!unpack_tensor(args[2], ref.ring, "ring") || !unpack_tensor(args[3], ref.state, "state")) {
    return nullptr;
  }
  try {
    check_ring_state(ref.ring, ref.state);
    ref.hist = make_hist_spec(s->hist_kind, s->hist_lo, s->hist_hi, s->hist_bins, ref.ring.size(2));
    if (ref.ring.is_cpu()) ref.cpu = cpu_ring(ref.ring, ref.state);
    ref.side = on_side_stream(s->hist_kind);
    ref.direct = true;
  } catch (const std::exception&) {
    // Every write goes through the op, which reports what is wrong (kept as the hook's error).
  }
  std::lock_guard<std::mutex> lock(s->mu);
  if (static_cast<int64_t>(s->rings.size()) <= index) s->rings.resize(index + 1);
  s->rings[index] = std::move(ref);
  Py_RETURN_NONE;
}

// _grad_sink_active(id, bool): hooks already registered do nothing while off
PyObject* grad_sink_active(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "_grad_sink_active takes 2 arguments");
  auto s = sink_of(PyLong_AsLongLong(args[0]));
  if (PyErr_Occurred()) return nullptr;
  if (s) s->active.store(PyObject_IsTrue(args[1]) == 1);
  Py_RETURN_NONE;
}

// _grad_sink_op_writes(id) -> int: the sink's writes so far that went
// through the dispatcher rather than straight to the kernel (a diagnostic:
// 0 for plain tensors while no profiler or dispatch mode watches).
PyObject* grad_sink_op_writes(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) return PyErr_Format(PyExc_TypeError, "_grad_sink_op_writes takes 1 argument");
  auto s = sink_of(PyLong_AsLongLong(args[0]));
  if (PyErr_Occurred()) return nullptr;
  if (!s) return PyErr_Format(PyExc_ValueError, "no such sink");
  return PyLong_FromLongLong(s->op_writes.load(std::memory_order_relaxed));
}

// _grad_sink_take(id) -> (row ids first written, after: int64 bytes, [(row id, timing, message)]),
// cleared
PyObject* grad_sink_take(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) return PyErr_Format(PyExc_TypeError, "_grad_sink_take takes 1 argument");
  auto s = sink_of(PyLong_AsLongLong(args[0]));
  if (PyErr_Occurred()) return nullptr;
  std::vector<int64_t> rids, after;
  std::vector<HookError> errors;
  if (s) {
    {
      std::lock_guard<SpinLock> lock(s->log_mu);
      // Copied, not swapped: the log keeps its capacity, so the hooks of the
      // next step do not grow it again.
      rids.assign(s->log_rids.begin(), s->log_rids.end());
      after.assign(s->log_after.begin(), s->log_after.end());
      s->log_rids.clear();
      s->log_after.clear();
    }
    std::lock_guard<std::mutex> lock(s->mu);
    errors.swap(s->errors);
  }
  // First writes only: the host wants the order in which rows were first
  // written; a Python write logged before a repeat lands before the next first
  // write instead, which is the same place in that order.
  {
    std::vector<std::vector<uint8_t>> seen;
    size_t kept = 0;
    for (size_t i = 0; i < rids.size(); ++i) {
      const int64_t rid = rids[i];
      const int64_t ri = ring_of(rid), row = row_of(rid);
      if (ri >= 0) {
        if (seen.size() <= static_cast<size_t>(ri)) seen.resize(ri + 1);
        auto& v = seen[ri];
        if (v.size() <= static_cast<size_t>(row)) v.resize(std::max<size_t>(row + 1, 2 * v.size()));
        if (v[row]) continue;
        v[row] = 1;
      }
      rids[kept] = rid;
      after[kept] = after[i];
      ++kept;
    }
    rids.resize(kept);
    after.resize(kept);
  }
  // Thousands of entries a step: raw int64 bytes (numpy reads them without
  // a Python int per entry).
  PyObject* t = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(rids.data()),
                                          static_cast<Py_ssize_t>(rids.size() * sizeof(int64_t)));
  PyObject* a = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(after.data()),
                                          static_cast<Py_ssize_t>(after.size() * sizeof(int64_t)));
  PyObject* e = PyList_New(static_cast<Py_ssize_t>(errors.size()));
  if (!t || !a || !e) {
    Py_XDECREF(t);
    Py_XDECREF(a);
    Py_XDECREF(e);
    return nullptr;
  }
  for (size_t i = 0; i < errors.size(); ++i) {
    PyList_SET_ITEM(e, i, Py_BuildValue("(LNs)", static_cast<long long>(errors[i].rid),
                                        PyBool_FromLong(errors[i].timing), errors[i].message.c_str()));
  }
  return Py_BuildValue("(NNN)", t, a, e);
}

// _grad_sink_free(id): hooks still pending keep the sink alive, inactive
PyObject* grad_sink_free(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) return PyErr_Format(PyExc_TypeError, "_grad_sink_free takes 1 argument");
  const int64_t id = PyLong_AsLongLong(args[0]);
  if (PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sinks.find(id);
  if (it != g_sinks.end()) {
    it->second->active.store(false);
    g_sinks.erase(it);
  }
  if (id == g_fast_id) g_fast_sink.reset();
  Py_RETURN_NONE;
}

// _accumulate_row(id, x, rid): the accumulate op into the row named by
// rid, for the forward hooks: one C call with three arguments instead of
// the Python op wrapper with eight. Errors raise RuntimeError.
PyObject* accumulate_row(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto a = row_args(args, nargs, "_accumulate_row");
  if (!a) return nullptr;
  try {
    accumulate_into(*a->sink, a->ref, row_of(a->rid), a->t);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "%s", message_of(e).c_str());
  }
  log_write(*a->sink, a->rid);
  Py_RETURN_NONE;
}

// t's gradient will be merged into the row named by rid. The hook owns the
// sink (not the tensor): freeing the Monitor's handle leaves pending hooks
// harmless. A failure marks the row skipped and rethrows.
void register_grad_hook(const std::shared_ptr<GradSink>& sink, const at::Tensor& t,
                        int64_t rid) {
  try {
    t.register_hook([s = sink, rid](const at::Tensor& grad) { write_logged(*s, rid, grad); });
  } catch (...) {
    std::lock_guard<std::mutex> lock(sink->mu);
    sink->skipped.insert(rid);
    throw;
  }
}

// _capture_grad(id, t, rid) -> bool: t's gradient will be merged into the
// row named by rid. False if t gets no gradient.
PyObject* capture_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto a = row_args(args, nargs, "_capture_grad");
  if (!a) return nullptr;
  if (!a->t.requires_grad()) Py_RETURN_FALSE;
  try {
    register_grad_hook(a->sink, a->t, a->rid);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "hookcap: %s", message_of(e).c_str());
  }
  Py_RETURN_TRUE;
}

// Whether compiled autograd is on now (its context sets a module global):
// it cannot trace C++ hooks, so gradients then take Python hooks.
bool compiled_autograd_on() {
  // Interned names, and the module kept once imported: no string built per call.
  static PyObject* const name = PyUnicode_InternFromString("torch._dynamo.compiled_autograd");
  static PyObject* const flag = PyUnicode_InternFromString("compiled_autograd_enabled");
  static PyObject* mod = nullptr;
  if (!mod) {
    mod = PyDict_GetItemWithError(PyImport_GetModuleDict(), name);
    if (!mod) {
      PyErr_Clear();
      return false;
    }
    Py_INCREF(mod);
  }
  PyObject* on = PyObject_GetAttr(mod, flag);
  if (!on) {
    PyErr_Clear();
    return false;
  }
  const bool yes = PyObject_IsTrue(on) == 1;
  Py_DECREF(on);
  return yes;
}

constexpr long kNotRecording = -2, kDone = -1;


// The sink a Python int names, from output_fast's cache.
const std::shared_ptr<GradSink>& fast_sink(PyObject* o) {
  const int64_t id = PyLong_AsLongLong(o);
  if (id != g_fast_id || !g_fast_sink) {
    g_fast_sink = sink_arg(o);
    g_fast_id = g_fast_sink ? id : -1;
  }
  return g_fast_sink;
}

// The forward hook's steady state (output_fast and output_hook): a module
// call whose output is one plain tensor, seen before on the same device, has
// its rows cached (_fast_learn): its output is merged and its gradient hook
// registered here. Sets *ci to -2 when the Monitor does not record (nothing
// counted), -1 when done, else the call's index: the Python hook then takes
// its general path with that index (first calls, other outputs, checkpoint
// recomputation, Python gradient hooks, errors). False: a Python error is set.
bool output_fast_ci(PyObject* sink_id, PyObject* hook_id, PyObject* out, int64_t* ci_out) {
  const std::shared_ptr<GradSink>& cached = fast_sink(sink_id);
  const int64_t hook = PyLong_AsLongLong(hook_id);
  if (!cached || PyErr_Occurred()) return false;
  GradSink* const s = cached.get();  // held by g_fast_sink while no Python code runs (see keep)
  int64_t& result = *ci_out;
  if (!s->recording) return result = kNotRecording, true;
  if (hook < 0 || hook > (1 << 24)) return PyErr_Format(PyExc_ValueError, "bad hook id"), false;
  if (static_cast<int64_t>(s->calls.size()) <= hook) s->calls.resize(hook + 1, 0);
  const int64_t ci = result = s->calls[hook]++;
  // Recomputation in backward (checkpointing) records nothing new: Python decides.
  if (!THPVariable_CheckExact(out) || torch::autograd::get_current_graph_task_id() != -1 ||
      static_cast<int64_t>(s->fast.size()) <= hook ||
      static_cast<int64_t>(s->fast[hook].size()) <= ci || !s->fast[hook][ci].valid) {
    return true;
  }
  GradSink::FastRows& f = s->fast[hook][ci];
  const at::Tensor& t = THPVariable_Unpack(out);
  if (t.device() != f.device) {
    f.valid = false;  // relearned by the general path for the new device
    return true;
  }
  bool grad = f.grad != kNoRow && t.requires_grad();
  if (grad) {
    std::lock_guard<std::mutex> lock(s->mu);
    grad = s->skipped.count(f.grad) == 0;
  }
  if (grad && (s->force_python_grad || compiled_autograd_on())) return true;
  // A copy only for a write through the dispatcher: a Python dispatch mode's
  // code may free the Monitor (and reset g_fast_sink) there.
  std::shared_ptr<GradSink> keep;
  try {
    if (f.out != kNoRow) {
      // No lock: the rings change only in _grad_sink_ring, under the GIL held here.
      RingRef& ref = s->rings[ring_of(f.out)];
      const bool direct = direct_write(ref, t);
      if (!direct) keep = cached;
      accumulate_into(*s, ref, row_of(f.out), t, direct);
      log_write(*s, f.out);
    }
  } catch (const std::exception&) {
    f.valid = false;  // the general path writes again, reports and skips the row
    return true;
  }
  if (grad) {
    try {
      register_grad_hook(keep ? keep : cached, t, f.grad);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(s->mu);
      s->errors.push_back({f.grad, false, message_of(e)});  // warned at the step's end
    }
  }
  result = kDone;
  return true;
}

// output_fast(hook, output) -> int, bound to a sink id (_output_fast_for):
// output_fast_ci's answer, for the Python hook (eval-mode calls, which the C
// hook hands over whole).
PyObject* output_fast(PyObject* sink_id, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "output_fast takes 2 arguments");
  int64_t ci = 0;
  if (!output_fast_ci(sink_id, args[0], args[1], &ci)) return nullptr;
  return PyLong_FromLongLong(ci);
}

// _output_hook(ctx, module, args, output): the forward hook itself, registered
// as functools.partial(_output_hook, ctx) with ctx = (sink id, hook id, split,
// hook, tail). No Python frame in the steady state: a module in eval mode
// (where split) goes to the Python `hook`, a call output_fast_ci does not
// finish to `tail(module, output, ci)`. Dynamo never runs it: it traces the
// Python `hook` instead (the polyfill in hookcap/_rows/fastpath.py).
PyObject* output_hook(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 5) {
    return PyErr_Format(PyExc_TypeError, "_output_hook takes (ctx, module, args, output)");
  }
  PyObject* const ctx = args[0];
  PyObject* const mod = args[1];
  if (PyTuple_GET_ITEM(ctx, 2) == Py_True) {
    static PyObject* const training = PyUnicode_InternFromString("training");
    if (!training) return nullptr;
    PyObject* const mode = PyObject_GetAttr(mod, training);
    if (!mode) return nullptr;
    const int train = PyObject_IsTrue(mode);
    Py_DECREF(mode);
    if (train < 0) return nullptr;
    if (train == 0) return PyObject_Vectorcall(PyTuple_GET_ITEM(ctx, 3), args + 1, 3, nullptr);
  }
  int64_t ci = 0;
  if (!output_fast_ci(PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1), args[3], &ci)) return nullptr;
  if (ci == kDone) Py_RETURN_NONE;
  PyObject* const index = PyLong_FromLongLong(ci);
  if (!index) return nullptr;
  PyObject* const tail_args[3] = {mod, args[3], index};
  PyObject* const r = PyObject_Vectorcall(PyTuple_GET_ITEM(ctx, 4), tail_args, 3, nullptr);
  Py_DECREF(index);
  return r;
}

PyMethodDef kOutputFast = {"output_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(output_fast)),
                           METH_FASTCALL, "output_fast(hook, output) -> int"};

// _output_fast_for(id) -> output_fast bound to the sink `id`: a builtin the
// hook calls with no partial or bound-method layer in between.
PyObject* output_fast_for(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !PyLong_CheckExact(args[0])) {
    return PyErr_Format(PyExc_TypeError, "_output_fast_for takes a sink id");
  }
  return PyCFunction_New(&kOutputFast, args[0]);
}

// _fast_learn(id, hook, call, output, out_rid, grad_rid): cache the rows
// of a module call (kNoRow: not recorded) for output_fast.
PyObject* fast_learn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) return PyErr_Format(PyExc_TypeError, "_fast_learn takes 6 arguments");
  auto s = sink_arg(args[0]);
  const int64_t hook = PyLong_AsLongLong(args[1]), ci = PyLong_AsLongLong(args[2]);
  at::Tensor t;
  if (!s || PyErr_Occurred() || !unpack_tensor(args[3], t, "the output")) return nullptr;
  const int64_t out = PyLong_AsLongLong(args[4]), grad = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  if (hook < 0 || hook > (1 << 24) || ci < 0 || ci > (1 << 24)) {
    return PyErr_Format(PyExc_ValueError, "bad hook id or call index");
  }
  std::lock_guard<std::mutex> lock(s->mu);
  for (int64_t rid : {out, grad}) {
    if (rid != kNoRow && !has_ring(*s, rid)) {
      return PyErr_Format(PyExc_ValueError, "hookcap: no ring %lld in the sink",
                          static_cast<long long>(ring_of(rid)));
    }
  }
  if (static_cast<int64_t>(s->fast.size()) <= hook) s->fast.resize(hook + 1);
  auto& calls = s->fast[hook];
  if (static_cast<int64_t>(calls.size()) <= ci) calls.resize(ci + 1);
  calls[ci] = GradSink::FastRows{true, t.device(), out, grad};
  Py_RETURN_NONE;
}

// _time_mark(id, rid, phase, start): the time_mark op on the timing row
// named by rid, from the forward timing hooks: one C call instead of the
// Python op wrapper. Errors raise RuntimeError.
PyObject* time_mark_row(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) return PyErr_Format(PyExc_TypeError, "_time_mark takes 4 arguments");
  auto s = sink_arg(args[0]);
  if (!s) return nullptr;
  const int64_t rid = PyLong_AsLongLong(args[1]), phase = PyLong_AsLongLong(args[2]);
  const bool start = PyObject_IsTrue(args[3]) == 1;
  if (PyErr_Occurred()) return nullptr;
  auto ref = checked_ring(*s, rid);
  if (!ref) return nullptr;
  try {
    time_mark_into(*ref, row_of(rid), phase, start);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "%s", message_of(e).c_str());
  }
  Py_RETURN_NONE;
}

// _time_grad_hook(id, t, rid, start) -> bool: when t's gradient arrives, a
// backward time mark (start or end) on the timing row named by rid, from a
// C++ tensor hook (no Python in the backward pass). False if t gets no
// gradient. A failing mark is reported through the sink's errors.
PyObject* time_grad_hook(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) return PyErr_Format(PyExc_TypeError, "_time_grad_hook takes 4 arguments");
  auto s = sink_arg(args[0]);
  if (!s) return nullptr;
  at::Tensor t;
  if (!unpack_tensor(args[1], t, "the tensor")) return nullptr;
  const int64_t rid = PyLong_AsLongLong(args[2]);
  const bool start = PyObject_IsTrue(args[3]) == 1;
  if (PyErr_Occurred() || !checked_ring(*s, rid)) return nullptr;
  if (!t.requires_grad()) Py_RETURN_FALSE;
  try {
    t.register_hook([s, rid, start](const at::Tensor&) {
      if (!s->active.load(std::memory_order_relaxed)) return;
      RingRef ref = ring_now(*s, rid);
      try {
        time_mark_into(ref, row_of(rid), 1, start);
      } catch (const std::exception& e) {  // telemetry must never take the run down
        std::lock_guard<std::mutex> lock(s->mu);
        s->errors.push_back({rid, true, message_of(e)});
      }
    });
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "hookcap: %s", message_of(e).c_str());
  }
  Py_RETURN_TRUE;
}

// _grad_sink_recording(id, recording, force_python_grad, new_step): set by
// the Monitor on attach, detach and step; a new step restarts the call counts.
PyObject* grad_sink_recording(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) return PyErr_Format(PyExc_TypeError, "_grad_sink_recording takes 4 arguments");
  auto s = sink_arg(args[0]);
  if (!s) return nullptr;
  s->recording = PyObject_IsTrue(args[1]) == 1;
  s->force_python_grad = PyObject_IsTrue(args[2]) == 1;
  if (PyObject_IsTrue(args[3]) == 1) std::fill(s->calls.begin(), s->calls.end(), 0);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"_grad_sink_new", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_new)),
     METH_FASTCALL, nullptr},
    {"_grad_sink_ring", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_ring)),
     METH_FASTCALL, nullptr},
    {"_grad_sink_active",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_active)), METH_FASTCALL,
     nullptr},
    {"_grad_sink_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_take)),
     METH_FASTCALL, nullptr},
    {"_grad_sink_op_writes",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_op_writes)), METH_FASTCALL, nullptr},
    {"_grad_sink_free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_free)),
     METH_FASTCALL, nullptr},
    {"_accumulate_row", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(accumulate_row)),
     METH_FASTCALL, nullptr},
    {"_capture_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(capture_grad)),
     METH_FASTCALL, nullptr},
    {"_output_fast_for", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(output_fast_for)),
     METH_FASTCALL, nullptr},
    {"_output_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(output_hook)), METH_FASTCALL,
     "_output_hook(ctx, module, args, output): a Monitor's forward hook (functools.partial of it)"},
    {"_fast_learn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_learn)),
     METH_FASTCALL, nullptr},
    {"_time_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(time_mark_row)),
     METH_FASTCALL, nullptr},
    {"_time_grad_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(time_grad_hook)),
     METH_FASTCALL, nullptr},
    {"_grad_sink_recording",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_recording)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* grad_hook_methods() { return kMethods; }

}  // namespace hookcap
