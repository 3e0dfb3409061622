// Python bindings of the CUDA emulation harness, built by tests/test_cuda_emu.py
// with torch.utils.cpp_extension.load. accumulate/reset_slot/reset_rows/advance mirror
// the launchers in csrc/cuda/stats_launch.cu (same checks, HistSpec and
// StridedDesc from op_checks.h, same dense/strided choice) but run on CPU
// tensors with the grid and block the caller passes. The probe kernels at the
// end test the harness itself.
#include <torch/extension.h>

#include "hookcap/op_checks.h"
#include "emu_runner.h"
#include "cuda/attention_qk_plan.h"
#include "cuda/many_plan.h"
#include "cuda/update_plan.h"

namespace {

using namespace hookcap;

dim3 dim(int64_t v, const char* what) {
  TORCH_CHECK(v >= 1 && v <= INT32_MAX, "emu: ", what, " must be >= 1, got ", v);
  return dim3(static_cast<unsigned>(v));
}

void check_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "emu: tensors must be on the CPU, got ", t.device());
}

// The tree merge's scratch, kept across launches as the launcher keeps one
// per stream (so a launch that leaves a ticket set spoils the next one), grown
// for larger grids; zeroed only when created. Null where the launcher passes
// none (one block, or more than kMaxTreeBlocks).
std::vector<int64_t> g_scratch;
int64_t* tree_scratch(int64_t grid) {
  if (grid < 2 || grid > kernels::kMaxTreeBlocks) return nullptr;
  const auto words = static_cast<size_t>(kernels::tree_scratch_words(kernels::kMaxTreeBlocks));
  if (g_scratch.size() < words) g_scratch.assign(words, 0);
  return g_scratch.data();
}

// The scratch's tickets (all 0 between launches).
std::vector<int64_t> tree_tickets() {
  tree_scratch(2);
  return std::vector<int64_t>(g_scratch.begin(), g_scratch.begin() + kernels::kTicketWords);
}

// Returns (flat, mult, strided dims, reads, vectors): the launcher's read plan
// (vectors: a strided plan read as 16-byte vectors, strided.h vector_read).
// smem_budget: the device's dynamic shared memory per block (smem_budget();
// default an H100's), which picks the histogram mode as on that device.
// groups > 1: one launch for several groups (grid rows), as
// accumulate_groups_cuda makes it (op_checks.h group_launch): x_in is group
// 0's view, group g's reads x_step elements on into row + g * row_step.
std::tuple<bool, int64_t, int64_t, int64_t, bool> accumulate_grouped(
    const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state, int64_t row, const HistSpec& h,
    int64_t grid, int64_t block, int64_t max_walk, int64_t smem_budget, bool tree, int64_t groups,
    int64_t row_step, int64_t x_step) {
  const int64_t n = x_in.numel();
  TORCH_CHECK(max_walk >= 1 && max_walk <= kMaxDims, "emu: max_walk must be in [1, ", kMaxDims, "]");
  const DimPlan plan = plan_read(x_in, max_walk);  // the launcher's choice (max_walk = kMaxDims)
  const dim3 g(static_cast<unsigned>(dim(grid, "grid").x), static_cast<unsigned>(groups)), b = dim(block, "block");
  int64_t reads = 0;
  ReadKind read = kReadFlat;
  int64_t* scratch = tree && groups == 1 ? tree_scratch(grid) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND4(
      at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, x_in.scalar_type(),
      "hookcap_emu_accumulate", [&] {
        const scalar_t* p = x_in.const_data_ptr<scalar_t>();
        StridedDesc vec;
        RowTails tails;
        read = kernels::accumulate_read(
            vector_read(plan, sizeof(scalar_t), reinterpret_cast<uintptr_t>(p), vec, tails), h);
        py::gil_scoped_release nogil;
        for_each_pass(plan, read, vec, tails, [&](ReadKind kind, const StridedDesc& desc, int64_t skip,
                                                  int64_t visit, bool counts) {
          for_each_read(plan, [&](int64_t offset, bool first) {
            const bool once = counts && first;
            const kernels::RowTarget tgt{ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(),
                                         row, ring.size(1), ring.size(2), ring.size(0),
                                         once ? n : 0, once ? 1 : 0, plan.mult, scratch, row_step, x_step};
            hookcap_emu::accumulate<scalar_t>(p + offset + skip, visit, kind, desc, tgt, h, g, b, smem_budget);
            ++reads;
          });
        });
      });
  return {plan.flat, plan.mult, plan.flat ? 0 : plan.desc.ndim, reads, read == kReadVectors};
}

