// CPU implementation of the hookcap ops: the statistics op reads a tensor
// with the loop in stats_loop.h (instantiated per dtype in
// accumulate_<dtype>.cpp); the ring's slot and reset ops; the statistics of
// values other kernels produce (doubles_*).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu/stats_loop.h"

namespace hookcap {
namespace {

// Rows [0, rows) at `base` reset for `step`. keep_reset: leave out rows
// already reset for `step` (the host resets the CPU rows it has read, while
// they are in its cache: hookcap/_drain.py); only a reset writes kStepTag, so
// a row tagged `step` has not been written since.
void reset_rows(int64_t* base, int64_t rows, int64_t width, int64_t step, bool keep_reset = false) {
  const auto stale = [&](int64_t r) { return !keep_reset || base[r * width + kStepTag] != step; };
  int64_t r = 0;
  while (r < rows && !stale(r)) ++r;
  if (r == rows) return;
  // One row built from reset_value, then copied: a per-value switch over every
  // bin of thousands of rows costs more than the copy itself.
  int64_t* tmpl = base + r * width;
  for (int64_t c = 0; c < width; ++c) tmpl[c] = reset_value(c, step);
  for (++r; r < rows; ++r) {
    if (stale(r)) std::memcpy(base + r * width, tmpl, width * sizeof(int64_t));
  }
}

void reset_slot_cpu(at::Tensor& ring, const at::Tensor& state) {
  check_ring_state(ring, state);
  const int64_t* st = state.data_ptr<int64_t>();
  const int64_t slot = state_slot(ring, st);
  reset_rows(ring.data_ptr<int64_t>() + slot * ring.size(1) * ring.size(2), ring.size(1),
             ring.size(2), st[kStateStep]);
}

void reset_rows_cpu(at::Tensor& ring, const at::Tensor& state, int64_t begin, int64_t end) {
  check_reset_rows(ring, state, begin, end);
  const int64_t* st = state.data_ptr<int64_t>();
  const int64_t slot = state_slot(ring, st);
  reset_rows(ring.data_ptr<int64_t>() + (slot * ring.size(1) + begin) * ring.size(2),
             end - begin, ring.size(2), st[kStateStep]);
}

void advance_cpu(at::Tensor& ring, at::Tensor& state, int64_t every) {
  check_ring_state(ring, state);
  TORCH_CHECK(every >= 1, "hookcap.advance: every must be >= 1, got ", every);
  int64_t* st = state.data_ptr<int64_t>();
  const StepState next = next_state(st, every, ring.size(0));
  if (next.enabled) {
    reset_rows(ring.data_ptr<int64_t>() + next.slot * ring.size(1) * ring.size(2),
               ring.size(1), ring.size(2), next.step, /*keep_reset=*/true);
  }
  st[kStateStep] = next.step;
  st[kStateEnabled] = next.enabled;
  st[kStateSlot] = next.slot;
}

// Host clock on CPU: the op runs synchronously, in program order with the
// module's own CPU work.
void time_mark_cpu(at::Tensor& ring, const at::Tensor& state, int64_t row, int64_t phase,
                   bool start) {
  check_time_mark(ring, state, row, phase);
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  row_time_mark<HostAtomics>(ring.data_ptr<int64_t>() + (slot * ring.size(1) + row) * ring.size(2),
                             phase, start, now);
}

}  // namespace

int64_t state_slot(int64_t slots, const int64_t* st) {
  const int64_t slot = st[kStateSlot];
  TORCH_CHECK(slot >= 0 && slot < slots, "hookcap: state slot ", slot, " out of range for ", slots, " slots");
  return slot;
}

int64_t state_slot(const at::Tensor& ring, const int64_t* st) { return state_slot(ring.size(0), st); }

bool cpu_avx2() { return use_avx2(); }

void partial_flush(Partial& p) {
  if (!p.started) return;
  row_merge<HostAtomics>(p.row, p.acc);
  wide_to_row<HostAtomics>(p.row, p.wide, 1);
  if (!p.local || p.pending == 0) return;
  with_partial_kind(p, [&](auto kind) { partial_flush_counts<decltype(kind)::value>(p); });
}

double row_shift(int64_t* row, double cand) {
  const int64_t found = HostAtomics::cas_i64(row + kShift, kShiftUnset, dbits(cand));
  return found == kShiftUnset ? cand : bitsd(found);
}

void accumulate_tensor_cpu(const at::Tensor& x_in, int64_t* row, const HistSpec& h) {
  if (x_in.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND4(
      at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, x_in.scalar_type(),
      "hookcap_accumulate_cpu", [&] {
        const scalar_t* x = x_in.const_data_ptr<scalar_t>();
        if (x_in.is_non_overlapping_and_dense()) {  // plan_read's flat read, without building the plan
          static const StridedDesc unused{};
          accumulate_read<scalar_t>(x, true, unused, x_in.numel(), 1, row, h);
          return;
        }
        const DimPlan plan = plan_read(x_in);
        for_each_read(plan, [&](int64_t offset, bool) {
          accumulate_read<scalar_t>(x + offset, plan.flat, plan.desc, plan.visit, plan.mult, row, h);
        });
      });
}

CpuRing cpu_ring(at::Tensor& ring, const at::Tensor& state) {
  return CpuRing{ring.data_ptr<int64_t>(), state.data_ptr<int64_t>(), ring.size(0), ring.size(1), ring.size(2)};
}

void accumulate_row_cpu(const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state,
                        int64_t row_index, const HistSpec& h) {
  accumulate_row_cpu(x_in, cpu_ring(ring, state), row_index, h);
}

void accumulate_row_cpu(const at::Tensor& x_in, const CpuRing& r, int64_t row_index, const HistSpec& h) {
  const int64_t* st = r.state;
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(r.slots, st);
  int64_t* row = r.data + (slot * r.rows + row_index) * r.width;
  // The header's lines fetched together: each locked add waits for its own.
  __builtin_prefetch(row, 1);
  __builtin_prefetch(row + kSumSq, 1);
  __builtin_prefetch(row + kHeader, 1);
  const int64_t n = x_in.numel();
  HostAtomics::add_i64(row + kCount, n);
  HostAtomics::add_i64(row + kCalls, 1);
  if (n == 0) return;
  accumulate_tensor_cpu(x_in, row, h);
}

static void accumulate_cpu(const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state,
                           int64_t row_index, int64_t hist_kind, double hist_lo, double hist_hi,
                           int64_t hist_bins) {
  check_accumulate(x_in, ring, state, row_index);
  accumulate_row_cpu(x_in, ring, state, row_index,
                     make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2)));
}

static void accumulate_many_cpu(at::TensorList xs, at::Tensor& ring, const at::Tensor& state,
                                c10::IntArrayRef rows, int64_t hist_kind, double hist_lo, double hist_hi,
                                int64_t hist_bins) {
  check_many(xs, ring, state, rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  for (size_t i = 0; i < xs.size(); ++i) {
    if (rows[i] >= 0) accumulate_row_cpu(xs[i], ring, state, rows[i], h);
  }
}

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("accumulate", &accumulate_cpu);
  m.impl("accumulate_many", &accumulate_many_cpu);
  m.impl("reset_slot", &reset_slot_cpu);
  m.impl("reset_rows", &reset_rows_cpu);
  m.impl("advance", &advance_cpu);
  m.impl("time_mark", &time_mark_cpu);
}

}  // namespace hookcap
