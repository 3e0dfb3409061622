// attention_qk's geometry and arguments (cuda/attention_qk_kernel.cuh), for
// the kernel, its launcher, the query op and the emulation harness.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace hookcap {
namespace kernels {

constexpr int kQkRows = 64;      // query rows per block: 16 per warp row block
constexpr int kQkKeys = 64;      // keys per tile: 32 per warp
constexpr int kQkMaxDim = 128;   // head dims 16, 32, ..., 128
constexpr int kQkMaxHeads = 128;
constexpr int kQkPad = 8;        // 16-bit elements after each shared row (bank spread; ld a multiple of 8)
constexpr int kQkLds = kQkKeys + 4;  // floats per shared logit row (a multiple of 4)

// Dynamic shared memory of a launch for head dim d (bytes, with the slack
// that aligns its start to 128 bytes).
C10_HOST_DEVICE constexpr int64_t qk_smem_bytes(int64_t d) {
  return 128 + 2 * kQkRows * (d + kQkPad) * 2 + kQkRows * kQkLds * 4 + (2 * kQkRows + 2 * kQkRows * 3) * 4;
}

// Each head's ring row of the logits' statistics (-1: not recorded), by value.
struct QkRows {
  int64_t row[kQkMaxHeads];
};

struct QkArgs {
  const void* q;  // [B, H, Tq, D], last dimension contiguous, rows 16-byte aligned
  const void* k;  // [B, Hk, Tk, D], likewise; head h reads key head h / (H / Hk)
  int64_t q_sb, q_sh, q_st;  // strides in elements
  int64_t k_sb, k_sh, k_st;
  int32_t heads, kv_heads, d;
  int64_t tq, tk;
  float scale;
  bool causal;     // top-left, as is_causal: query i sees keys [0, min(i + 1, tk))
  float* lse;      // [B, H, Tq] float32, written
  float* entropy;  // [B, H, Tq] float32, written
};

}  // namespace kernels
}  // namespace hookcap