std::tuple<bool, int64_t, int64_t, int64_t, bool> accumulate(
    const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state, int64_t row,
    int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins, int64_t grid,
    int64_t block, int64_t max_walk, int64_t smem_budget, bool tree) {
  check_accumulate(x_in, ring, state, row);
  check_cpu(x_in);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  return accumulate_grouped(x_in, ring, state, row, h, grid, block, max_walk, smem_budget, tree, 1, 0, 0);
}

// accumulate_groups as accumulate_groups_cuda does it: one launch for every
// group where group_launch allows (returns True), else one per group.
bool accumulate_groups(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, std::vector<int64_t> rows,
                       int64_t dim_, int64_t size, int64_t hist_kind, double hist_lo, double hist_hi,
                       int64_t hist_bins, int64_t grid, int64_t block) {
  check_groups(x, ring, state, rows, dim_, size);
  check_cpu(x);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const GroupLaunch one = group_launch(x, rows, dim_, size);
  if (one.ok) {
    accumulate_grouped(x.narrow(dim_, 0, size), ring, state, rows[0], h, grid, block, kMaxDims,
                       hookcap_emu::kH100SmemBudget, false, one.groups, one.row_step, one.x_step);
    return true;
  }
  for (int64_t g = 0; g < static_cast<int64_t>(rows.size()); ++g) {
    if (rows[g] >= 0) {
      accumulate_grouped(x.narrow(dim_, g * size, size), ring, state, rows[g], h, grid, block, kMaxDims,
                         hookcap_emu::kH100SmemBudget, true, 1, 0, 0);
    }
  }
  return false;
}

// accumulate_many as accumulate_many_cuda does it (many_plan.h), with
// `per_block` elements per block of a launch of its own and at most `most`
// blocks (the launcher's: kThreads * kPerThread, max_blocks). Returns the
// tensors of each launch in order (1 for a launch of its own: negative).
std::vector<int64_t> accumulate_many(std::vector<at::Tensor> xs, at::Tensor& ring, const at::Tensor& state,
                                     std::vector<int64_t> rows, int64_t hist_kind, double hist_lo, double hist_hi,
                                     int64_t hist_bins, int64_t per_block, int64_t most, int64_t block) {
  check_many(xs, ring, state, rows);
  for (const at::Tensor& x : xs) check_cpu(x);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  std::vector<int64_t> launches;
  plan_many(
      xs, rows, per_block, most,
      [&](size_t i) {
        accumulate_grouped(xs[i], ring, state, rows[i], h, blocks_for_elements(xs[i].numel(), per_block, most), block,
                           kMaxDims, hookcap_emu::kH100SmemBudget, true, 1, 0, 0);
        launches.push_back(-1);
      },
      [&](const ManyBatch& b) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.dtype, "hookcap_emu_accumulate_many", [&] {
          const kernels::RowTarget tgt = many_target(ring, state);
          py::gil_scoped_release nogil;
          hookcap_emu::accumulate_many<scalar_t>(b.table, b.tensors, tgt, h, b.blocks, dim(block, "block"));
        });
        launches.push_back(b.tensors);
      });
  return launches;
}

// (mode, dynamic shared bytes) of kernels::hist_plan for a
// histogram (as make_hist_spec reads it), float or double work, a budget.
std::tuple<int64_t, int64_t> hist_plan(int64_t hist_kind, double hist_lo, double hist_hi,
                                             int64_t hist_bins, bool work_is_float,
                                             int64_t smem_budget) {
  int64_t nbins = hist_kind == kHistNone ? 0 : hist_bins + 2;
  if (hist_kind == kHistLog2) {
    const Log2Layout l = log2_layout(hist_bins);
    nbins = log2_nbins(static_cast<int64_t>(hist_lo), static_cast<int64_t>(hist_hi), l.sub_shift, l.sign);
  }
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, kHeader + nbins);
  const kernels::HistPlan p = kernels::hist_plan(h, work_is_float, smem_budget);
  return {p.mode, p.smem};
}

