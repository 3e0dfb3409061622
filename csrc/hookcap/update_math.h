// What an optimizer's step did to each element, recomputed from the
// parameter and the optimizer's state after the step: the update
// Δw = w_after − w_before and Adam's ratio g / (√v̂ + ε), with w_before.
// Shared by the CPU loop, the CUDA kernel and the emulation harness (plain
// C++ plus C10_HOST_DEVICE, as stats_math.h). float64 parameters in double;
// narrower ones in float where every value provably stays a normal float
// (update_value_for): each value is then the float rounding of the step's
// arithmetic (a few units in float's last place, below the rounding of the
// stored weights themselves), else in double.
#pragma once

#include <c10/macros/Macros.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

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
  bool narrow_ok;       // update_rule_narrow_ok: float arithmetic allowed (update_value_for)
};

// Reciprocals instead of per-element divisions (a double division costs the
// GPU dozens of instructions): the values move by an ulp of a double.
C10_HOST_DEVICE C10_ALWAYS_INLINE void update_set_keep(UpdateRule& r) { r.inv_keep = 1.0 / (1.0 - r.lr * r.wd); }

// Adam's bias corrections for step t (the optimizer's own step count,
// after its step: 1 on the first).
// Then update_rule_narrow_ok again (the kernels set the step on the device).
C10_HOST_DEVICE C10_ALWAYS_INLINE void update_set_step(UpdateRule& r, double t);

