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

#include <cmath>
#include <type_traits>

namespace hookcap {
namespace kernels {

constexpr int kWarpSize = 32;
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
  int64_t count;  // logical elements this launch adds to the row's count (strided.h's splits: 0 after the first)
  int64_t calls;  // 1, or 0 for a split's later launches
  int64_t mult;   // logical elements each element read stands for (stride-0 dimensions)
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
    o.nfin = shfl_down(a.nfin, d);
    acc_merge(a, o);
  }
}

// Rebase each lane's partial onto the shift of the warp's lowest lane that
// has one (lanes without finite values have none); afterwards every lane has
// that shift, or none if no lane had one.
__device__ __forceinline__ void warp_common_shift(Acc& a, bool& has, double& shift) {
  const unsigned mask = __ballot_sync(0xffffffffu, has);
  if (mask == 0u) return;
  const int src = __popc((mask & (0u - mask)) - 1u);  // lowest set lane
  const double common = __shfl_sync(0xffffffffu, shift, src);
  if (has) acc_rebase(a, shift, common);
  shift = common;
  has = true;
}

// 16-byte vector of elements for aligned loads.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// ---------------------------------------------------------------------------
// accumulate: one specialisation per (element type, histogram mode, dense or
// strided), chosen on the host (stats_launch.cu), so the hot loop holds one
// path. Elements of 32 bits or fewer are worked in float (exact: every such
// value is a float): each thread sums runs of up to kRunElems values about a
// center in float and flushes each run to a double partial (thread_acc_add_run); a
// run holding NaN/Inf or leaving float's safe range (float_sums_ok) is redone
// element by element in double. Float64 input works in double.
// ---------------------------------------------------------------------------
constexpr int kThreads = 256;  // every accumulate launch (stats_launch.cu)
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnroll = 4;      // independent loads in flight per thread
constexpr int kRunElems = 512;  // elements per thread between flushes to double

enum HistMode : int {
  kModeNone = 0,
  kModeLog2Exp = 1,  // log2 on float, lo_exp >= -126: count the exponent byte (per warp), map once
  kModeLog2 = 2,     // log2 in shared memory (float64 input, or bins reaching float subnormals)
  kModeLinear = 3,   // linear in shared memory; float: exact float thresholds, no divide
  kModeWide = 4,     // more than kSharedBins bins, or linear bins finer than float resolves
                     // near the range (linear_float_ok): global atomics per element
};

// Whether float arithmetic estimates a linear bin to within one bin for
// every value in range: the error of (v - lo) * (1 / width) in float is below
// (max(|lo|, |hi|) / width + bins) * 2**-22 bins (kept below 1/2 here).
C10_HOST_DEVICE inline bool linear_float_ok(const HistSpec& h) {
  const double alo = h.lo < 0 ? -h.lo : h.lo, ahi = h.hi < 0 ? -h.hi : h.hi;
  const double m = alo > ahi ? alo : ahi;
  return (m / h.width + static_cast<double>(h.bins)) * 0x1p-21 <= 0.5;
}

// Which mode the host picks for a histogram and a working type.
C10_HOST_DEVICE inline int hist_mode(const HistSpec& h, bool work_is_float) {
  if (h.kind == kHistNone) return kModeNone;
  if (h.nbins > kSharedBins) return kModeWide;
  if (h.kind == kHistLog2) return work_is_float && h.lo_exp >= -126 ? kModeLog2Exp : kModeLog2;
  return !work_is_float || linear_float_ok(h) ? kModeLinear : kModeWide;
}

template <typename T>
using work_t = std::conditional_t<sizeof(T) == sizeof(double), double, float>;

// Shared memory of one block, by histogram mode.
template <int kMode, typename W>
struct HistSmem {};
template <typename W>
struct HistSmem<kModeLog2Exp, W> {
  unsigned int tab[kWarps][256];  // per warp: counts by biased float exponent
};
template <typename W>
struct HistSmem<kModeLog2, W> {
  unsigned int bins[kSharedBins + 1];  // [0]: values not binned (NaN/Inf)
};
template <typename W>
struct HistSmem<kModeLinear, W> {
  unsigned int bins[kSharedBins + 1];  // [0]: values not binned (NaN/Inf)
  float thr[sizeof(W) == sizeof(float) ? kSharedBins + 1 : 1];  // least float >= each edge
};

