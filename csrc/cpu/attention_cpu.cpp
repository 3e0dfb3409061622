// attention_rows on the CPU: rows in parallel, each read twice from cache
// (its max, then the sums about it: attention_math.h), with kLanes partial
// sums per row (vector lanes; a shorter error path than one sum), compiled
// for AVX2+FMA and for the baseline ISA, chosen at run time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "cpu/stats_cpu.h"
#include "hookcap/attention_math.h"
#include "hookcap/op_checks.h"

namespace hookcap {
namespace {

#define HC_ATTN_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;

// One row: the causal mask written, then its max and its sums in kLanes
// lanes each (the compiler vectorises both loops for the ISA of the function
// it is inlined into: attention_math.h's per-logit math has no branch).
HC_ATTN_INLINE void attention_row(float* v, int64_t tk, int64_t keys, float* lse, float* entropy) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = keys; j < tk; ++j) v[j] = ninf;
  float mx[kLanes];
  for (float& m : mx) m = ninf;
  const int64_t nv = keys - keys % kLanes;
  for (int64_t j = 0; j < nv; j += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) mx[l] = logit_max(mx[l], v[j + l]);
  }
  for (int64_t j = nv; j < keys; ++j) mx[0] = logit_max(mx[0], v[j]);
  float m = mx[0];
  for (int l = 1; l < kLanes; ++l) m = logit_max(m, mx[l]);
  SoftmaxSums s = softmax_sums_zero();
  if (m - m == 0.f) {  // finite: softmax_finish settles the rest
    float others[kLanes] = {}, ties[kLanes] = {}, t[kLanes] = {};
    for (int64_t j = 0; j < nv; j += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) softmax_push(others[l], ties[l], t[l], v[j + l], m);
    }
    for (int64_t j = nv; j < keys; ++j) softmax_push(others[0], ties[0], t[0], v[j], m);
    for (int w = kLanes / 2; w > 0; w /= 2) {  // pairwise
      for (int l = 0; l < w; ++l) {
        others[l] += others[l + w];
        ties[l] += ties[l + w];
        t[l] += t[l + w];
      }
    }
    s = SoftmaxSums{others[0], ties[0], t[0]};
  }
  softmax_finish(m, s, lse, entropy);
}

__attribute__((target("avx2,fma"))) void rows_avx2(float* x, int64_t r0, int64_t r1, int64_t tile_rows, int64_t tk,
                                                   int64_t causal_row0, float* lse, float* entropy) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t keys = causal_keys(causal_row0 + r % tile_rows, tk, causal_row0 >= 0);
    attention_row(x + r * tk, tk, keys, lse + r, entropy + r);
  }
}

void rows_baseline(float* x, int64_t r0, int64_t r1, int64_t tile_rows, int64_t tk, int64_t causal_row0,
                   float* lse, float* entropy) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t keys = causal_keys(causal_row0 + r % tile_rows, tk, causal_row0 >= 0);
    attention_row(x + r * tk, tk, keys, lse + r, entropy + r);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_rows_cpu(at::Tensor& logits, int64_t causal_row0) {
  AttentionRows a = attention_rows_outputs(logits, causal_row0);
  if (a.rows == 0) return {a.lse, a.entropy};
  float* x = logits.data_ptr<float>();
  float* pl = a.lse.data_ptr<float>();
  float* pe = a.entropy.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, a.keys));
  const bool avx2 = cpu_avx2();  // the statistics loop's choice (HOOKCAP_CPU_ISA=baseline forces it)
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    (avx2 ? rows_avx2 : rows_baseline)(x, r0, r1, a.tile_rows, a.keys, causal_row0, pl, pe);
  });
  return {a.lse, a.entropy};
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) { m.impl("attention_rows", &attention_rows_cpu); }

}  // namespace hookcap
