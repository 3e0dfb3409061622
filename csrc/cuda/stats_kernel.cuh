// CUDA device code of hookcap: kernels only, no launches. Compiled by nvcc for
// the real build (stats_launch.cu) and by g++ through tests/cuda_emu for the
// CPU emulation harness, so it must stay plain CUDA C++: no inline PTX, no
// CUB, only the intrinsics the harness provides.
// HOOKCAP_EMU_FAULT(name) is defined only by that harness, which turns one
// fault on at run time (proof that it catches a missing barrier, a wrong
// index, ...); in every real build it is false and the fault code is gone.
#pragma once

#ifndef HOOKCAP_EMU_FAULT
#define HOOKCAP_EMU_FAULT(name) false
#endif

#include "cuda/launch_plan.cuh"
#include "hookcap/dtype_load.h"
#include "hookcap/state.h"
#include "hookcap/stats_math.h"
#include "hookcap/strided.h"

#include <cmath>
#include <type_traits>

#ifndef HOOKCAP_CUDA_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace hookcap {
namespace kernels {

// The block's dynamic shared memory (the launch's shared-memory bytes),
// 16-byte aligned. The CPU harness (tests/cuda_emu/cuda_emu.h, which defines
// HOOKCAP_CUDA_EMU) supplies its own; for nvcc it is the extern __shared__ array.
#ifdef HOOKCAP_CUDA_EMU
using emu::dynamic_smem;
#else
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char hookcap_dynamic_smem[];
  return hookcap_dynamic_smem;
}
#endif

// A static shared array's address as an integer, and back: shared-memory
// offsets on the device (__cvta_generic_to_shared, 32 bits), host addresses
// in the CPU harness. An offset built with an or instead of an add (a table
// aligned past the bits it sets) stays one instruction before the atomic:
// on sm_90 the array's address is a register (its CTA's shared window),
// which an add would repeat for every element.
#ifdef HOOKCAP_CUDA_EMU
using SmemAddr = uintptr_t;
inline SmemAddr smem_addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
template <typename T>
inline T* smem_ptr(SmemAddr a) {
  return reinterpret_cast<T*>(a);
}
#else
using SmemAddr = uint32_t;
__device__ __forceinline__ SmemAddr smem_addr(const void* p) {
  return static_cast<SmemAddr>(__cvta_generic_to_shared(p));
}
template <typename T>
__device__ __forceinline__ T* smem_ptr(SmemAddr a) {
  return reinterpret_cast<T*>(__cvta_shared_to_generic(a));
}
#endif

// Every global-memory atomic of the kernels goes through here (the harness
// counts them: a launch's fixed cost).
#ifdef HOOKCAP_CUDA_EMU
#define HOOKCAP_NOTE_ATOMIC() emu::note_device_atomic()
#else
#define HOOKCAP_NOTE_ATOMIC() ((void)0)
#endif
struct DeviceAtomics {
  static __device__ __forceinline__ void add_i64(int64_t* p, int64_t v) {
    HOOKCAP_NOTE_ATOMIC();
    atomicAdd(reinterpret_cast<unsigned long long*>(p),
              static_cast<unsigned long long>(v));
  }
  static __device__ __forceinline__ void add_f64(int64_t* p, double v) {
    HOOKCAP_NOTE_ATOMIC();
    atomicAdd(reinterpret_cast<double*>(p), v);
  }
  static __device__ __forceinline__ void min_i64(int64_t* p, int64_t v) {
    HOOKCAP_NOTE_ATOMIC();
    atomicMin(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  }
  static __device__ __forceinline__ void max_i64(int64_t* p, int64_t v) {
    HOOKCAP_NOTE_ATOMIC();
    atomicMax(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  }
  // *p = v if *p == expect; returns the old *p.
  static __device__ __forceinline__ int64_t cas_i64(int64_t* p, int64_t expect, int64_t v) {
    HOOKCAP_NOTE_ATOMIC();
    return static_cast<int64_t>(atomicCAS(reinterpret_cast<unsigned long long*>(p),
                                          static_cast<unsigned long long>(expect),
                                          static_cast<unsigned long long>(v)));
  }
  // Adds 1; returns the old value.
  static __device__ __forceinline__ int64_t ticket(int64_t* p) {
    HOOKCAP_NOTE_ATOMIC();
    return static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(p), 1ull));
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
  int64_t* scratch;  // tree_scratch_words(grid) words for the tree merge (launch_plan.cuh), or null:
                     // every block merges into the ring
  // Groups in one launch (accumulate_groups): the blocks of grid row
  // blockIdx.y read from x + blockIdx.y * x_step into row + blockIdx.y *
  // row_step (0, 0: one row). Such launches pass no scratch.
  int64_t row_step;
  int64_t x_step;
};

// The tensors of one many-tensor launch (accumulate_many): grid row y reads
// the n[y] contiguous elements at x[y] into row[y], as a launch of its own
// would (no tree: every block merges into the ring). By value, in the
// kernel's parameter space.
constexpr int kManyTensors = 32;
struct ManyTable {
  const void* x[kManyTensors];
  int64_t n[kManyTensors];
  int64_t row[kManyTensors];
};
// A launch's tensors beyond its x: none (accumulate, accumulate_groups), or a table.
template <bool kMany>
struct ManyArg {};
template <>
struct ManyArg<true> {
  ManyTable t;
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

// warp_reduce of the third and fourth sums (moments=4; about one shift).
__device__ __forceinline__ void warp_reduce4(Moments4& q) {
  for (int d = kWarpSize / 2; d > 0; d /= 2) {
    q.s3 += shfl_down(q.s3, d);
    q.s4 += shfl_down(q.s4, d);
  }
}

// Rebase each lane's partial onto the shift of the warp's lowest lane that
// has one (lanes without finite values have none); afterwards every lane has
// that shift, or none if no lane had one.
// kM4: the lane's third and fourth sums q move with it.
template <bool kM4 = false>
__device__ __forceinline__ void warp_common_shift(Acc& a, bool& has, double& shift, Moments4* q = nullptr) {
  const unsigned mask = __ballot_sync(0xffffffffu, has);
  if (mask == 0u) return;
  const int src = __popc((mask & (0u - mask)) - 1u);  // lowest set lane
  const double common = __shfl_sync(0xffffffffu, shift, src);
  if (has) {
    // The harness's planted bug: the third and fourth sums left about the lane's own shift.
    if constexpr (kM4) {
      if (HOOKCAP_EMU_FAULT(m4_rebase)) {
        acc_rebase(a, shift, common);
      } else {
        acc_rebase4(a, *q, shift, common);
      }
    } else {
      acc_rebase(a, shift, common);
    }
  }
  shift = common;
  has = true;
}

// 16-byte vector of elements for aligned loads.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// 16-byte vector of 32-bit words.
struct alignas(16) Words16 {
  uint32_t w[4];
};

// 16 bytes at p (16-byte aligned) by a read-only (non-coherent) load: the
// input is not written while a kernel reads it.
__device__ __forceinline__ Words16 load16(const void* p) {
#ifdef HOOKCAP_CUDA_EMU
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) __trap();  // a GPU faults on it
  return *reinterpret_cast<const Words16*>(p);
#else
  const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
  return Words16{{r.x, r.y, r.z, r.w}};
#endif
}

// Vectors of 16-bit and 8-bit floats are worked as 32-bit words of two
// 16-bit floats ("pairs"): bfloat16 as bfloat16, float16 and float8 as
// float16 (every float8 value is one: e5m2 is float16's top byte, e4m3 is
// converted by the hardware, sm_89 on). A run's min and max are taken on the
// pairs, two elements per instruction (minmax2).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kHwFp8 = false;  // e4m3 widened element by element (dtype_load.h)
#else
constexpr bool kHwFp8 = true;
#endif
template <typename T>
constexpr bool kPairs16 = sizeof(T) == 2 || std::is_same_v<T, c10::Float8_e5m2> ||
                          (std::is_same_v<T, c10::Float8_e4m3fn> && kHwFp8);
template <typename T>
using pair_t = std::conditional_t<std::is_same_v<T, c10::BFloat16>, c10::BFloat16, c10::Half>;
template <typename T>
constexpr int kPairWords = 8 / sizeof(T);  // pairs in a 16-byte vector

// Element `hi` (0: low half, 1: high half) of a pair of P, as a float.
template <typename P>
__device__ __forceinline__ float half_of_word(uint32_t w, int hi) {
  const uint32_t h = hi ? w >> 16 : w & 0xffffu;
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    return float_of_bits(h << 16);
  } else {
    return static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits()));
  }
}

