// The CPU statistics loop: one pass over a tensor, split into a fixed number
// of chunks (independent of the thread count, so results are bitwise
// reproducible for any OMP_NUM_THREADS), each chunk reduced block by block with
// vector accumulators; the chunk loop is compiled twice — AVX2+FMA (which also
// counts log2 histograms with AVX2 byte compares) and baseline — and picked at
// run time. Each input dtype is instantiated in its own file
// (accumulate_<dtype>.cpp) so the build compiles them in parallel.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

// GCC vectors of 8 floats pass through always-inlined helpers (here and in
// stats_math.h), so the ABI note GCC gives for returning a 32-byte vector
// without AVX never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <type_traits>

#include "cpu/stats_cpu.h"
#include "hookcap/dtype_load.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"
#include "hookcap/stats_math.h"
#include "hookcap/strided.h"

#define HC_ALWAYS_INLINE inline __attribute__((always_inline))

namespace hookcap {
namespace {

struct HostAtomics {
  static void add_i64(int64_t* p, int64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  static void add_f64(int64_t* p, double v) {
    int64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, dbits(bitsd(old) + v), true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
  static int64_t cas_i64(int64_t* p, int64_t expect, int64_t v) {
    // A plain load first: once set, the value stays (a locked op costs more than a small tensor's values).
    const int64_t seen = __atomic_load_n(p, __ATOMIC_RELAXED);
    if (seen != expect) return seen;
    __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expect;  // the value found: `expect` when the exchange happened
  }
  static void min_i64(int64_t* p, int64_t v) {
    int64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
  }
  static void max_i64(int64_t* p, int64_t v) {
    int64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
  }
};

constexpr int kHistCopies = 4;        // sub-histograms break store->load chains (unrolled x4 below)
// Wider histograms count into the ring. 2,100: the default log2 range with
// 8 bins per octave and the sign (2,053 bins) still counts locally.
constexpr int64_t kLocalBins = 2100;
constexpr int64_t kBlock = 2048;       // float sums are flushed to double per block
constexpr int64_t kMinChunk = 16384;
constexpr int64_t kMaxChunks = 64;
// CPU-only variant of the log2 histogram for float-sized inputs when every
// float subnormal falls in the underflow bin (lo >= -126): the hot loop only
// counts the 8-bit exponent field; a 256-entry table built from the shared
// log2_bin maps those counts to bins once per chunk.
constexpr int kHistLog2Exp = 3;
// CPU-only tag of log2 histograms with bins per octave or signed bins
// (log2_bin_fine), counted by bin index as the other kinds.
constexpr int kHistLog2Fine = 4;
// CPU-only tag of the same histograms on float-sized inputs with lo >= -126:
// the loop stores each value's key (log2_key_bits: sign, exponent, top
// mantissa bits, as the CUDA kernel's kModeLog2Key) and counts keys in a
// local table; a table built from log2_key_bin maps them to bins per chunk.
constexpr int kHistLog2Key = 5;
constexpr int64_t kExpBins = 256;
// The loops compiled for the baseline ISA (CPUs without AVX2/FMA/F16C): one
// per kind of bins, the generic ones. The exponent, key and plain log2 tags
// are AVX2-only speedups of the same bins (log2_bin_fine with s = 0 is
// log2_bin); compiling them twice made the baseline loops 58 % of each
// dtype's build.
template <int kHist>
constexpr bool kBaselineLoop = kHist == kHistNone || kHist == kHistLog2Fine || kHist == kHistLinear;
// Below this many elements a histogram counts straight into the ring (one
// atomic add per element); from here on into local copies merged once, when
// the copies are no more than twice as many entries as elements (clearing
// and merging them then costs less than the atomics: 4,095 float32 values
// took 17 us with atomics, 5 us with the local exponent counts).
constexpr int64_t kDirectHistBelow = 256;

// Per-chunk sinks of the loop beside its Acc: kHistCopies local copies of
// (1 + nbins) uint32 counts (slot 0 swallows unbinned values), or, for wide
// histograms, the ring row itself; and with moments=4 the chunk's third and
// fourth moments.
struct HistSink {
  const HistSpec* spec;
  uint32_t* local;
  int64_t* ring_bins;
  int64_t copy_stride;  // entries per local copy
  int64_t unit;         // count per element (a view's stride-0 multiplicity)
  int copies = kHistCopies;  // local copies (kHistLog2Key: as many as fit)
  Moments4* m4 = nullptr;    // moments=4: the chunk's sums about the row's shift
};

// How a segment's element i is addressed: x + i (kWalkUnit), x + i * stride
// (kWalkStrided), or rows of `run` contiguous values `stride` apart
// (kWalkRows: a slice of the last dimension, e.g. one head of a projection's
// output, read in whole blocks instead of a block per row). Rows hold a
// multiple of 16 values (rows_run_ok), so each half of the 32 values the
// vector loop loads lies in one row; blocks hold whole rows.
constexpr int kWalkStrided = 0, kWalkUnit = 1, kWalkRows = 2;
struct Walk {
  int64_t stride;     // elements between consecutive values (kWalkStrided) or rows (kWalkRows)
  int64_t run = 0;    // kWalkRows: values per row
  uint64_t magic = 0; // kWalkRows: i / run as (umul64hi(i, magic) + i) >> shift (strided.h),
  int32_t shift = 0;  // or as i >> shift where run is a power of 2 (magic 1)
  int64_t ahead = 0;  // kWalkRows: prefetch the element this many after each one read (0: none)
  // kWalkRows, instead of `ahead`: prefetch bytes in address order from here
  // into L2, as many as the values read take (the caller's next piece, read
  // as one run), and each row kRowsNear rows ahead into L1.
  const char* seq = nullptr;
};
constexpr int64_t kRowsNear = 4;

static_assert(kRowsMaxRun == kBlock, "stats_cpu.h's rows_run_ok: rows of at most one block");

inline Walk rows_walk(int64_t stride, int64_t run, int64_t ahead) {
  // The divisor of the last run asked for, kept: a 128-bit division per push costs.
  thread_local int64_t last_run = 0;
  thread_local uint64_t last_magic = 0;
  thread_local int32_t last_shift = 0;
  if (run != last_run) {
    StridedDesc d;
    set_divisor(d, 0, run);
    last_run = run;
    last_magic = d.magic[0];
    last_shift = d.shift[0];
  }
  return Walk{stride, run, last_magic, last_shift, ahead};
}

template <int kW, typename T>
HC_ALWAYS_INLINE const T* walk_at(const T* x, const Walk& w, int64_t i) {
  if constexpr (kW == kWalkUnit) {
    return x + i;
  } else if constexpr (kW == kWalkRows) {
    const uint64_t u = static_cast<uint64_t>(i);
    const int64_t r = static_cast<int64_t>((w.magic == 1 ? u : umul64hi(u, w.magic) + u) >> w.shift);
    return x + r * w.stride + (i - r * w.run);
  } else {
    return x + i * w.stride;
  }
}

template <typename T>
using work_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
HC_ALWAYS_INLINE work_t<T> load_work(const T* p) {
  if constexpr (std::is_same_v<T, double>) {
    return *p;
  } else {
    return load_float(p);
  }
}

// Statistics of one block (n <= kBlock) in the working precision V: moments
// about `center` (zero, or for data far from zero an earlier block's mean:
// data drift slowly, so one pass is usually enough) plus extrema; the raw
// sums follow from the moments in double. Contiguous float/bf16 data runs an explicit 8-float-vector loop
// (32 elements per iteration, two accumulator sets); the rest (strided, fp16,
// double, the tail) runs a loop over kLanes lane accumulators the compiler
// vectorises. Either way several add chains stay in flight and partials are
// combined in a fixed order (results do not depend on threads). A block
// whose mean is far from the center is re-centred on its own mean in a second
// pass over L1-resident data. A block holding NaN/Inf (its sum of squares is
// then not finite) or values outside float's safe range is redone with
// push_value in double. Log2 bin indices (or exponent bytes) come out of the
// same loop.
constexpr int kLanes = 16;

// GCC vectors: 8 floats = one AVX2 register (two SSE registers in the
// baseline build).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));

// s + d * d in one fused instruction (AVX2+FMA build); the moments are still
// push_shifted's.
struct FusedSquare8 {
  __attribute__((target("avx2,fma"))) f8 operator()(f8 s, f8 d) const {
    return reinterpret_cast<f8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(d),
                                                reinterpret_cast<__m256>(d),
                                                reinterpret_cast<__m256>(s)));
  }
};

// Narrows four vectors of byte-sized u32 values to 32 bytes (in an order
// counting does not care about) with the shuffle port's packs, which the
// stats loop leaves idle.
struct PackBytes4 {
  __attribute__((target("avx2"))) void operator()(const u8v* e, uint8_t* out) const {
    const __m256i a = _mm256_packus_epi32(reinterpret_cast<__m256i>(e[0]), reinterpret_cast<__m256i>(e[1]));
    const __m256i b = _mm256_packus_epi32(reinterpret_cast<__m256i>(e[2]), reinterpret_cast<__m256i>(e[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_packus_epi16(a, b));
  }
};

// Lane reductions of 8-wide vectors in a fixed tree (same result every run);
// every lane of the result holds the reduction.
template <typename W, typename Op>
HC_ALWAYS_INLINE W tree8(W v, Op op) {
  v = op(v, __builtin_shuffle(v, i8v{4, 5, 6, 7, 0, 1, 2, 3}));
  v = op(v, __builtin_shuffle(v, i8v{2, 3, 0, 1, 6, 7, 4, 5}));
  return op(v, __builtin_shuffle(v, i8v{1, 0, 3, 2, 5, 4, 7, 6}));
}

// 8 halves to 8 floats in one F16C instruction (exact, like c10::Half's).
struct HalfToFloat8 {
  __attribute__((target("avx2,f16c"))) f8 operator()(const c10::Half* p) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<f8>(_mm256_cvtph_ps(h));
  }
};

template <bool kAvx2 = false, typename T>
HC_ALWAYS_INLINE f8 load8(const T* p) {
  f8 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof v);
  } else if constexpr (kAvx2 && std::is_same_v<T, c10::Half>) {
    v = HalfToFloat8{}(p);
  } else {
    float t[8];
    for (int j = 0; j < 8; ++j) t[j] = load_float(p + j);
    std::memcpy(&v, t, sizeof v);
  }
  return v;
}

template <typename T, int kW>
HC_ALWAYS_INLINE void shifted_pass(const T* x, const Walk& wk, int64_t n, work_t<T> c,
                                   work_t<T>& s1_out, work_t<T>& s2_out) {
  using V = work_t<T>;
  auto at = [&](int64_t i) -> const T* { return walk_at<kW>(x, wk, i); };
  V s1[kLanes] = {}, s2[kLanes] = {};
  const int64_t nv = n - n % kLanes;
  for (int64_t i = 0; i < nv; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) push_shifted(load_work(at(i + j)), c, s1[j], s2[j]);
  }
  for (int64_t i = nv; i < n; ++i) push_shifted(load_work(at(i)), c, s1[i - nv], s2[i - nv]);
  V a = 0, b = 0;
  for (int j = 0; j < kLanes; ++j) {
    a += s1[j];
    b += s2[j];
  }
  s1_out = a;
  s2_out = b;
}