// Linear bins of float values by the kernel's float path (thresholds,
// linear_bin_thr: NaN and -Inf in 0, +Inf in bins + 1) and by linear_bin in
// double (-1 for NaN/Inf). Run on the host directly (no launch). Also whether
// linear_float_ok holds.
std::tuple<at::Tensor, at::Tensor, bool> linear_bins(double lo, double hi, int64_t bins,
                                                     const at::Tensor& values) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous(), "emu: float32 values");
  const HistSpec h = make_hist_spec(kHistLinear, lo, hi, bins, kHeader + bins + 2);
  std::vector<float> thr(static_cast<size_t>(bins + 1));
  for (int64_t i = 0; i <= bins; ++i) thr[i] = kernels::float_at_or_above(linear_edge(h, i));
  const kernels::LinearThr f = kernels::linear_thr(h);
  auto got = at::empty({values.numel()}, at::kLong), want = at::empty({values.numel()}, at::kLong);
  const float* v = values.const_data_ptr<float>();
  for (int64_t k = 0; k < values.numel(); ++k) {
    got[k] = kernels::linear_bin_thr(v[k], thr.data(), f);
    want[k] = linear_bin(static_cast<double>(v[k]), h);
  }
  return {got, want, kernels::linear_float_ok(h)};
}

// update_kernel as accumulate_updates_cuda launches it (update_plan.h), each
// parameter with up to `grid` blocks. step_on_device: the kernel reads each
// `step` (capturable / fused Adam) instead of the host.
void accumulate_updates(const std::vector<at::Tensor>& params, const std::vector<c10::optional<at::Tensor>>& grads,
                        const std::vector<c10::optional<at::Tensor>>& a,
                        const std::vector<c10::optional<at::Tensor>>& b,
                        const std::vector<c10::optional<at::Tensor>>& steps, std::vector<double> hyper, int64_t rule,
                        at::Tensor& ring, const at::Tensor& state, std::vector<int64_t> rows, int64_t hist_kind,
                        double hist_lo, double hist_hi, int64_t hist_bins, int64_t grid, int64_t block,
                        bool step_on_device) {
  const c10::List<c10::optional<at::Tensor>> g(grads), la(a), lb(b), ls(steps);
  check_updates(params, g, la, lb, ls, hyper, rule, ring, state, rows);
  for (const at::Tensor& p : params) check_cpu(p);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const dim3 bl = dim(block, "block");
  dim(grid, "grid");
  auto device_step = [&](const c10::optional<at::Tensor>& t) { return step_on_device && t.has_value() && t->defined(); };
  py::gil_scoped_release nogil;
  plan_updates(params, g, la, lb, ls, hyper, rule, rows, h, 1, grid, device_step,
               [&](auto kernel, const auto& batch, const UpdateRule& r, const kernels::UpdateOuts& o, int32_t blocks,
                   int64_t smem) {
                 emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), bl, static_cast<size_t>(smem), batch, r,
                             ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1),
                             ring.size(2), o, h);
               });
}

void accumulate_update(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                       const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                       const c10::optional<at::Tensor>& step, std::vector<double> hyper, int64_t rule,
                       at::Tensor& ring, const at::Tensor& state, std::vector<int64_t> rows,
                       int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins, int64_t grid,
                       int64_t block, bool step_on_device) {
  accumulate_updates({param}, {grad}, {a}, {b}, {step}, std::move(hyper), rule, ring, state, std::move(rows),
                     hist_kind, hist_lo, hist_hi, hist_bins, grid, block, step_on_device);
}

// bins_kernel as accumulate_bins_cuda launches it, with `grid` blocks per bin.
// attention_rows_kernel on a CPU tile, on the launcher's grid (a warp per
// row); -> (lse, entropy).
py::tuple attention_rows(at::Tensor& logits, int64_t causal_row0) {
  check_cpu(logits);
  AttentionRows a = attention_rows_outputs(logits, causal_row0);
  if (a.rows > 0) {
    py::gil_scoped_release nogil;
    emu::launch(kernels::attention_rows_kernel, dim((a.rows + kAttnRowsPerBlock - 1) / kAttnRowsPerBlock, "grid"),
                dim3(kernels::kThreads), 0, logits.data_ptr<float>(), a.rows, a.tile_rows, a.keys, causal_row0,
                a.lse.data_ptr<float>(), a.entropy.data_ptr<float>());
  }
  return py::make_tuple(a.lse, a.entropy);
}

