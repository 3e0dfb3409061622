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
#endif

namespace {
// _join_write_streams(device index) -> int: make the current stream of that
// CUDA device wait for every other stream hookcap ops wrote on since the
// last call; returns how many it waited for (0 without CUDA kernels).
PyObject* py_join_write_streams(PyObject*, PyObject* arg) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
#ifdef HOOKCAP_WITH_CUDA
  try {
    return PyLong_FromLongLong(join_write_streams(static_cast<int>(device)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
#else
  return PyLong_FromLong(0);
#endif
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

PyMethodDef kStreamMethods[] = {
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

constexpr int64_t kAbiVersion = 7;

// Meta: same checks as the real kernels, no data touched. The ops mutate in
// place and return nothing, so there is nothing else to fake.
void accumulate_meta(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state,
                     int64_t row, int64_t hist_kind, double hist_lo, double hist_hi,
                     int64_t hist_bins) {
  check_accumulate(x, ring, state, row);
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

void merge_row_meta(const at::Tensor& partials, const at::Tensor& shift, at::Tensor& ring, const at::Tensor& state,
                    int64_t row) {
  check_merge_row(partials, shift, ring, state, row);
}

void merge_partials_meta(const at::Tensor& partials, const at::Tensor& shift, int64_t sink, int64_t rid) {
  check_partials(partials, shift, "hookcap.merge_partials");
}

at::Tensor shift_of_row_meta(const at::Tensor& ring, const at::Tensor& state, int64_t row) {
  check_shift_of_row(ring, state, row);
  return at::empty({}, ring.options().dtype(at::kDouble));
}

at::Tensor fused_shift_meta(const at::Tensor& like, int64_t sink, int64_t rid) {
  return at::empty({}, like.options().dtype(at::kDouble));
}

void merge_rows_meta(at::TensorList partials, at::TensorList shifts, at::Tensor& ring, const at::Tensor& state,
                     at::IntArrayRef rows) {
  check_merge_rows(partials, shifts, ring, state, rows);
}

void merge_partials_list_meta(at::TensorList partials, at::TensorList shifts, int64_t sink, at::IntArrayRef rids) {
  check_one_partials_per(partials, shifts, rids.size(), "hookcap.merge_partials_list", "row id");
  for (size_t i = 0; i < rids.size(); ++i) check_partials(partials[i], shifts[i], "hookcap.merge_partials_list");
}

at::Tensor shifts_of_rows_meta(const at::Tensor& ring, const at::Tensor& state, at::IntArrayRef rows) {
  check_shifts_of_rows(ring, state, rows);
  return at::empty({static_cast<int64_t>(rows.size())}, ring.options().dtype(at::kDouble));
}

at::Tensor fused_shifts_meta(const at::Tensor& like, int64_t sink, at::IntArrayRef rids) {
  return at::empty({static_cast<int64_t>(rids.size())}, like.options().dtype(at::kDouble));
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
          kWideScale,  kN4,      kS3,    kS4,    kMoments4Flag,
          kPNan,       kPPosInf, kPNegInf, kPZeros, kPFinite, kPS1, kPS2, kPMin, kPMax, kPartials};
}

}  // namespace

TORCH_LIBRARY(hookcap, m) {
  // hist_kind: 0 none, 1 log2, 2 linear; plus 16 (kMoments4Flag) to also sum
  // (x - K)^3 and (x - K)^4 (moments=4).
  m.def(
      "accumulate(Tensor x, Tensor(a!) ring, Tensor state, int row, int hist_kind, "
      "float hist_lo, float hist_hi, int hist_bins) -> ()");
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
  m.def("reset_slot(Tensor(a!) ring, Tensor state) -> ()");
  m.def("reset_rows(Tensor(a!) ring, Tensor state, int begin, int end) -> ()");
  m.def("advance(Tensor(a!) ring, Tensor(b!) state, int every=1) -> ()");
  m.def("time_mark(Tensor(a!) ring, Tensor state, int row, int phase, bool start) -> ()");
  // Side effect only (registered as effectful from Python, so compiled
  // graphs keep it in order): x into the row `rid` of gradient sink `sink`.
  m.def("record(Tensor x, int sink, int rid) -> ()");
  // Monitor(fused=True): one tensor's statistics, computed by the compiled
  // graph as float64 [PartialCol, blocks] about `shift` (stats_math.h), into
  // a ring row as accumulate would merge that tensor; merge_partials names
  // the row by sink and row id as record does (effectful, registered from
  // Python).
  m.def("merge_row(Tensor partials, Tensor shift, Tensor(a!) ring, Tensor state, int row) -> ()");
  m.def("merge_partials(Tensor partials, Tensor shift, int sink, int rid) -> ()");
  // The shift fused partials are summed about (stats_math.h row_center), as
  // a new float64 0-dim tensor on the ring's device; fused_shift: of the row
  // named by sink and row id, on like's device (0 where there is none).
  m.def("shift_of_row(Tensor ring, Tensor state, int row) -> Tensor");
  m.def("fused_shift(Tensor like, int sink, int rid) -> Tensor");
  // The same for several rows of one ring in one launch each (a compiled
  // graph's run of merges, and its shifts, gathered by a pass): the lists
  // are in order, one partials matrix, shift and row (id) each; the shifts
  // come back as float64 [rows].
  m.def("merge_rows(Tensor[] partials, Tensor[] shifts, Tensor(a!) ring, Tensor state, int[] rows) -> ()");
  m.def("merge_partials_list(Tensor[] partials, Tensor[] shifts, int sink, int[] rids) -> ()");
  m.def("shifts_of_rows(Tensor ring, Tensor state, int[] rows) -> Tensor");
  m.def("fused_shifts(Tensor like, int sink, int[] rids) -> Tensor");
  m.def("layout() -> int[]", &layout);
}

TORCH_LIBRARY_IMPL(hookcap, Meta, m) {
  m.impl("accumulate", &accumulate_meta);
  m.impl("accumulate_update", &accumulate_update_meta);
  m.impl("accumulate_updates", &accumulate_updates_each<&accumulate_update_meta>);
  m.impl("reset_slot", &reset_slot_meta);
  m.impl("reset_rows", &reset_rows_meta);
  m.impl("advance", &advance_meta);
  m.impl("time_mark", &time_mark_meta);
  m.impl("record", &record_meta);
  m.impl("merge_row", &merge_row_meta);
  m.impl("merge_partials", &merge_partials_meta);
  m.impl("shift_of_row", &shift_of_row_meta);
  m.impl("fused_shift", &fused_shift_meta);
  m.impl("merge_rows", &merge_rows_meta);
  m.impl("merge_partials_list", &merge_partials_list_meta);
  m.impl("shifts_of_rows", &shifts_of_rows_meta);
  m.impl("fused_shifts", &fused_shifts_meta);
}

// The ops only read their tensor inputs and write telemetry buffers: they are
// not part of any autograd graph, so skip autograd bookkeeping entirely.
TORCH_LIBRARY_IMPL(hookcap, Autograd, m) {
  for (const char* op : {"accumulate", "accumulate_update", "accumulate_updates", "reset_slot", "reset_rows", "advance", "time_mark", "record", "merge_row", "merge_partials", "shift_of_row", "fused_shift", "merge_rows",
                          "merge_partials_list", "shifts_of_rows", "fused_shifts"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}

}  // namespace hookcap