// A float-precision block holding NaN/Inf (a mask's -inf): its finite
// values' moments about c, extrema and zeros, and the NaN/Inf counts, into
// acc in one lane-vectorised pass that leaves the others out by a select
// per value, re-centred once on the finite mean if need be. Returns false
// (nothing added) where the float sums would not be exact enough: the caller
// then redoes the block in double.
template <typename T, int kW>
HC_ALWAYS_INLINE bool finite_pass(const T* x, const Walk& wk, int64_t n, work_t<T> c, double shift, Acc& acc) {
  using V = work_t<T>;
  static_assert(!std::is_same_v<V, double>, "float64 blocks take the wide redo");
  auto at = [&](int64_t i) -> const T* { return walk_at<kW>(x, wk, i); };
  for (int attempt = 0; attempt < 2; ++attempt) {
    V s1l[kLanes] = {}, s2l[kLanes] = {}, mnl[kLanes], mxl[kLanes];
    int32_t nfl[kLanes] = {}, nzl[kLanes] = {}, nanl[kLanes] = {}, pinfl[kLanes] = {}, ninfl[kLanes] = {};
    for (int j = 0; j < kLanes; ++j) {
      mnl[j] = static_cast<V>(kInf);
      mxl[j] = static_cast<V>(-kInf);
    }
    auto one = [&](int64_t i, int j) __attribute__((always_inline)) {
      const V v = load_work(at(i));
      const bool fin = v - v == 0;
      push_shifted(fin ? v : c, c, s1l[j], s2l[j]);  // c - c: adds 0 and 0
      const V lo = fin ? v : static_cast<V>(kInf), hi = fin ? v : static_cast<V>(-kInf);
      mnl[j] = lo < mnl[j] ? lo : mnl[j];
      mxl[j] = hi > mxl[j] ? hi : mxl[j];
      nfl[j] += fin;
      nzl[j] += v == 0;
      nanl[j] += v != v;
      pinfl[j] += v == static_cast<V>(kInf);
      ninfl[j] += v == static_cast<V>(-kInf);
    };
    const int64_t nv = n - n % kLanes;
    for (int64_t i = 0; i < nv; i += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) one(i + j, j);
    }
    for (int64_t i = nv; i < n; ++i) one(i, static_cast<int>(i - nv));
    V s1 = 0, s2 = 0, mn = static_cast<V>(kInf), mx = static_cast<V>(-kInf);
    int64_t m = 0, nz = 0, nnan = 0, npinf = 0, nninf = 0;
    for (int j = 0; j < kLanes; ++j) {
      s1 += s1l[j];
      s2 += s2l[j];
      mn = mnl[j] < mn ? mnl[j] : mn;
      mx = mxl[j] > mx ? mxl[j] : mx;
      m += nfl[j];
      nz += nzl[j];
      nnan += nanl[j];
      npinf += pinfl[j];
      nninf += ninfl[j];
    }
    if (m > 0 && attempt == 0 && s2 - s2 == 0 && !shift_well_conditioned(s1, s2, m)) {
      c = c + s1 / static_cast<V>(m);  // the finite values' mean
      continue;
    }
    if (m > 0 && !(s2 - s2 == 0 && float_sums_ok(s1, s2, mn, mx))) return false;
    if (m > 0) acc_add_run(acc, s1, s2, m, c, shift, mn, mx, nz);
    acc.nnan += nnan;
    acc.npinf += npinf;
    acc.nninf += nninf;
    return true;
  }
  return false;
}

// Whether block_stats leaves the zeros of its explicit-vector loop to the
// caller: with the AVX2 exponent counter, exponent field 0 (zeros and
// subnormals) is counted anyway, and only blocks where it occurs need their
// zeros counted (count_zeros) -- one compare less per element in the rest.
template <typename T, int kW, int kHist, bool kAvx2>
constexpr bool kDeferZeros = kAvx2 && kHist == kHistLog2Exp && kW == kWalkUnit &&
                             std::is_same_v<work_t<T>, float>;