// attention_qk_kernel as attention_qk_cuda launches it (its grid, block
// and shared memory), on CPU q and k: the logits' statistics into
// logit_rows; -> (lse, entropy), float32 [B, H, Tq].
py::tuple attention_qk(const at::Tensor& q, const at::Tensor& k, bool causal, double scale, at::Tensor& ring,
                       const at::Tensor& state, std::vector<int64_t> logit_rows, int64_t hist_kind, double hist_lo,
                       double hist_hi, int64_t hist_bins) {
  check_cpu(q);
  check_cpu(k);
  check_ring_state(ring, state);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const char* why = attention_qk_unsupported(q, k, h, hookcap_emu::kH100SmemBudget);
  TORCH_CHECK(why == nullptr, "emu: attention_qk: ", why ? why : "");
  TORCH_CHECK(static_cast<int64_t>(logit_rows.size()) == q.size(1), "emu: attention_qk: one row per head");
  for (const int64_t r : logit_rows) check_row_or_skip("attention_qk", r, ring);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  auto entropy = at::empty_like(lse);
  const kernels::QkArgs a = attention_qk_args(q, k, causal, scale, lse, entropy);
  const kernels::QkRows rows = attention_qk_rows(logit_rows);
  const QkLaunch l = attention_qk_launch(q, k, ring, state, h, hookcap_emu::kH100SmemBudget);
  {
    py::gil_scoped_release nogil;
    emu::launch(l.kernel, dim3(l.blocks_x, l.blocks_y), dim3(kernels::kThreads), static_cast<size_t>(l.smem), a,
                rows, l.tgt, h);
  }
  return py::make_tuple(lse, entropy);
}

void accumulate_bins(const at::Tensor& index, const c10::optional<at::Tensor>& weight, at::Tensor& ring,
                     const at::Tensor& state, std::vector<int64_t> rows, int64_t hist_kind, double hist_lo,
                     double hist_hi, int64_t hist_bins, int64_t grid, int64_t block) {
  check_bins(index, weight, ring, state, rows);
  check_cpu(index);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const dim3 bl = dim(block, "block");
  dim(grid, "grid");
  const int64_t smem = kernels::bins_smem_bytes(h.kind == kHistNone ? 0 : h.nbins);
  const int64_t n = index.numel(), bins = static_cast<int64_t>(rows.size());
  auto run = [&](auto* w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    AT_DISPATCH_INTEGRAL_TYPES(index.scalar_type(), "emu_bins", [&] {
      const scalar_t* idx = index.const_data_ptr<scalar_t>();
      py::gil_scoped_release nogil;
      kernels::for_bins_launch(rows.data(), bins, [&](const kernels::BinsRows& r, int64_t b0, int64_t nb) {
        emu::launch(kernels::bins_kernel<scalar_t, W>, dim3(static_cast<unsigned>(grid), static_cast<unsigned>(nb)),
                    bl, static_cast<size_t>(smem), idx, w, n, r, b0, bins, ring.data_ptr<int64_t>(),
                    state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1), ring.size(2), h);
      });
    });
  };
  if (!(weight.has_value() && weight->defined())) {
    run(static_cast<const float*>(nullptr));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight->scalar_type(), "emu_bins_w", [&] {
      run(weight->const_data_ptr<scalar_t>());
    });
  }
}

// The fault the kernels commit from now on (cuda_emu.h Fault, by number; 0: none).
void set_fault(int64_t f) { emu::fault() = static_cast<emu::Fault>(f); }

void reset_slot(at::Tensor& ring, const at::Tensor& state, int64_t grid, int64_t block) {
  check_ring_state(ring, state);
  check_cpu(ring);
  const dim3 g = dim(grid, "grid"), b = dim(block, "block");
  py::gil_scoped_release nogil;
  hookcap_emu::reset_slot(ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(),
                          ring.size(0), ring.size(1), ring.size(2), g, b);
}