// Two e4m3 (the low 16 bits of `two`) as a pair of float16.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t two) {
#ifdef HOOKCAP_CUDA_EMU
  const c10::Half lo(fp8_e4m3fn_to_float(two & 0xffu)), hi(fp8_e4m3fn_to_float((two >> 8) & 0xffu));
  return static_cast<uint32_t>(lo.x) | static_cast<uint32_t>(hi.x) << 16;
#else
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(r.x) | static_cast<uint32_t>(r.y) << 16;
#endif
}

// A 16-byte vector's elements as pairs (kPairs16<T>), in an order of their own.
template <typename T>
__device__ __forceinline__ void pairs_of_words(const Words16& q, uint32_t (&p)[kPairWords<T>]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2) {
      p[i] = q.w[i];
    } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
      p[2 * i] = (q.w[i] << 8) & 0xff00ff00u;  // bytes 0 and 2
      p[2 * i + 1] = q.w[i] & 0xff00ff00u;     // bytes 1 and 3
    } else {
      p[2 * i] = e4m3x2_to_half2(q.w[i]);
      p[2 * i + 1] = e4m3x2_to_half2(q.w[i] >> 16);
    }
  }
}

// The elementwise min (kMax: max) of two pairs of P, one instruction for
// both halves. A NaN half gives the other operand's: the kernel redoes runs
// holding NaN. The harness, without the half types, compares as floats.
template <typename P, bool kMax>
__device__ __forceinline__ uint32_t minmax2(uint32_t a, uint32_t b) {
#ifdef HOOKCAP_CUDA_EMU
  uint32_t r = 0;
  for (int hi = 0; hi < 2; ++hi) {
    const float fa = half_of_word<P>(a, hi), fb = half_of_word<P>(b, hi);
    const bool take_b = fa != fa || (kMax ? fb > fa : fb < fa);
    r |= ((take_b ? b : a) >> (16 * hi) & 0xffffu) << (16 * hi);
  }
  return r;
#else
  using V = std::conditional_t<std::is_same_v<P, c10::BFloat16>, __nv_bfloat162, __half2>;
  V va, vb, vr;
  memcpy(&va, &a, 4);
  memcpy(&vb, &b, 4);
  vr = kMax ? __hmax2(va, vb) : __hmin2(va, vb);
  uint32_t r;
  memcpy(&r, &vr, 4);
  return r;
#endif
}

// z (two counts) plus one in each half for a zero half (either sign) of
// pair w, both halves in one instruction. The counts are float16 on the
// device (exact to 2,048; a run adds at most kRunElems / 2 to each), and one
// float16 compare serves every pair type: a zero has the same bits in
// bfloat16 and float16, any other half is a nonzero float16 or a NaN (the
// compare flushes no subnormal). The harness counts in integers.
__device__ __forceinline__ uint32_t add_zero_halves(uint32_t z, uint32_t w) {
#ifdef HOOKCAP_CUDA_EMU
  return z + ((w & 0x7fffu) == 0 ? 1u : 0u) + ((w & 0x7fff0000u) == 0 ? 0x10000u : 0u);
#else
  __half2 vz, vw;
  memcpy(&vz, &z, 4);
  memcpy(&vw, &w, 4);
  vz = __hadd2(vz, __heq2(vw, __float2half2_rn(0.0f)));
  uint32_t r;
  memcpy(&r, &vz, 4);
  return r;
#endif
}

// The sum of add_zero_halves' two counts.
__device__ __forceinline__ float zero_halves_total(uint32_t z) {
#ifdef HOOKCAP_CUDA_EMU
  return static_cast<float>((z & 0xffffu) + (z >> 16));
#else
  __half2 vz;
  memcpy(&vz, &z, 4);
  return __low2float(vz) + __high2float(vz);
#endif
}

// Pairs of P as floats, two elements each.
template <typename P, int kWords>
__device__ __forceinline__ void widen_pairs(const uint32_t (&p)[kWords], float (&out)[2 * kWords]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    out[2 * i] = half_of_word<P>(p[i], 0);
    out[2 * i + 1] = half_of_word<P>(p[i], 1);
  }
}

// A 16-byte vector of elements T, loaded as words, in the working type W:
// by pairs (kByPairs: kPairs16<T>, float; bfloat16 always, a shift and a
// mask per pair), else element by element.
template <typename W, typename T, bool kByPairs>
__device__ __forceinline__ void widen_words(const Words16& q, W (&out)[Vec16<T>::kN]) {
  if constexpr (kByPairs || (std::is_same_v<T, c10::BFloat16> && sizeof(W) == sizeof(float))) {
    uint32_t p[kPairWords<T>];
    pairs_of_words<T>(q, p);
    widen_pairs<pair_t<T>>(p, out);
  } else {
    const Vec16<T> e = __builtin_bit_cast(Vec16<T>, q);
#pragma unroll
    for (int k = 0; k < Vec16<T>::kN; ++k) out[k] = widen<W>(e.v[k]);
  }
}

// ---------------------------------------------------------------------------
// accumulate: one specialisation per (element type, histogram mode, read
// kind: flat, vectors or elements; strided.h), chosen on the host
// (stats_launch.cu), so the hot loop holds one path. Elements of 32 bits or
// fewer are worked in float (exact: every such value is a float): each
// thread sums runs of up to kRunElems values about a center in float and
// flushes each run to a double partial (thread_acc_add_run); a run holding
// NaN/Inf or leaving float's safe range (float_sums_ok) is redone element by
// element in double. Float64 input works in double.
// ---------------------------------------------------------------------------
constexpr int kUnroll = 4;      // independent loads in flight per thread
constexpr int kRunElems = 512;  // elements per thread between flushes to double

constexpr float kInfF = __builtin_huge_valf();

template <typename T>
using work_t = std::conditional_t<sizeof(T) == sizeof(double), double, float>;

