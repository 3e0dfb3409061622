// accumulate_update on the CPU: the optimizer's per-element update, the
// parameter before the step and Adam's ratio, recomputed in blocks of
// doubles (update_math.h) and merged by the statistics loop; the state
// tensors by the statistics op's loop. No tensor is made: each block lives
// in this thread's buffer.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "cpu/stats_cpu.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"
#include "hookcap/update_math.h"

namespace hookcap {
namespace {

// Values per block: three blocks of doubles and their local histograms
// (3 x 16 KB) on the stack.
constexpr int64_t kUpdateBlock = 1024;

// One block's Δw, w before and (kRatio) Adam's ratio: a loop without
// branches on the outputs, so that the compiler vectorises the division and
// square root.
template <int kRule, bool kRatio, typename T>
__attribute__((always_inline)) inline void fill_block(const UpdateRule& r, const T* w, const T* g, const T* a, const T* b, int64_t m,
                                 double* value, double* base, double* ratio) {
  for (int64_t i = 0; i < m; ++i) {
    const UpdateValue u = update_value_of<kRule>(r, static_cast<double>(w[i]), g ? static_cast<double>(g[i]) : 0.0,
                                                 a ? static_cast<double>(a[i]) : 0.0,
                                                 b ? static_cast<double>(b[i]) : 0.0, kRatio);
    value[i] = u.value;
    base[i] = u.base;
    if constexpr (kRatio) ratio[i] = u.ratio;
  }
}

// The same loop for AVX2 (no FMA: the values match the baseline build's).
template <int kRule, bool kRatio, typename T>
__attribute__((target("avx2"))) void fill_block_avx2(const UpdateRule& r, const T* w, const T* g, const T* a,
                                                     const T* b, int64_t m, double* value, double* base,
                                                     double* ratio) {
  fill_block<kRule, kRatio>(r, w, g, a, b, m, value, base, ratio);
}

void accumulate_update_cpu(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                           const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                           const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper,
                           int64_t rule, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                           int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_update(param, grad, a, b, step, hyper, rule, ring, state, rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  const int64_t n = param.numel();
  int64_t* row_of[kOutputs] = {};
  for (int o = 0; o < kOutputs; ++o) {
    if (rows[o] < 0) continue;
    int64_t* r = ring.data_ptr<int64_t>() + (slot * ring.size(1) + rows[o]) * ring.size(2);
    __atomic_fetch_add(r + kCount, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(r + kCalls, 1, __ATOMIC_RELAXED);
    row_of[o] = r;
  }
  // The state tensors as stored: the statistics op's own loop (in float for
  // float32 state, as when the op records them).
  if (row_of[kOutA]) accumulate_tensor_cpu(*a, row_of[kOutA], h);
  if (row_of[kOutB]) accumulate_tensor_cpu(*b, row_of[kOutB], h);
  if (!row_of[kOutUpdate] && !row_of[kOutBase] && !row_of[kOutRatio]) return;
  const UpdateRule rule_c = make_update_rule(rule, hyper, host_step(step, hyper));
  const bool avx2 = cpu_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "hookcap_update_cpu", [&] {
    const scalar_t* w = param.const_data_ptr<scalar_t>();
    const scalar_t* g = data_or_null<scalar_t>(grad);
    const scalar_t* pa = data_or_null<scalar_t>(a);
    const scalar_t* pb = data_or_null<scalar_t>(b);
    auto for_rule = [&](auto rule_tag, auto ratio_tag) {
      constexpr int kRule = decltype(rule_tag)::value;
      constexpr bool kRatio = decltype(ratio_tag)::value;
      // Threads take runs of blocks, each with its own partials, merged into
      // the rows once per run: the double sums' last bits may depend on the
      // order the threads finish in.
      const int64_t nblocks = (n + kUpdateBlock - 1) / kUpdateBlock;
      // grain: small parameters stay on this thread (a parallel region costs more)
      at::parallel_for(0, nblocks, 16, [&](int64_t c0, int64_t c1) {
        double vals[3][kUpdateBlock];  // Δw, w before, ratio (kOutUpdate..kOutRatio)
        uint32_t local[3][kDoublesLocalWords];
        DoublesPartial part[3];
        for (int k = 0; k < 3; ++k) {
          if (row_of[k]) doubles_begin(part[k], row_of[k], h, local[k]);
        }
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b0 = c * kUpdateBlock, m = std::min(kUpdateBlock, n - b0);
          auto at = [&](const scalar_t* p) { return p ? p + b0 : nullptr; };
          if (avx2) {
            fill_block_avx2<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m, vals[0], vals[1], vals[2]);
          } else {
            fill_block<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m, vals[0], vals[1], vals[2]);
          }
          for (int k = 0; k < 3; ++k) {
            if (row_of[k]) doubles_push(part[k], vals[k], m);
          }
        }
        for (int k = 0; k < 3; ++k) {
          if (row_of[k]) doubles_flush(part[k]);
        }
      });
    };
    using Yes = std::true_type;
    using No = std::false_type;
    const bool ratio = row_of[kOutRatio] != nullptr;
    switch (rule) {
      case kRuleSgd: for_rule(std::integral_constant<int, kRuleSgd>{}, No{}); break;
      case kRuleAdam:
        if (ratio) {
          for_rule(std::integral_constant<int, kRuleAdam>{}, Yes{});
        } else {
          for_rule(std::integral_constant<int, kRuleAdam>{}, No{});
        }
        break;
      default: for_rule(std::integral_constant<int, kRuleDiff>{}, No{}); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("accumulate_update", &accumulate_update_cpu);
  m.impl("accumulate_updates", &accumulate_updates_each<&accumulate_update_cpu>);
}

}  // namespace hookcap