void reset_rows(at::Tensor& ring, const at::Tensor& state, int64_t begin, int64_t end,
                int64_t grid, int64_t block) {
  check_reset_rows(ring, state, begin, end);
  check_cpu(ring);
  if (begin == end) return;  // as the launcher: no launch
  const dim3 g = dim(grid, "grid"), b = dim(block, "block");
  py::gil_scoped_release nogil;
  hookcap_emu::reset_rows(ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), ring.size(0),
                          ring.size(1), ring.size(2), begin, end, g, b);
}

void advance(at::Tensor& ring, at::Tensor& state, int64_t every, int64_t block, int64_t grid) {
  check_ring_state(ring, state);
  check_cpu(ring);
  TORCH_CHECK(every >= 1, "hookcap.advance: every must be >= 1, got ", every);
  const dim3 g = dim(grid, "grid"), b = dim(block, "block");
  py::gil_scoped_release nogil;
  hookcap_emu::advance(ring.data_ptr<int64_t>(), state.data_ptr<int64_t>(), ring.size(0),
                       ring.size(1), ring.size(2), every, g, b);
}

// order: 0 forward, 1 reverse, 2 shuffled by seed; schedule: 0 concurrent,
// 1 warp-serial, 2 warp-serial reversed (see cuda_emu.h).
void configure(int64_t order, uint64_t seed, int64_t schedule) {
  TORCH_CHECK(order >= 0 && order <= 2, "emu: block order must be 0, 1 or 2");
  TORCH_CHECK(schedule >= 0 && schedule <= 2, "emu: schedule must be 0, 1 or 2");
  emu::set_config(emu::Config{static_cast<emu::BlockOrder>(order), seed,
                              static_cast<emu::Schedule>(schedule)});
}

// Storage offsets of a view's elements in the order its read plan visits
// them (each listed once per multiplicity), and the plan's shape.
std::tuple<at::Tensor, bool, int64_t, int64_t, int64_t> plan_offsets(
    std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t max_walk) {
  TORCH_CHECK(sizes.size() == strides.size() && sizes.size() <= kMaxTensorDims, "emu: bad view");
  const DimPlan p = plan_dims(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), max_walk);
  std::vector<int64_t> out;
  for_each_read(p, [&](int64_t base, bool) {
    for (int64_t i = 0; i < p.visit; ++i) {
      const int64_t off = base + (p.flat ? i : strided_offset(p.desc, i));
      for (int64_t r = 0; r < p.mult; ++r) out.push_back(off);
    }
  });
  return {torch::tensor(out, torch::kInt64), p.flat, p.mult, p.flat ? 0 : p.desc.ndim, p.nouter};
}

// For a view read from storage offset `base` (in elements of `elem_size`
// bytes; storage 16-byte aligned): the launcher's read kind, and with
// kReadVectors the storage offsets of the elements its vector walk and its
// rows' tails read (vector_offset, strided_offset; each listed once per
// multiplicity), else none.
std::tuple<int64_t, at::Tensor> vector_offsets(std::vector<int64_t> sizes, std::vector<int64_t> strides,
                                               int64_t elem_size, int64_t base) {
  TORCH_CHECK(sizes.size() == strides.size() && sizes.size() <= kMaxTensorDims, "emu: bad view");
  TORCH_CHECK(elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8, "emu: elem_size");
  const DimPlan p = plan_dims(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data());
  StridedDesc vec;
  RowTails tails;
  const ReadKind read = vector_read(p, elem_size, static_cast<uintptr_t>(base * elem_size), vec, tails);
  std::vector<int64_t> out;
  if (read == kReadVectors) {
    const int64_t per = 16 / elem_size;
    for_each_read(p, [&](int64_t offset, bool) {
      for (int64_t i = 0; i < (p.visit - tails.visit) / per; ++i) {
        for (int64_t k = 0; k < per; ++k) {
          for (int64_t r = 0; r < p.mult; ++r) out.push_back(base + offset + vector_offset(vec, i) * per + k);
        }
      }
      for (int64_t i = 0; i < tails.visit; ++i) {
        for (int64_t r = 0; r < p.mult; ++r) out.push_back(base + offset + tails.offset + strided_offset(tails.desc, i));
      }
    });
  }
  return {static_cast<int64_t>(read), torch::tensor(out, torch::kInt64)};
}