// Returns how many leading elements' zeros were left uncounted (0 unless
// kDeferZeros and the block took the float path).
template <typename T, int kW, int kHist, bool kAvx2>
HC_ALWAYS_INLINE int64_t block_stats(const T* x, const Walk& wk, int64_t n, double shift,
                                     work_t<T>& center, Acc& acc, WideAcc& wacc, const HistSpec& h,
                                     int32_t* idx, uint8_t* eb, work_t<T>& top,
                                     const char* ahead) {
  constexpr bool kDefer = kDeferZeros<T, kW, kHist, kAvx2>;
  using Square8 = std::conditional_t<kAvx2, FusedSquare8, AddSquare>;
  using V = work_t<T>;
  auto at = [&](int64_t i) -> const T* { return walk_at<kW>(x, wk, i); };
  // Calls f(i0, p, len) for runs of contiguous elements covering [0, m):
  // one run, or (kWalkRows) one per row.
  auto for_runs = [&](int64_t m, auto&& f) __attribute__((always_inline)) {
    if constexpr (kW == kWalkRows) {
      const int64_t len = wk.run;
      for (int64_t i0 = 0; i0 < m; i0 += len) f(i0, at(i0), std::min(len, m - i0));
    } else {
      f(int64_t{0}, x, m);
    }
  };
  const int32_t lo = static_cast<int32_t>(h.lo_exp), hi = static_cast<int32_t>(h.hi_exp);
  [[maybe_unused]] const int32_t sub = static_cast<int32_t>(h.sub_shift);
  [[maybe_unused]] const bool sgn = h.sign != 0;
  [[maybe_unused]] const int32_t key_shift = 23 - sub;
  [[maybe_unused]] const uint32_t key_mask = static_cast<uint32_t>(log2_keys(h) - 1);
  V c = center;
  V s1 = 0, s2 = 0, mn = static_cast<V>(kInf), mx = static_cast<V>(-kInf);
  int32_t nz = 0;
  int64_t head = 0;  // elements done by the explicit-vector loop
  // fp16 takes the explicit vectors only with F16C (the AVX2 build); the
  // baseline build's conversion vectorises only in the lane loop below.
  // Rows hold a multiple of 16 values: each 16 of the 32 lie in one row.
  if constexpr (std::is_same_v<V, float> && kW != kWalkStrided && (kAvx2 || !std::is_same_v<T, c10::Half>)) {
    // Two 8-float vectors per quantity: independent add chains, all in
    // registers (the compiler's own vectorisation of lane arrays spills).
    head = n - n % 32;
    const f8 cv = f8{} + c;
    f8 vs1[2] = {}, vs2[2] = {}, vmn[2], vmx[2];
    i8v vnz[2] = {};
    for (int k = 0; k < 2; ++k) {
      vmn[k] = f8{} + static_cast<float>(kInf);
      vmx[k] = f8{} - static_cast<float>(kInf);
    }
    // About zero (see next_center) the shift folds away: one vector op
    // less per 8 elements.
    auto vector_loop = [&](auto about_zero) __attribute__((always_inline)) {
      const f8 cc = about_zero ? f8{} : cv;
      // Rows: a cursor (the block starts a row) steps 16 values at a time,
      // cheaper than dividing each index by the run.
      [[maybe_unused]] const T* row_at = x;
      [[maybe_unused]] int64_t in_row = 0;
      auto next16 = [&]() __attribute__((always_inline)) {
        const T* p = row_at + in_row;
        in_row += 16;
        if (in_row == wk.run) {
          in_row = 0;
          row_at += wk.stride;
        }
        return p;
      };
      for (int64_t i = 0; i < head; i += 32) {
        const T* q;
        const T* q16;  // rows of an odd multiple of 16 values: the second half may start a row
        if constexpr (kW == kWalkRows) {
          q = next16();
          q16 = next16();
        } else {
          q = at(i);
          q16 = q + 16;
        }
        // Two cache lines of the next block per iteration (no histogram:
        // nothing else overlaps the loads); evenly paced, unlike a burst.
        // Rows of a few lines each escape the hardware's stream prefetch:
        // the walk names what to fetch.
        if constexpr (kW == kWalkRows) {
          if (wk.seq) {
            // The caller's next piece into L2, in address order; this walk's
            // row kRowsNear ahead into L1 (its lines are a stride apart: the
            // hardware's stream prefetch misses them).
            const char* a = wk.seq + i * static_cast<int64_t>(sizeof(T));
            __builtin_prefetch(a, 0, 2);
            if constexpr (sizeof(T) >= 4) __builtin_prefetch(a + 64, 0, 2);
            __builtin_prefetch(q + kRowsNear * wk.stride);
            if constexpr (sizeof(T) >= 4) __builtin_prefetch(q16 + kRowsNear * wk.stride);
          } else if (wk.ahead) {
            __builtin_prefetch(q + wk.ahead);
            __builtin_prefetch(q16 + wk.ahead);
          }
        } else if constexpr (kHist == kHistNone && std::is_same_v<T, float>) {
          const char* a = ahead + 4 * (q - x);  // the same place in the next block
          __builtin_prefetch(a);
          __builtin_prefetch(a + 64);
        }
        u8v packed = {};  // baseline: exponent field of element 8k + j in byte k of lane j
        u8v ex[4];        // AVX2: exponent fields, narrowed to bytes by PackBytes4
        for (int k = 0; k < 4; ++k) {
          const f8 v = load8<kAvx2>(k < 2 ? q + 8 * k : q16 + 8 * (k - 2));
          if constexpr (kHist == kHistLog2Key) {  // log2_key_bits, 8 at a time
            u8v bits;
            std::memcpy(&bits, &v, sizeof bits);
            bits = (bits << 1) == 0u ? u8v{} : bits;  // +-0 share key 0
            const u8v key = (bits >> key_shift) & key_mask;
            std::memcpy(idx + i + 8 * k, &key, sizeof key);
          }
          push_shifted(v, cc, vs1[k & 1], vs2[k & 1], Square8{});
          if constexpr (kDefer) {
            push_min_max(v, vmn[k & 1], vmx[k & 1]);
          } else {
            push_minmax(v, vmn[k & 1], vmx[k & 1], vnz[k & 1]);
          }
          if constexpr (kHist == kHistLog2Exp) {
            u8v bits;
            std::memcpy(&bits, &v, sizeof bits);
            if constexpr (kAvx2) {
              ex[k] = (bits >> 23) & 0xffu;
            } else {
              const u8v e = k < 3 ? bits >> (23 - 8 * k) : bits << 1;
              packed |= e & (0xffu << (8 * k));
            }
          }
        }
        // Counting ignores order: the block's exponent bytes may sit in any order.
        if constexpr (kHist == kHistLog2Exp) {
          if constexpr (kAvx2) {
            PackBytes4{}(ex, eb + i);
          } else {
            std::memcpy(eb + i, &packed, sizeof packed);
          }
        }
      }
    };
    if (c == 0) {
      vector_loop(std::true_type{});
    } else {
      vector_loop(std::false_type{});
    }
    auto add = [](auto a, auto b) { return a + b; };
    auto vmin = [](f8 a, f8 b) { return a < b ? a : b; };
    auto vmax = [](f8 a, f8 b) { return a > b ? a : b; };
    s1 = tree8(vs1[0] + vs1[1], add)[0];
    s2 = tree8(vs2[0] + vs2[1], add)[0];
    mn = tree8(vmin(vmn[0], vmn[1]), vmin)[0];
    mx = tree8(vmax(vmx[0], vmx[1]), vmax)[0];
    if constexpr (!kDefer) nz = -tree8(vnz[0] + vnz[1], add)[0];  // vector compares count down
    if constexpr (kHist == kHistLog2) {
      for_runs(head, [&](int64_t i0, const T* p, int64_t len) {
        for (int64_t i = 0; i < len; ++i) idx[i0 + i] = log2_bin(load_work(p + i), lo, hi) + 1;
      });
    } else if constexpr (kHist == kHistLog2Fine) {
      for_runs(head, [&](int64_t i0, const T* p, int64_t len) {
        for (int64_t i = 0; i < len; ++i) idx[i0 + i] = log2_bin_fine(load_work(p + i), lo, hi, sub, sgn) + 1;
      });
    }
  }
  V s1l[kLanes] = {}, s2l[kLanes] = {}, mnl[kLanes], mxl[kLanes];
  int32_t nzl[kLanes] = {};
  for (int j = 0; j < kLanes; ++j) {
    mnl[j] = static_cast<V>(kInf);
    mxl[j] = static_cast<V>(-kInf);
  }
  auto one = [&](int64_t i, int j) __attribute__((always_inline)) {
    const V v = load_work(at(i));
    push_shifted(v, c, s1l[j], s2l[j]);
    push_minmax(v, mnl[j], mxl[j], nzl[j]);
    if constexpr (kHist == kHistLog2) idx[i] = log2_bin(v, lo, hi) + 1;
    if constexpr (kHist == kHistLog2Fine) idx[i] = log2_bin_fine(v, lo, hi, sub, sgn) + 1;
    if constexpr (kHist == kHistLog2Key) idx[i] = static_cast<int32_t>(log2_key_bits(v, key_shift, key_mask));
    if constexpr (kHist == kHistLog2Exp) eb[i] = static_cast<uint8_t>(vbits(v) >> 23);
  };
  const int64_t nv = head + (n - head) / kLanes * kLanes;
  for (int64_t i = head; i < nv; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) one(i + j, j);
  }
  for (int64_t i = nv; i < n; ++i) one(i, static_cast<int>(i - nv));
  for (int j = 0; j < kLanes; ++j) {
    s1 += s1l[j];
    s2 += s2l[j];
    mn = mnl[j] < mn ? mnl[j] : mn;
    mx = mxl[j] > mx ? mxl[j] : mx;
    nz += nzl[j];
  }
  if constexpr (kHist == kHistLinear) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      idx[i] = static_cast<int32_t>(linear_bin(load_double(at(i)), h) + 1);
    }
  }
  const bool finite = s2 - s2 == 0;  // false iff some value is NaN/Inf (or squares overflow)
  top = finite ? absmax_of(mn, mx) : static_cast<V>(-1);
  if (finite && !shift_well_conditioned(s1, s2, n)) {
    c = c + s1 / static_cast<V>(n);  // the block mean
    shifted_pass<T, kW>(x, wk, n, c, s1, s2);
  }
  // Float64 blocks that may hold wide values (may_be_wide) are redone too:
  // their squares need the buckets.
  bool redo = !finite || !float_sums_ok(s1, s2, mn, mx);
  if constexpr (std::is_same_v<V, double>) redo = redo || may_be_wide(mn, mx);
  if (redo) {
    if constexpr (!std::is_same_v<V, double>) {
      if (!finite && finite_pass<T, kW>(x, wk, n, c, shift, acc)) return 0;
    }
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<V, double>) {
        acc_push_wide(acc, wacc, load_double(at(i)), shift);
      } else {
        acc_push(acc, load_double(at(i)), shift);
      }
    }
    return 0;
  }
  center = next_center(c, s1, s2, n);
  if constexpr (kHist == kHistLog2Exp) {
    // The exponent window ends at the largest |x|, or at 8x the RMS when a
    // few values sit far above the bulk (a one-hot gradient): the bulk then
    // stays inside the window instead of escaping below it.
    const V ms = (s2 + c * (V(2) * s1 + static_cast<V>(n) * c)) / static_cast<V>(n);
    const V cap = V(8) * std::sqrt(ms);
    top = cap < top ? cap : top;  // NaN (rounding below 0) keeps the absmax
  }
  acc_add_run(acc, s1, s2, n, c, shift, mn, mx, nz);
  return kDefer ? head : 0;
}

