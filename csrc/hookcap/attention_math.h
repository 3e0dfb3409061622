// attention_rows' per-row math, shared by the CPU loop, the CUDA kernel and
// the emulation harness: each row of pre-softmax logits, read twice (its
// max, then the sums about it), gives the row's logsumexp and its softmax's
// entropy in nats.
//
// About the row's max m, with d = m - l >= 0 and e = exp(-d):
//   lse = m + log1p(S'),  entropy = log1p(S') + T / (1 + S'),
// where S' = sum of e over the values below m plus one per extra value equal
// to m, and T = sum of e * d. Every term is non-negative: no cancellation in
// a peaked row (lse - sum p * l would cancel to float32's noise there).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace hookcap {

// Rows per block of the CUDA kernel (one warp each).
constexpr int kAttnRowsPerBlock = 8;

// The partial sums of one row (or of a part of it: they add).
struct SoftmaxSums {
  float others;  // S'
  float ties;    // values equal to the max, the first included
  float t;       // T
};

C10_HOST_DEVICE C10_ALWAYS_INLINE SoftmaxSums softmax_sums_zero() { return SoftmaxSums{0.f, 0.f, 0.f}; }

// The max of two logits, NaN if either is (a NaN logit makes the row's
// results NaN, as softmax would).
C10_HOST_DEVICE C10_ALWAYS_INLINE float logit_max(float a, float b) { return (b > a || b != b) ? b : a; }

// The keys query `q` may see under a causal mask aligned top-left (as
// F.scaled_dot_product_attention's is_causal): [0, min(q + 1, tk)). q < 0:
// no causal mask (all tk).
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t causal_keys(int64_t q, int64_t tk, bool causal) {
  if (!causal) return tk;
  return q + 1 < tk ? q + 1 : tk;
}

// One logit `l` of a row whose max is `m` (finite or +inf; never called for
// a row whose max is -inf). A masked logit (-inf) adds nothing.
C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_push(SoftmaxSums& a, float l, float m) {
  if (l == -std::numeric_limits<float>::infinity()) return;
  const float d = m - l;  // NaN where l or m is NaN, or both are +inf
  if (d == 0.f) {
    a.ties += 1.f;
    return;
  }
  const float e = ::expf(-d);
  a.others += e;
  a.t += e * d;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_merge(SoftmaxSums& a, const SoftmaxSums& b) {
  a.others += b.others;
  a.ties += b.ties;
  a.t += b.t;
}

// The row's logsumexp and entropy (nats): -inf both for a row with no
// allowed key (max -inf), NaN for a row holding a NaN or +inf logit.
C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_finish(float m, const SoftmaxSums& a, float* lse, float* entropy) {
  const float inf = std::numeric_limits<float>::infinity();
  if (m == -inf) {
    *lse = -inf;
    *entropy = -inf;
    return;
  }
  if (m == inf) {  // exp overflowed: the softmax is undefined
    *lse = std::numeric_limits<float>::quiet_NaN();
    *entropy = *lse;
    return;
  }
  const float others = a.others + (a.ties - 1.f);
  const float s = ::log1pf(others);
  *lse = m + s;
  *entropy = s + a.t / (1.f + others);
}

}  // namespace hookcap
