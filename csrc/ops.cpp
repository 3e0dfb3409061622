// Operator schemas (the dispatcher contract), the Meta implementation used by
// FakeTensor / torch.compile, and the layout query Python checks at import.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "hookcap/op_checks.h"
#include "hookcap/row_id.h"
#include "hookcap/state.h"
#include "hookcap/stats_math.h"

namespace hookcap {
PyMethodDef* grad_hook_methods();  // grad_hooks.cpp
PyMethodDef* host_pack_methods();  // host_pack.cpp
#ifdef HOOKCAP_WITH_CUDA
int64_t join_write_streams(int device);  // cuda/stats_launch.cu
bool captured_ring(uintptr_t ring);
int block_merge(int mode);
uintptr_t side_stream_handle(int device);
bool attention_qk_supported_cuda(const at::Tensor& q, const at::Tensor& k, int64_t hist_kind, double hist_lo,
                                 double hist_hi, int64_t hist_bins, int64_t ring_width);
#endif

namespace {
// fn(device index) for a function of one device index: a C++ exception as a
// Python RuntimeError.
template <typename Fn>
PyObject* with_device(PyObject* arg, Fn&& fn) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  try {
    return fn(static_cast<int>(device));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// _join_write_streams(device index) -> int: make the current stream of that
// CUDA device wait for every other stream hookcap ops wrote on since the
// last call; returns how many it waited for (0 without CUDA kernels).
PyObject* py_join_write_streams(PyObject*, PyObject* arg) {
  return with_device(arg, [](int device) {
#ifdef HOOKCAP_WITH_CUDA
    return PyLong_FromLongLong(join_write_streams(device));
#else
    return PyLong_FromLong(0);
#endif
  });
}

// _captured_ring(ring data_ptr) -> bool: whether a hookcap op wrote into
// that ring buffer inside a CUDA graph capture (the graph keeps its address).
PyObject* py_captured_ring(PyObject*, PyObject* arg) {
  const unsigned long long ptr = PyLong_AsUnsignedLongLong(arg);
  if (ptr == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
#ifdef HOOKCAP_WITH_CUDA
  return PyBool_FromLong(captured_ring(static_cast<uintptr_t>(ptr)));
#else
  Py_RETURN_FALSE;
#endif
}

// _block_merge(mode) -> int: how the CUDA accumulate kernels' blocks merge
// their partials from now on (0: each into the ring, 1: the tree; -1: only
// ask); returns the mode before. 0 without CUDA kernels.
PyObject* py_block_merge(PyObject*, PyObject* arg) {
  const long mode = PyLong_AsLong(arg);
  if (mode == -1 && PyErr_Occurred()) return nullptr;
#ifdef HOOKCAP_WITH_CUDA
  return PyLong_FromLong(block_merge(static_cast<int>(mode)));
#else
  return PyLong_FromLong(0);
#endif
}

// _side_stream(device index) -> int: the cudaStream_t of hookcap's side
// stream of that device (Monitor(stream="side")), made on first use; for
// torch.cuda.ExternalStream. RuntimeError without CUDA kernels.
PyObject* py_side_stream(PyObject*, PyObject* arg) {
  return with_device(arg, [](int device) -> PyObject* {
#ifdef HOOKCAP_WITH_CUDA
    return PyLong_FromUnsignedLongLong(side_stream_handle(device));
#else
    PyErr_SetString(PyExc_RuntimeError, "hookcap was built without CUDA kernels");
    return nullptr;
#endif
  });
}

PyMethodDef kStreamMethods[] = {
    {"_side_stream", py_side_stream, METH_O, nullptr},
    {"_block_merge", py_block_merge, METH_O, nullptr},
    {"_join_write_streams", py_join_write_streams, METH_O, nullptr},
    {"_captured_ring", py_captured_ring, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace
}  // namespace hookcap

// The importable Python module: `import hookcap._C` loads the library and
// runs the static registrations below; its functions are the gradient
// capture entry points (grad_hooks.cpp) and host encoding helpers (host_pack.cpp).
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                          hookcap::grad_hook_methods()};
  PyObject* m = PyModule_Create(&module_def);
  if (m && (PyModule_AddIntConstant(m, "ROW_BITS", hookcap::kRowBits) < 0 ||
            PyModule_AddFunctions(m, hookcap::host_pack_methods()) < 0 ||
            PyModule_AddFunctions(m, hookcap::kStreamMethods) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}

namespace hookcap {
namespace {

constexpr int64_t kAbiVersion = 13;

// Meta: same checks as the real kernels, no data touched. The ops mutate in
// place and return nothing, so there is nothing else to fake, but for
// attention_rows' two outputs.
void accumulate_meta(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state,
                     int64_t row, int64_t hist_kind, double hist_lo, double hist_hi,
                     int64_t hist_bins) {
  check_accumulate(x, ring, state, row);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

void accumulate_many_meta(at::TensorList xs, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                          int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_many(xs, ring, state, rows);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

void accumulate_groups_meta(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                            int64_t dim, int64_t size, int64_t hist_kind, double hist_lo, double hist_hi,
                            int64_t hist_bins) {
  check_groups(x, ring, state, rows, dim, size);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

void accumulate_bins_meta(const at::Tensor& index, const c10::optional<at::Tensor>& weight, at::Tensor& ring,
                          const at::Tensor& state, c10::IntArrayRef rows, int64_t hist_kind, double hist_lo,
                          double hist_hi, int64_t hist_bins) {
  check_bins(index, weight, ring, state, rows);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

void accumulate_update_meta(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                            const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                            const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper,
                            int64_t rule, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                            int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_update(param, grad, a, b, step, hyper, rule, ring, state, rows);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

std::tuple<at::Tensor, at::Tensor> attention_rows_meta(at::Tensor& logits, int64_t causal_row0) {
  check_attention_rows(logits, causal_row0);
  const auto sizes = logits.sym_sizes();
  const c10::SymIntArrayRef rows(sizes.data(), sizes.size() - 1);
  return {at::empty_symint(rows, logits.options()), at::empty_symint(rows, logits.options())};
}

void accumulate_attention_meta(at::Tensor& logits, int64_t causal_row0, at::Tensor& ring, const at::Tensor& state,
                               c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows, c10::IntArrayRef entropy_rows,
                               int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_attention_record(logits, causal_row0, ring, state, logit_rows, lse_rows, entropy_rows);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

void attention_qk_meta(const at::Tensor& q, const at::Tensor& k, bool causal, double scale, at::Tensor& ring,
                       const at::Tensor& state, c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows,
                       c10::IntArrayRef entropy_rows, int64_t hist_kind, double hist_lo, double hist_hi,
                       int64_t hist_bins) {
  check_attention_qk(q, k, ring, state, logit_rows, lse_rows, entropy_rows);
  check_hist(hist_kind, hist_lo, hist_hi, hist_bins, ring.sym_size(2));
}

// Whether attention_qk takes these q and k (CUDA tensors the kernel reads,
// on a GPU of compute capability 8.0 on) with this histogram; reads no data.
bool attention_qk_supported(const at::Tensor& q, const at::Tensor& k, int64_t hist_kind, double hist_lo,
                            double hist_hi, int64_t hist_bins, int64_t ring_width) {
#ifdef HOOKCAP_WITH_CUDA
  return attention_qk_supported_cuda(q, k, hist_kind, hist_lo, hist_hi, hist_bins, ring_width);
#else
  return false;
#endif
}

void reset_slot_meta(at::Tensor& ring, const at::Tensor& state) { check_ring_state(ring, state); }

void reset_rows_meta(at::Tensor& ring, const at::Tensor& state, int64_t begin, int64_t end) {
  check_reset_rows(ring, state, begin, end);
}

void time_mark_meta(at::Tensor& ring, const at::Tensor& state, int64_t row, int64_t phase,
                    bool start) {
  check_time_mark(ring, state, row, phase);
}

void record_meta(const at::Tensor& x, int64_t sink, int64_t rid) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "hookcap.record: only floating-point tensors, got ",
              x.scalar_type());
}

void advance_meta(at::Tensor& ring, at::Tensor& state, int64_t every) {
  check_ring_state(ring, state);
  TORCH_CHECK(every >= 1, "hookcap.advance: every must be >= 1, got ", every);
}

std::vector<int64_t> layout() {
#ifdef HOOKCAP_WITH_CUDA
  const int64_t cuda = 1;
#else
  const int64_t cuda = 0;
#endif
  return {kAbiVersion, kHeader,  kCount, kNan, kPosInf, kNegInf,  kZeros,      kShift,
          kS1,         kS2,      kMin,   kMax, kAbsMax, kCalls,   kStepTag,    kSum, kSumSq, kShiftUnset,
          kStateStep,  kStateEnabled, kStateSlot, kStateSize, cuda,
          kFwdNs,      kFwdOpen, kFwdEnds, kBwdNs, kBwdOpen, kBwdEnds,
          kBigN,       kBigShift, kBigS1, kBigS2, kSmallN, kSmallShift, kSmallS1, kSmallS2,
          kWideScale,  kN4,      kS3,    kS4,    kMoments4Flag, kSideStreamFlag};
}

}  // namespace

TORCH_LIBRARY(hookcap, m) {
  // hist_kind: 0 none, 1 log2, 2 linear; plus 16 (kMoments4Flag) to also sum
  // (x - K)^3 and (x - K)^4 (moments=4), plus 32 (kSideStreamFlag) to launch
  // on hookcap's side stream (CUDA).
  m.def(
      "accumulate(Tensor x, Tensor(a!) ring, Tensor state, int row, int hist_kind, "
      "float hist_lo, float hist_hi, int hist_bins) -> ()");
  // accumulate of each xs[i] into rows[i] (-1: not recorded), in one call
  // (on a GPU, tensors alike go kManyTensors to a launch).
  m.def(
      "accumulate_many(Tensor[] xs, Tensor(a!) ring, Tensor state, int[] rows, int hist_kind, "
      "float hist_lo, float hist_hi, int hist_bins) -> ()");
  // x split along `dim` into groups of `size` slices (heads, experts,
  // channels), each group into its own row (`rows`, one per group; -1: not
  // recorded), in one call.
  m.def(
      "accumulate_groups(Tensor x, Tensor(a!) ring, Tensor state, int[] rows, int dim, int size, "
      "int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  // Each element of the integer tensor `index` adds its weight (or 1) to
  // the row of the bin it names (rows[index]; an index outside [0,
  // len(rows)) is in no bin): a bin's count is torch.bincount's.
  m.def(
      "accumulate_bins(Tensor index, Tensor? weight, Tensor(a!) ring, Tensor state, int[] rows, "
      "int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  // The optimizer's step per element (update_math.h), recomputed from the
  // parameter and its state after the step, in one pass: `rows` holds the
  // rows of Δw, w before the step, Adam's ratio and the state tensors a and
  // b (update_math.h kOut*; -1: not recorded).
  m.def(
      "accumulate_update(Tensor param, Tensor? grad, Tensor? a, Tensor? b, Tensor? step, "
      "float[] hyper, int rule, Tensor(a!) ring, Tensor state, int[] rows, "
      "int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  // accumulate_update for a list of parameters stepped alike (one call per
  // parameter group): grads/a/b/steps per parameter, rows 5 per parameter.
  m.def(
      "accumulate_updates(Tensor[] params, Tensor?[] grads, Tensor?[] a, Tensor?[] b, Tensor?[] steps, "
      "float[] hyper, int rule, Tensor(a!) ring, Tensor state, int[] rows, "
      "int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  // Per row of a float32 tile of pre-softmax logits [..., rows, keys]: its
  // logsumexp and its softmax's entropy (nats), float32 [..., rows]; -inf
  // both for a row with no allowed key. causal_row0 >= 0: row i is query
  // causal_row0 + i % rows under a top-left causal mask, whose hidden keys
  // are set to -inf in place first; -1: no causal mask.
  m.def("attention_rows(Tensor(a!) logits, int causal_row0) -> (Tensor, Tensor)");
  // attention_rows of a tile [batch, heads, rows, keys], and per head h the
  // statistics of its logits (the mask's -inf included), of its rows'
  // logsumexp and of their entropy merged into logit_rows[h], lse_rows[h]
  // and entropy_rows[h] (-1: not recorded), as accumulate_groups along the
  // heads would.
  m.def(
      "accumulate_attention(Tensor(a!) logits, int causal_row0, Tensor(b!) ring, Tensor state, int[] logit_rows, "
      "int[] lse_rows, int[] entropy_rows, int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  // The attention capture's whole observation of one attention call from
  // its 16-bit q [B, H, Tq, D] and k [B, Hk, Tk, D] (scale: of q.k^T;
  // causal: top-left, as is_causal), with no logits in memory: what
  // accumulate_attention records of the logits' tiles, into the same rows.
  // CUDA only, for the inputs attention_qk_supported accepts.
  m.def(
      "attention_qk(Tensor q, Tensor k, bool causal, float scale, Tensor(a!) ring, Tensor state, int[] logit_rows, "
      "int[] lse_rows, int[] entropy_rows, int hist_kind, float hist_lo, float hist_hi, int hist_bins) -> ()");
  m.def("attention_qk_supported(Tensor q, Tensor k, int hist_kind, float hist_lo, float hist_hi, int hist_bins, "
        "int ring_width) -> bool", &attention_qk_supported);
  m.def("reset_slot(Tensor(a!) ring, Tensor state) -> ()");
  m.def("reset_rows(Tensor(a!) ring, Tensor state, int begin, int end) -> ()");
  m.def("advance(Tensor(a!) ring, Tensor(b!) state, int every=1) -> ()");
  m.def("time_mark(Tensor(a!) ring, Tensor state, int row, int phase, bool start) -> ()");
  // Side effect only (registered as effectful from Python, so compiled
  // graphs keep it in order): x into the row `rid` of gradient sink `sink`.
  m.def("record(Tensor x, int sink, int rid) -> ()");
  m.def("layout() -> int[]", &layout);
}

TORCH_LIBRARY_IMPL(hookcap, Meta, m) {
  m.impl("accumulate", &accumulate_meta);
  m.impl("accumulate_many", &accumulate_many_meta);
  m.impl("accumulate_groups", &accumulate_groups_meta);
  m.impl("accumulate_bins", &accumulate_bins_meta);
  m.impl("accumulate_update", &accumulate_update_meta);
  m.impl("accumulate_updates", &accumulate_updates_each<&accumulate_update_meta>);
  m.impl("attention_rows", &attention_rows_meta);
  m.impl("accumulate_attention", &accumulate_attention_meta);
  m.impl("attention_qk", &attention_qk_meta);
  m.impl("reset_slot", &reset_slot_meta);
  m.impl("reset_rows", &reset_rows_meta);
  m.impl("advance", &advance_meta);
  m.impl("time_mark", &time_mark_meta);
  m.impl("record", &record_meta);
}

// The ops only read their tensor inputs and write telemetry buffers: they are
// not part of any autograd graph, so skip autograd bookkeeping entirely.
TORCH_LIBRARY_IMPL(hookcap, Autograd, m) {
  for (const char* op : {"accumulate", "accumulate_many", "accumulate_groups", "accumulate_bins", "accumulate_update", "accumulate_updates", "attention_rows", "accumulate_attention", "attention_qk", "reset_slot", "reset_rows", "advance", "time_mark", "record"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}

}  // namespace hookcap
