// Gradient capture with no Python in the backward pass. The Monitor's forward
// hook hands each output that will receive a gradient to capture_grad, which
// registers a C++ tensor hook; when the gradient arrives, the hook merges its
// statistics into the output's grad row through the dispatcher (the same
// accumulate op, CPU or CUDA kernel) and logs the row for the host's
// execution order. Python keeps every decision (which rows exist, when a
// Monitor records); this file only removes the interpreter from the per-
// gradient path: a Python tensor hook costs ~10-20 us per gradient in a real
// training step (cold caches), this path a few. The forward hooks enter the
// same op through _accumulate_row (three arguments, no Python op wrapper).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hookcap {
namespace {

using AccumulateFn = void(const at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          double, double, int64_t);

struct RingRef {
  at::Tensor ring, state;
};

// One per Monitor: its rings (by the Monitor's ring index), histogram
// arguments, and what the hooks report back (order log, errors).
struct GradSink {
  std::mutex mu;
  std::vector<RingRef> rings;
  int64_t hist_kind = 0, hist_bins = 0;
  double hist_lo = 0, hist_hi = 0;
  at::Tensor python_writes;  // int64 [1]: rows Python has logged this step
  std::atomic<bool> active{true};
  std::vector<int64_t> log_tokens, log_after;  // token, Python rows logged before it
  std::vector<std::pair<int64_t, std::string>> errors;
};

std::mutex g_mu;
std::vector<std::shared_ptr<GradSink>> g_sinks;  // index = id; nullptr once freed

std::shared_ptr<GradSink> sink_of(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (id < 0 || id >= static_cast<int64_t>(g_sinks.size()) || !g_sinks[id]) return nullptr;
  return g_sinks[id];
}

// The accumulate op into `row` of `ref`, through the dispatcher (CPU or CUDA
// kernel by x's device). Throws what the kernel's checks throw.
void accumulate_into(const GradSink& s, RingRef& ref, int64_t row, const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookcap::accumulate", "")
                       .typed<AccumulateFn>();
  op.call(x, ref.ring, ref.state, row, s.hist_kind, s.hist_lo, s.hist_hi, s.hist_bins);
}

// An exception's message without the C++ backtrace c10::Error may carry.
std::string message_of(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// token = ring index << 32 | row.
void on_grad(GradSink& s, int64_t token, const at::Tensor& grad) {
  if (!s.active.load(std::memory_order_relaxed) || !grad.defined()) return;
  const int64_t ri = token >> 32, row = token & 0xffffffff;
  RingRef ref;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ref = s.rings[ri];  // the ring may have grown since the hook was registered
  }
  try {
    TORCH_CHECK(grad.layout() == c10::kStrided && !grad.is_quantized() && !grad.is_nested(),
                "gradient layout ", grad.layout(), " is not supported");
    accumulate_into(s, ref, row, grad);
  } catch (const std::exception& e) {  // telemetry must never take the run down
    std::lock_guard<std::mutex> lock(s.mu);
    s.errors.emplace_back(token, message_of(e));
    return;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.log_tokens.push_back(token);
  s.log_after.push_back(s.python_writes.data_ptr<int64_t>()[0]);
}

bool unpack_tensor(PyObject* o, at::Tensor& out, const char* what) {
  if (!THPVariable_Check(o)) {
    PyErr_Format(PyExc_TypeError, "hookcap: %s must be a Tensor", what);
    return false;
  }
  out = THPVariable_Unpack(o);
  return true;
}

// Arguments (tensor, sink id, token) of _accumulate_row and _capture_grad,
// with the ring the token names. Empty (Python error set) if any is invalid.
struct RowArgs {
  at::Tensor t;
  std::shared_ptr<GradSink> sink;
  int64_t token = 0;
  RingRef ref;
};

std::optional<RowArgs> row_args(PyObject* const* args, Py_ssize_t nargs, const char* fn) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", fn);
    return std::nullopt;
  }
  RowArgs a;
  if (!unpack_tensor(args[0], a.t, "the tensor")) return std::nullopt;
  a.sink = sink_of(PyLong_AsLongLong(args[1]));
  a.token = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return std::nullopt;
  if (!a.sink) {
    PyErr_Format(PyExc_ValueError, "hookcap: gradient sink was freed");
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(a.sink->mu);
  if (a.token < 0 || (a.token >> 32) >= static_cast<int64_t>(a.sink->rings.size())) {
    PyErr_Format(PyExc_ValueError, "hookcap: no ring %lld in the sink",
                 static_cast<long long>(a.token >> 32));
    return std::nullopt;
  }
  a.ref = a.sink->rings[a.token >> 32];
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
  std::lock_guard<std::mutex> lock(g_mu);
  g_sinks.push_back(std::move(s));
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(g_sinks.size()) - 1);
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

// _grad_sink_take(id) -> (tokens, after, [(token, message)]), cleared
PyObject* grad_sink_take(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) return PyErr_Format(PyExc_TypeError, "_grad_sink_take takes 1 argument");
  auto s = sink_of(PyLong_AsLongLong(args[0]));
  if (PyErr_Occurred()) return nullptr;
  std::vector<int64_t> tokens, after;
  std::vector<std::pair<int64_t, std::string>> errors;
  if (s) {
    std::lock_guard<std::mutex> lock(s->mu);
    tokens.swap(s->log_tokens);
    after.swap(s->log_after);
    errors.swap(s->errors);
  }
  PyObject* t = PyList_New(static_cast<Py_ssize_t>(tokens.size()));
  PyObject* a = PyList_New(static_cast<Py_ssize_t>(after.size()));
  PyObject* e = PyList_New(static_cast<Py_ssize_t>(errors.size()));
  if (!t || !a || !e) {
    Py_XDECREF(t);
    Py_XDECREF(a);
    Py_XDECREF(e);
    return nullptr;
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    PyList_SET_ITEM(t, i, PyLong_FromLongLong(tokens[i]));
    PyList_SET_ITEM(a, i, PyLong_FromLongLong(after[i]));
  }
  for (size_t i = 0; i < errors.size(); ++i) {
    PyList_SET_ITEM(e, i, Py_BuildValue("(Ls)", static_cast<long long>(errors[i].first),
                                        errors[i].second.c_str()));
  }
  return Py_BuildValue("(NNN)", t, a, e);
}