// i // d through StridedDesc's multiply-shift division (i < 2**63, d >= 1).
at::Tensor fast_divide(const at::Tensor& i, int64_t d) {
  TORCH_CHECK(d >= 1 && i.scalar_type() == at::kLong, "emu: fast_divide needs int64 i and d >= 1");
  StridedDesc desc{};
  set_divisor(desc, 0, d);
  at::Tensor q = at::empty_like(i);
  const int64_t* pi = i.const_data_ptr<int64_t>();
  int64_t* pq = q.data_ptr<int64_t>();
  for (int64_t k = 0; k < i.numel(); ++k) {
    TORCH_CHECK(pi[k] >= 0, "emu: fast_divide needs i >= 0");
    pq[k] = static_cast<int64_t>(div_dim(desc, 0, static_cast<uint64_t>(pi[k])));
  }
  return q;
}

py::dict stats() {
  const emu::Stats s = emu::stats();
  py::dict d;
  d["launches"] = s.launches;
  d["blocks"] = s.blocks;
  d["threads"] = s.threads;
  d["barrier_phases"] = s.barrier_phases;
  d["warp_phases"] = s.warp_phases;
  d["device_atomics"] = s.device_atomics;
  return d;
}

// ---------------------------------------------------------------------------
// Probe kernels: the harness's own semantics, checked from Python against the
// CUDA definitions.
// ---------------------------------------------------------------------------
constexpr int kProbeCols = 10;

__global__ void warp_probe_kernel(long long* out) {
  const unsigned t = threadIdx.x;
  const unsigned lane = t % 32;
  const long long v = 1000 + t;
  long long* o = out + static_cast<int64_t>(t) * kProbeCols;
  o[0] = __shfl_down_sync(0xffffffffu, v, 5);
  o[1] = __shfl_up_sync(0xffffffffu, v, 3);
  o[2] = __shfl_xor_sync(0xffffffffu, v, 9);
  o[3] = __shfl_sync(0xffffffffu, v, 7);
  o[4] = __shfl_down_sync(0xffffffffu, v, 2, 8);
  o[5] = __shfl_xor_sync(0xffffffffu, v, 4, 4);
  o[6] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  o[7] = __all_sync(0xffffffffu, lane < 32) + 2 * __all_sync(0xffffffffu, lane < 31) +
         4 * __any_sync(0xffffffffu, lane == 30) + 8 * __any_sync(0xffffffffu, lane > 40);
  o[8] = static_cast<long long>(2.0 * __shfl_xor_sync(0xffffffffu, t + 0.25, 1));
  o[9] = __shfl_down_sync(0xffffffffu, static_cast<int>(t), 16) +
         static_cast<long long>(__shfl_up_sync(0xffffffffu, static_cast<unsigned>(t), 1)) * 10000;
}

// Every thread of every block hits the same shared and global cells.
__global__ void atomic_probe_kernel(unsigned long long* g_sum, long long* g_min, long long* g_max,
                                    double* g_dsum, unsigned long long* g_first,
                                    unsigned* out_shared) {
  __shared__ unsigned s_count;
  __shared__ unsigned long long s_sum;
  if (threadIdx.x == 0) {
    s_count = 0;
    s_sum = 0;
  }
  __syncthreads();
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  atomicAdd(&s_count, 1u);
  atomicAdd(&s_sum, static_cast<unsigned long long>(gid));
  atomicAdd(g_sum, static_cast<unsigned long long>(gid));
  atomicMin(g_min, 5 - gid);
  atomicMax(g_max, gid * 3);
  atomicAdd(g_dsum, 0.5);
  atomicCAS(g_first, ~0ull, static_cast<unsigned long long>(gid));
  __syncthreads();
  if (threadIdx.x == 0) {
    out_shared[2 * blockIdx.x] = s_count;
    out_shared[2 * blockIdx.x + 1] = static_cast<unsigned>(s_sum);
  }
}

__global__ void divergent_sync_kernel() {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void deadlock_kernel() {
  if (threadIdx.x % 32 != 0) (void)__shfl_down_sync(0xffffffffu, 1, 1);
  __syncthreads();
}

__global__ void partial_mask_kernel() {
  if (threadIdx.x % 32 < 16) (void)__shfl_down_sync(0x0000ffffu, 1, 1);
  __syncthreads();
}

__global__ void not_in_mask_kernel() { (void)__shfl_down_sync(0x0000ffffu, 1, 1); }

// Lanes that exit drop out of warp primitives and barriers, as on the GPU.
__global__ void exited_lanes_kernel(int* out) {
  if (threadIdx.x % 32 >= 16) return;
  const int v = __shfl_down_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 1, 16);
  __syncthreads();
  out[threadIdx.x] = v;
}

