// accumulate_bins on the CPU: each element of an integer index tensor (a
// router's top-k expert choices) adds its value (its weight, or 1) to the row
// of the bin it names, so a bin's count is exactly the number of elements
// naming it (torch.bincount). Index tensors are small (tokens x k), so one
// scalar pass in double, the shared per-element math (stats_math.h,
// bins_math.h), partials per bin and thread, merged into the rows once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu/stats_cpu.h"
#include "cpu/stats_loop.h"
#include "hookcap/bins_math.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"

namespace hookcap {
namespace {

constexpr int64_t kBinsGrain = 1 << 15;         // elements per task
constexpr int64_t kBinsRun = 1 << 24;           // elements between flushes (uint32 counters never overflow)
constexpr int64_t kLocalHistWords = 1 << 20;    // more bins x histogram bins than this count into the ring

// One bin's partial in one thread: moments and extrema (Acc, WideAcc), its
// element count, and the histogram bins it touched [lo, hi] in `local`.
struct BinPart {
  Acc acc;
  WideAcc wide;
  int64_t count;
  int64_t lo, hi;
};

struct BinsState {
  std::vector<BinPart> part;
  std::vector<uint32_t> local;  // bins x nbins counters, all zero between flushes
};

void flush_bins(BinsState& s, int64_t* const* rows, int64_t nbins, bool local) {
  for (size_t b = 0; b < s.part.size(); ++b) {
    BinPart& p = s.part[b];
    if (p.count == 0) continue;
    int64_t* row = rows[b];
    HostAtomics::add_i64(row + kCount, p.count);
    row_merge<HostAtomics>(row, p.acc);
    wide_to_row<HostAtomics>(row, p.wide, 1);
    if (local) {
      uint32_t* c = s.local.data() + b * nbins;
      for (int64_t k = p.lo; k <= p.hi; ++k) {
        if (c[k]) HostAtomics::add_i64(row + kHeader + k, c[k]);
        c[k] = 0u;
      }
    }
    acc_init(p.acc);
    wide_init(p.wide);
    p.count = 0;
    p.lo = nbins;
    p.hi = -1;
  }
}

template <typename I, typename W>
void bins_loop(const I* index, const W* weight, int64_t n, int64_t* const* rows, const double* shift, int64_t bins,
               const HistSpec& h) {
  const int64_t nbins = h.kind == kHistNone ? 0 : h.nbins;
  const bool local = nbins > 0 && bins * nbins <= kLocalHistWords;
  at::parallel_for(0, n, kBinsGrain, [&](int64_t i0, int64_t i1) {
    thread_local BinsState s;
    s.part.resize(bins);
    for (BinPart& p : s.part) {
      acc_init(p.acc);
      wide_init(p.wide);
      p.count = 0;
      p.lo = nbins;
      p.hi = -1;
    }
    if (local && static_cast<int64_t>(s.local.size()) < bins * nbins) s.local.assign(bins * nbins, 0u);
    for (int64_t r0 = i0; r0 < i1; r0 += kBinsRun) {
      const int64_t r1 = std::min(i1, r0 + kBinsRun);
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t b = bin_of(index[i], bins);
        if (b < 0 || rows[b] == nullptr) continue;
        BinPart& p = s.part[b];
        const double v = bins_value(weight, i);
        ++p.count;
        acc_push_wide(p.acc, p.wide, v, shift[b]);
        if (nbins == 0) continue;
        const int64_t k = hist_bin(v, h);
        if (k < 0) continue;
        if (local) {
          ++s.local[b * nbins + k];
          p.lo = std::min(p.lo, k);
          p.hi = std::max(p.hi, k);
        } else {
          HostAtomics::add_i64(rows[b] + kHeader + k, 1);
        }
      }
      flush_bins(s, rows, nbins, local);
    }
  });
}

void accumulate_bins_cpu(const at::Tensor& index, const c10::optional<at::Tensor>& weight, at::Tensor& ring,
                         const at::Tensor& state, c10::IntArrayRef rows, int64_t hist_kind, double hist_lo,
                         double hist_hi, int64_t hist_bins) {
  check_bins(index, weight, ring, state, rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  const int64_t bins = static_cast<int64_t>(rows.size());
  const int64_t n = index.numel();
  const bool weighted = weight.has_value() && weight->defined();
  std::vector<int64_t*> row_of(bins, nullptr);
  std::vector<double> shift(bins, 0.0);
  auto run = [&](auto* w) {
    const double cand = bins_shift_candidate(w, n);
    for (int64_t b = 0; b < bins; ++b) {
      if (rows[b] < 0) continue;
      row_of[b] = ring.data_ptr<int64_t>() + (slot * ring.size(1) + rows[b]) * ring.size(2);
      __atomic_fetch_add(row_of[b] + kCalls, 1, __ATOMIC_RELAXED);
      shift[b] = row_shift(row_of[b], cand);
    }
    if (n == 0) return;
    AT_DISPATCH_INTEGRAL_TYPES(index.scalar_type(), "hookcap_bins_cpu", [&] {
      bins_loop(index.const_data_ptr<scalar_t>(), w, n, row_of.data(), shift.data(), bins, h);
    });
  };
  if (!weighted) {
    run(static_cast<const float*>(nullptr));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight->scalar_type(), "hookcap_bins_cpu_w", [&] {
    run(weight->const_data_ptr<scalar_t>());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) { m.impl("accumulate_bins", &accumulate_bins_cpu); }

}  // namespace hookcap