// Zeros among x[0..n) (n a multiple of 32), for a block whose exponent bytes
// show field 0: two vector counters, reduced in a fixed order.
template <bool kAvx2, typename T>
HC_ALWAYS_INLINE int64_t count_zeros(const T* x, int64_t n) {
  i8v nz[2] = {};
  for (int64_t i = 0; i < n; i += 16) {
    push_zero(load8<kAvx2>(x + i), nz[0]);
    push_zero(load8<kAvx2>(x + i + 8), nz[1]);
  }
  return -tree8(nz[0] + nz[1], [](i8v a, i8v b) { return a + b; })[0];
}

// Exponent-field histogram of one block (bytes eb[0..n), n <= kBlock) into
// hist[256]. AVX2: byte compares count a window of exponents [base, base + W),
// exponent field 0 (zeros, subnormals) and field 0xff (NaN/Inf) 32 at a time in u8 lanes (at most
// kBlock / 32 = 64 per lane, no overflow); the rare bytes outside both are
// counted one by one from the movemask. The window sits just under the
// block's top (largest |x|, capped at 8x its RMS), where nearly all values of
// a block lie. W is kExpWindow, or kExpWindowWide for data whose blocks
// spread wider (a gradient with two modes 8 octaves apart): when the narrow
// window would have missed more than 1/16 of the previous block, the next
// block counts the wide one. Baseline ISA: one increment per element.
constexpr int kExpWindow = 12;
constexpr int kExpWindowWide = 24;
static_assert(kBlock / 32 < 256, "u8 window counters must not overflow");

__attribute__((target("avx2"))) inline uint32_t hsum_u8(__m256i v) {
  const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());  // 4 x u64
  const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return static_cast<uint32_t>(_mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1));
}

// Counts window bins [k0, k0 + kPass) of the exponent bytes into hist and
// returns their total; the first pass also counts exponent field 0 and the
// bytes outside the W-wide window (into *outside). Passes of kPass counters
// keep every counter in a register.
constexpr int kPass = 6;

template <int k0, int W>
__attribute__((target("avx2"))) inline uint32_t count_window_pass(
    const uint8_t* eb, int64_t n32, int base, uint32_t* hist, const char* ahead,
    uint32_t* outside) {
  constexpr bool kFirst = k0 == 0;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i vbase = _mm256_set1_epi8(static_cast<char>(base + k0));
  // r + (128 - W) has its top bit set iff r >= W (saturating).
  const __m256i out_bias = _mm256_set1_epi8(static_cast<char>(128 - W));
  __m256i cnt[kPass];
  for (int k = 0; k < kPass; ++k) cnt[k] = zero;
  __m256i c0 = zero, cff = zero;
  const __m256i ones = _mm256_set1_epi8(static_cast<char>(0xff));
  uint32_t nout = 0;
  for (int64_t i = 0; i < n32; i += 32) {
    if (ahead) {  // the next block (4 bytes per element): its loads overlap this counting
      __builtin_prefetch(ahead + 4 * i);
      __builtin_prefetch(ahead + 4 * i + 64);
    }
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eb + i));
    const __m256i r = _mm256_sub_epi8(e, vbase);
    // Compares yield -1 (0xff) per match: the counters run down (negated
    // below); an add, unlike a subtract, lets them stay in place.
    for (int k = 0; k < kPass; ++k) {
      cnt[k] = _mm256_add_epi8(cnt[k], _mm256_cmpeq_epi8(r, _mm256_set1_epi8(static_cast<char>(k))));
    }
    if constexpr (kFirst) {
      const __m256i is0 = _mm256_cmpeq_epi8(e, zero);
      c0 = _mm256_add_epi8(c0, is0);
      // Field 0xff (NaN/Inf: in no bin; a mask's -inf fills half a logit
      // tile) is counted here too, not one by one as outside the window.
      const __m256i isff = _mm256_cmpeq_epi8(e, ones);
      cff = _mm256_add_epi8(cff, isff);
      const __m256i far = _mm256_adds_epu8(r, out_bias);
      uint32_t out = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_andnot_si256(_mm256_or_si256(is0, isff), far)));
      nout += static_cast<uint32_t>(__builtin_popcount(out));
      while (out) {
        ++hist[eb[i + __builtin_ctz(out)]];
        out &= out - 1;
      }
    }
  }
  uint32_t total = 0;
  for (int k = 0; k < kPass; ++k) {
    const uint32_t c = hsum_u8(_mm256_sub_epi8(zero, cnt[k]));
    hist[base + k0 + k] += c;
    total += c;
  }
  if constexpr (kFirst) {
    hist[0] += hsum_u8(_mm256_sub_epi8(zero, c0));
    hist[0xff] += hsum_u8(_mm256_sub_epi8(zero, cff));
    *outside = nout;
  }
  return total;
}

struct ExpCount {
  uint32_t field0;   // bytes with exponent field 0 (zeros and subnormals)
  uint32_t missed;   // bytes the narrow window would not have held
};

template <int W>
__attribute__((target("avx2"))) inline ExpCount count_window(const uint8_t* eb, int64_t n,
                                                             int base, uint32_t* hist,
                                                             const char* ahead) {
  static_assert(W == kExpWindow || W == 4 * kPass, "narrow or four-pass wide window");
  const uint32_t h0 = hist[0];
  const int64_t n32 = n - n % 32;
  uint32_t outside = 0;
  // The lowest 2 * kPass bins: for the wide window, those the narrow one
  // (which ends at the same top) would not have held.
  const uint32_t low = count_window_pass<0, W>(eb, n32, base, hist, ahead, &outside) +
                       count_window_pass<kPass, W>(eb, n32, base, hist, nullptr, nullptr);
  constexpr bool kWide = W > 2 * kPass;
  if constexpr (kWide) {
    count_window_pass<2 * kPass, W>(eb, n32, base, hist, nullptr, nullptr);
    count_window_pass<3 * kPass, W>(eb, n32, base, hist, nullptr, nullptr);
  }
  for (int64_t i = n32; i < n; ++i) ++hist[eb[i]];
  return {hist[0] - h0, kWide ? outside + low : outside};
}

// Returns the block's counts (see ExpCount); `wide` picks the window.
__attribute__((target("avx2"))) inline ExpCount count_exponents_avx2(
    const uint8_t* eb, int64_t n, int base, bool wide, uint32_t* hist, const char* ahead,
    int64_t ahead_bytes) {
  if (ahead_bytes < 4 * n) ahead = nullptr;  // only float-sized blocks are prefetched
  return wide ? count_window<kExpWindowWide>(eb, n, base, hist, ahead)
              : count_window<kExpWindow>(eb, n, base, hist, ahead);
}