// fminf/fmaxf (one instruction each) rather than push_min_max's compare and
// select: the same result here, where a NaN makes the whole run be redone.
template <typename W>
__device__ __forceinline__ W wmin(W a, W b) {
  if constexpr (sizeof(W) == sizeof(float)) return fminf(a, b); else return fmin(a, b);
}
template <typename W>
__device__ __forceinline__ W wmax(W a, W b) {
  if constexpr (sizeof(W) == sizeof(float)) return fmaxf(a, b); else return fmax(a, b);
}
// s + d * d in one rounding (an explicit fma, whatever --fmad says).
struct FmaSquare {
  __device__ __forceinline__ float operator()(float s, float d) const { return fmaf(d, d, s); }
  __device__ __forceinline__ double operator()(double s, double d) const { return fma(d, d, s); }
};

// Least float >= e (e finite or infinite): a value v (float) is >= e iff
// v >= that float, so float compares give the double edges' bins exactly.
__device__ __forceinline__ float float_at_or_above(double e) {
  float f = static_cast<float>(e);
  if (static_cast<double>(f) < e) f = nextafterf(f, kInf);
  return f;
}

// The bin of a finite float through the thresholds (linear_bin's result):
// a float estimate, then one exact correction each way (linear_float_ok).
__device__ __forceinline__ int linear_bin_thr(float v, const float* thr, float lo, float inv,
                                              int bins) {
  float q = (v - lo) * inv;
  q = fminf(fmaxf(q, 0.0f), static_cast<float>(bins - 1));
  int i = static_cast<int>(q);
  i -= (i > 0) & (v < thr[i]);
  i += (i < bins - 1) & (v >= thr[i + 1]);
  return v < thr[0] ? 0 : (v >= thr[bins] ? bins + 1 : 1 + i);
}