// _grad_sink_free(id): hooks still pending keep the sink alive, inactive
PyObject* grad_sink_free(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) return PyErr_Format(PyExc_TypeError, "_grad_sink_free takes 1 argument");
  const int64_t id = PyLong_AsLongLong(args[0]);
  if (PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  if (id >= 0 && id < static_cast<int64_t>(g_sinks.size()) && g_sinks[id]) {
    g_sinks[id]->active.store(false);
    g_sinks[id].reset();
  }
  Py_RETURN_NONE;
}

// _accumulate_row(x, id, token): the accumulate op into the row named by
// token, for the forward hooks: one C call with three arguments instead of
// the Python op wrapper with eight. Errors raise RuntimeError.
PyObject* accumulate_row(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto a = row_args(args, nargs, "_accumulate_row");
  if (!a) return nullptr;
  try {
    accumulate_into(*a->sink, a->ref, a->token & 0xffffffff, a->t);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "%s", message_of(e).c_str());
  }
  Py_RETURN_NONE;
}

// _capture_grad(t, id, token) -> bool: t's gradient will be merged into the
// row named by token (ring index << 32 | row). False if t gets no gradient.
PyObject* capture_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  auto a = row_args(args, nargs, "_capture_grad");
  if (!a) return nullptr;
  if (!a->t.requires_grad()) Py_RETURN_FALSE;
  try {
    // The hook owns the sink (not the tensor): freeing the Monitor's handle
    // leaves pending hooks harmless.
    a->t.register_hook([s = a->sink, token = a->token](const at::Tensor& grad) {
      on_grad(*s, token, grad);
    });
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "hookcap: %s", message_of(e).c_str());
  }
  Py_RETURN_TRUE;
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
    {"_grad_sink_free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_sink_free)),
     METH_FASTCALL, nullptr},
    {"_accumulate_row", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(accumulate_row)),
     METH_FASTCALL, nullptr},
    {"_capture_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(capture_grad)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* grad_hook_methods() { return kMethods; }

}  // namespace hookcap