HC_ALWAYS_INLINE void count_exponents_scalar(const uint8_t* eb, int64_t n, const HistSink& hs) {
  uint32_t* c[kHistCopies];
  for (int r = 0; r < kHistCopies; ++r) c[r] = hs.local + r * hs.copy_stride;
  int64_t i = 0;
  for (; i + kHistCopies <= n; i += kHistCopies) {
    for (int r = 0; r < kHistCopies; ++r) ++c[r][eb[i + r]];
  }
  for (; i < n; ++i) ++c[0][eb[i]];
}

// Base of a W-wide window for a block whose window should end at magnitude
// `top` (< 0: block not finite, keep the previous base). Kept in
// [1, 256 - W] so the window never wraps onto exponent field 0.
template <typename V>
HC_ALWAYS_INLINE int exponent_window_base(V top_value, int w, int prev) {
  if (!(top_value >= 0)) return prev;
  const int top = static_cast<int>((vbits(static_cast<float>(top_value)) >> 23) & 0xff);
  const int b = top - (w - 1);
  return b < 1 ? 1 : (b > 255 - w ? 255 - w : b);  // never field 0xff: count_window counts it apart
}

// Count the block's keys (kHistLog2Key) into hs.copies local tables of
// hs.copy_stride entries: every key counts (NaN/Inf keys are left out when
// the tables are merged).
HC_ALWAYS_INLINE void count_keys(const int32_t* idx, int64_t n, const HistSink& hs) {
  uint32_t* c = hs.local;
  const int64_t cs = hs.copy_stride;
  int64_t i = 0;
  if (hs.copies >= 4) {
    for (; i + 4 <= n; i += 4) {
      ++c[idx[i]];
      ++c[cs + idx[i + 1]];
      ++c[2 * cs + idx[i + 2]];
      ++c[3 * cs + idx[i + 3]];
    }
  } else if (hs.copies == 2) {
    for (; i + 2 <= n; i += 2) {
      ++c[idx[i]];
      ++c[cs + idx[i + 1]];
    }
  }
  for (; i < n; ++i) ++c[idx[i]];
}

// A small tensor's values count straight into the row (kDirectHistBelow):
// one locked add per distinct bin instead of one per value, through a small
// open-addressed table; a bin that finds no slot is added at once.
constexpr int64_t kFewValues = kDirectHistBelow;
HC_ALWAYS_INLINE void few_scatter(const int32_t* idx, int64_t n, const HistSink& hs) {
  constexpr int kSlots = 64, kProbes = 4;
  int32_t key[kSlots] = {};  // bin + 1; 0 = empty
  int64_t cnt[kSlots];
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = idx[i];
    if (b <= 0) continue;
    uint32_t slot = (static_cast<uint32_t>(b) * 2654435761u) >> 26;
    int p = 0;
    for (; p < kProbes; ++p, slot = (slot + 1) & (kSlots - 1)) {
      if (key[slot] == b) {
        cnt[slot] += hs.unit;
        break;
      }
      if (key[slot] == 0) {
        key[slot] = b;
        cnt[slot] = hs.unit;
        break;
      }
    }
    if (p == kProbes) HostAtomics::add_i64(hs.ring_bins + b - 1, hs.unit);
  }
  for (int k = 0; k < kSlots; ++k) {
    if (key[k]) HostAtomics::add_i64(hs.ring_bins + key[k] - 1, cnt[k]);
  }
}

// Count the block's bin indices (idx = bin + 1; 0 = not binned).
// `ahead` (may be null) is prefetched one line per 16 elements, spread over
// the scalar loop so the fill buffers never stall it.
HC_ALWAYS_INLINE void block_scatter(const int32_t* idx, int64_t n, const HistSink& hs,
                                    const char* ahead, int64_t ahead_bytes) {
  if (hs.local) {
    const int64_t cs = hs.copy_stride;
    uint32_t* c0 = hs.local;
    uint32_t* c1 = c0 + cs;
    uint32_t* c2 = c1 + cs;
    uint32_t* c3 = c2 + cs;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      if (ahead && (i & 15) == 0 && i * 4 < ahead_bytes) __builtin_prefetch(ahead + i * 4);
      ++c0[idx[i]];
      ++c1[idx[i + 1]];
      ++c2[idx[i + 2]];
      ++c3[idx[i + 3]];
    }
    for (; i < n; ++i) ++c0[idx[i]];
  } else if (n > 16 && n <= kFewValues) {  // (for fewer, clearing and scanning the table costs more)
    few_scatter(idx, n, hs);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if (idx[i] > 0) HostAtomics::add_i64(hs.ring_bins + idx[i] - 1, hs.unit);
    }
  }
}

// Third and fourth moments of a block's finite values (float64: ordinary
// ones, as nfin counts them) about the row's shift, in double, into m. The
// block has just been read by block_stats, so it comes from L1, not memory.
template <typename T, int kW>
HC_ALWAYS_INLINE void block_moments4(const T* x, const Walk& wk, int64_t n, double shift, Moments4& m) {
  constexpr int kL = 8;
  double s3[kL] = {}, s4[kL] = {};
  int64_t cnt[kL] = {};
  auto one = [&](int64_t i, int j) __attribute__((always_inline)) {
    const double v = load_double(walk_at<kW>(x, wk, i));
    const double a = v < 0 ? -v : v;
    bool ok = a < kInf;
    if constexpr (std::is_same_v<T, double>) ok = ok && wide_bucket(a) == 0;
    push_moments4(ok ? v - shift : 0.0, s3[j], s4[j]);
    cnt[j] += ok;
  };
  const int64_t nv = n - n % kL;
  for (int64_t i = 0; i < nv; i += kL) {
#pragma omp simd
    for (int j = 0; j < kL; ++j) one(i + j, j);
  }
  for (int64_t i = nv; i < n; ++i) one(i, static_cast<int>(i - nv));
  for (int j = 0; j < kL; ++j) {
    m.s3 += s3[j];
    m.s4 += s4[j];
    m.n += cnt[j];
  }
}

// Returns the center the next segment of the same values should start about.
template <typename T, int kW, int kHist, bool kAvx2>
HC_ALWAYS_INLINE double run_segment(const T* x, const Walk& wk, int64_t n, double shift, double center0,
                                    Acc& acc, WideAcc& wacc, const HistSink& hs) {
  constexpr bool kExp = kHist == kHistLog2Exp;
  int32_t idx[kHist != kHistNone && !kExp ? kBlock : 1];
  uint8_t eb[kExp ? kBlock : 1];
  int base = 127 - kExpWindow / 2;
  bool wide = false;  // count the wide exponent window (see count_window)
  work_t<T> center = static_cast<work_t<T>>(center0), top;
  // Rows: blocks of whole rows (block_stats addresses a block from its first row).
  const int64_t block = kW == kWalkRows ? kBlock / wk.run * wk.run : kBlock;
  for (int64_t b = 0; b < n; b += block) {
    const int64_t len = std::min(block, n - b);
    const T* p = walk_at<kW>(x, wk, b);
    const bool pf = kW != kWalkStrided && b + 2 * block <= n;
    const char* ahead = pf ? reinterpret_cast<const char*>(walk_at<kW>(x, wk, b + block)) : nullptr;
    // The stats loop prefetches unconditionally: without a next block, the
    // current one (already being read) stands in.
    Walk bw = wk;  // the block's own sequential prefetch
    if constexpr (kW == kWalkRows) {
      if (wk.seq) bw.seq = wk.seq + b * static_cast<int64_t>(sizeof(T));
    }
    const int64_t deferred = block_stats<T, kW, kHist, kAvx2>(
        p, bw, len, shift, center, acc, wacc, *hs.spec, idx, eb, top,
        ahead ? ahead : reinterpret_cast<const char*>(p));
    if (hs.m4) block_moments4<T, kW>(p, wk, len, shift, *hs.m4);
    if constexpr (kExp && kAvx2) {
      base = exponent_window_base(top, wide ? kExpWindowWide : kExpWindow, base);
      // The counting prefetches the next block as one run: not for rows.
      const ExpCount ec = count_exponents_avx2(eb, len, base, wide, hs.local, kW == kWalkUnit ? ahead : nullptr,
                                               kBlock * static_cast<int64_t>(sizeof(T)));
      if (ec.field0 && deferred) acc.nzero += count_zeros<kAvx2>(p, deferred);
      wide = ec.missed * 16 > static_cast<uint32_t>(len);
    } else if constexpr (kExp) {
      count_exponents_scalar(eb, len, hs);
    } else if constexpr (kHist == kHistLog2Key) {
      count_keys(idx, len, hs);
    } else if constexpr (kHist != kHistNone) {
      block_scatter(idx, len, hs, kW == kWalkUnit ? ahead : nullptr, kBlock * static_cast<int64_t>(sizeof(T)));
    }
  }
  return static_cast<double>(center);
}