template <typename T, int kMode, bool kDense>
__global__ void __launch_bounds__(kThreads, 4)
    accumulate_kernel(const T* __restrict__ x, int64_t n, StridedDesc desc, RowTarget tgt,
                      HistSpec hist) {
  using W = work_t<T>;
  __shared__ HistSmem<kMode, W> sh;
  __shared__ Acc s_warp[kWarps];
  __shared__ int64_t s_shift[kWarps];  // each warp partial's shift (bits), or kShiftUnset

  if (blockDim.x > kThreads) __trap();  // shared memory is sized for kThreads
  const int64_t enabled = tgt.state[kStateEnabled];
  const int64_t slot = tgt.state[kStateSlot];
  if (enabled == 0) return;  // off-step: uniform early exit
  if (slot < 0 || slot >= tgt.slots) return;  // corrupt state: never write out of bounds
  int64_t* row = tgt.ring + (slot * tgt.rows + tgt.row) * tgt.width;
  int64_t* hrow = row + kHeader;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  if constexpr (kMode == kModeLog2Exp) {
    for (int i = tid; i < kWarps * 256; i += blockDim.x) (&sh.tab[0][0])[i] = 0u;
  } else if constexpr (kMode == kModeLog2 || kMode == kModeLinear) {
    for (int64_t b = tid; b <= hist.nbins; b += blockDim.x) sh.bins[b] = 0u;
  }
  float lo_f = 0.0f, inv_f = 0.0f;
  const int nbins_lin = static_cast<int>(hist.bins);
  if constexpr (kMode == kModeLinear && sizeof(W) == sizeof(float)) {
    for (int64_t i = tid; i <= hist.bins; i += blockDim.x) sh.thr[i] = float_at_or_above(linear_edge(hist, i));
    lo_f = static_cast<float>(hist.lo);
    inv_f = static_cast<float>(hist.inv_width);
  }
  __syncthreads();
  const int32_t lo_exp = static_cast<int32_t>(hist.lo_exp), hi_exp = static_cast<int32_t>(hist.hi_exp);

  // Every element is binned exactly once, here (runs redone in double are not).
  auto bin = [&](W v) {
    if constexpr (kMode == kModeLog2Exp) {
      atomicAdd(&sh.tab[warp][(vbits(v) >> 23) & 0xff], 1u);
    } else if constexpr (kMode == kModeLog2) {
      atomicAdd(&sh.bins[1 + log2_bin(v, lo_exp, hi_exp)], 1u);
    } else if constexpr (kMode == kModeLinear) {
      const bool finite = (v < 0 ? -v : v) < static_cast<W>(kInf);
      if constexpr (sizeof(W) == sizeof(float)) {
        atomicAdd(&sh.bins[finite ? 1 + linear_bin_thr(v, sh.thr, lo_f, inv_f, nbins_lin) : 0], 1u);
      } else {
        atomicAdd(&sh.bins[1 + linear_bin(v, hist)], 1u);
      }
    } else if constexpr (kMode == kModeWide) {
      const int64_t b = hist_bin(static_cast<double>(v), hist);
      if (b >= 0) DeviceAtomics::add_i64(hrow + b, tgt.mult);
    }
  };

  // The thread's partial, about its shift (its first run's center).
  ThreadAcc<W> part;
  thread_acc_init(part);
  double shift = 0.0;
  bool has_shift = false;
  auto exact = [&](double v) {  // one value in double: NaN/Inf counted, any magnitude
    if (!has_shift && (v < 0 ? -v : v) < kInf) {
      shift = v;
      has_shift = true;
    }
    thread_acc_push(part, v, shift);
  };

  // The thread's work: items gtid, gtid + gstride, ... of `count`, each kPer
  // elements (a 16-byte vector, or one strided element).
  constexpr int kPer = kDense ? Vec16<T>::kN : 1;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  int64_t head = 0, count = n;  // dense: elements before the first 16-byte boundary
  const T* body = x;
  if constexpr (kDense) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    head = n;
    if (addr % sizeof(T) == 0) {
      const int64_t mis = static_cast<int64_t>((16 - addr % 16) % 16) / sizeof(T);
      head = mis < n ? mis : n;
    }
    count = (n - head) / kPer;
    body = x + head;
  }
  auto load = [&](int64_t item, W (&out)[kPer]) {
    if constexpr (kDense) {
      const Vec16<T> p = reinterpret_cast<const Vec16<T>*>(body)[item];
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[k] = widen<W>(p.v[k]);
    } else {
      out[0] = widen<W>(x[strided_offset(desc, item)]);
    }
  };

  // f(v) for every element of the thread's items [i0, i1), one item at a time.
  auto revisit = [&](int64_t i0, int64_t i1, auto&& f) {
    for (int64_t i = i0; i < i1; ++i) {
      W v[kPer];
      load(gtid + i * gstride, v);
#pragma unroll
      for (int k = 0; k < kPer; ++k) f(v[k]);
    }
  };

  const int64_t nitems = gtid < count ? (count - 1 - gtid) / gstride + 1 : 0;
  constexpr int64_t kRunItems = (kRunElems / kPer / kUnroll) * kUnroll > 0
                                    ? (kRunElems / kPer / kUnroll) * kUnroll : kUnroll;
  W c = W(0);  // center of the next run
  for (int64_t j0 = 0; j0 < nitems; j0 += kRunItems) {
    const int64_t j1 = j0 + kRunItems < nitems ? j0 + kRunItems : nitems;
    W s1 = 0, s2 = 0, mn = static_cast<W>(kInf), mx = static_cast<W>(-kInf);
    unsigned int nz = 0;
    auto push = [&](W v) {
      const W d = v - c;
      s1 += d;
      s2 = FmaSquare{}(s2, d);
      mn = wmin(mn, v);
      mx = wmax(mx, v);
      nz += v == W(0);
      bin(v);
    };
    int64_t j = j0;
    for (; j + kUnroll <= j1; j += kUnroll) {  // the steady-state loop
      W v[kUnroll][kPer];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load(gtid + (j + u) * gstride, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) push(v[u][k]);
      }
    }
    revisit(j, j1, push);  // the last items, fewer than kUnroll
    const int64_t m = (j1 - j0) * kPer;
    const bool finite = s2 - s2 == W(0);  // false iff a NaN/Inf (or an overflowing square)
    if (finite && !shift_well_conditioned(s1, s2, m)) {
      // Far from the center: again about this run's mean (rare; re-read from cache).
      c = c + s1 / static_cast<W>(m);
      s1 = s2 = 0;
      revisit(j0, j1, [&](W v) { push_shifted(v, c, s1, s2, FmaSquare{}); });
    }
    if (finite && float_sums_ok(s1, s2, mn, mx)) {
      if (!has_shift) {
        shift = static_cast<double>(c);
        has_shift = true;
      }
      thread_acc_add_run(part, s1, s2, m, c, shift, mn, mx, nz);
      c = next_center(c, s1, s2, m);
    } else {
      revisit(j0, j1, [&](W v) { exact(static_cast<double>(v)); });  // in double (the bins stand)
    }
  }
  if constexpr (kDense) {
    // The head (before the first 16-byte boundary; element-misaligned
    // pointers are all head) and the tail (after the last whole vector).
    const int64_t tail = head + count * kPer;
#ifndef HOOKCAP_EMU_BREAK_INDEX  // fault injection for tests/cuda_emu only
    for (int64_t i = gtid; i < head + (n - tail); i += gstride) {
      const W v = widen<W>(x[i < head ? i : tail + (i - head)]);
#else
    for (int64_t i = gtid; i < head + (n - tail); i += gstride) {
      const W v = widen<W>(x[i < head ? i : count * kPer + (i - head)]);
#endif
      bin(v);
      exact(static_cast<double>(v));
    }
  }

  // Partials merge about one shift: within a warp its lowest lane's that has
  // one, across warps warp 0's first such partial, and per row the first block
  // to merge sets it (later blocks rebase onto it). No extra barrier.
  Acc acc = to_acc(part, shift);
  warp_common_shift(acc, has_shift, shift);
  warp_reduce(acc);
  if (lane == 0) {
    s_warp[warp] = acc;
    s_shift[warp] = has_shift ? dbits(shift) : kShiftUnset;
  }
#ifndef HOOKCAP_EMU_BREAK_SYNC  // fault injection for tests/cuda_emu only
  __syncthreads();
#endif
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarpSize;
    const bool mine = lane < nwarps && s_shift[lane] != kShiftUnset;
    shift = mine ? bitsd(s_shift[lane]) : 0.0;
    if (lane < nwarps) {
      acc = s_warp[lane];
    } else {
      acc_init(acc);
    }
    has_shift = mine;
    warp_common_shift(acc, has_shift, shift);
    warp_reduce(acc);
    if (lane == 0) {
      if (has_shift) {
        const auto old = static_cast<int64_t>(atomicCAS(
            reinterpret_cast<unsigned long long*>(row + kShift),
            static_cast<unsigned long long>(kShiftUnset), static_cast<unsigned long long>(dbits(shift))));
        if (old != kShiftUnset) acc_rebase(acc, shift, bitsd(old));
      }
      if (blockIdx.x == 0) {
        if (tgt.count) DeviceAtomics::add_i64(row + kCount, tgt.count);
        if (tgt.calls) DeviceAtomics::add_i64(row + kCalls, tgt.calls);
      }
      if (tgt.mult != 1) acc_scale(acc, tgt.mult);
      row_merge<DeviceAtomics>(row, acc);
      if constexpr (kMode == kModeLog2Exp) {
        // Exponent byte 0 holds the zeros (bin 0) and float subnormals,
        // which lie below lo_exp >= -126 (the underflow bin 1).
        int64_t zero_or_sub = 0;
        for (int w = 0; w < kWarps; ++w) zero_or_sub += sh.tab[w][0];
        zero_or_sub *= tgt.mult;
        if (acc.nzero) DeviceAtomics::add_i64(hrow, acc.nzero);
        if (zero_or_sub > acc.nzero) DeviceAtomics::add_i64(hrow + 1, zero_or_sub - acc.nzero);
      }
    }
  }
  if constexpr (kMode == kModeLog2Exp) {
    // Exponent bytes 1..254 (finite normals) to their bins; 255 is NaN/Inf.
    for (int e = 1 + tid; e < 255; e += blockDim.x) {
      unsigned int cnt = 0;
      for (int w = 0; w < kWarps; ++w) cnt += sh.tab[w][e];
      if (cnt) {
        const float v = bitsf(static_cast<int32_t>(e) << 23);
        DeviceAtomics::add_i64(hrow + log2_bin(v, lo_exp, hi_exp), static_cast<int64_t>(cnt) * tgt.mult);
      }
    }
  } else if constexpr (kMode == kModeLog2 || kMode == kModeLinear) {
    for (int64_t b = tid; b < hist.nbins; b += blockDim.x) {
      const unsigned int cnt = sh.bins[1 + b];
      if (cnt) DeviceAtomics::add_i64(hrow + b, static_cast<int64_t>(cnt) * tgt.mult);
    }
  }
}

