// CUDA device code of hookcap: kernels only, no launches. Compiled by nvcc for
// the real build (stats_launch.cu) and by g++ through tests/cuda_emu for the
// CPU emulation harness, so it must stay plain CUDA C++: no inline PTX, no
// CUB, only the intrinsics the harness provides.
// HOOKCAP_EMU_BREAK_* are defined only by test-only builds of that harness
// (proof that it catches a missing barrier / a wrong index); nvcc never sees them.
#pragma once

#include "hookcap/dtype_load.h"
#include "hookcap/state.h"
#include "hookcap/stats_math.h"
#include "hookcap/strided.h"

namespace hookcap {
namespace kernels {

constexpr int kWarpSize = 32;
constexpr int kMaxBlock = 1024;
// Histograms up to this many bins are counted in shared memory per block and
// merged once; wider ones go straight to the ring with global atomics.
constexpr int kSharedBins = 2048;

struct DeviceAtomics {
  static __device__ __forceinline__ void add_i64(int64_t* p, int64_t v) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p),
              static_cast<unsigned long long>(v));
  }
  static __device__ __forceinline__ void add_f64(int64_t* p, double v) {
    atomicAdd(reinterpret_cast<double*>(p), v);
  }
  static __device__ __forceinline__ void min_i64(int64_t* p, int64_t v) {
    atomicMin(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  }
  static __device__ __forceinline__ void max_i64(int64_t* p, int64_t v) {
    atomicMax(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  }
};

// Where one accumulate launch writes.
struct RowTarget {
  int64_t* ring;         // [slots, rows, width] int64
  const int64_t* state;  // int64[3] (step, enabled, slot)
  int64_t row;
  int64_t rows;
  int64_t width;
  int64_t slots;
};

template <typename T>
__device__ __forceinline__ T shfl_down(T v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}

__device__ __forceinline__ void warp_reduce(Acc& a) {
  for (int d = kWarpSize / 2; d > 0; d /= 2) {
    Acc o;
    o.sum = shfl_down(a.sum, d);
    o.sumsq = shfl_down(a.sumsq, d);
    o.s1 = shfl_down(a.s1, d);
    o.s2 = shfl_down(a.s2, d);
    o.mn = shfl_down(a.mn, d);
    o.mx = shfl_down(a.mx, d);
    o.amx = shfl_down(a.amx, d);
    o.nnan = shfl_down(a.nnan, d);
    o.npinf = shfl_down(a.npinf, d);
    o.nninf = shfl_down(a.nninf, d);
    o.nzero = shfl_down(a.nzero, d);
    acc_merge(a, o);
  }
}

// 16-byte vector of elements for aligned loads.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// One pass over x: moments, counts, extrema and histogram of every element,
// merged into ring[state.slot, row]. Dense inputs (any permutation) are read
// straight from storage with 16-byte loads; others through `desc`.
// blockDim.x must be a multiple of 32 and at most kMaxBlock.
template <typename T, bool kDense>
__global__ void __launch_bounds__(kMaxBlock)
    accumulate_kernel(const T* __restrict__ x, int64_t n, StridedDesc desc,
                      RowTarget tgt, HistSpec hist) {
  __shared__ double s_shift;
  __shared__ Acc s_warp[kMaxBlock / kWarpSize];
  __shared__ unsigned int s_hist[kSharedBins];

  if (tgt.state[kStateEnabled] == 0) return;  // off-step: uniform early exit
  const int64_t slot = tgt.state[kStateSlot];
  if (slot < 0 || slot >= tgt.slots) return;  // corrupt state: never write out of bounds
  int64_t* row = tgt.ring + (slot * tgt.rows + tgt.row) * tgt.width;
  int64_t* hrow = row + kHeader;

  const int tid = threadIdx.x;
  const bool use_hist = hist.kind != kHistNone;
  const bool shared_hist = use_hist && hist.nbins <= kSharedBins;
  if (shared_hist) {
    for (int64_t b = tid; b < hist.nbins; b += blockDim.x) s_hist[b] = 0u;
  }

  auto load = [&](int64_t i) -> double {
    return kDense ? load_double(x + i) : load_double(x + strided_offset(desc, i));
  };

  if (tid == 0) {
    // First writer of the slot fixes the shift; every block of this launch
    // computes the same candidate, later launches read the stored one.
    // An empty tensor leaves the shift to the next writer.
    const double cand = shift_candidate(load, n);
    const unsigned long long old =
        n == 0 ? 0ull
               : atomicCAS(reinterpret_cast<unsigned long long*>(row + kShift),
                           static_cast<unsigned long long>(kShiftUnset),
                           static_cast<unsigned long long>(dbits(cand)));
    s_shift = static_cast<int64_t>(old) == kShiftUnset
                  ? cand
                  : bitsd(static_cast<int64_t>(old));
    if (blockIdx.x == 0) {
      DeviceAtomics::add_i64(row + kCount, n);
      DeviceAtomics::add_i64(row + kCalls, 1);
    }
  }
  __syncthreads();
  const double shift = s_shift;

  Acc acc;
  acc_init(acc);
  auto visit = [&](double v) {
    acc_push(acc, v, shift);
    if (use_hist) {
      const int64_t b = hist_bin(v, hist);
      if (b >= 0) {
        if (shared_hist) {
          atomicAdd(&s_hist[b], 1u);
        } else {
          DeviceAtomics::add_i64(hrow + b, 1);
        }
      }
    }
  };

  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  if (kDense) {
    using V = Vec16<T>;
    constexpr int kN = V::kN;
    // Elements before the first 16-byte boundary, then whole vectors, then
    // the tail. Element-misaligned pointers (odd byte offsets) are all head.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    int64_t head = n;
    if (addr % sizeof(T) == 0) {
      const int64_t mis = static_cast<int64_t>((16 - addr % 16) % 16) / sizeof(T);
      head = mis < n ? mis : n;
    }
    const int64_t nvec = (n - head) / kN;
    for (int64_t i = gtid; i < head; i += gstride) visit(load_double(x + i));
    const V* xv = reinterpret_cast<const V*>(x + head);
    for (int64_t i = gtid; i < nvec; i += gstride) {
      const V pack = xv[i];
#pragma unroll
      for (int k = 0; k < kN; ++k) visit(load_double(&pack.v[k]));
    }
#ifndef HOOKCAP_EMU_BREAK_INDEX  // fault injection for tests/cuda_emu only
    for (int64_t i = head + nvec * kN + gtid; i < n; i += gstride) {
#else
    for (int64_t i = nvec * kN + gtid; i < n; i += gstride) {
#endif
      visit(load_double(x + i));
    }
  } else {
    for (int64_t i = gtid; i < n; i += gstride) visit(load(i));
  }

  // Block reduction: warps by shuffle, then warp 0 over the warp partials.
  warp_reduce(acc);
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  if (lane == 0) s_warp[warp] = acc;
#ifndef HOOKCAP_EMU_BREAK_SYNC  // fault injection for tests/cuda_emu only
  __syncthreads();
#endif
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarpSize;
    if (lane < nwarps) {
      acc = s_warp[lane];
    } else {
      acc_init(acc);
    }
    warp_reduce(acc);
    if (lane == 0) row_merge<DeviceAtomics>(row, acc);
  }
  if (shared_hist) {
    for (int64_t b = tid; b < hist.nbins; b += blockDim.x) {
      const unsigned int c = s_hist[b];
      if (c) DeviceAtomics::add_i64(hrow + b, static_cast<int64_t>(c));
    }
  }
}

// Advance the state by one step and reset the new slot if the step is
// recorded. Launched with ONE block: the state is read by every thread
// before thread 0 writes it back after the barrier.
__global__ void advance_kernel(int64_t* ring, int64_t* state, int64_t slots,
                               int64_t rows, int64_t width, int64_t every) {
  if (state[kStateSlot] < 0 || state[kStateSlot] >= slots) return;  // corrupt state
  const StepState next = next_state(state, every, slots);
  if (next.enabled) {
    int64_t* base = ring + next.slot * rows * width;
    const int64_t total = rows * width;
    for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
      base[i] = reset_value(i % width, next.step);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    state[kStateStep] = next.step;
    state[kStateEnabled] = next.enabled;
    state[kStateSlot] = next.slot;
  }
}

// Reset rows [begin, end) of the slot the state points at (for its step):
// the whole slot, new metrics' rows after the ring grew, or one row whose
// value is replaced.
__global__ void reset_rows_kernel(int64_t* ring, const int64_t* state, int64_t slots,
                                  int64_t rows, int64_t width, int64_t begin, int64_t end) {
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // corrupt state: never write out of bounds
  const int64_t step = state[kStateStep];
  int64_t* base = ring + (slot * rows + begin) * width;
  const int64_t total = (end - begin) * width;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += gstride) {
    base[i] = reset_value(i % width, step);
  }
}

}  // namespace kernels
}  // namespace hookcap