// Whether the rule's constants allow float arithmetic: each 0 or within
// [2^-30, 2^30] (and √(1 − β2^t)'s reciprocal below 2^20). With the inputs
// and results update_narrow_ok admits, no product then falls below float's
// normal range, so no value is flushed to zero where double keeps it.
C10_HOST_DEVICE C10_ALWAYS_INLINE bool update_const_ok(double c) {
  const double m = c < 0 ? -c : c;
  return c == 0.0 || (m >= 0x1p-30 && m <= 0x1p30);
}
C10_HOST_DEVICE C10_ALWAYS_INLINE bool update_rule_narrow_ok(const UpdateRule& r) {
  return update_const_ok(r.lr) && update_const_ok(r.wd) && update_const_ok(r.momentum) &&
         update_const_ok(r.eps) && update_const_ok(r.step_size) && update_const_ok(r.inv_keep) &&
         r.inv_bc2_sqrt >= 0.0 && r.inv_bc2_sqrt <= 0x1p20;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void update_set_step(UpdateRule& r, double t) {
  r.step_size = r.lr / (1.0 - ::pow(r.beta1, t));
  r.inv_bc2_sqrt = 1.0 / ::sqrt(1.0 - ::pow(r.beta2, t));
  r.narrow_ok = update_rule_narrow_ok(r);
}

template <typename V>
struct UpdateValueT {
  V value;  // Δw
  V base;   // w before the step
  V ratio;  // Adam: g / (√v̂ + ε); else 0
};
using UpdateValue = UpdateValueT<double>;

// √x in V's own precision (::sqrt of a float would compute in double).
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE V update_sqrt(V x) {
  if constexpr (std::is_same_v<V, float>) {
    return ::sqrtf(x);
  } else {
    return ::sqrt(x);
  }
}

// One element under rule kRule, in arithmetic V (double, or float under
// update_value_for's conditions). w: the parameter after the step; g: its
// gradient (as the optimizer found it, before `maximize`); a, b: the rule's
// state tensors. `ratio`: compute Adam's ratio (a division per element).
template <int kRule, typename V = double>
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateValueT<V> update_value_of(const UpdateRule& r, V w, V g, V a, V b,
                                                                  bool ratio) {
  const V lr = static_cast<V>(r.lr), wd = static_cast<V>(r.wd), keep = static_cast<V>(r.inv_keep);
  const bool maximize = r.flags & kFlagMaximize;
  const V gs = maximize ? -g : g;  // the gradient the step descended
  if constexpr (kRule == kRuleDiff) {
    return {w - a, a, V(0)};
  } else if constexpr (kRule == kRuleSgd) {
    // torch: d = g' (+ μ·buf, Nesterov) or buf, g' = ±g + wd·w₀; w = w₀ − lr·d.
    if ((r.flags & kFlagHasBuf) && !(r.flags & kFlagNesterov)) return {-lr * a, w + lr * a, V(0)};
    const V c = gs + ((r.flags & kFlagNesterov) ? static_cast<V>(r.momentum) * a : V(0));
    const V w0 = (w + lr * c) * keep;
    return {-lr * (c + wd * w0), w0, V(0)};
  } else {
    // Adam: w = w₀·(1 − lr·wd if decoupled) − step_size·m / (√v / √(1 − β2^t) + ε).
    const V inv_denom = V(1) / (update_sqrt(b) * static_cast<V>(r.inv_bc2_sqrt) + static_cast<V>(r.eps));
    const V adam = -static_cast<V>(r.step_size) * (a * inv_denom);
    const bool decoupled = r.flags & kFlagDecoupled;
    const V w0 = decoupled ? (w - adam) * keep : w - adam;
    // The gradient the moments took: L2 weight decay (Adam's own) is part of it.
    const V gm = decoupled ? gs : gs + wd * w0;
    return {decoupled ? adam - lr * wd * w0 : adam, w0, ratio ? gm * inv_denom : V(0)};
  }
}

// Whether update_value_of<kRule, float>'s results are float roundings of the
// step's arithmetic: inputs 0 or within [2^-64, 2^40] (b, a second moment:
// [2^-100, 2^40]), results 0 or normal floats. Non-finite, huge or tiny
// values take double. Branch-free, so that the CPU loop vectorises it.
C10_HOST_DEVICE C10_ALWAYS_INLINE bool narrow_in_ok(float x, float lo) {
  const float m = ::fabsf(x);
  return (x == 0.0f) | ((m >= lo) & (m <= 0x1p40f));
}
C10_HOST_DEVICE C10_ALWAYS_INLINE bool narrow_out_ok(float x) {
  const float m = ::fabsf(x);
  return (x == 0.0f) | ((m >= FLT_MIN) & (m <= FLT_MAX));
}
C10_HOST_DEVICE C10_ALWAYS_INLINE bool update_narrow_ok(float w, float g, float a, float b,
                                                        const UpdateValueT<float>& u) {
  return narrow_in_ok(w, 0x1p-64f) & narrow_in_ok(g, 0x1p-64f) & narrow_in_ok(a, 0x1p-64f) &
         narrow_in_ok(b, 0x1p-100f) & narrow_out_ok(u.value) & narrow_out_ok(u.base) & narrow_out_ok(u.ratio);
}

// The values of one element of a parameter stored as T: float64 parameters
// in double; narrower ones in float where the rule and update_narrow_ok allow
// it, else in double. The one definition of each value: the CPU loop's
// vector path takes the float branch only for blocks where every element does.
template <int kRule, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateValue update_value_for(const UpdateRule& r, double w, double g, double a,
                                                               double b, bool ratio) {
  if constexpr (!std::is_same_v<T, double>) {
    if (r.narrow_ok) {
      const float wf = static_cast<float>(w), gf = static_cast<float>(g), af = static_cast<float>(a),
                  bf = static_cast<float>(b);
      const UpdateValueT<float> f = update_value_of<kRule, float>(r, wf, gf, af, bf, ratio);
      if (update_narrow_ok(wf, gf, af, bf, f)) return {f.value, f.base, f.ratio};
    }
  }
  return update_value_of<kRule, double>(r, w, g, a, b, ratio);
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

// update_value_for for the rule in `r` (a branch per element: the CUDA
// kernel's warps all take the same one; the CPU loop dispatches once per call).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE UpdateValue update_value(const UpdateRule& r, double w, double g,
                                                           double a, double b, bool ratio) {
  switch (r.rule) {
    case kRuleSgd: return update_value_for<kRuleSgd, T>(r, w, g, a, b, ratio);
    case kRuleAdam: return update_value_for<kRuleAdam, T>(r, w, g, a, b, ratio);
    default: return update_value_for<kRuleDiff, T>(r, w, g, a, b, ratio);
  }
}

}  // namespace hookcap
