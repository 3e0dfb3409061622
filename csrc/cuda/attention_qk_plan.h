// Host side of attention_qk_kernel (attention_qk_kernel.cuh): which calls it
// takes, and their launch. Shared by the CUDA launcher and the query op
// (stats_launch.cu) and the emulation harness (tests/cuda_emu), so all
// three decide and launch alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>

#include "cuda/attention_qk_kernel.cuh"
#include "cuda/launch_plan.cuh"
#include "hookcap/attention_qk.h"
#include "hookcap/stats_math.h"

namespace hookcap {

// Why attention_qk cannot take q, k with histogram h (nullptr: it can).
// q [B, H, Tq, D] and k [B, Hk, Tk, D], bfloat16 or float16 alike, the
// head dim D in 16, 32, ..., 128 and contiguous, every row 16-byte aligned;
// H a multiple of Hk, at most kQkMaxHeads; the histogram none or the default
// log2 (by exponent), without moments=4.
inline const char* attention_qk_unsupported(const at::Tensor& q, const at::Tensor& k, const HistSpec& h,
                                            int64_t smem_budget) {
  if (q.dim() != 4 || k.dim() != 4) return "q and k must be [batch, heads, tokens, head_dim]";
  if (q.scalar_type() != k.scalar_type() ||
      (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) {
    return "q and k must both be bfloat16 or both float16";
  }
  if (q.device() != k.device()) return "q and k must be on one device";
  const int64_t d = q.size(3);
  if (k.size(3) != d || d % 16 != 0 || d < 16 || d > kernels::kQkMaxDim) return "head dims 16, 32, ..., 128 only";
  if (k.size(0) != q.size(0) || q.size(1) % std::max<int64_t>(k.size(1), 1) != 0 || k.size(1) == 0) {
    return "k must have q's batch and a number of heads dividing q's";
  }
  if (q.size(1) > kernels::kQkMaxHeads || q.size(0) * q.size(1) > 65535) return "too many heads";
  if (q.size(0) == 0 || q.size(2) == 0 || k.size(2) == 0) return "empty";
  if (k.size(2) > (int64_t{1} << 24) || q.size(2) > (int64_t{1} << 31)) return "too many tokens";
  for (const at::Tensor* t : {&q, &k}) {
    if (t->stride(3) != 1 || reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return "rows not 16-byte aligned";
    for (int i = 0; i < 3; ++i) {
      if (t->size(i) > 1 && t->stride(i) % 8 != 0) return "rows not 16-byte aligned";
    }
  }
  if (h.moments4) return "moments=4";
  const kernels::HistPlan p = kernels::hist_plan(h, true, smem_budget);
  if (p.mode != kernels::kModeNone && p.mode != kernels::kModeLog2Exp) return "histogram other than none or log2 by exponent";
  return nullptr;
}

// The kernel's arguments for q, k (checked by attention_qk_unsupported) and
// its outputs lse, entropy (float32 [B, H, Tq], contiguous).
inline kernels::QkArgs attention_qk_args(const at::Tensor& q, const at::Tensor& k, bool causal, double scale,
                                         at::Tensor& lse, at::Tensor& entropy) {
  kernels::QkArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.q_sb = q.stride(0);
  a.q_sh = q.stride(1);
  a.q_st = q.stride(2);
  a.k_sb = k.stride(0);
  a.k_sh = k.stride(1);
  a.k_st = k.stride(2);
  a.heads = static_cast<int32_t>(q.size(1));
  a.kv_heads = static_cast<int32_t>(k.size(1));
  a.d = static_cast<int32_t>(q.size(3));
  a.tq = q.size(2);
  a.tk = k.size(2);
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.lse = lse.data_ptr<float>();
  a.entropy = entropy.data_ptr<float>();
  return a;
}

// Per head, its logits' ring row (-1: not recorded).
inline kernels::QkRows attention_qk_rows(c10::IntArrayRef logit_rows) {
  kernels::QkRows r{};
  for (size_t i = 0; i < logit_rows.size() && i < static_cast<size_t>(kernels::kQkMaxHeads); ++i) {
    r.row[i] = logit_rows[i];
  }
  return r;
}

// attention_qk_kernel's launch for q, k into ring (checked by
// attention_qk_unsupported with the same histogram and budget).
struct QkLaunch {
  kernels::QkKernel kernel;  // for the dtype and histogram
  kernels::RowTarget tgt;    // the head's row comes from QkRows
  unsigned blocks_x;         // blocks of kQkRows query rows
  unsigned blocks_y;         // batch x heads
  int64_t smem;              // dynamic shared memory, bytes
};

inline QkLaunch attention_qk_launch(const at::Tensor& q, const at::Tensor& k, at::Tensor& ring,
                                    const at::Tensor& state, const HistSpec& h, int64_t smem_budget) {
  const bool log2 = kernels::hist_plan(h, true, smem_budget).mode == kernels::kModeLog2Exp;
  return QkLaunch{kernels::attention_qk_kernel_for(q.scalar_type() == at::kBFloat16, log2),
                  kernels::RowTarget{ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), 0, ring.size(1),
                                     ring.size(2), ring.size(0), q.size(0) * q.size(2) * k.size(2), 1, 1, nullptr,
                                     0, 0},
                  static_cast<unsigned>((q.size(2) + kernels::kQkRows - 1) / kernels::kQkRows),
                  static_cast<unsigned>(q.size(0) * q.size(1)), kernels::qk_smem_bytes(q.size(3))};
}

}  // namespace hookcap