// Logical elements [begin, end) of x, walked as runs along the innermost
// coalesced dimension (dense inputs are a single run). Whole rows of a
// contiguous innermost dimension that rows_run_ok accepts, evenly spaced along
// the next dimension, are read as one kWalkRows segment.
template <typename T, int kHist, bool kAvx2>
HC_ALWAYS_INLINE void run_range(const T* x, bool flat, const StridedDesc& d, int64_t begin,
                                int64_t end, double shift, double center0, Acc& acc, WideAcc& wacc,
                                const HistSink& hs) {
  if (flat || d.ndim <= 1) {
    const int64_t st = flat ? 1 : (d.ndim == 1 ? d.strides[0] : 0);
    if (st == 1) {
      run_segment<T, kWalkUnit, kHist, kAvx2>(x + begin, Walk{1, 0}, end - begin, shift, center0, acc, wacc, hs);
    } else {
      run_segment<T, kWalkStrided, kHist, kAvx2>(x + begin * st, Walk{st, 0}, end - begin, shift, center0, acc, wacc, hs);
    }
    return;
  }
  const int64_t inner = d.sizes[d.ndim - 1];
  const int64_t ist = d.strides[d.ndim - 1];
  const bool rows = ist == 1 && rows_run_ok(inner);
  const int64_t span = rows ? inner * d.sizes[d.ndim - 2] : inner;  // elements of one evenly spaced stretch
  int64_t i = begin;
  while (i < end) {
    const int64_t in0 = i % inner;
    int64_t len = std::min(inner - in0, end - i);
    const T* p = x + strided_offset(d, i);
    if (rows && in0 == 0) {
      len = std::min(span - i % span, end - i) / inner * inner;  // whole rows of this stretch
      if (len > inner) {
        const int64_t step = d.strides[d.ndim - 2];
        run_segment<T, kWalkRows, kHist, kAvx2>(p, rows_walk(step, inner, kBlock / inner * step), len, shift,
                                                center0, acc, wacc, hs);
        i += len;
        continue;
      }
      len = std::min(inner, end - i);
    }
    if (ist == 1) {
      run_segment<T, kWalkUnit, kHist, kAvx2>(p, Walk{1, 0}, len, shift, center0, acc, wacc, hs);
    } else {
      run_segment<T, kWalkStrided, kHist, kAvx2>(p, Walk{ist, 0}, len, shift, center0, acc, wacc, hs);
    }
    i += len;
  }
}

template <typename T, int kHist, bool kAvx2>
HC_ALWAYS_INLINE void chunk_impl(const T* x, bool flat, const StridedDesc& d, int64_t begin,
                                 int64_t end, double shift, double center0, Acc& out, WideAcc& wout,
                                 const HistSink& hs) {
  acc_init(out);
  wide_init(wout);
  run_range<T, kHist, kAvx2>(x, flat, d, begin, end, shift, center0, out, wout, hs);
}

// The same chunk loop, compiled for AVX2+FMA+F16C and for the baseline ISA.
template <typename T, int kHist>
__attribute__((target("avx2,fma,f16c"))) void chunk_avx2(const T* x, bool flat,
                                                    const StridedDesc& d, int64_t b,
                                                    int64_t e, double shift, double center0, Acc& out,
                                                    WideAcc& wout, const HistSink& hs) {
  chunk_impl<T, kHist, true>(x, flat, d, b, e, shift, center0, out, wout, hs);
}

template <typename T, int kHist>
void chunk_base(const T* x, bool flat, const StridedDesc& d, int64_t b, int64_t e,
                double shift, double center0, Acc& out, WideAcc& wout, const HistSink& hs) {
  chunk_impl<T, kHist, false>(x, flat, d, b, e, shift, center0, out, wout, hs);
}

// One segment (run_segment) into fresh partials, for both builds: the
// partial statistics' pushes (no chunking, no strided walk to set up).
// `center`: where the segment starts, then where the next push should (a
// push of a few blocks would otherwise take its first block off zero).
template <typename T, int kHist, int kW>
__attribute__((target("avx2,fma,f16c"))) void segment_avx2(const T* x, Walk wk, int64_t n, double shift,
                                                      double& center, Acc& out, WideAcc& wout,
                                                      const HistSink& hs) {
  acc_init(out);
  wide_init(wout);
  center = run_segment<T, kW, kHist, true>(x, wk, n, shift, center, out, wout, hs);
}

template <typename T, int kHist, int kW>
void segment_base(const T* x, Walk wk, int64_t n, double shift, double& center, Acc& out, WideAcc& wout,
                  const HistSink& hs) {
  acc_init(out);
  wide_init(wout);
  center = run_segment<T, kW, kHist, false>(x, wk, n, shift, center, out, wout, hs);
}