// Static shared memory of the exponent-byte mode: per warp, counts by biased
// float exponent. (The other histogram modes count in dynamic shared memory.)
// Aligned to a warp's table (1 KiB): an entry's address is the table's or'd
// with the entry's offset.
struct alignas(256 * sizeof(unsigned int)) Log2ExpSmem {
  unsigned int tab[kWarps][256];
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

// s + a * b in one rounding (moments=4's cubes and fourth powers).
struct FmaMul {
  __device__ __forceinline__ float operator()(float s, float a, float b) const { return fmaf(a, b, s); }
  __device__ __forceinline__ double operator()(double s, double a, double b) const { return fma(a, b, s); }
};

// The bin of a float v (linear_bin's result: 0 below lo, bins + 1 at or
// above hi, else 1 + i for edge i <= v < edge i + 1) through the thresholds
// thr[i] = least float >= edge i, so that v >= edge i iff v >= thr[i]. The
// float estimate q of v's position plus a half lies within 0.4 bins of it
// (linear_float_ok), so with j = trunc(q) clamped to [0, bins], v lies
// strictly between edges j - 1 and j + 1: one compare with edge j decides
// between bins j and j + 1. Below lo q < 1 (j = 0, v < thr[0]); at or above
// hi q >= bins (j = bins, v >= thr[bins]). The conversion saturates (negative
// and NaN give 0), so NaN and -Inf land in bin 0 and +Inf in bins + 1: the
// kernel takes those back by its NaN/Inf counts. No divide, no double, no
// branch.
__device__ __forceinline__ unsigned linear_estimate(float v, const LinearThr& f) {
  const unsigned q = __float2uint_rz(fmaf(v, f.inv, f.off));
  return q < static_cast<unsigned>(f.bins) ? q : static_cast<unsigned>(f.bins);
}
__device__ __forceinline__ int linear_bin_thr(float v, const float* thr, const LinearThr& f) {
  const unsigned j = linear_estimate(v, f);
  return static_cast<int>(j) + (v >= thr[j]);
}

// Linear bins counted in shared memory with their thresholds: pair i holds
// thr[i] (i <= bins) and the count of bin i (i <= bins + 1).
struct ThrCount {
  float thr;
  unsigned int count;
};
// The count of v's bin (linear_bin_thr's): the pair of v's estimate, or the
// next one if v is at or above its threshold. One address serves the
// threshold's load and the count's atomic, with no bin index in between.
__device__ __forceinline__ unsigned int* linear_count_thr(float v, ThrCount* pairs, const LinearThr& f) {
  unsigned char* base = reinterpret_cast<unsigned char*>(pairs);
  const unsigned o = static_cast<unsigned>(sizeof(ThrCount)) * linear_estimate(v, f);
  const float t = reinterpret_cast<const ThrCount*>(base + o)->thr;
  return &reinterpret_cast<ThrCount*>(base + (v >= t ? o + static_cast<unsigned>(sizeof(ThrCount)) : o))->count;
}

// Add one element per lane to the ring's bin `key` (-1: none), lanes with the
// same bin combined: the lowest of them adds their number. Every lane of the
// warp must call it together (the kernel keeps its loops warp-uniform here).
__device__ __forceinline__ void warp_add_bin(int64_t* hrow, int key, int64_t mult, int lane) {
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  if (key >= 0 && (peers & ((1u << lane) - 1u)) == 0u) {
    DeviceAtomics::add_i64(hrow + key, static_cast<int64_t>(__popc(peers)) * mult);
  }
}

// A block partial's record in the tree's scratch (launch_plan.cuh): the Acc
// as 12 words, then its shift (kShiftUnset: none), then with moments=4 its
// third and fourth sums.
__device__ __forceinline__ void record_write(int64_t* r, const Acc& a, bool has, double shift,
                                             const Moments4* q = nullptr) {
  r[0] = dbits(a.sum);
  r[1] = dbits(a.sumsq);
  r[2] = dbits(a.s1);
  r[3] = dbits(a.s2);
  r[4] = dbits(a.mn);
  r[5] = dbits(a.mx);
  r[6] = dbits(a.amx);
  r[7] = a.nnan;
  r[8] = a.npinf;
  r[9] = a.nninf;
  r[10] = a.nzero;
  r[11] = a.nfin;
  r[12] = has ? dbits(shift) : kShiftUnset;
  if (q) {
    r[13] = dbits(q->s3);
    r[14] = dbits(q->s4);
  }
}

// Read through volatile loads: written by other blocks of the launch (past
// their __threadfence), not to be served from a stale L1 line.
__device__ __forceinline__ void record_read(const volatile int64_t* r, Acc& a, bool& has, double& shift,
                                            Moments4* q = nullptr) {
  a.sum = bitsd(r[0]);
  a.sumsq = bitsd(r[1]);
  a.s1 = bitsd(r[2]);
  a.s2 = bitsd(r[3]);
  a.mn = bitsd(r[4]);
  a.mx = bitsd(r[5]);
  a.amx = bitsd(r[6]);
  a.nnan = r[7];
  a.npinf = r[8];
  a.nninf = r[9];
  a.nzero = r[10];
  a.nfin = r[11];
  const int64_t s = r[12];
  has = s != kShiftUnset;
  shift = has ? bitsd(s) : 0.0;
  if (q) {
    q->s3 = bitsd(r[13]);
    q->s4 = bitsd(r[14]);
  }
}

// Where a block's histogram counts are in shared memory: entry i's count is
// the sum over `ways` of at[w * way_stride + i * step + off].
struct BlockCounts {
  unsigned int* at;
  int ways, way_stride, step, off;
  __device__ __forceinline__ unsigned int operator()(int64_t i) const {
    unsigned int c = 0;
    for (int w = 0; w < ways; ++w) c += at[w * way_stride + i * step + off];
    return c;
  }
};

// What the ring merges of a block's or a group's histogram counts need.
struct CountsTarget {
  int64_t* row;    // the ring row
  int64_t mult;    // RowTarget::mult
  int64_t ncounts;  // entries: 256 exponent bytes (kModeLog2Exp), keys (kModeLog2Key), else the ring's bins
  int64_t bins;    // linear: equal-width bins (thresholds' +Inf bin at bins + 1)
  int32_t lo_exp, hi_exp;
  int32_t sub_shift;  // log2: bins per octave 2**sub_shift
  bool sign;          // log2: signed bins
};

// Into the ring: a partial's moments (one thread; `zero_or_sub`: with
// kModeLog2Exp, its count of exponent byte 0; kM4: its third and fourth
// sums q, about the same shift)...
template <int kMode, bool kThresholds, bool kM4>
__device__ __forceinline__ void ring_merge_moments(const CountsTarget& t, Acc a, bool a_has, double a_shift,
                                                   int64_t zero_or_sub, Moments4 q) {
  int64_t* hrow = t.row + kHeader;
  if (a_has) {
    const int64_t old = DeviceAtomics::cas_i64(t.row + kShift, kShiftUnset, dbits(a_shift));
    if (old != kShiftUnset) {
      if constexpr (kM4) {
        acc_rebase4(a, q, a_shift, bitsd(old));
      } else {
        acc_rebase(a, a_shift, bitsd(old));
      }
    }
  }
  if constexpr (kM4) {
    q.n = a.nfin;  // the values in q's sums (before acc_scale)
    moments4_to_row<DeviceAtomics>(t.row, q, t.mult);
  }
  if (t.mult != 1) acc_scale(a, t.mult);
  row_merge<DeviceAtomics>(t.row, a);
  if constexpr (kMode == kModeLog2Exp) {
    // Exponent byte 0 holds the zeros (bin 0) and float subnormals,
    // which lie below lo_exp >= -126 (the underflow bin 1).
    zero_or_sub *= t.mult;
    if (a.nzero) DeviceAtomics::add_i64(hrow, a.nzero);
    if (zero_or_sub > a.nzero) DeviceAtomics::add_i64(hrow + 1, zero_or_sub - a.nzero);
  }
  if constexpr (kMode == kModeLog2Key) {
    // ring_merge_counts put the zeros with the positive subnormals (key
    // field 0, sign 0) in the positive underflow bin: move them to the zeros'.
    if (a.nzero) {
      const int32_t zero_bin = log2_zero_bin(t.lo_exp, t.hi_exp, t.sub_shift, t.sign);
      DeviceAtomics::add_i64(hrow + zero_bin, a.nzero);
      DeviceAtomics::add_i64(hrow + zero_bin + 1, -a.nzero);
    }
  }
  if constexpr (kThresholds) {
    // linear_bin_thr put NaN and -Inf in bin 0 and +Inf in bins + 1.
    if (a.nnan + a.nninf) DeviceAtomics::add_i64(hrow, -(a.nnan + a.nninf));
    if (a.npinf) DeviceAtomics::add_i64(hrow + t.bins + 1, -a.npinf);
  }
}

// ... and the counts (every thread of the block: entries tid, tid + blockDim.x, ...).
template <int kMode, typename Cnt>
__device__ __forceinline__ void ring_merge_counts(const CountsTarget& t, const Cnt& cnt) {
  int64_t* hrow = t.row + kHeader;
  for (int64_t i = threadIdx.x; i < t.ncounts; i += blockDim.x) {
    if constexpr (kMode == kModeLog2Exp) {
      if (i == 0 || i == 255) continue;  // zeros and subnormals: the moments' merge; NaN/Inf: none
      const unsigned int c = cnt(i);
      if (c) {
        const float v = bitsf(static_cast<int32_t>(i) << 23);
        DeviceAtomics::add_i64(hrow + log2_bin(v, t.lo_exp, t.hi_exp), static_cast<int64_t>(c) * t.mult);
      }
    } else if constexpr (kMode == kModeLog2Key) {
      const unsigned int c = cnt(i);
      if (!c) continue;
      // The harness's planted bug: the key's sign dropped when it is mapped to a bin.
      const uint32_t k = HOOKCAP_EMU_FAULT(key_sign) ? static_cast<uint32_t>(i) & ((1u << (8 + t.sub_shift)) - 1)
                                                     : static_cast<uint32_t>(i);
      // Zeros land in the positive underflow bin: ring_merge_moments moves them.
      const int32_t b = log2_key_bin(k, t.lo_exp, t.hi_exp, t.sub_shift, t.sign);
      if (b >= 0) DeviceAtomics::add_i64(hrow + b, static_cast<int64_t>(c) * t.mult);
    } else {
      const unsigned int c = cnt(i);
      if (c) DeviceAtomics::add_i64(hrow + i, static_cast<int64_t>(c) * t.mult);
    }
  }
}

// The tree's ticket for a group (launch_plan.cuh), taken by the whole block
// after its record is written: whether this block is the group's last, which
// merges it. The barrier orders every thread's record writes before thread
// 0's fence and ticket (fences are cumulative), as a grid barrier does; the
// last block's fence orders its reads of the group after the ticket. `flag`:
// a shared word.
__device__ __forceinline__ bool tree_ticket(int64_t* ticket, int members, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's record, visible before its ticket
    const bool last = DeviceAtomics::ticket(ticket) == members - 1;
    if (last && !HOOKCAP_EMU_FAULT(ticket)) *ticket = 0;  // for the next launch on this stream
    if (last) __threadfence();  // the group's records, read after the ticket
    *flag = last ? 1 : 0;
  }
  __syncthreads();
  return *flag != 0;
}

