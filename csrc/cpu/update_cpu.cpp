// accumulate_update on the CPU: the optimizer's per-element update, the
// parameter before the step, Adam's ratio and the state tensors, recomputed
// in blocks of doubles (update_math.h) in one pass and merged by the
// statistics loop. No tensor is made: each block lives in this thread's
// buffer.
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

// Values per block: kOutputs blocks of doubles and their local histograms
// (kOutputs x 16 KB) on the stack.
constexpr int64_t kUpdateBlock = 1024;

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
  // The recorded outputs, in kOut* order: outs[k] of row_ptrs[k].
  int outs[kOutputs];
  int64_t* row_ptrs[kOutputs];
  int nout = 0;
  const int64_t n = param.numel();
  for (int o = 0; o < kOutputs; ++o) {
    if (rows[o] < 0) continue;
    int64_t* r = ring.data_ptr<int64_t>() + (slot * ring.size(1) + rows[o]) * ring.size(2);
    __atomic_fetch_add(r + kCount, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(r + kCalls, 1, __ATOMIC_RELAXED);
    outs[nout] = o;
    row_ptrs[nout++] = r;
  }
  const bool want_ratio = rows[kOutRatio] >= 0;
  const bool want_step = rows[kOutUpdate] >= 0 || rows[kOutBase] >= 0 || want_ratio;
  const UpdateRule rule_c = make_update_rule(rule, hyper, host_step(step, hyper));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "hookcap_update_cpu", [&] {
    const scalar_t* w = param.const_data_ptr<scalar_t>();
    const scalar_t* g = data_or_null<scalar_t>(grad);
    const scalar_t* pa = data_or_null<scalar_t>(a);
    const scalar_t* pb = data_or_null<scalar_t>(b);
    auto for_rule = [&](auto rule_tag) {
      constexpr int kRule = decltype(rule_tag)::value;
      // Threads take runs of blocks, each with its own partials, merged into
      // the rows once per run: the double sums' last bits may depend on the
      // order the threads finish in.
      const int64_t nblocks = (n + kUpdateBlock - 1) / kUpdateBlock;
      // grain: small parameters stay on this thread (a parallel region costs more)
      at::parallel_for(0, nblocks, 16, [&](int64_t c0, int64_t c1) {
        double vals[kOutputs][kUpdateBlock];
        uint32_t local[kOutputs][kDoublesLocalWords];
        DoublesPartial part[kOutputs];
        for (int k = 0; k < nout; ++k) doubles_begin(part[k], row_ptrs[k], h, local[k]);
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b0 = c * kUpdateBlock, m = std::min(kUpdateBlock, n - b0);
          for (int64_t i = 0; i < m; ++i) {
            const double av = pa ? static_cast<double>(pa[b0 + i]) : 0.0;
            const double bv = pb ? static_cast<double>(pb[b0 + i]) : 0.0;
            const UpdateValue u = want_step ? update_value_of<kRule>(
                rule_c, static_cast<double>(w[b0 + i]), g ? static_cast<double>(g[b0 + i]) : 0.0, av, bv,
                want_ratio) : UpdateValue{0.0, 0.0, 0.0};
            for (int k = 0; k < nout; ++k) vals[k][i] = update_output(u, av, bv, outs[k]);
          }
          for (int k = 0; k < nout; ++k) doubles_push(part[k], vals[k], m);
        }
        for (int k = 0; k < nout; ++k) doubles_flush(part[k]);
      });
    };
    switch (rule) {
      case kRuleSgd: for_rule(std::integral_constant<int, kRuleSgd>{}); break;
      case kRuleAdam: for_rule(std::integral_constant<int, kRuleAdam>{}); break;
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