bool use_avx2() {
  static const bool yes = [] {
    const char* force = std::getenv("HOOKCAP_CPU_ISA");
    if (force && std::strcmp(force, "baseline") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}

// Count k of a local histogram: the sum over its `copies` (each `cs` entries).
HC_ALWAYS_INLINE int64_t local_total(const uint32_t* local, int copies, int64_t cs, int64_t k) {
  int64_t cnt = 0;
  for (int r = 0; r < copies; ++r) cnt += local[r * cs + k];
  return cnt;
}

// A linear or log2 local histogram (bin k at entry 1 + k) into the row's bins,
// each count times `mult`.
void merge_local_bins(const uint32_t* local, int copies, int64_t cs, int64_t nbins, int64_t mult, int64_t* row) {
  for (int64_t k = 0; k < nbins; ++k) {
    const int64_t cnt = local_total(local, copies, cs, 1 + k) * mult;
    if (cnt) HostAtomics::add_i64(row + kHeader + k, cnt);
  }
}

// Exponent field -> bin (kHistLog2Exp), this thread's table, rebuilt only
// when the histogram range changes (one Monitor uses one range).
inline const int32_t* exp_bin_table(const HistSpec& h) {
  thread_local int32_t exp_bin[kExpBins];
  thread_local int64_t exp_bin_lo = 1, exp_bin_hi = 0;  // empty: built on first use
  if (exp_bin_lo != h.lo_exp || exp_bin_hi != h.hi_exp) {
    const int32_t lo = static_cast<int32_t>(h.lo_exp), hi = static_cast<int32_t>(h.hi_exp);
    for (int e = 1; e < 255; ++e) exp_bin[e] = log2_bin(std::ldexp(1.0f, e - 127), lo, hi);
    exp_bin_lo = h.lo_exp;
    exp_bin_hi = h.hi_exp;
  }
  return exp_bin;
}

// Key -> bin (kHistLog2Key; -1: NaN/Inf), this thread's table, rebuilt when
// the histogram changes.
inline const int32_t* key_bin_table(const HistSpec& h) {
  thread_local std::vector<int32_t> key_bin;
  thread_local int64_t key_spec[4] = {1, 0, -1, -1};
  const int64_t spec[4] = {h.lo_exp, h.hi_exp, h.sub_shift, h.sign};
  if (!std::equal(spec, spec + 4, key_spec)) {
    const int64_t nkeys = log2_keys(h);
    key_bin.resize(nkeys);
    for (int64_t k = 0; k < nkeys; ++k) {
      key_bin[k] = log2_key_bin(static_cast<uint32_t>(k), static_cast<int32_t>(h.lo_exp),
                                static_cast<int32_t>(h.hi_exp), static_cast<int32_t>(h.sub_shift), h.sign != 0);
    }
    std::copy(spec, spec + 4, key_spec);
  }
  return key_bin.data();
}

// Entries per local copy of loop kind kHist, and how many copies.
template <int kHist>
int64_t local_copy_size(const HistSpec& h) {
  return kHist == kHistLog2Exp ? kExpBins : kHist == kHistLog2Key ? log2_keys(h) : h.nbins + 1;
}
template <int kHist>
int local_copies(int64_t cs, bool avx2) {
  // The AVX2 exponent counter writes copy 0 only; keys take as many copies as fit.
  const int64_t room = kHistCopies * (kLocalBins + 1) / cs;
  TORCH_CHECK(kHist != kHistLog2Key || room >= 1, "hookcap: log2 key table of ", cs, " entries exceeds the local array");
  if (kHist == kHistLog2Exp && avx2) return 1;
  if (kHist != kHistLog2Key) return kHistCopies;
  return room >= 4 ? 4 : room >= 2 ? 2 : 1;
}

// A worker's local counts (`copies` of `cs` entries, each count times
// `mult`) into the row's bins; `zeros`: the zeros among them (times mult),
// counted exactly by the stats. The caller clears the copies.
template <int kHist>
void flush_local_counts(const uint32_t* local, int copies, int64_t cs, int64_t zeros, int64_t mult, int64_t* row,
                        const HistSpec& h, const int32_t* bin_of_exp, const int32_t* bin_of_key) {
  auto total_of = [&](int64_t k) { return local_total(local, copies, cs, k) * mult; };
  if constexpr (kHist == kHistLog2Exp) {
    // Exponent field 0 holds zeros and float subnormals (underflow when
    // lo >= -126); 255 is NaN/Inf.
    if (zeros) HostAtomics::add_i64(row + kHeader + 0, zeros);
    const int64_t sub = total_of(0) - zeros;
    if (sub) HostAtomics::add_i64(row + kHeader + 1, sub);
    for (int k = 1; k < 255; ++k) {
      const int64_t cnt = total_of(k);
      if (cnt) HostAtomics::add_i64(row + kHeader + bin_of_exp[k], cnt);
    }
  } else if constexpr (kHist == kHistLog2Key) {
    // Every key's count to its bin (log2_key_bin); the zeros, counted
    // with the positive underflow under key 0, move to the zero bin.
    for (int64_t k = 0; k < cs; ++k) {
      const int64_t cnt = bin_of_key[k] >= 0 ? total_of(k) : 0;
      if (cnt) HostAtomics::add_i64(row + kHeader + bin_of_key[k], cnt);
    }
    if (zeros) {
      const int64_t zero_bin = log2_zero_bin(static_cast<int32_t>(h.lo_exp), static_cast<int32_t>(h.hi_exp),
                                             static_cast<int32_t>(h.sub_shift), h.sign != 0);
      HostAtomics::add_i64(row + kHeader + zero_bin, zeros);
      HostAtomics::add_i64(row + kHeader + zero_bin + 1, -zeros);
    }
  } else {
    merge_local_bins(local, copies, cs, h.nbins, mult, row);
  }
}

template <typename T, int kHist>
void accumulate_typed(const T* x, bool flat, const StridedDesc& d, int64_t n, int64_t mult,
                      int64_t* row, const HistSpec& h) {
  // Fix the slot's shift (first writer wins), as the CUDA kernel does.
  auto load = [&](int64_t i) -> double {
    return flat ? load_double(x + i) : load_double(x + strided_offset(d, i));
  };
  // The runs start about this tensor's own center: the row's shift may be
  // another tensor's, far from these values (float sums about it would lose
  // digits that a spread-out tensor's variance does not flag).
  const double own = shift_candidate(load, n);
  const double shift = row_shift(row, own);

  const int64_t chunk = std::max(kMinChunk, (n + kMaxChunks - 1) / kMaxChunks);
  const int64_t nchunks = (n + chunk - 1) / chunk;
  constexpr bool kExp = kHist == kHistLog2Exp;
  // Tiny tensors count straight into the ring: clearing and merging local
  // copies would cost more than the elements themselves.
  constexpr bool kKey = kHist == kHistLog2Key;
  const int64_t cs = local_copy_size<kHist>(h);
  // Keys always count locally (idx holds keys, not bins): as many copies as fit.
  const bool local_hist = kKey || (kHist != kHistNone && (kExp || h.nbins <= kLocalBins) &&
                                   n >= kDirectHistBelow && n >= (kExp ? 1 : kHistCopies) * cs / 2);
  const int32_t* bin_of_exp = kExp ? exp_bin_table(h) : nullptr;  // this thread's table, read by the workers too
  const int32_t* bin_of_key = kKey ? key_bin_table(h) : nullptr;
  const bool avx2 = use_avx2();
  const int copies = local_copies<kHist>(cs, avx2);
  Acc partial[kMaxChunks];
  WideAcc wide[kMaxChunks];
  Moments4 m4[kMaxChunks];

  auto run_chunks = [&](int64_t c0, int64_t c1) {
    uint32_t local[kHistCopies * (kLocalBins + 1)];
    static_assert(kLocalBins + 1 >= kExpBins, "local copies must hold the exponent histogram");
    // The local counts of this worker's chunks go to the row once (counts
    // add in any order), or earlier if a uint32 count could overflow;
    // `zeros`: the zeros among them, counted exactly by the stats.
    int64_t pending = 0, zeros = 0;
    auto flush = [&] {
      flush_local_counts<kHist>(local, copies, cs, zeros * mult, mult, row, h, bin_of_exp, bin_of_key);
      std::memset(local, 0, sizeof(uint32_t) * copies * cs);
      pending = zeros = 0;
    };
    if (local_hist) std::memset(local, 0, sizeof(uint32_t) * copies * cs);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      if (local_hist && pending + (e - b) > int64_t{UINT32_MAX}) flush();
      moments4_init(m4[c]);
      const HistSink hs{&h, local_hist ? local : nullptr, row + kHeader, cs, mult, copies,
                        h.moments4 ? &m4[c] : nullptr};
      if constexpr (kBaselineLoop<kHist>) {
        if (avx2) {
          chunk_avx2<T, kHist>(x, flat, d, b, e, shift, own, partial[c], wide[c], hs);
        } else {
          chunk_base<T, kHist>(x, flat, d, b, e, shift, own, partial[c], wide[c], hs);
        }
      } else {
        chunk_avx2<T, kHist>(x, flat, d, b, e, shift, own, partial[c], wide[c], hs);  // accumulate_read: AVX2 only
      }
      pending += e - b;
      zeros += partial[c].nzero;
    }
    if (local_hist && pending) flush();
  };
  if (nchunks == 1) {
    run_chunks(0, 1);  // a small tensor: no trip through the thread pool's entry
  } else {
    at::parallel_for(0, nchunks, 1, run_chunks);
  }
  // Merge in chunk order: the same sums for any number of threads.
  Acc total;
  acc_init(total);
  WideAcc wtotal;
  wide_init(wtotal);
  for (int64_t c = 0; c < nchunks; ++c) {
    acc_merge(total, partial[c]);
    wide_merge(wtotal, wide[c]);
  }
  if (mult != 1) acc_scale(total, mult);
  row_merge<HostAtomics>(row, total);
  wide_to_row<HostAtomics>(row, wtotal, mult);
  if (h.moments4) {
    Moments4 t4;
    moments4_init(t4);
    for (int64_t c = 0; c < nchunks; ++c) moments4_merge(t4, m4[c]);
    moments4_to_row<HostAtomics>(row, t4, mult);
  }
}

}  // namespace

// Calls f(std::integral_constant<int, kHist>{}) with the loop variant the
// histogram and dtype call for (n: the elements one call reads).
template <typename T, typename F>
void with_loop_kind(const HistSpec& h, int64_t n, F&& f) {
  constexpr bool kFloatWork = !std::is_same_v<T, double>;
  using std::integral_constant;
  switch (h.kind) {
    case kHistNone: f(integral_constant<int, kHistNone>{}); break;
    case kHistLog2:
      if (!use_avx2()) {  // kBaselineLoop: the generic log2 loop
        f(integral_constant<int, kHistLog2Fine>{});
      } else if ((h.sub_shift || h.sign) && kFloatWork && h.lo_exp >= -126) {
        f(integral_constant<int, kFloatWork ? kHistLog2Key : kHistLog2Fine>{});
      } else if (h.sub_shift || h.sign) {
        f(integral_constant<int, kHistLog2Fine>{});
      } else if (kFloatWork && h.lo_exp >= -126 && n >= kDirectHistBelow) {
        f(integral_constant<int, kFloatWork ? kHistLog2Exp : kHistLog2>{});
      } else {
        f(integral_constant<int, kHistLog2>{});
      }
      break;
    default: f(integral_constant<int, kHistLinear>{}); break;
  }
}

