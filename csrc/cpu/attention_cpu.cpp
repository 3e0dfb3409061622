// attention_rows on the CPU: rows in parallel, each read twice from cache
// (its max, then the sums about it: attention_math.h), with kLanes partial
// sums per row (independent add chains; a shorter error path than one sum).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "hookcap/attention_math.h"
#include "hookcap/op_checks.h"

namespace hookcap {
namespace {

constexpr int kLanes = 8;

void attention_row(float* v, int64_t tk, int64_t keys, float* lse, float* entropy) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = keys; j < tk; ++j) v[j] = ninf;  // the causal mask, in place
  float mx[kLanes];
  for (float& m : mx) m = ninf;
  int64_t j = 0;
  for (; j + kLanes <= keys; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) mx[l] = logit_max(mx[l], v[j + l]);
  }
  for (; j < keys; ++j) mx[0] = logit_max(mx[0], v[j]);
  float m = mx[0];
  for (int l = 1; l < kLanes; ++l) m = logit_max(m, mx[l]);
  SoftmaxSums s[kLanes];
  for (SoftmaxSums& a : s) a = softmax_sums_zero();
  if (m != ninf) {
    for (j = 0; j + kLanes <= keys; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) softmax_push(s[l], v[j + l], m);
    }
    for (; j < keys; ++j) softmax_push(s[0], v[j], m);
    for (int w = kLanes / 2; w > 0; w /= 2) {
      for (int l = 0; l < w; ++l) softmax_merge(s[l], s[l + w]);
    }
  }
  softmax_finish(m, s[0], lse, entropy);
}

std::tuple<at::Tensor, at::Tensor> attention_rows_cpu(at::Tensor& logits, int64_t causal_row0) {
  check_attention_rows(logits, causal_row0);
  auto sizes = logits.sizes().vec();
  const int64_t tk = sizes.back();
  sizes.pop_back();
  const int64_t tile_rows = sizes.back();
  at::Tensor lse = at::empty(sizes, logits.options()), entropy = at::empty(sizes, logits.options());
  const int64_t rows = lse.numel();
  if (rows == 0) return {lse, entropy};
  float* x = logits.data_ptr<float>();
  float* pl = lse.data_ptr<float>();
  float* pe = entropy.data_ptr<float>();
  const bool causal = causal_row0 >= 0;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, tk));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t keys = causal_keys(causal_row0 + r % tile_rows, tk, causal);
      attention_row(x + r * tk, tk, keys, pl + r, pe + r);
    }
  });
  return {lse, entropy};
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) { m.impl("attention_rows", &attention_rows_cpu); }

}  // namespace hookcap
