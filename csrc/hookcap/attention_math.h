// attention_rows' per-row math, shared by the CPU loop, the CUDA kernels and
// the emulation harness: each row of pre-softmax logits, read twice (its
// max, then the sums about it), or once with the sums rebased whenever the
// max grows (attention_qk_kernel), gives the row's logsumexp and its
// softmax's entropy in nats.
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
#include <cstring>
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
// F.scaled_dot_product_attention's is_causal): [0, min(q + 1, tk)); all tk
// without one.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t causal_keys(int64_t q, int64_t tk, bool causal) {
  if (!causal) return tk;
  return q + 1 < tk ? q + 1 : tk;
}

// The float whose bits are `b`.
C10_HOST_DEVICE C10_ALWAYS_INLINE float float_from_bits(int32_t b) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

// a * b + c, rounded once where kFused (the CPU loop's AVX2+FMA build: one
// instruction, not two), else twice (the CUDA kernel, built with
// --fmad=false, and the baseline CPU loop). Either is within exp_neg's bound.
template <bool kFused>
C10_HOST_DEVICE C10_ALWAYS_INLINE float mul_add(float a, float b, float c) {
  if constexpr (kFused) {
    return ::fmaf(a, b, c);
  } else {
    return a * b + c;
  }
}

// exp(-d) for d >= 0 within 2 ulp, 0 from d = 87 on (below float's normal
// range; such a term is lost against the max's 1 anyway), with no branch:
// the CPU loop vectorises it. exp(-d) = 2^-k exp(-r), r = d - k ln 2 in
// [-ln2/2, ln2/2] (ln 2 split in two, Cody-Waite), exp(-r) by a degree-7
// polynomial (Cephes' expf coefficients).
template <bool kFused = false>
C10_HOST_DEVICE C10_ALWAYS_INLINE float exp_neg(float d) {
  const float x = d < 87.f ? d : 87.f;  // NaN: 87 (a NaN row is NaN by softmax_finish)
  const float k = ::floorf(mul_add<kFused>(x, 1.44269504088896341f, 0.5f));
  const float y = mul_add<kFused>(-k, 2.12194440e-4f, k * 0.693359375f - x);  // -r (k * 0.693359375f: exact)
  float p = 1.9875691500e-4f;
  p = mul_add<kFused>(p, y, 1.3981999507e-3f);
  p = mul_add<kFused>(p, y, 8.3334519073e-3f);
  p = mul_add<kFused>(p, y, 4.1665795894e-2f);
  p = mul_add<kFused>(p, y, 1.6666665459e-1f);
  p = mul_add<kFused>(p, y, 5.0000001201e-1f);
  p = mul_add<kFused>(p, y * y, y) + 1.f;
  const float scale = float_from_bits((127 - static_cast<int32_t>(k)) << 23);  // 2^-k, k <= 126: normal
  return d < 87.f ? p * scale : 0.f;
}

// One logit `l` of a row whose max `m` is finite (softmax_finish settles
// the others): d = m - l is in [0, inf], inf for a masked logit (-inf),
// which adds nothing. No branch: the CPU loop vectorises it.
template <bool kFused = false>
C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_push(float& others, float& ties, float& t, float l, float m) {
  const float d = m - l;
  const float e = exp_neg<kFused>(d);
  ties += d == 0.f ? 1.f : 0.f;
  others += d > 0.f ? e : 0.f;
  t = d < std::numeric_limits<float>::infinity() ? mul_add<kFused>(e, d, t) : t;  // masked: e * d = 0 * inf
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_push(SoftmaxSums& a, float l, float m) {
  softmax_push(a.others, a.ties, a.t, l, m);
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_merge(SoftmaxSums& a, const SoftmaxSums& b) {
  a.others += b.others;
  a.ties += b.ties;
  a.t += b.t;
}

// Sums `a` about max `m`, re-expressed about a larger max `m2` (online
// softmax: a part of a row summed before its max was known). About m2 every
// old term is e * w with w = exp(-(m2 - m)) and d + (m2 - m), the old ties
// included: others' = w * (others + ties), T' = w * (T + (m2 - m) * (others +
// ties)), no ties left; still no negative term. Nothing when m2 <= m or
// either is NaN (a NaN row is NaN by softmax_finish), none from m = -inf
// (empty sums; +inf - -inf would give inf * 0).
C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_rebase(SoftmaxSums& a, float m, float m2) {
  if (!(m2 > m)) return;
  const float gap = m2 - m;
  const float w = exp_neg(gap);
  const float n = a.others + a.ties;
  a.t = w * (n > 0.f ? a.t + gap * n : a.t);
  a.others = w * n;
  a.ties = 0.f;
}

// Sums `a` about max `ma` and `b` about `mb` into `a` about the larger of
// the two, which `ma` becomes.
C10_HOST_DEVICE C10_ALWAYS_INLINE void softmax_merge_about(float& ma, SoftmaxSums& a, float mb, SoftmaxSums b) {
  const float m = logit_max(ma, mb);
  softmax_rebase(a, ma, m);
  softmax_rebase(b, mb, m);
  softmax_merge(a, b);
  ma = m;
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
  if (m == inf || m != m) {  // a NaN logit, or exp overflowed: the softmax is undefined
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