// The tree above a group's last block at level 0: merges the group's records
// (into a record of the next level and its ticket, or at the top into the
// ring). Out of line: only the last block of each group runs it, so its
// registers are neither in the streaming loop nor saved by every block.
// `s_sum`: shared memory for ncounts merged counts (the block's own counts,
// already in its record); `flag`: a shared word.
template <int kMode, bool kThresholds, bool kM4>
__device__ __noinline__ void tree_merge_groups(CountsTarget t, int64_t* scratch, bool table, unsigned int* s_sum,
                                               int* flag) {
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  int64_t* tickets = scratch;
  int64_t* records = scratch + kTicketWords;
  int64_t idx = blockIdx.x, nrec = gridDim.x, base = 0;  // this level: record, records, first
  for (;;) {
    const int64_t group = idx / kTreeFan, first = group * kTreeFan;
    const int members = static_cast<int>(nrec - first < kTreeFan ? nrec - first : kTreeFan);
    const volatile int64_t* grp = records + (base + first) * kRecordWords;
    Acc acc;
    Moments4 q;
    moments4_init(q);
    bool has_shift = false;
    double shift = 0.0;
    if (warp == 0) {
      acc_init(acc);
      if (lane < members) record_read(grp + lane * kRecordWords, acc, has_shift, shift, kM4 ? &q : nullptr);
      warp_common_shift<kM4>(acc, has_shift, shift, &q);
      warp_reduce(acc);
      if constexpr (kM4) warp_reduce4(q);
    }
    if (table) {
      for (int64_t i = tid; i < t.ncounts; i += blockDim.x) {
        unsigned int c = 0;
        for (int m = 0; m < members; ++m) {
          c += reinterpret_cast<const volatile unsigned int*>(grp + m * kRecordWords + kRecordHeader)[i];
        }
        s_sum[i] = c;
      }
    }
    if (nrec <= kTreeFan) {  // the top: into the ring
      if (tid == 0) {  // s_sum[0]: its own entry
        ring_merge_moments<kMode, kThresholds, kM4>(t, acc, has_shift, shift,
                                                    kMode == kModeLog2Exp && table ? s_sum[0] : 0, q);
      }
      if (table) ring_merge_counts<kMode>(t, [&](int64_t i) { return s_sum[i]; });
      return;
    }
    // Into the group's record on the next level, then that level's ticket.
    int64_t* rec = records + (static_cast<int64_t>(gridDim.x) + group) * kRecordWords;
    if (tid == 0) record_write(rec, acc, has_shift, shift, kM4 ? &q : nullptr);
    if (table) {
      unsigned int* out = reinterpret_cast<unsigned int*>(rec + kRecordHeader);
      for (int64_t i = tid; i < t.ncounts; i += blockDim.x) out[i] = s_sum[i];
    }
    idx = group;
    nrec = (nrec + kTreeFan - 1) / kTreeFan;
    base = gridDim.x;
    if (!tree_ticket(tickets + kTreeFan, static_cast<int>(nrec), flag)) return;
  }
}

// The end of every accumulate block: its partial (in lane 0 of warp 0: `acc`
// about `shift`) and its shared-memory counts into the ring, directly or by
// the tree (launch_plan.cuh). Every thread of the block calls it.
template <int kMode, bool kThresholds, bool kM4>
__device__ __forceinline__ void block_epilogue(const Acc& acc, bool has_shift, double shift, const RowTarget& tgt,
                                               const HistSpec& hist, int64_t* row, BlockCounts counts,
                                               const Moments4& q) {
  constexpr bool kCounts = kMode == kModeLog2Exp || kMode == kModeLog2Key || kMode == kModeLog2 ||
                          kMode == kModeLog2Fine || kMode == kModeLinear;
  const int tid = threadIdx.x;
  const CountsTarget t{row, tgt.mult,
                       kMode == kModeLog2Exp ? 256 : kMode == kModeLog2Key ? log2_keys(hist) : kCounts ? hist.nbins : 0,
                       hist.bins, static_cast<int32_t>(hist.lo_exp), static_cast<int32_t>(hist.hi_exp),
                       static_cast<int32_t>(hist.sub_shift), hist.sign != 0};
  __shared__ int s_last;  // the tree: whether this block merges its group
  if (tid == 0 && blockIdx.x == 0) {
    if (tgt.count) DeviceAtomics::add_i64(row + kCount, tgt.count);
    if (tgt.calls) DeviceAtomics::add_i64(row + kCalls, tgt.calls);
  }
  const bool tree = tgt.scratch != nullptr && gridDim.x > 1 && gridDim.x <= kMaxTreeBlocks;
  if (!tree) {  // every block into the ring
    if (tid == 0) {
      ring_merge_moments<kMode, kThresholds, kM4>(t, acc, has_shift, shift, kMode == kModeLog2Exp ? counts(0) : 0,
                                                  q);
    }
    if constexpr (kCounts) ring_merge_counts<kMode>(t, counts);
    return;
  }
  // The tree (launch_plan.cuh): the block's record, then its group's ticket.
  const bool table = kCounts && t.ncounts <= kTableCounts;  // counts travel with the records
  if (kCounts && !table) ring_merge_counts<kMode>(t, counts);  // else each block's go to the ring
  int64_t* rec = tgt.scratch + kTicketWords + static_cast<int64_t>(blockIdx.x) * kRecordWords;
  if (tid == 0) record_write(rec, acc, has_shift, shift, kM4 ? &q : nullptr);
  if (table) {
    unsigned int* out = reinterpret_cast<unsigned int*>(rec + kRecordHeader);
    for (int64_t i = tid; i < t.ncounts; i += blockDim.x) out[i] = counts(i);
  }
  const int64_t group = blockIdx.x / kTreeFan, first = group * kTreeFan;
  const int members = static_cast<int>(gridDim.x - first < kTreeFan ? gridDim.x - first : kTreeFan);
  if (!tree_ticket(tgt.scratch + group, members, &s_last)) return;
  // The block's own counts are in its record: their shared memory sums the group's.
  tree_merge_groups<kMode, kThresholds, kM4>(t, tgt.scratch, table, counts.at, &s_last);
}

// A wide float64 value (stats_math.h wide_bucket) into the ring row. Out of
// line: rare, and its registers stay out of the streaming loop.
__device__ __noinline__ void wide_value_to_ring(int64_t* row, double v, int b, int64_t mult) {
  wide_value_to_row<DeviceAtomics>(row, v, b, mult);
}

