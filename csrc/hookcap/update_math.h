// What an optimizer's step did to each element, recomputed from the
// parameter and the optimizer's state after the step: the update
// Δw = w_after − w_before and Adam's ratio g / (√v̂ + ε), with w_before.
// Shared by the CPU loop, the CUDA kernel and the emulation harness (plain
// C++ plus C10_HOST_DEVICE, as stats_math.h). All in double: the inputs are
// the optimizer's own values, so the result matches a float64 recomputation
// of the step up to the rounding of those stored values.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace hookcap {

// Which step (the op's `rule`).
constexpr int kRuleSgd = 0;   // torch.optim.SGD; a = momentum_buffer (or .grad holding d)
constexpr int kRuleAdam = 1;  // Adam/AdamW; a = exp_avg, b = exp_avg_sq (max_exp_avg_sq: amsgrad)
constexpr int kRuleDiff = 2;  // w − a, a = a copy of w taken before the step
constexpr int kRules = 3;

// What one pass can record per parameter (the op's `rows`, kOutputs per
// parameter, -1 where not recorded): Δw, w before the step, Adam's ratio
// g / (√v̂ + ε) (needs the gradient), and the state tensors a and b as read.
constexpr int kOutUpdate = 0, kOutBase = 1, kOutRatio = 2, kOutA = 3, kOutB = 4, kOutputs = 5;

// The op's `hyper` list, by index.
constexpr int kHypLr = 0, kHypWeightDecay = 1, kHypMomentum = 2, kHypBeta1 = 3, kHypBeta2 = 4,
              kHypEps = 5, kHypFlags = 6, kHypStep = 7, kHypCount = 8;
// Bits of hyper[kHypFlags].
constexpr int kFlagNesterov = 1, kFlagMaximize = 2, kFlagDecoupled = 4, kFlagHasBuf = 8;

struct UpdateRule {
  int rule;
  double lr, wd, momentum, beta1, beta2, eps;
  int flags;
  double step_size;     // Adam: lr / (1 − β1^t)
  double inv_bc2_sqrt;  // Adam: 1 / √(1 − β2^t)
  double inv_keep;      // 1 / (1 − lr·wd): w₀ from w after a decay step
};

// Reciprocals instead of per-element divisions (a double division costs the
// GPU dozens of instructions): the values move by an ulp of a double.
C10_HOST_DEVICE C10_ALWAYS_INLINE void update_set_keep(UpdateRule& r) { r.inv_keep = 1.0 / (1.0 - r.lr * r.wd); }

// Adam's bias corrections for step t (the optimizer's own step count,
// after its step: 1 on the first).
C10_HOST_DEVICE C10_ALWAYS_INLINE void update_set_step(UpdateRule& r, double t) {
  r.step_size = r.lr / (1.0 - ::pow(r.beta1, t));
  r.inv_bc2_sqrt = 1.0 / ::sqrt(1.0 - ::pow(r.beta2, t));
}

struct UpdateValue {
  double value;  // Δw
  double base;   // w before the step
  double ratio;  // Adam: g / (√v̂ + ε); else 0
};

// One element under rule kRule. w: the parameter after the step; g: its
// gradient (as the optimizer found it, before `maximize`); a, b: the rule's
// state tensors. `ratio`: compute Adam's ratio (a division per element).
template <int kRule>
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateValue update_value_of(const UpdateRule& r, double w, double g,
                                                              double a, double b, bool ratio) {
  const bool maximize = r.flags & kFlagMaximize;
  const double gs = maximize ? -g : g;  // the gradient the step descended
  if constexpr (kRule == kRuleDiff) {
    return {w - a, a, 0.0};
  } else if constexpr (kRule == kRuleSgd) {
    // torch: d = g' (+ μ·buf, Nesterov) or buf, g' = ±g + wd·w₀; w = w₀ − lr·d.
    if ((r.flags & kFlagHasBuf) && !(r.flags & kFlagNesterov)) return {-r.lr * a, w + r.lr * a, 0.0};
    const double c = gs + ((r.flags & kFlagNesterov) ? r.momentum * a : 0.0);
    const double w0 = (w + r.lr * c) * r.inv_keep;
    return {-r.lr * (c + r.wd * w0), w0, 0.0};
  } else {
    // Adam: w = w₀·(1 − lr·wd if decoupled) − step_size·m / (√v / √(1 − β2^t) + ε).
    const double inv_denom = 1.0 / (::sqrt(b) * r.inv_bc2_sqrt + r.eps);
    const double adam = -r.step_size * (a * inv_denom);
    const bool decoupled = r.flags & kFlagDecoupled;
    const double w0 = decoupled ? (w - adam) * r.inv_keep : w - adam;
    // The gradient the moments took: L2 weight decay (Adam's own) is part of it.
    const double gm = decoupled ? gs : gs + r.wd * w0;
    return {decoupled ? adam - r.lr * r.wd * w0 : adam, w0, ratio ? gm * inv_denom : 0.0};
  }
}

// Output `out` (kOut*) of one element: its value, or the input state read.
C10_HOST_DEVICE C10_ALWAYS_INLINE double update_output(const UpdateValue& u, double a, double b, int out) {
  switch (out) {
    case kOutUpdate: return u.value;
    case kOutBase: return u.base;
    case kOutRatio: return u.ratio;
    case kOutA: return a;
    default: return b;
  }
}

// update_value_of for the rule in `r` (a branch per element: the CUDA kernel's
// warps all take the same one; the CPU loop dispatches once per call).
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateValue update_value(const UpdateRule& r, double w, double g,
                                                           double a, double b, bool ratio) {
  switch (r.rule) {
    case kRuleSgd: return update_value_of<kRuleSgd>(r, w, g, a, b, ratio);
    case kRuleAdam: return update_value_of<kRuleAdam>(r, w, g, a, b, ratio);
    default: return update_value_of<kRuleDiff>(r, w, g, a, b, ratio);
  }
}

}  // namespace hookcap
