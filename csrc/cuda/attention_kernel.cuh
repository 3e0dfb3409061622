// attention_rows' CUDA kernel: one warp per row of a float32 tile of logits
// (attention_math.h holds the math). Plain CUDA C++, compiled by nvcc
// (stats_launch.cu) and by the CPU emulation harness (tests/cuda_emu).
//
// Each lane reads every 32nd logit of its row (coalesced), twice: the
// row's max, reduced across the warp, then the sums about it. The second
// read of a row (4 KB at 1,024 keys) comes from L1/L2. Keys a causal mask
// hides are written -inf and never read.
#pragma once

#include "cuda/stats_kernel.cuh"
#include "hookcap/attention_math.h"

namespace hookcap {
namespace kernels {

static_assert(kAttnRowsPerBlock * kWarpSize == kThreads, "one warp per row");

// rows: rows of the whole tensor; tile_rows: its size(-2); causal_row0: as
// the op's (-1: none).
__global__ void __launch_bounds__(kThreads)
    attention_rows_kernel(float* logits, int64_t rows, int64_t tile_rows, int64_t tk, int64_t causal_row0,
                          float* lse, float* entropy) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kAttnRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // the whole warp: no shuffle below misses a lane
  float* v = logits + row * tk;
  const int64_t keys = causal_keys(causal_row0 + row % tile_rows, tk, causal_row0 >= 0);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = keys + lane; j < tk; j += kWarpSize) v[j] = ninf;
  float m = ninf;
  for (int64_t j = lane; j < keys; j += kWarpSize) m = logit_max(m, v[j]);
  for (int d = kWarpSize / 2; d > 0; d /= 2) m = logit_max(m, __shfl_xor_sync(0xffffffffu, m, d));
  SoftmaxSums s = softmax_sums_zero();
  if (m != ninf) {
    for (int64_t j = lane; j < keys; j += kWarpSize) softmax_push(s, v[j], m);
    for (int d = kWarpSize / 2; d > 0; d /= 2) {
      const SoftmaxSums o{__shfl_xor_sync(0xffffffffu, s.others, d), __shfl_xor_sync(0xffffffffu, s.ties, d),
                          __shfl_xor_sync(0xffffffffu, s.t, d)};
      softmax_merge(s, o);
    }
  }
  if (lane == 0) softmax_finish(m, s, lse + row, entropy + row);
}

}  // namespace kernels
}  // namespace hookcap