// kM4 (moments=4): also the third and fourth sums, in float per run like
// s1, s2 (three instructions per element), flushed to double about the
// thread's shift (moments4_add_run) and merged like the moments, rebased
// by shift_rebase4.
// Blocks per SM a specialisation's registers are bounded for. moments=4
// (the third and fourth sums), float8 inputs' log2 bins per octave and
// float64 with a histogram spilled inside their loops at 64 registers
// (bench_sass.py): they get 128 and keep fewer blocks per SM. The other
// specialisations keep kMinBlocks.
template <typename T, int kMode, bool kM4>
constexpr int kMinBlocksOf = kM4 || (sizeof(T) == 1 && kMode == kModeLog2Fine) ||
                                     (sizeof(T) == 8 && kMode != kModeNone)
                                 ? 2
                                 : kMinBlocks;

template <typename T, int kMode, int kRead, bool kM4 = false, bool kMany = false>
__global__ void __launch_bounds__(kThreads, (kMinBlocksOf<T, kMode, kM4>))
    accumulate_kernel(const T* __restrict__ x, int64_t n, StridedDesc desc, RowTarget tgt,
                      HistSpec hist, LinearThr lin, ManyArg<kMany> many) {
  using W = work_t<T>;
  constexpr bool kFloat = sizeof(W) == sizeof(float);
  constexpr bool kSharedCounts = kMode == kModeLog2 || kMode == kModeLog2Fine || kMode == kModeLinear;
  // Counts in the ring, lane by lane through warp_add_bin: the loops below
  // keep every lane of a warp going round together.
  constexpr bool kWarpBins = kMode == kModeWide || kMode == kModeWideExact;
  constexpr bool kThresholds = (kMode == kModeLinear || kMode == kModeWide) && kFloat;
  __shared__ std::conditional_t<kMode == kModeLog2Exp, Log2ExpSmem, char> sh;
  __shared__ Acc s_warp[kWarps];
  __shared__ int64_t s_shift[kWarps];  // each warp partial's shift (bits), or kShiftUnset
  __shared__ std::conditional_t<kM4, Moments4[kWarps], char> s_m4;  // kM4: each warp's third and fourth sums

  if (blockDim.x > kThreads) __trap();  // shared memory is sized for kThreads
  const int64_t enabled = tgt.state[kStateEnabled];
  const int64_t slot = tgt.state[kStateSlot];
  if (enabled == 0) return;  // off-step: uniform early exit
  if (slot < 0 || slot >= tgt.slots) return;  // corrupt state: never write out of bounds
  const int64_t gy = blockIdx.y;  // the group (or kMany: the tensor): 0 unless the launch holds several
  if constexpr (kMany) {
    static_assert(kRead == kReadFlat, "many-tensor launches read contiguous tensors");
    x = static_cast<const T*>(many.t.x[gy]);
    n = many.t.n[gy];
    tgt.row = many.t.row[gy];
    tgt.count = n;
    // Blocks past the tensor's last vector read nothing (block 0 records its count and call).
    if (blockIdx.x > 0 && static_cast<int64_t>(blockIdx.x) * blockDim.x * Vec16<T>::kN >= n) return;
  } else {
    x += gy * tgt.x_step;
  }
  int64_t* row = tgt.ring + (slot * tgt.rows + tgt.row + gy * tgt.row_step) * tgt.width;
  int64_t* hrow = row + kHeader;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  // Dynamic shared memory. kPairs (linear on float, counted in shared
  // memory): ThrCount pairs 0 .. bins + 1. Otherwise [thresholds: bins + 1]
  // with kThresholds (kModeWide: thresholds only), then [counts: nbins + 1,
  // [0] the values not binned] with kSharedCounts.
  constexpr bool kPairs = kSharedCounts && kThresholds;
  unsigned char* smem = dynamic_smem();
  ThrCount* pairs = reinterpret_cast<ThrCount*>(smem);
  const float* thr = nullptr;
  if constexpr (kPairs) {
    for (int64_t i = tid; i <= hist.bins + 1; i += blockDim.x) {
      pairs[i] = ThrCount{i <= hist.bins ? float_at_or_above(linear_edge(hist, i)) : kInfF, 0u};
    }
  } else if constexpr (kThresholds) {
    float* s_thr = reinterpret_cast<float*>(smem);
    for (int64_t i = tid; i <= hist.bins; i += blockDim.x) s_thr[i] = float_at_or_above(linear_edge(hist, i));
    thr = s_thr;
    smem += 4 * (hist.bins + 1);
  }
  unsigned int* s_cnt = reinterpret_cast<unsigned int*>(smem);
  if constexpr (kMode == kModeLog2Exp) {
    for (int i = tid; i < kWarps * 256; i += blockDim.x) (&sh.tab[0][0])[i] = 0u;
  } else if constexpr (kMode == kModeLog2Key) {
    for (int64_t b = tid; b < log2_keys(hist); b += blockDim.x) s_cnt[b] = 0u;
  } else if constexpr (kSharedCounts && !kPairs) {
    for (int64_t b = tid; b <= hist.nbins; b += blockDim.x) s_cnt[b] = 0u;
  }
  __syncthreads();
  const int32_t lo_exp = static_cast<int32_t>(hist.lo_exp), hi_exp = static_cast<int32_t>(hist.hi_exp);
  const int32_t sub_shift = static_cast<int32_t>(hist.sub_shift);
  const bool sgn = hist.sign != 0;
  // kModeLog2Key: the key's shift and mask (log2_key_bits).
  const int32_t key_shift = 23 - sub_shift;
  const uint32_t key_mask = static_cast<uint32_t>(log2_keys(hist) - 1);

  // The bin of v in the ring (-1: NaN/Inf, not binned).
  auto bin_of = [&](W v) -> int {
    if constexpr (kMode == kModeLog2) {
      return log2_bin(v, lo_exp, hi_exp);
    } else if constexpr (kMode == kModeLog2Fine) {
      return log2_bin_fine(v, lo_exp, hi_exp, sub_shift, sgn);
    } else if constexpr (kThresholds) {
      return linear_bin_thr(v, thr, lin);  // NaN/Inf: bins 0, bins + 1, taken back at the end
    } else {
      return static_cast<int>(linear_bin(static_cast<double>(v), hist));
    }
  };
  // Every element is binned exactly once, here (runs redone in double are not).
  // kModeLog2Exp: the entry's address is one and-or of the value's bits
  // ((bits >> 21) & 0x3fc is the exponent byte times 4, below 1,024) and the
  // address of the warp's table (aligned to 1,024: the or adds).
  SmemAddr warp_tab = 0;
  if constexpr (kMode == kModeLog2Exp) warp_tab = smem_addr(&sh.tab[warp][0]);
  auto bin = [&](W v) {
    if constexpr (kMode == kModeLog2Exp) {
      atomicAdd(smem_ptr<unsigned int>(((vbits(v) >> 21) & 0x3fcu) | warp_tab), 1u);
    } else if constexpr (kMode == kModeLog2Key) {
      atomicAdd(&s_cnt[log2_key_bits(v, key_shift, key_mask)], 1u);
    } else if constexpr (kPairs) {
      atomicAdd(linear_count_thr(v, pairs, lin), 1u);
    } else if constexpr (kSharedCounts) {
      atomicAdd(&s_cnt[1 + bin_of(v)], 1u);
    } else if constexpr (kWarpBins) {
      warp_add_bin(hrow, bin_of(v), tgt.mult, lane);
    }
  };

  // The thread's partial, about its shift (its first run's center).
  ThreadAcc<W> part;
  thread_acc_init(part);
  Moments4 q;  // kM4: the thread's third and fourth sums, about its shift (q.n unused until the merge)
  moments4_init(q);
  double shift = 0.0;
  bool has_shift = false;
  auto exact = [&](double v) {  // one value in double: NaN/Inf counted, any magnitude
    const double a = v < 0 ? -v : v;
    if constexpr (kFloat) {
      if (!has_shift && a < kInf) {
        shift = v;
        has_shift = true;
      }
      thread_acc_push(part, v, shift);
      if constexpr (kM4) {
        if (a < kInf) push_moments4(v - shift, q.s3, q.s4);
      }
    } else {
      if (!has_shift && a < kInf && wide_bucket(a) == 0) {  // the shift is an ordinary value
        shift = v;
        has_shift = true;
      }
      const int b = thread_acc_push_wide(part, v, shift);
      if (b != 0) wide_value_to_ring(row, v, b, tgt.mult);  // rare: straight into the ring
      if constexpr (kM4) {
        if (a < kInf && wide_bucket(a) == 0) push_moments4(v - shift, q.s3, q.s4);  // the values nfin counts
      }
    }
  };

  // The thread's work: items gtid, gtid + gstride, ... of `count`, each kPer
  // elements (a 16-byte vector, or one strided element). kReadVectors: the
  // host guarantees two dimensions of whole aligned vectors, `desc` in vectors.
  constexpr bool kFlat = kRead == kReadFlat;
  constexpr bool kVec = kRead != kReadElements;
  constexpr int kPer = kVec ? Vec16<T>::kN : 1;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  int64_t head = 0, count = n / kPer;  // flat: elements before the first 16-byte boundary
  const T* body = x;
  if constexpr (kFlat) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    head = n;
    if (addr % sizeof(T) == 0) {
      const int64_t mis = static_cast<int64_t>((16 - addr % 16) % 16) / sizeof(T);
      head = mis < n ? mis : n;
    }
    count = (n - head) / kPer;
    body = x + head;
  }
  // An item as loaded (a 16-byte vector, or one strided element), then widened.
  using Raw = std::conditional_t<kVec, Words16, T>;
  auto load_raw = [&](int64_t item) -> Raw {
    if constexpr (kFlat) {
      return load16(body + item * kPer);
    } else if constexpr (kVec) {
      return load16(x + vector_offset(desc, item) * kPer);
    } else {
      return x[strided_offset(desc, item)];
    }
  };
  // Vectors of pairs (kPairs16; not wide-exact, whose double binning needs
  // the registers, nor float8 log2 by log2_bin, which spills with them on
  // sm_89): widened by pairs, a run's min and max on the pairs.
  constexpr bool kPacked = kVec && kPairs16<T> && kFloat && kMode != kModeWideExact &&
                           !(sizeof(T) == 1 && (kMode == kModeLog2 || kMode == kModeLog2Fine));
  auto widen_raw = [&](const Raw& r, W (&out)[kPer]) {
    if constexpr (kVec) {
      widen_words<W, T, kPacked>(r, out);
    } else {
      out[0] = widen<W>(r);
    }
  };
  auto load = [&](int64_t item, W (&out)[kPer]) { widen_raw(load_raw(item), out); };

  // kPacked: a run's min and max on the pairs, two elements per
  // instruction, then (min, max) of each half.
  using P = pair_t<T>;
  constexpr uint32_t kWordInf = std::is_same_v<P, c10::BFloat16> ? 0x7f807f80u : 0x7c007c00u;
  constexpr uint32_t kWordNegInf = kWordInf | 0x80008000u;
  uint32_t mn2, mx2;  // the run's, from +Inf and -Inf in both halves
  uint32_t z2;        // the run's zeros (add_zero_halves), with its min and max
  // widen_raw, and with kPacked the run's min, max and zeros.
  auto widen_mm = [&](const Raw& r, W (&out)[kPer]) {
    if constexpr (kPacked) {
      uint32_t p[kPairWords<T>];
      pairs_of_words<T>(r, p);
#pragma unroll
      for (int i = 0; i < kPairWords<T>; ++i) {
        mn2 = minmax2<P, false>(mn2, p[i]);
        mx2 = minmax2<P, true>(mx2, p[i]);
        z2 = add_zero_halves(z2, p[i]);
      }
      widen_pairs<P>(p, out);
    } else {
      widen_raw(r, out);
    }
  };

  // f(v) for every element of the thread's items [i0, i1), one item at a
  // time; with_minmax: the items' min and max too (kPacked).
  auto revisit = [&](int64_t i0, int64_t i1, auto&& f, bool with_minmax = false) {
    for (int64_t i = i0; i < i1; ++i) {
      const Raw r = load_raw(gtid + i * gstride);
      W v[kPer];
      if (with_minmax) {
        widen_mm(r, v);
      } else {
        widen_raw(r, v);
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) f(v[k]);
    }
  };

  // This thread's items; kWarpBins: the warp goes round as often as its lane
  // 0 (the most items), every lane has the first items_all (lanes differ by
  // one item at most), and the lanes with one more (`extra`, a prefix of the
  // warp) have their last at items_all.
  int64_t items_all = gtid < count ? (count - 1 - gtid) / gstride + 1 : 0;
  bool extra = false, extra_warp = false;
  if constexpr (kWarpBins) {
    const int64_t base = gtid - lane;
    const int64_t items0 = base < count ? (count - 1 - base) / gstride + 1 : 0;
    extra_warp = items0 > 0 && base + (items0 - 1) * gstride + (kWarpSize - 1) >= count;
    extra = items_all == items0 && extra_warp;
    items_all = items0 - extra_warp;
  }
  const int64_t nitems = items_all + extra, items_warp = items_all + extra_warp;
  // kWarpBins, and float64 linear bins (in double): two loads in flight
  // (their bins cost more than their loads; fewer registers, no spill in the
  // loop). kTwoSets, two groups of two: 16-bit elements counted in shared
  // memory, whose loads the compiler would issue one at a time, and dense
  // 16-bit log2 by exponent byte, whose four loads it would wait on at once
  // (there a group stays in flight for about one more instruction per
  // element; the other loops spill with it).
  constexpr bool kTwoSets =
      kVec && sizeof(T) == 2 && (kSharedCounts || kMode == kModeLog2Key || (kMode == kModeLog2Exp && kFlat));
  constexpr int kUnrollM = kTwoSets                               ? 2
                           : kWarpBins                            ? (kPer >= 8 ? 1 : 2)
                           : !kFloat && kMode == kModeLinear      ? 2
                                                                  : kUnroll;
  constexpr int64_t kRunItems = (kRunElems / kPer / kUnrollM) * kUnrollM > 0
                                    ? (kRunElems / kPer / kUnrollM) * kUnrollM : kUnrollM;
  // kM4 on float: the powers' float sums lose accuracy in proportion to how
  // far the run's center lies from its mean (their central moments cancel
  // out of sums about c), so runs are centred closely: the first run is one
  // group of loads, whose mean centres the next (and every later run the
  // one before's), and a run whose mean lies more than a standard deviation
  // from its center is summed again about it (shift_well_conditioned).
  constexpr bool kCentred = kM4 && kFloat;
  W c = W(0);  // center of the next run
  constexpr int64_t kFirstRun = kCentred ? kUnrollM : kRunItems;  // the default's runs: all kRunItems
  for (int64_t j0 = 0; j0 < items_warp; j0 += (j0 == 0 ? kFirstRun : kRunItems)) {
    const int64_t jend = j0 + (j0 == 0 ? kFirstRun : kRunItems);
    const int64_t j1 = jend < nitems ? jend : (nitems > j0 ? nitems : j0);  // this thread's
    W s1 = 0, s2 = 0, mn = static_cast<W>(kInf), mx = static_cast<W>(-kInf);
    W s3 = 0, s4 = 0;  // kM4
    W nz = 0;  // zeros of the run, counted in W (exact: at most kRunElems)
    mn2 = kWordInf;
    mx2 = kWordNegInf;
    z2 = 0;
    auto stats = [&](W v) {  // kPacked: min, max and zeros by widen_mm
      const W d = v - c;
      s1 += d;
      s2 = FmaSquare{}(s2, d);
      if constexpr (kM4) push_moments4(d, s3, s4, FmaMul{});
      if constexpr (!kPacked) {
        mn = wmin(mn, v);
        mx = wmax(mx, v);
        nz += v == W(0) ? W(1) : W(0);
      }
    };
    auto push = [&](W v) {
      stats(v);
      bin(v);
    };
    int64_t j = j0;
    const int64_t jsteady = kWarpBins ? (jend < items_all ? jend : items_all) : j1;  // warp-uniform for kWarpBins
    if constexpr (kTwoSets) {
      // Groups of kUnrollM items in two sets of registers, a and b: the next
      // group's loads are issued before this group is worked, so they are in
      // flight all the while (the compiler would otherwise issue them late).
      Raw ga[kUnrollM], gb[kUnrollM];
      // Dense: the next group's first vector as a pointer stepped group by
      // group (the item index, multiplied out at every load, costs a dozen
      // address instructions per group where registers are short).
      // The grid's stride in elements fits an int (the launcher's grids are
      // far below 2**31 / 256 / 8 blocks): each step is one wide multiply-add.
      const int vstride = static_cast<int>(gstride * kPer);
      const T* next = kFlat ? body + (gtid + j * gstride) * kPer : nullptr;  // the next vector to load
      auto issue = [&](Raw (&g)[kUnrollM], int64_t j_at) {
        if constexpr (kFlat) {
#pragma unroll
          for (int u = 0; u < kUnrollM; ++u) {
            g[u] = load16(next);
            next += vstride;
          }
        } else {
#pragma unroll
          for (int u = 0; u < kUnrollM; ++u) g[u] = load_raw(gtid + (j_at + u) * gstride);
        }
      };
      auto work = [&](const Raw (&g)[kUnrollM]) {
#pragma unroll
        for (int u = 0; u < kUnrollM; ++u) {
          W v[kPer];
          widen_mm(g[u], v);
#pragma unroll
          for (int k = 0; k < kPer; ++k) push(v[k]);
        }
      };
      // Whole groups left, counted in 32 bits (a run holds few): the loop
      // tests one register, and j moves once after it.
      const int groups = j + kUnrollM <= jsteady ? static_cast<int>((jsteady - j) / kUnrollM) : 0;
      int left = groups;
      if (left > 0) issue(ga, j);
      while (left > 0) {  // the steady-state loop
        const bool more_b = left >= 2;
        if (more_b) issue(gb, j + (groups - left + 1) * kUnrollM);
        work(ga);
        --left;
        if (!more_b) break;
        const bool more_a = left >= 2;
        if (more_a) issue(ga, j + (groups - left + 1) * kUnrollM);
        work(gb);
        --left;
        if (!more_a) break;
      }
      j += static_cast<int64_t>(groups) * kUnrollM;
    } else {
      for (; j + kUnrollM <= jsteady; j += kUnrollM) {  // the steady-state loop
        W v[kUnrollM][kPer];
        if constexpr (kPacked) {  // the other loops keep their load-and-widen order (no spill)
          Raw r[kUnrollM];
#pragma unroll
          for (int u = 0; u < kUnrollM; ++u) r[u] = load_raw(gtid + (j + u) * gstride);
#pragma unroll
          for (int u = 0; u < kUnrollM; ++u) {
            widen_mm(r[u], v[u]);
          }
        } else {
#pragma unroll
          for (int u = 0; u < kUnrollM; ++u) load(gtid + (j + u) * gstride, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnrollM; ++u) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) push(v[u][k]);
        }
      }
    }
    if constexpr (kWarpBins) {
      // The last items, fewer than kUnrollM + 1: this thread's moments, then
      // their bins with the warp's lanes together (a lane without one adds none).
      revisit(j, j1, stats, true);
      const int64_t jlast = jend < items_warp ? jend : items_warp;
      for (; j < jlast; ++j) {
        const bool mine = j < j1;
        W v[kPer] = {};
        if (mine) load(gtid + j * gstride, v);
#pragma unroll
        for (int k = 0; k < kPer; ++k) warp_add_bin(hrow, mine ? bin_of(v[k]) : -1, tgt.mult, lane);
      }
      if (j1 == j0) continue;  // no items of this thread's in this run
    } else {
      revisit(j, j1, push, true);  // the last items, fewer than kUnrollM
    }
    if constexpr (kPacked) {
      mn = wmin(half_of_word<P>(mn2, 0), half_of_word<P>(mn2, 1));
      mx = wmax(half_of_word<P>(mx2, 0), half_of_word<P>(mx2, 1));
      nz = static_cast<W>(zero_halves_total(z2));
    }
    const int64_t m = (j1 - j0) * kPer;
    const bool finite = s2 - s2 == W(0);  // false iff a NaN/Inf (or an overflowing square)
    // v's moments about the center cv, into the run's sums (a run summed again).
    auto restat = [&](W v, W cv) {
      push_shifted(v, cv, s1, s2, FmaSquare{});
      if constexpr (kM4) push_moments4(v - cv, s3, s4, FmaMul{});
    };
    if (finite && !shift_well_conditioned(s1, s2, m, kCentred ? 1 : 2)) {
      // Far from the center: again about this run's mean (rare; re-read from cache).
      c = c + s1 / static_cast<W>(m);
      s1 = s2 = s3 = s4 = 0;
      revisit(j0, j1, [&](W v) { restat(v, c); });
    }
    bool in_float = finite && float_sums_ok(s1, s2, mn, mx);
    if constexpr (kM4) in_float = in_float && float_moments4_ok(s3, s4, s1, mn, mx);
    if constexpr (!kFloat) {
      // Float64 runs that may hold wide values go element by element (their
      // moments need the buckets).
      in_float = in_float && !may_be_wide(mn, mx);
    }
    int scale_exp = 0;
    if (!in_float) {
      // Redone (rare; re-read from cache): a run of tiny values again about
      // its mean, values and center times 2**k (exact), in float (the scaled
      // squares cannot underflow: the largest value is in [1, 2)); any other
      // run element by element in double (the bins stand).
      if constexpr (kFloat) {
        bool tiny = finite && float_sums_tiny(s1, s2, mn, mx);
        if constexpr (kM4) {
          // Either pair's sums tiny, the other within float's range. Times
          // 2**k, a run that is not constant either spreads over 0.5 or more
          // or has its values and center on a grid of 2**-24 or coarser
          // (near the largest |value|, in [1, 2); subnormals: 2**-22), so
          // some |x - c| >= 2**-24: its fourth powers pass float_moments4_ok.
          tiny = finite && ((tiny && float_pair_fits(s3, s4)) ||
                            (float_moments4_tiny(s3, s4, s1, mn, mx) && float_pair_fits(s1, s2)));
        }
        if (tiny) scale_exp = tiny_run_exp(wmax(-mn, mx));
      }
      W sc = W(1), cs = W(0);
      if (scale_exp > 0) {
        sc = pow2f(scale_exp);
        c = c + s1 / static_cast<W>(m);
        cs = c * sc;
        s1 = s2 = s3 = s4 = 0;
      }
      revisit(j0, j1, [&](W v) {
        if (scale_exp > 0) {
          restat(v * sc, cs);
        } else {
          exact(static_cast<double>(v));
        }
      });
      if (HOOKCAP_EMU_FAULT(rescale) && scale_exp > 0) scale_exp -= 1;
    }
    if constexpr (!kFloat) {
      if (!in_float) c = W(0);  // a redone run's center may be wide: the next run's is an ordinary value
    }
    if (in_float || scale_exp > 0) {
      if (!has_shift) {
        shift = static_cast<double>(c);
        has_shift = true;
      }
      thread_acc_add_run(part, s1, s2, m, c, shift, mn, mx, static_cast<uint32_t>(nz), scale_exp);
      if constexpr (kM4) moments4_add_run(q, s1, s2, s3, s4, m, c, shift, scale_exp);
      if constexpr (kCentred) {
        if (scale_exp == 0) c = c + s1 / static_cast<W>(m);  // rescaled runs: c is their mean already
      } else if (scale_exp > 0) {
        c = next_center(c * pow2f(scale_exp), s1, s2, m) == W(0) ? W(0) : c;
      } else {
        c = next_center(c, s1, s2, m);
      }
    }
  }
  if constexpr (kFlat) {
    // The head (before the first 16-byte boundary; element-misaligned
    // pointers are all head) and the tail (after the last whole vector).
    const int64_t tail = head + count * kPer;
    const int64_t ends = head + (n - tail);  // elements in the head and the tail
    auto element = [&](int64_t i) {
      return widen<W>(x[i < head ? i : (HOOKCAP_EMU_FAULT(index) ? count * kPer : tail) + (i - head)]);
    };
    if constexpr (kWarpBins) {
      for (int64_t i0 = gtid - lane; i0 < ends; i0 += gstride) {  // warp-uniform
        const int64_t i = i0 + lane;
        int b = -1;
        if (i < ends) {
          const W v = element(i);
          b = bin_of(v);
          exact(static_cast<double>(v));
        }
        warp_add_bin(hrow, b, tgt.mult, lane);
      }
    } else {
      for (int64_t i = gtid; i < ends; i += gstride) {
        const W v = element(i);
        bin(v);
        exact(static_cast<double>(v));
      }
    }
  }

  // Partials merge about one shift: within a warp its lowest lane's that has
  // one, across warps warp 0's first such partial, across blocks (the tree)
  // the first such record's of a group, and per row the first merge into the
  // ring sets it (later merges rebase onto it).
  Acc acc = to_acc(part, shift);
  warp_common_shift<kM4>(acc, has_shift, shift, &q);
  warp_reduce(acc);
  if constexpr (kM4) warp_reduce4(q);
  if (lane == 0) {
    s_warp[warp] = acc;
    s_shift[warp] = has_shift ? dbits(shift) : kShiftUnset;
    if constexpr (kM4) s_m4[warp] = q;
  }
  if (!HOOKCAP_EMU_FAULT(sync)) __syncthreads();
  if (warp == 0) {  // the block's partial, in lane 0
    const int nwarps = blockDim.x / kWarpSize;
    const bool mine = lane < nwarps && s_shift[lane] != kShiftUnset;
    shift = mine ? bitsd(s_shift[lane]) : 0.0;
    if (lane < nwarps) {
      acc = s_warp[lane];
      if constexpr (kM4) q = s_m4[lane];
    } else {
      acc_init(acc);
      moments4_init(q);
    }
    has_shift = mine;
    warp_common_shift<kM4>(acc, has_shift, shift, &q);
    warp_reduce(acc);
    if constexpr (kM4) warp_reduce4(q);
  }

  // The block's histogram counts in shared memory, entry i: kModeLog2Exp, of
  // exponent byte i (0: zeros and float subnormals, 255: NaN/Inf), summed
  // over the warps' tables; counted in shared memory, of ring bin i (kWarpBins
  // modes counted into the ring as they went).
  BlockCounts counts{nullptr, 0, 0, 0, 0};
  if constexpr (kMode == kModeLog2Exp) {
    counts = BlockCounts{&sh.tab[0][0], kWarps, 256, 1, 0};
  } else if constexpr (kMode == kModeLog2Key) {
    counts = BlockCounts{s_cnt, 1, 0, 1, 0};  // entry i: key i
  } else if constexpr (kPairs) {
    counts = BlockCounts{reinterpret_cast<unsigned int*>(pairs), 1, 0, 2, 1};  // ThrCount::count
  } else if constexpr (kSharedCounts) {
    counts = BlockCounts{s_cnt, 1, 0, 1, 1};  // [0]: values not binned
  }
  block_epilogue<kMode, kThresholds, kM4>(acc, has_shift, shift, tgt, hist, row, counts, q);
}

