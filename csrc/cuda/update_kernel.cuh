// accumulate_update's CUDA kernel: the optimizer's step per element
// (hookcap/update_math.h) and the parameter before it, into two ring rows in
// one pass over the parameter and its state. Plain CUDA C++, compiled by nvcc
// (stats_launch.cu) and by the CPU emulation harness (tests/cuda_emu).
//
// Parameters are read once per recorded step, so this kernel is simple
// rather than tuned: double arithmetic per element (the values match a
// float64 recomputation of the step), one merge into the ring per block,
// histogram counts in shared memory per block, one shared atomic per
// distinct bin of a warp.
#pragma once

#include "cuda/stats_kernel.cuh"
#include "hookcap/update_math.h"

namespace hookcap {
namespace kernels {

template <typename T>
struct UpdateInputs {
  const T* w;  // the parameter after the step
  const T* g;  // its gradient, or null
  const T* a;  // the rule's first state tensor, or null
  const T* b;  // its second, or null
};

template <typename T>
__device__ __forceinline__ double as_double(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

template <typename T>
__device__ __forceinline__ UpdateValue update_at(const UpdateRule& r, const UpdateInputs<T>& in, int64_t i) {
  return update_value(r, as_double(in.w[i]), in.g ? as_double(in.g[i]) : 0.0,
                      in.a ? as_double(in.a[i]) : 0.0, in.b ? as_double(in.b[i]) : 0.0);
}

// Shared-memory histogram counters per row (more bins count straight into the ring).
constexpr int64_t kUpdateSmemBins = 2048;

// Dynamic shared memory: the rows' shifts, each warp's partial per row,
// then (local_hist) the rows' counters.
C10_HOST_DEVICE constexpr int64_t update_acc_offset() { return 16; }
C10_HOST_DEVICE constexpr int64_t update_hist_offset(int64_t rows) {
  return update_acc_offset() + kWarps * rows * static_cast<int64_t>(sizeof(Acc));
}
inline int64_t update_smem_bytes(int64_t nbins, bool two_rows) {
  const int64_t rows = two_rows ? 2 : 1;
  return update_hist_offset(rows) + (nbins > 0 && nbins <= kUpdateSmemBins ? rows * nbins * 4 : 0);
}

// step_f / step_d: the optimizer's step count on the device (Adam with
// capturable or fused), read here so the host never syncs; both null: `r`
// carries the bias corrections already.
// kRows: 2 with the parameter before the step (row_base), else 1; a
// template argument so that every per-row array stays in registers.
template <typename T, int kRows>
__global__ void __launch_bounds__(kThreads) update_kernel(UpdateInputs<T> in, int64_t n, UpdateRule r,
                                                          const float* step_f, const double* step_d,
                                                          int64_t* ring, const int64_t* state, int64_t slots,
                                                          int64_t rows, int64_t width, int64_t row,
                                                          int64_t row_base, HistSpec h) {
  if (state[kStateEnabled] == 0) return;
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // same guard as the stats kernels
  if (step_f != nullptr) update_set_step(r, static_cast<double>(*step_f));
  if (step_d != nullptr) update_set_step(r, *step_d);
  if (HOOKCAP_EMU_FAULT(update_bias)) r.step_size = r.lr;  // the harness's planted bug: no bias correction
  constexpr int nrows = kRows;
  int64_t* out[2] = {ring + (slot * rows + row) * width,
                     kRows == 2 ? ring + (slot * rows + row_base) * width : nullptr};
  unsigned char* smem = dynamic_smem();
  double* s_shift = reinterpret_cast<double*>(smem);
  const int64_t nbins = h.kind == kHistNone ? 0 : h.nbins;
  const bool local_hist = nbins > 0 && nbins <= kUpdateSmemBins;
  Acc* s_acc = reinterpret_cast<Acc*>(smem + update_acc_offset());
  unsigned int* s_hist = reinterpret_cast<unsigned int*>(smem + update_hist_offset(kRows));
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (blockIdx.x == 0) {
        DeviceAtomics::add_i64(out[k] + kCount, n);
        DeviceAtomics::add_i64(out[k] + kCalls, 1);
      }
      // Every block finds the same candidate (the first elements): the first
      // writer of the row fixes it, as the stats kernels do.
      const double cand = shift_candidate(
          [&](int64_t i) { const UpdateValue u = update_at(r, in, i); return k == 0 ? u.value : u.base; }, n);
      const int64_t old = DeviceAtomics::cas_i64(out[k] + kShift, kShiftUnset, dbits(cand));
      s_shift[k] = old == kShiftUnset ? cand : bitsd(old);
    }
  }
  if (local_hist) {
    for (int64_t i = tid; i < nrows * nbins; i += kThreads) s_hist[i] = 0u;
  }
  __syncthreads();
  Acc acc[kRows];
  WideAcc wide[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    acc_init(acc[k]);
    wide_init(wide[k]);
  }
  const double shift0 = s_shift[0], shift1 = nrows == 2 ? s_shift[1] : 0.0;
  const int lane = tid % kWarpSize;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // The same trip count for every thread (a multiple of the stride), so every
  // lane of a warp reaches the warp-wide bin match together.
  const int64_t end = (n + stride - 1) / stride * stride;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + tid; i < end; i += stride) {
    const bool valid = i < n;
    const UpdateValue u = valid ? update_at(r, in, i) : UpdateValue{0.0, 0.0};
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const double v = k == 0 ? u.value : u.base;
      if (valid) {
        // Values from narrower parameters are never wide (update_math.h's
        // results of float inputs stay far inside double's squaring range).
        if constexpr (std::is_same_v<T, double>) {
          acc_push_wide(acc[k], wide[k], v, k == 0 ? shift0 : shift1);
        } else {
          acc_push(acc[k], v, k == 0 ? shift0 : shift1);
        }
      }
      if (nbins == 0) continue;
      const int bin = valid ? static_cast<int>(hist_bin(v, h)) : -1;
      if (local_hist) {
        // Most values of a parameter's update share a few bins: one shared
        // atomic per distinct bin of the warp, not one per value.
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin >= 0 && (peers & ((1u << lane) - 1u)) == 0u) atomicAdd(s_hist + k * nbins + bin, __popc(peers));
      } else if (bin >= 0) {
        DeviceAtomics::add_i64(out[k] + kHeader + bin, 1);
      }
    }
  }
  // One merge into the ring per block and row: warps, then warp 0 over the warps.
  const int warp = tid / kWarpSize;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if constexpr (std::is_same_v<T, double>) {
      wide_to_row<DeviceAtomics>(out[k], wide[k], 1);  // rare values: straight from their thread
    }
    warp_reduce(acc[k]);
    if (lane == 0) s_acc[warp * kRows + k] = acc[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      Acc a;
      if (lane < kWarps) {
        a = s_acc[lane * kRows + k];
      } else {
        acc_init(a);
      }
      warp_reduce(a);
      if (lane == 0) row_merge<DeviceAtomics>(out[k], a);
    }
  }
  if (local_hist) {
    for (int64_t i = tid; i < nrows * nbins; i += kThreads) {
      if (s_hist[i] != 0u) DeviceAtomics::add_i64(out[i / nbins] + kHeader + i % nbins, s_hist[i]);
    }
  }
}

}  // namespace kernels
}  // namespace hookcap
