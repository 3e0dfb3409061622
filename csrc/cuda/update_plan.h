// How accumulate_update(s) parameters go to update_kernel launches, for the
// CUDA launcher (stats_launch.cu) and the emulation harness (tests/cuda_emu):
// runs of up to kernels::kUpdateTensors consecutive parameters with one
// dtype and one set of outputs, each parameter with up to `max_blocks`
// blocks of its own. Host code only.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "cuda/update_kernel.cuh"
#include "hookcap/op_checks.h"

namespace hookcap {

// The recorded outputs of one parameter's `rows` (kOutputs, -1: not recorded).
inline int update_out_mask(c10::IntArrayRef rows) {
  int m = 0;
  for (int i = 0; i < kOutputs; ++i) m |= rows[i] >= 0 ? 1 << i : 0;
  return m;
}

inline kernels::UpdateOuts update_outs(int mask) {
  kernels::UpdateOuts o{};
  int k = 0;
  for (int i = 0; i < kOutputs; ++i) {
    if (mask & (1 << i)) o.out[k++] = i;
  }
  o.ratio = mask & (1 << kOutRatio);
  o.step = mask & ((1 << kOutUpdate) | (1 << kOutBase) | (1 << kOutRatio));
  return o;
}

inline int update_out_count(int mask) { return __builtin_popcount(static_cast<unsigned>(mask)); }

// launch(kernel, batch, rule, outs, blocks, smem_bytes) for each launch the
// parameters need (checked already). `device_step(step)`: whether the kernel
// reads that step count (a GPU tensor; the host never reads it).
// `per_block`: elements per block before a parameter takes another block.
template <typename DeviceStep, typename Launch>
void plan_updates(at::TensorList params, const c10::List<c10::optional<at::Tensor>>& grads,
                  const c10::List<c10::optional<at::Tensor>>& a, const c10::List<c10::optional<at::Tensor>>& b,
                  const c10::List<c10::optional<at::Tensor>>& steps, c10::ArrayRef<double> hyper, int64_t rule,
                  c10::IntArrayRef rows, const HistSpec& h, int64_t per_block, int64_t max_blocks,
                  DeviceStep&& device_step, Launch&& launch) {
  const int64_t count = static_cast<int64_t>(params.size());
  const UpdateRule r = make_update_rule(rule, hyper, 1.0);  // bias corrections: per parameter
  for (int64_t s = 0; s < count;) {
    const int mask = update_out_mask(rows.slice(s * kOutputs, kOutputs));
    const at::ScalarType dtype = params[s].scalar_type();
    int64_t e = s + 1;
    while (e < count && e - s < kernels::kUpdateTensors && params[e].scalar_type() == dtype &&
           update_out_mask(rows.slice(e * kOutputs, kOutputs)) == mask) {
      ++e;
    }
    const kernels::UpdateOuts o = update_outs(mask);
    const int nrows = update_out_count(mask);
    const int64_t smem = kernels::update_smem_bytes(h.kind == kHistNone ? 0 : h.nbins, nrows);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "hookcap_update_plan", [&] {
      kernels::UpdateBatch<scalar_t> batch{};
      int32_t blocks = 0;
      for (int64_t i = s; i < e; ++i) {
        const c10::optional<at::Tensor> step = steps.get(i);
        const UpdateLaunch u = update_launch(rule, hyper, step, device_step(step));
        kernels::UpdateTensor<scalar_t>& t = batch.t[batch.count++];
        t.in = {params[i].const_data_ptr<scalar_t>(), data_or_null<scalar_t>(grads.get(i)),
                data_or_null<scalar_t>(a.get(i)), data_or_null<scalar_t>(b.get(i))};
        t.step_f = u.step_f;
        t.step_d = u.step_d;
        t.step_size = u.rule.step_size;
        t.inv_bc2_sqrt = u.rule.inv_bc2_sqrt;
        t.n = params[i].numel();
        int k = 0;
        for (int j = 0; j < kOutputs; ++j) {
          const int64_t row = rows[i * kOutputs + j];
          if (row >= 0) t.row[k++] = static_cast<int32_t>(row);
        }
        t.first_block = blocks;
        t.blocks = static_cast<int32_t>(std::max<int64_t>(1, std::min((t.n + per_block - 1) / per_block, max_blocks)));
        blocks += t.blocks;
      }
      kernels::with_update_kernel<scalar_t>(nrows, [&](auto kernel) { launch(kernel, batch, r, o, blocks, smem); });
    });
    s = e;
  }
}

}  // namespace hookcap
