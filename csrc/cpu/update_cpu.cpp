// accumulate_update on the CPU: the optimizer's per-element update (or Adam
// ratio) and the parameter before the step, recomputed in blocks of doubles
// (update_math.h) and merged by the statistics loop. No tensor is made: each
// block lives in this thread's buffer.
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

// 2 x 32 KB on the stack; at least the loop's size for a local histogram.
constexpr int64_t kUpdateBlock = 4096;

void accumulate_update_cpu(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                           const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                           const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper,
                           int64_t rule, at::Tensor& ring, const at::Tensor& state, int64_t row_index,
                           int64_t row_base, int64_t hist_kind, double hist_lo, double hist_hi,
                           int64_t hist_bins) {
  check_update(param, grad, a, b, step, hyper, rule, ring, state, row_index, row_base);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  auto row_ptr = [&](int64_t r) {
    return ring.data_ptr<int64_t>() + (slot * ring.size(1) + r) * ring.size(2);
  };
  int64_t* row = row_ptr(row_index);
  int64_t* base_row = row_base >= 0 ? row_ptr(row_base) : nullptr;
  const int64_t n = param.numel();
  for (int64_t* r : {row, base_row}) {
    if (r == nullptr) continue;
    __atomic_fetch_add(r + kCount, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(r + kCalls, 1, __ATOMIC_RELAXED);
  }
  const UpdateRule rule_c = make_update_rule(rule, hyper, host_step(step, hyper));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "hookcap_update_cpu", [&] {
    const scalar_t* w = param.const_data_ptr<scalar_t>();
    const scalar_t* g = data_or_null<scalar_t>(grad);
    const scalar_t* pa = data_or_null<scalar_t>(a);
    const scalar_t* pb = data_or_null<scalar_t>(b);
    auto for_rule = [&](auto rule_tag) {
      constexpr int kRule = decltype(rule_tag)::value;
      // Blocks in parallel: their rows merge by atomics, so the double sums'
      // last bits may depend on the order the threads finish in.
      const int64_t nblocks = (n + kUpdateBlock - 1) / kUpdateBlock;
      // grain: small parameters stay on this thread (a parallel region costs more)
      at::parallel_for(0, nblocks, 4, [&](int64_t c0, int64_t c1) {
        double values[kUpdateBlock], bases[kUpdateBlock];
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b0 = c * kUpdateBlock, m = std::min(kUpdateBlock, n - b0);
          const scalar_t* wb = w + b0;
          for (int64_t i = 0; i < m; ++i) {
            const UpdateValue u = update_value_of<kRule>(
                rule_c, static_cast<double>(wb[i]), g ? static_cast<double>(g[b0 + i]) : 0.0,
                pa ? static_cast<double>(pa[b0 + i]) : 0.0, pb ? static_cast<double>(pb[b0 + i]) : 0.0);
            values[i] = u.value;
            bases[i] = u.base;
          }
          accumulate_doubles_cpu(values, m, row, h);
          if (base_row) accumulate_doubles_cpu(bases, m, base_row, h);
        }
      });
    };
    switch (rule) {
      case kRuleSgd: for_rule(std::integral_constant<int, kRuleSgd>{}); break;
      case kRuleAdam: for_rule(std::integral_constant<int, kRuleAdam>{}); break;
      case kRuleAdamRatio: for_rule(std::integral_constant<int, kRuleAdamRatio>{}); break;
      default: for_rule(std::integral_constant<int, kRuleDiff>{}); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("accumulate_update", &accumulate_update_cpu);
  m.impl("accumulate_updates", &accumulate_updates_each<&accumulate_update_cpu>);
}

}  // namespace hookcap