// The accumulate specialisation for an element type, a histogram and a read
// (dense or strided), handed to `launch` (the CUDA launcher, or the emulation
// harness) as a kernel pointer: both choose exactly alike.
template <typename T, typename Launch>
void dispatch_accumulate(bool dense, const HistSpec& h, Launch&& launch) {
  const int mode = hist_mode(h, sizeof(work_t<T>) == sizeof(float));
  auto pick = [&](auto mode_tag) {
    // Float64 never takes the exponent-byte mode (hist_mode): not instantiated.
    constexpr int kMode = decltype(mode_tag)::value == kModeLog2Exp && sizeof(work_t<T>) != sizeof(float)
                              ? kModeLog2 : decltype(mode_tag)::value;
    if (dense) {
      launch(&accumulate_kernel<T, kMode, true>);
    } else {
      launch(&accumulate_kernel<T, kMode, false>);
    }
  };
  switch (mode) {
    case kModeNone: pick(std::integral_constant<int, kModeNone>{}); break;
    case kModeLog2Exp: pick(std::integral_constant<int, kModeLog2Exp>{}); break;
    case kModeLog2: pick(std::integral_constant<int, kModeLog2>{}); break;
    case kModeLinear: pick(std::integral_constant<int, kModeLinear>{}); break;
    default: pick(std::integral_constant<int, kModeWide>{}); break;
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