// A few flat values (a module's tiny output, a scalar loss) take one scalar
// pass in double with the shared per-value math: the chunked loop's setup
// (blocks, local histograms, vector reductions) costs more than they do.
constexpr int64_t kTinyValues = 16;

template <typename T>
void accumulate_tiny(const T* x, int64_t n, int64_t mult, int64_t* row, const HistSpec& h) {
  double v[kTinyValues];
  for (int64_t i = 0; i < n; ++i) v[i] = load_double(x + i);
  const double shift = row_shift(row, shift_candidate([&](int64_t i) { return v[i]; }, n));
  Acc a;
  acc_init(a);
  WideAcc w;
  wide_init(w);
  Moments4 m4;
  moments4_init(m4);
  int64_t bin[kTinyValues];
  for (int64_t i = 0; i < n; ++i) {
    acc_push_wide(a, w, v[i], shift);
    if (h.moments4) {  // block_moments4's values: finite, not wide
      const double abs = v[i] < 0 ? -v[i] : v[i];
      const bool ok = abs < kInf && wide_bucket(abs) == 0;
      push_moments4(ok ? v[i] - shift : 0.0, m4.s3, m4.s4);
      m4.n += ok;
    }
    bin[i] = h.kind != kHistNone ? hist_bin(v[i], h) : -1;
    // Each locked add below waits for its line: fetch the bins' lines together first.
    if (bin[i] >= 0) __builtin_prefetch(row + kHeader + bin[i], 1);
  }
  if (mult != 1) acc_scale(a, mult);
  row_merge<HostAtomics>(row, a);
  wide_to_row<HostAtomics>(row, w, mult);
  if (h.moments4) moments4_to_row<HostAtomics>(row, m4, mult);
  for (int64_t i = 0; i < n; ++i) {
    if (bin[i] >= 0) HostAtomics::add_i64(row + kHeader + bin[i], mult);
  }
}

// Merges the n values at x (flat, or walked through d) into `row`, each
// counted `mult` times (count and calls excepted), with the loop variant
// the histogram and dtype call for. Instantiated once per dtype
// (accumulate_<dtype>.cpp).
template <typename T>
void accumulate_read(const T* x, bool flat, const StridedDesc& d, int64_t n, int64_t mult, int64_t* row,
                     const HistSpec& h) {
  if (flat && n <= kTinyValues) {
    accumulate_tiny(x, n, mult, row, h);
    return;
  }
  with_loop_kind<T>(h, n, [&](auto kind) {
    accumulate_typed<T, decltype(kind)::value>(x, flat, d, n, mult, row, h);
  });
}

namespace {

// The partial's local counts into the row, then cleared.
template <int kHist>
void partial_flush_counts(Partial& p) {
  flush_local_counts<kHist>(p.local, p.copies, p.cs, p.zeros, 1, p.row, *p.h,
                            kHist == kHistLog2Exp ? exp_bin_table(*p.h) : nullptr,
                            kHist == kHistLog2Key ? key_bin_table(*p.h) : nullptr);
  std::memset(p.local, 0, sizeof(uint32_t) * p.copies * p.cs);
  p.pending = p.zeros = 0;
}

template <typename T, int kHist, int kW>
void partial_run(Partial& p, const T* x, Walk wk, int64_t n) {
  if (p.local && p.pending + n > int64_t{UINT32_MAX}) partial_flush_counts<kHist>(p);  // a uint32 count could overflow
  const HistSink hs{p.h, p.local, p.row + kHeader, p.cs, 1, p.copies};
  Acc a;
  WideAcc w;
  if (!kBaselineLoop<kHist> || use_avx2()) {
    segment_avx2<T, kHist, kW>(x, wk, n, p.shift, p.center, a, w, hs);
  } else if constexpr (kBaselineLoop<kHist>) {
    segment_base<T, kHist, kW>(x, wk, n, p.shift, p.center, a, w, hs);
  }
  acc_merge(p.acc, a);
  wide_merge(p.wide, w);
  p.pending += n;
  p.zeros += a.nzero;
}

template <typename F>
void with_partial_kind(const Partial& p, F&& f) {
  switch (p.kind) {
    case kHistNone: f(std::integral_constant<int, kHistNone>{}); break;
    case kHistLog2: f(std::integral_constant<int, kHistLog2>{}); break;
    case kHistLog2Fine: f(std::integral_constant<int, kHistLog2Fine>{}); break;
    case kHistLog2Exp: f(std::integral_constant<int, kHistLog2Exp>{}); break;
    case kHistLog2Key: f(std::integral_constant<int, kHistLog2Key>{}); break;
    default: f(std::integral_constant<int, kHistLinear>{}); break;
  }
}

// The row's shift from the first values any writer pushes.
template <typename T>
void partial_start(Partial& p, const T* x, int64_t n) {
  if (p.started) return;
  p.shift = row_shift(p.row, shift_candidate([&](int64_t i) { return load_double(x + i); }, n));
  p.center = p.shift;
  p.started = true;
}

}  // namespace

template <typename T>
void partial_begin(Partial& p, int64_t* row, const HistSpec& h, uint32_t* local) {
  static_assert(kPartialLocalWords == kHistCopies * (kLocalBins + 1), "stats_cpu.h's local histogram size");
  acc_init(p.acc);
  wide_init(p.wide);
  p.row = row;
  p.h = &h;
  p.kind = kHistNone;
  with_loop_kind<T>(h, kDirectHistBelow, [&](auto kind) {
    constexpr int k = decltype(kind)::value;
    p.kind = k;
    p.cs = local_copy_size<k>(h);
    p.copies = local_copies<k>(p.cs, use_avx2());
  });
  // A local histogram where its counters fit (the exponent and key loops
  // always count locally); wider ones count into the row.
  const bool fits = p.kind == kHistLog2Exp || p.kind == kHistLog2Key || (h.kind != kHistNone && h.nbins <= kLocalBins);
  p.local = fits ? local : nullptr;
  if (p.local) std::memset(p.local, 0, sizeof(uint32_t) * p.copies * p.cs);
  p.pending = p.zeros = 0;
  p.shift = 0.0;
  p.started = false;
}

template <typename T>
void partial_push(Partial& p, const T* x, int64_t n) {
  if (n == 0) return;
  partial_start(p, x, n);
  with_partial_kind(p, [&](auto kind) { partial_run<T, decltype(kind)::value, kWalkUnit>(p, x, Walk{1, 0}, n); });
}

template <typename T>
void partial_push_rows(Partial& p, const T* x, int64_t rows, int64_t step, int64_t run, int64_t ahead,
                       const void* seq) {
  if (rows == 0 || run == 0) return;
  if (rows == 1 || step == run) return partial_push(p, x, rows * run);
  TORCH_CHECK(rows_run_ok(run), "hookcap: partial_push_rows reads runs of a multiple of 16 values up to ", kBlock,
              ", not ", run);
  partial_start(p, x, run);
  with_partial_kind(p, [&](auto kind) {
    Walk wk = rows_walk(step, run, ahead);
    wk.seq = static_cast<const char*>(seq);
    partial_run<T, decltype(kind)::value, kWalkRows>(p, x, wk, rows * run);
  });
}

// The partial's functions for T, instantiated in accumulate_<dtype>.cpp.
#define HOOKCAP_PARTIAL(T)                                                                  \
  template void partial_begin<T>(Partial&, int64_t*, const HistSpec&, uint32_t*);          \
  template void partial_push<T>(Partial&, const T*, int64_t);                               \
  template void partial_push_rows<T>(Partial&, const T*, int64_t, int64_t, int64_t, int64_t, const void*)

// accumulate_read<T>'s signature, for the explicit instantiations below and
// in accumulate_<dtype>.cpp.
#define HOOKCAP_ACCUMULATE_READ(T) \
  void accumulate_read<T>(const T*, bool, const StridedDesc&, int64_t, int64_t, int64_t*, const HistSpec&)

// Each compiled in its own file only.
extern template HOOKCAP_ACCUMULATE_READ(double);
extern template HOOKCAP_ACCUMULATE_READ(float);
extern template HOOKCAP_ACCUMULATE_READ(c10::Half);
extern template HOOKCAP_ACCUMULATE_READ(c10::BFloat16);
extern template HOOKCAP_ACCUMULATE_READ(c10::Float8_e4m3fn);
extern template HOOKCAP_ACCUMULATE_READ(c10::Float8_e5m2);

}  // namespace hookcap