// The accumulate specialisation for an element type, a histogram (with
// moments=4 or not), a read (strided.h's ReadKind, through accumulate_read)
// and the device's shared-memory budget (smem_budget), handed to `launch`
// (the CUDA launcher, or the emulation harness) as a kernel pointer with its
// HistPlan: both choose exactly alike. kMany: the many-tensor kernel
// (contiguous tensors, a ManyTable), whatever `read`.
template <typename T, bool kMany = false, typename Launch>
void dispatch_accumulate(ReadKind read, const HistSpec& h, int64_t smem_budget, Launch&& launch) {
  const HistPlan plan = hist_plan(h, sizeof(work_t<T>) == sizeof(float), smem_budget - static_smem_extra(h));
  auto pick = [&](auto mode_tag, auto m4_tag) {
    // Float64 never takes the exponent-byte or the exact-wide mode (hist_plan): not instantiated.
    constexpr int kTag = decltype(mode_tag)::value;
    constexpr bool kM4 = decltype(m4_tag)::value;
    constexpr bool kF64 = sizeof(work_t<T>) != sizeof(float);
    constexpr int kMode = kF64 && kTag == kModeLog2Exp   ? kModeLog2
                          : kF64 && kTag == kModeLog2Key ? kModeLog2Fine
                          : kF64 && kTag == kModeWideExact ? kModeWide : kTag;
    if constexpr (kMany) {  // many-tensor launches read contiguous tensors only
      launch(&accumulate_kernel<T, kMode, kReadFlat, kM4, true>, plan);
    } else if (read == kReadFlat) {
      launch(&accumulate_kernel<T, kMode, kReadFlat, kM4>, plan);
    } else if (read == kReadVectors && !kM4) {  // moments=4 reads strided views by element (accumulate_read)
      launch(&accumulate_kernel<T, kMode, kReadVectors, false>, plan);
    } else {
      launch(&accumulate_kernel<T, kMode, kReadElements, kM4>, plan);
    }
  };
  auto pick_m4 = [&](auto mode_tag) {
    if (h.moments4) {
      pick(mode_tag, std::true_type{});
    } else {
      pick(mode_tag, std::false_type{});
    }
  };
  switch (plan.mode) {
    case kModeNone: pick_m4(std::integral_constant<int, kModeNone>{}); break;
    case kModeLog2Exp: pick_m4(std::integral_constant<int, kModeLog2Exp>{}); break;
    case kModeLog2: pick_m4(std::integral_constant<int, kModeLog2>{}); break;
    case kModeLog2Fine: pick_m4(std::integral_constant<int, kModeLog2Fine>{}); break;
    case kModeLog2Key: pick_m4(std::integral_constant<int, kModeLog2Key>{}); break;
    case kModeLinear: pick_m4(std::integral_constant<int, kModeLinear>{}); break;
    case kModeWide: pick_m4(std::integral_constant<int, kModeWide>{}); break;
    default: pick_m4(std::integral_constant<int, kModeWideExact>{}); break;
  }
}