constexpr int kMatchCols = 4;

// __match_any_sync over 32-bit, 64-bit and float keys (bits, not values: -0 != +0).
__global__ void match_probe_kernel(long long* out) {
  const unsigned t = threadIdx.x;
  const unsigned lane = t % 32;
  long long* o = out + static_cast<int64_t>(t) * kMatchCols;
  o[0] = __match_any_sync(0xffffffffu, static_cast<int>(lane % 5));
  o[1] = __match_any_sync(0xffffffffu, static_cast<long long>(lane / 8) << 40);
  o[2] = __match_any_sync(0xffffffffu, lane % 3 == 0 ? -0.0f : 0.0f);
  o[3] = __match_any_sync(0xffffffffu, static_cast<unsigned>(t / 48));  // same keys in other warps
}

// Lanes 20..31 exit: the others match over their mask.
__global__ void match_exited_kernel(long long* out) {
  if (threadIdx.x % 32 >= 20) return;
  out[threadIdx.x] = __match_any_sync(0x000fffffu, static_cast<int>(threadIdx.x % 32) % 3);
}

// Each block: what its threads first see in dynamic shared memory, then
// words written by the block and read back reversed after a barrier.
__global__ void dynamic_smem_kernel(int* first, int* out, int words) {
  int* s = reinterpret_cast<int*>(emu::dynamic_smem());
  const int base = static_cast<int>(blockIdx.x) * words;
  for (int i = threadIdx.x; i < words; i += blockDim.x) first[base + i] = s[i];
  __syncthreads();
  for (int i = threadIdx.x; i < words; i += blockDim.x) s[i] = static_cast<int>(blockIdx.x) * 100000 + i;
  __syncthreads();
  for (int i = threadIdx.x; i < words; i += blockDim.x) out[base + i] = s[words - 1 - i];
}

__global__ void dynamic_overrun_kernel(int words) {
  if (threadIdx.x == 5) reinterpret_cast<int*>(emu::dynamic_smem())[words] = 1;
}

__global__ void trap_kernel() {
  if (threadIdx.x == 7) __trap();
  __syncthreads();
}

