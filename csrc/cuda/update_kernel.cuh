// accumulate_update's CUDA kernel: the optimizer's step per element
// (hookcap/update_math.h), the parameter before it, Adam's ratio and the
// state tensors, into up to kOutputs ring rows in one pass over each
// parameter and its state; up to kUpdateTensors parameters per launch. Plain
// CUDA C++, compiled by nvcc (stats_launch.cu) and by the CPU emulation
// harness (tests/cuda_emu).
//
// Parameters are read once per recorded step, so this kernel is simple
// rather than tuned: update_value_for's arithmetic per element (float for
// narrower parameters where it is exact to float rounding, else double),
// sums in double, one merge into the ring per block and row, histogram
// counts in shared memory per block, one shared atomic per value.
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

// One parameter of a launch. step_f / step_d: the optimizer's step count on
// the device (Adam with capturable or fused), read by the kernel so the host
// never syncs; both null: step_size and inv_bc2_sqrt are the bias corrections.
template <typename T>
struct UpdateTensor {
  UpdateInputs<T> in;
  const float* step_f;
  const double* step_d;
  double step_size, inv_bc2_sqrt;
  int64_t n;
  int32_t row[kOutputs];  // the row of each recorded output, in the launch's order (UpdateOuts)
  int32_t first_block;    // this parameter's first block in the launch
  int32_t blocks;
};

// Parameters per launch: the launch's arguments stay within the 4 KB every
// CUDA version takes.
constexpr int kUpdateTensors = 24;
template <typename T>
struct UpdateBatch {
  UpdateTensor<T> t[kUpdateTensors];
  int32_t count;
};
static_assert(sizeof(UpdateBatch<double>) <= 2600, "accumulate_update's launch arguments must fit 4 KB");

// Which outputs a launch records (update_math.h kOut*), in row order.
struct UpdateOuts {
  int out[kOutputs];
  bool step;   // an output needs the step's values (Δw, w before, ratio)
  bool ratio;  // Adam's ratio is one of them
};