// Write the reset value of every `width`-word row into words start,
// start + stride, ... of `total` from `base`, for `step`. The column follows
// the index incrementally (stride % width < width: at most one subtraction),
// so a thread divides once, not once per word.
__device__ __forceinline__ void reset_words(int64_t* base, int64_t total, int64_t width, int64_t step,
                                            int64_t start, int64_t stride) {
  if (start >= total) return;
  int64_t col = start % width;
  const int64_t col_step = stride % width;
  for (int64_t i = start; i < total; i += stride) {
    base[i] = reset_value(col, step);
    if (HOOKCAP_EMU_FAULT(reset_walk)) {
      col = (col + col_step) % (width - 1);
    } else {
      col += col_step;
      if (col >= width) col -= width;
    }
  }
}

// Advance, part 1 (any grid): reset the slot the next step opens, if that
// step is recorded. Reads the state and leaves it as it is, so every block
// sees the same one; advance_state_kernel, next on the same stream, moves it.
__global__ void advance_reset_kernel(int64_t* ring, const int64_t* state, int64_t slots,
                                     int64_t rows, int64_t width, int64_t every) {
  if (state[kStateSlot] < 0 || state[kStateSlot] >= slots) return;  // corrupt state
  const StepState next = next_state(state, every, slots);
  if (!next.enabled) return;
  reset_words(ring + next.slot * rows * width, rows * width, width, next.step,
              static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// Advance, part 2 (one thread, after part 1): the state moves by one step.
__global__ void advance_state_kernel(int64_t* state, int64_t slots, int64_t every) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (state[kStateSlot] < 0 || state[kStateSlot] >= slots) return;  // corrupt state
  const StepState next = next_state(state, every, slots);
  state[kStateStep] = next.step;
  state[kStateEnabled] = next.enabled;
  state[kStateSlot] = next.slot;
}

// Reset rows [begin, end) of the slot the state points at (for its step):
// the whole slot, new metrics' rows after the ring grew, or one row whose
// value is replaced.
__global__ void reset_rows_kernel(int64_t* ring, const int64_t* state, int64_t slots,
                                  int64_t rows, int64_t width, int64_t begin, int64_t end) {
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // corrupt state: never write out of bounds
  reset_words(ring + (slot * rows + begin) * width, (end - begin) * width, width, state[kStateStep],
              static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace kernels
}  // namespace hookcap