at::Tensor probe_warp(int64_t block) {
  auto out = at::full({block, kProbeCols}, -1, at::kLong);
  emu::launch(warp_probe_kernel, dim3(1), dim(block, "block"), 0,
              reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  return out;
}

// -> (sum, min, max, dsum, first, per-block [count, sum mod 2**32]).
py::tuple probe_atomics(int64_t grid, int64_t block) {
  unsigned long long sum = 0, first = ~0ull;
  long long mn = INT64_MAX, mx = INT64_MIN;
  double dsum = 0;
  auto shared = at::zeros({grid, 2}, at::kLong);
  std::vector<unsigned> sh(2 * grid);
  {
    py::gil_scoped_release nogil;
    emu::launch(atomic_probe_kernel, dim(grid, "grid"), dim(block, "block"), 0, &sum, &mn, &mx,
                &dsum, &first, sh.data());
  }
  for (int64_t i = 0; i < 2 * grid; ++i) shared.view(-1)[i] = static_cast<int64_t>(sh[i]);
  return py::make_tuple(sum, mn, mx, dsum, first, shared);
}

void probe_fault(const std::string& kind, int64_t block) {
  py::gil_scoped_release nogil;
  const dim3 b = dim(block, "block");
  if (kind == "divergent") {
    emu::launch(divergent_sync_kernel, dim3(1), b, 0);
  } else if (kind == "deadlock") {
    emu::launch(deadlock_kernel, dim3(1), b, 0);
  } else if (kind == "partial_mask") {
    emu::launch(partial_mask_kernel, dim3(1), b, 0);
  } else if (kind == "not_in_mask") {
    emu::launch(not_in_mask_kernel, dim3(1), b, 0);
  } else if (kind == "trap") {
    emu::launch(trap_kernel, dim3(1), b, 0);
  } else if (kind == "dynamic_too_big") {
    emu::launch(trap_kernel, dim3(1), b, 232448 + 4);
  } else if (kind == "dynamic_overrun") {
    emu::launch(dynamic_overrun_kernel, dim3(2), b, 64, 16);
  } else {
    throw std::invalid_argument("unknown probe: " + kind);
  }
}

at::Tensor probe_match(int64_t block) {
  auto out = at::full({block, kMatchCols}, -1, at::kLong);
  py::gil_scoped_release nogil;
  emu::launch(match_probe_kernel, dim3(1), dim(block, "block"), 0,
              reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  return out;
}

at::Tensor probe_match_exited(int64_t block) {
  auto out = at::full({block}, -1, at::kLong);
  py::gil_scoped_release nogil;
  emu::launch(match_exited_kernel, dim3(1), dim(block, "block"), 0,
              reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  return out;
}

// -> (first read [grid, words], read back [grid, words]).
py::tuple probe_dynamic_smem(int64_t grid, int64_t block, int64_t words) {
  TORCH_CHECK(words >= 1 && words <= 60000, "emu: words in [1, 60000]");
  auto first = at::full({grid, words}, 0, at::kInt), out = at::full({grid, words}, 0, at::kInt);
  {
    py::gil_scoped_release nogil;
    emu::launch(dynamic_smem_kernel, dim(grid, "grid"), dim(block, "block"),
                static_cast<size_t>(words) * 4, first.data_ptr<int>(), out.data_ptr<int>(),
                static_cast<int>(words));
  }
  return py::make_tuple(first, out);
}

at::Tensor probe_exited_lanes(int64_t block) {
  auto out = at::full({block}, -1, at::kInt);
  py::gil_scoped_release nogil;
  emu::launch(exited_lanes_kernel, dim3(1), dim(block, "block"), 0, out.data_ptr<int>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hookcap CUDA kernels executed on the CPU by tests/cuda_emu (test-only)";
  m.def("accumulate", &accumulate, "accumulate_kernel on CPU tensors; returns the read plan",
        py::arg("x"), py::arg("ring"), py::arg("state"), py::arg("row"), py::arg("hist_kind"),
        py::arg("hist_lo"), py::arg("hist_hi"), py::arg("hist_bins"), py::arg("grid"),
        py::arg("block"), py::arg("max_walk") = kMaxDims,
        py::arg("smem_budget") = hookcap_emu::kH100SmemBudget, py::arg("tree") = true);
  m.def("tree_tickets", &tree_tickets);
  m.def("hist_plan", &hist_plan, py::arg("hist_kind"), py::arg("hist_lo"), py::arg("hist_hi"),
        py::arg("hist_bins"), py::arg("work_is_float"),
        py::arg("smem_budget") = hookcap_emu::kH100SmemBudget);
  m.def("linear_bins", &linear_bins);
  m.def("probe_match", &probe_match);
  m.def("probe_match_exited", &probe_match_exited);
  m.def("probe_dynamic_smem", &probe_dynamic_smem);
  m.def("plan_offsets", &plan_offsets);
  m.def("vector_offsets", &vector_offsets);
  m.def("fast_divide", &fast_divide);
  m.def("reset_slot", &reset_slot);
  m.def("accumulate_update", &accumulate_update);
  m.def("accumulate_updates", &accumulate_updates);
  m.def("accumulate_bins", &accumulate_bins);
  m.def("attention_rows", &attention_rows);
  m.def("attention_qk", &attention_qk);
  m.def("accumulate_groups", &accumulate_groups);
  m.def("accumulate_many", &accumulate_many);
  m.def("set_fault", &set_fault);
  m.def("reset_rows", &reset_rows);
  m.def("advance", &advance, py::arg("ring"), py::arg("state"), py::arg("every"), py::arg("block"),
        py::arg("grid") = 1);
  m.def("configure", &configure, py::arg("order") = 0, py::arg("seed") = 0,
        py::arg("schedule") = 0);
  m.def("stats", &stats);
  m.def("probe_warp", &probe_warp);
  m.def("probe_atomics", &probe_atomics);
  m.def("probe_fault", &probe_fault);
  m.def("probe_exited_lanes", &probe_exited_lanes);
  py::register_exception<emu::KernelFault>(m, "KernelFault", PyExc_RuntimeError);
}