template <typename T>
__device__ __forceinline__ double as_double(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

// Element i: its state values a and b, and the step's values where an
// output needs them.
template <typename T>
__device__ __forceinline__ UpdateValue update_at(const UpdateRule& r, const UpdateInputs<T>& in,
                                                 const UpdateOuts& o, int64_t i, double& a, double& b) {
  a = in.a ? as_double(in.a[i]) : 0.0;
  b = in.b ? as_double(in.b[i]) : 0.0;
  return o.step ? update_value<T>(r, as_double(in.w[i]), in.g ? as_double(in.g[i]) : 0.0, a, b, o.ratio)
                : UpdateValue{0.0, 0.0, 0.0};
}

// Shared-memory histogram counters per row (more bins count straight into the ring).
constexpr int64_t kUpdateSmemBins = 2048;

// Dynamic shared memory: the rows' shifts, each warp's partial per row,
// then (local_hist) the rows' counters.
C10_HOST_DEVICE constexpr int64_t update_acc_offset() { return (kOutputs * 8 + 15) / 16 * 16; }
C10_HOST_DEVICE constexpr int64_t update_hist_offset(int64_t rows) {
  return update_acc_offset() + kWarps * rows * static_cast<int64_t>(sizeof(Acc));
}
inline int64_t update_smem_bytes(int64_t nbins, int64_t rows) {
  return update_hist_offset(rows) + (nbins > 0 && nbins <= kUpdateSmemBins ? rows * nbins * 4 : 0);
}

// The batch's parameter that block `block` works on: the last whose first
// block is at or before it.
template <typename T>
__device__ __forceinline__ int update_tensor_of(const UpdateBatch<T>& batch, int64_t block) {
  int ti = 0;
  for (int j = 1; j < batch.count; ++j) ti = batch.t[j].first_block <= block ? j : ti;
  return ti;
}

// Float64 parameters' values may be wide (stats_math.h): Acc and WideAcc per
// row; every narrower parameter's results stay inside double's squaring range.
template <typename T>
constexpr bool kWideUpdate = std::is_same_v<T, double>;
template <typename T>
using Part = std::conditional_t<kWideUpdate<T>, Acc, ThreadAcc<double>>;

// kRows: how many outputs `o` records (1 to kOutputs); a template argument
// so that every per-row array stays in registers. `r`: the rule, whose
// bias corrections each parameter sets.
template <typename T, int kRows>
__global__ void __launch_bounds__(kThreads, kWideUpdate<T> ? 1 : 2)
    update_kernel(UpdateBatch<T> batch, UpdateRule r, int64_t* ring, const int64_t* state, int64_t slots,
                  int64_t rows, int64_t width, UpdateOuts o, HistSpec h) {
  if (state[kStateEnabled] == 0) return;
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // same guard as the stats kernels
  const UpdateTensor<T>& t = batch.t[update_tensor_of(batch, blockIdx.x)];
  const UpdateInputs<T> in = t.in;
  const int64_t n = t.n;
  const int64_t block = static_cast<int64_t>(blockIdx.x) - t.first_block;
  r.step_size = t.step_size;
  r.inv_bc2_sqrt = t.inv_bc2_sqrt;
  if (t.step_f != nullptr) update_set_step(r, static_cast<double>(*t.step_f));
  if (t.step_d != nullptr) update_set_step(r, *t.step_d);
  if (HOOKCAP_EMU_FAULT(update_bias)) r.step_size = r.lr;  // the harness's planted bug: no bias correction
  r.narrow_ok = update_rule_narrow_ok(r);
  int64_t* out[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) out[k] = ring + (slot * rows + t.row[k]) * width;
  unsigned char* smem = dynamic_smem();
  double* s_shift = reinterpret_cast<double*>(smem);
  const int64_t nbins = h.kind == kHistNone ? 0 : h.nbins;
  const bool local_hist = nbins > 0 && nbins <= kUpdateSmemBins;
  Acc* s_acc = reinterpret_cast<Acc*>(smem + update_acc_offset());
  unsigned int* s_hist = reinterpret_cast<unsigned int*>(smem + update_hist_offset(kRows));
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kRows) {
    // Thread k takes row k: the rows' probes load side by side.
    const int k = tid;
    int64_t* row = ring + (slot * rows + t.row[k]) * width;
    if (block == 0) {
      DeviceAtomics::add_i64(row + kCount, n);
      DeviceAtomics::add_i64(row + kCalls, 1);
    }
    // Every block finds the same candidate (the first elements): the first
    // writer of the row fixes it, as the stats kernels do.
    const double cand = shift_candidate([&](int64_t i) {
      double a, b;
      const UpdateValue u = update_at(r, in, o, i, a, b);
      return update_output(u, a, b, o.out[k]);
    }, n);
    const int64_t old = DeviceAtomics::cas_i64(row + kShift, kShiftUnset, dbits(cand));
    s_shift[k] = old == kShiftUnset ? cand : bitsd(old);
  }
  if (local_hist) {
    for (int64_t i = tid; i < kRows * nbins; i += kThreads) s_hist[i] = 0u;
  }
  __syncthreads();
  // Partials per row: the stats kernels' small per-thread accumulator
  // (moments about the shift and extrema, made an Acc at the merge), which
  // keeps two blocks of five rows in an SM's registers; float64 parameters
  // keep Acc and the wide buckets.
  Part<T> acc[kRows];
  WideAcc wide[kWideUpdate<T> ? kRows : 1];
  double shift[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if constexpr (kWideUpdate<T>) {
      acc_init(acc[k]);
      wide_init(wide[k]);
    } else {
      thread_acc_init(acc[k]);
    }
    shift[k] = s_shift[k];
  }
  const int lane = tid % kWarpSize;
  const int64_t stride = static_cast<int64_t>(t.blocks) * kThreads;
  for (int64_t i = block * kThreads + tid; i < n; i += stride) {
    double av, bv;
    const UpdateValue u = update_at(r, in, o, i, av, bv);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const double v = update_output(u, av, bv, o.out[k]);
      // Values from narrower parameters are never wide (update_math.h's
      // results of float inputs stay far inside double's squaring range).
      if constexpr (kWideUpdate<T>) {
        acc_push_wide(acc[k], wide[k], v, shift[k]);
      } else {
        thread_acc_push(acc[k], v, shift[k]);
      }
      if (nbins == 0) continue;
      const int bin = static_cast<int>(hist_bin(v, h));
      if (bin < 0) continue;
      // One shared atomic per value, as the stats kernels count (a warp-wide
      // match of equal bins first cost more than the conflicts it saves).
      if (local_hist) {
        atomicAdd(s_hist + k * nbins + bin, 1u);
      } else {
        DeviceAtomics::add_i64(out[k] + kHeader + bin, 1);
      }
    }
  }
  // One merge into the ring per block and row: warps, then warp 0 over the warps.
  const int warp = tid / kWarpSize;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    Acc a;
    if constexpr (kWideUpdate<T>) {
      wide_to_row<DeviceAtomics>(out[k], wide[k], 1);  // rare values: straight from their thread
      a = acc[k];
    } else {
      a = to_acc(acc[k], shift[k]);
    }
    warp_reduce(a);
    if (lane == 0) s_acc[warp * kRows + k] = a;
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
    for (int64_t i = tid; i < kRows * nbins; i += kThreads) {
      if (s_hist[i] != 0u) DeviceAtomics::add_i64(out[i / nbins] + kHeader + i % nbins, s_hist[i]);
    }
  }
}

// fn(update_kernel<T, rows>) for 1 <= rows <= kOutputs.
template <typename T, typename Fn>
void with_update_kernel(int rows, Fn&& fn) {
  switch (rows) {
    case 1: fn(&update_kernel<T, 1>); break;
    case 2: fn(&update_kernel<T, 2>); break;
    case 3: fn(&update_kernel<T, 3>); break;
    case 4: fn(&update_kernel<T, 4>); break;
    default: fn(&update_kernel<T, 5>); break;
  }
}

}  // namespace kernels
}  // namespace hookcap
