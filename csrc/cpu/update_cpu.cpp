// accumulate_update on the CPU: the optimizer's per-element update, the
// parameter before the step and Adam's ratio, recomputed block by block
// (update_math.h: in float for narrower parameters where every value of the
// block allows it, else in double) and merged by the float or double
// statistics loop; the state tensors by the statistics op's loop. No tensor
// is made: each block lives in this thread's buffer.
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

// Values per block (the float statistics loop's own block): three blocks of
// floats, and of doubles where a block takes the exact path.
constexpr int64_t kUpdateBlock = 2048;

// An input of the block, or a block of zeros where the step has none: the
// loops below then load without a branch, so they vectorise.
template <typename T>
inline const T* or_zeros(const T* p) {
  static const T kZeros[kUpdateBlock] = {};
  return p ? p : kZeros;
}

// One block's Δw, w before and (kRatio) Adam's ratio of a parameter narrower
// than double, in float (update_value_of<kRule, float>). Returns whether every
// element passes update_narrow_ok, that is whether these are
// update_value_for's values; else the caller takes fill_block. No branch on
// the values, so that the compiler vectorises the division and square root.
template <int kRule, bool kRatio, typename T>
__attribute__((always_inline)) inline bool fill_block_narrow(const UpdateRule& r, const T* __restrict w, const T* g,
                                                             const T* a, const T* b, int64_t m,
                                                             float* __restrict value, float* __restrict base,
                                                             float* __restrict ratio) {
  const T* __restrict gz = or_zeros(g);
  const T* __restrict az = or_zeros(a);
  const T* __restrict bz = or_zeros(b);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float wf = static_cast<float>(w[i]), gf = static_cast<float>(gz[i]), af = static_cast<float>(az[i]),
                bf = static_cast<float>(bz[i]);
    const UpdateValueT<float> u = update_value_of<kRule, float>(r, wf, gf, af, bf, kRatio);
    value[i] = u.value;
    base[i] = u.base;
    if constexpr (kRatio) ratio[i] = u.ratio;
    bad |= !update_narrow_ok(wf, gf, af, bf, u);
  }
  return bad == 0;
}

// update_value_for's values of one block, in doubles (vectorised for
// float64 parameters; narrower ones come here only for blocks with values
// outside float's range, element by element).
template <int kRule, bool kRatio, typename T>
__attribute__((always_inline)) inline void fill_block(const UpdateRule& r, const T* w, const T* g, const T* a,
                                                      const T* b, int64_t m, double* value, double* base,
                                                      double* ratio) {
  const T* __restrict gz = or_zeros(g);
  const T* __restrict az = or_zeros(a);
  const T* __restrict bz = or_zeros(b);
  for (int64_t i = 0; i < m; ++i) {
    const UpdateValue u = update_value_for<kRule, T>(r, static_cast<double>(w[i]), static_cast<double>(gz[i]),
                                                     static_cast<double>(az[i]), static_cast<double>(bz[i]), kRatio);
    value[i] = u.value;
    base[i] = u.base;
    if constexpr (kRatio) ratio[i] = u.ratio;
  }
}

// The same loops for AVX2 (no FMA: the values match the baseline build's).
template <int kRule, bool kRatio, typename T>
__attribute__((target("avx2"))) bool fill_block_narrow_avx2(const UpdateRule& r, const T* w, const T* g, const T* a,
                                                            const T* b, int64_t m, float* value, float* base,
                                                            float* ratio) {
  return fill_block_narrow<kRule, kRatio>(r, w, g, a, b, m, value, base, ratio);
}
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
    if (rows[o] >= 0) row_of[o] = counted_row(ring, slot, rows[o], n);
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
      // Narrower parameters in float where the rule allows it, block by block.
      const bool narrow = !std::is_same_v<scalar_t, double> && rule_c.narrow_ok;
      // grain: small parameters stay on this thread (a parallel region costs more)
      at::parallel_for(0, nblocks, 8, [&](int64_t c0, int64_t c1) {
        float fvals[3][kUpdateBlock];   // Δw, w before, ratio (kOutUpdate..kOutRatio)
        double dvals[3][kUpdateBlock];  // the same on the exact path
        uint32_t flocal[3][kPartialLocalWords], dlocal[3][kPartialLocalWords];
        Partial fpart[3];
        Partial dpart[3];
        bool dstarted = false;  // the doubles' partials begin with their first block
        for (int k = 0; k < 3; ++k) {
          if (row_of[k] && narrow) partial_begin<float>(fpart[k], row_of[k], h, flocal[k]);
        }
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b0 = c * kUpdateBlock, m = std::min(kUpdateBlock, n - b0);
          auto at = [&](const scalar_t* p) { return p ? p + b0 : nullptr; };
          if (narrow && (avx2 ? fill_block_narrow_avx2<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m,
                                                                      fvals[0], fvals[1], fvals[2])
                              : fill_block_narrow<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m,
                                                                 fvals[0], fvals[1], fvals[2]))) {
            for (int k = 0; k < 3; ++k) {
              if (row_of[k]) partial_push<float>(fpart[k], fvals[k], m);
            }
            continue;
          }
          if (!dstarted) {
            for (int k = 0; k < 3; ++k) {
              if (row_of[k]) partial_begin<double>(dpart[k], row_of[k], h, dlocal[k]);
            }
            dstarted = true;
          }
          if (avx2) {
            fill_block_avx2<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m, dvals[0], dvals[1], dvals[2]);
          } else {
            fill_block<kRule, kRatio>(rule_c, w + b0, at(g), at(pa), at(pb), m, dvals[0], dvals[1], dvals[2]);
          }
          for (int k = 0; k < 3; ++k) {
            if (row_of[k]) partial_push<double>(dpart[k], dvals[k], m);
          }
        }
        for (int k = 0; k < 3; ++k) {
          if (row_of[k] && narrow) partial_flush(fpart[k]);
          if (row_of[k] && dstarted) partial_flush(dpart[k]);
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
