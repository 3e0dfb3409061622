// Shared statistics math: the ONLY place where per-element classification,
// accumulation, merging, ordered-key encoding and histogram bin indices are
// written. Included by the CPU loop, the CUDA kernel and the CUDA emulation
// harness (tests/cuda_emu), so all three run exactly the same arithmetic.
//
// Everything here is plain C++ plus C10_HOST_DEVICE: no intrinsics, no PTX,
// no std:: calls that are unavailable in device code.
#pragma once

#include <c10/macros/Macros.h>
#include <cstdint>
#include <cstring>

namespace hookcap {

// ---------------------------------------------------------------------------
// Ring row layout (int64 columns). Python mirrors this through the
// hookcap::layout op, so the two can never drift silently.
// Doubles are stored as their bit pattern; min/max/absmax as ordered keys so
// that integer atomicMin/atomicMax order them like the doubles they encode.
// ---------------------------------------------------------------------------
enum Col : int64_t {
  kCount = 0,   // numel of every tensor written into the row
  kNan = 1,
  kPosInf = 2,
  kNegInf = 3,
  kZeros = 4,   // == 0, including -0
  kShift = 5,   // double bits: shift K (a central value of the slot's first write)
  kS1 = 6,      // double bits: sum over finite of (x - K)
  kS2 = 7,      // double bits: sum over finite of (x - K)^2   (for std, no cancellation)
  kMin = 8,     // ordered key of min over finite
  kMax = 9,     // ordered key of max over finite
  kAbsMax = 10, // ordered key of max |x| over finite
  kCalls = 11,  // number of accumulate calls merged into the row
  kStepTag = 12, // step number the slot was reset for
  kSum = 13,    // double bits: sum over finite of x
  kSumSq = 14,  // double bits: sum over finite of x^2
  // Third and fourth moments (moments=4, opt-in): kN4 finite values summed
  // into kS3, kS4 about the same shift K as kS1/kS2. A row whose kN4 differs
  // from its ordinary finite values (another write without moments=4) has none.
  kN4 = 15,
  // Float64 values too large or too small to square in
  // double (wide_bucket) keep their moments in two buckets of their own, as
  // values times 2**-kWideScale (big) or 2**kWideScale (small): count, shift
  // (double bits, kShiftUnset: none), and moments about it. Every column
  // above (sums, moments, kShift) then holds the other finite values only.
  kBigN = 16,
  kBigShift = 17,
  kBigS1 = 18,
  kBigS2 = 19,
  kSmallN = 20,
  kSmallShift = 21,
  kSmallS1 = 22,
  kSmallS2 = 23,
  kS3 = 24,     // double bits: sum over finite of (x - K)^3   (moments=4)
  kS4 = 25,     // double bits: sum over finite of (x - K)^4   (moments=4)
  kHeader = 26, // histogram bins start here
};

// hist_kind flag of the accumulate op: also sum (x - K)^3 and (x - K)^4
// (Monitor(moments=4)); the histogram kind is hist_kind & kHistKindMask.
constexpr int64_t kMoments4Flag = 16;
constexpr int64_t kHistKindMask = kMoments4Flag - 1;
// hist_kind flag: CUDA launches run on hookcap's side stream of the device
// (Monitor(stream="side"), cuda/stats_launch.cu); no effect on the CPU.
constexpr int64_t kSideStreamFlag = 32;

// Shift sentinel: "no shift chosen yet in this slot". A NaN pattern no
// finite candidate can equal.
constexpr int64_t kShiftUnset = static_cast<int64_t>(0x7ff8dead0000beefULL);

enum HistKind : int64_t { kHistNone = 0, kHistLog2 = 1, kHistLinear = 2 };

// Histogram spec in the form every kernel consumes.
struct HistSpec {
  int64_t kind;    // HistKind
  int64_t nbins;   // total bins incl. the special ones (ring width - kHeader)
  int64_t lo_exp;  // log2: lowest exponent bin
  int64_t hi_exp;  // log2: exponent where overflow starts
  int64_t sub_shift;  // log2: 2**sub_shift bins per octave (the top mantissa bits)
  int64_t sign;       // log2: 1 = negative and positive values in separate bins
  double lo;       // linear: range start
  double hi;       // linear: range end
  int64_t bins;    // linear: equal-width bins between lo and hi
  double width;    // linear: (hi - lo) / bins
  double inv_width;  // linear: 1 / width (an estimate's factor; edges decide the bin)
  int64_t moments4;  // 1: also the third and fourth moments (kMoments4Flag)
};

C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t dbits(double v) {
  int64_t b;
  memcpy(&b, &v, sizeof(b));
  return b;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE double bitsd(int64_t b) {
  double v;
  memcpy(&v, &b, sizeof(v));
  return v;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE float bitsf(int32_t b) {
  float v;
  memcpy(&v, &b, sizeof(v));
  return v;
}

// 2**k as a float (-126 <= k <= 127) and as a double (-1022 <= k <= 1023).
C10_HOST_DEVICE C10_ALWAYS_INLINE float pow2f(int k) { return bitsf(static_cast<int32_t>(127 + k) << 23); }
C10_HOST_DEVICE C10_ALWAYS_INLINE double pow2d(int k) { return bitsd(static_cast<int64_t>(1023 + k) << 52); }

constexpr double kInf = __builtin_huge_val();

// Order-preserving map double -> int64 (for non-NaN values): flip the
// magnitude bits of negatives so that larger doubles get larger keys.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t order_key(double v) {
  int64_t b = dbits(v);
  return b >= 0 ? b : (b ^ INT64_MAX);
}

// The double of an order key (order_key is its own inverse on the bits).
C10_HOST_DEVICE C10_ALWAYS_INLINE double key_value(int64_t k) {
  return bitsd(k >= 0 ? k : (k ^ INT64_MAX));
}

// ---------------------------------------------------------------------------
// Per-element accumulation, written over references so the CUDA kernel can
// pass the fields of one Acc and the CPU loop can pass its own (vectorised)
// accumulators: one definition for both.
// ---------------------------------------------------------------------------
// s + d * d, rounded twice. Callers with a fused multiply-add pass their own
// square-accumulate (one rounding); the moments themselves are defined here.
struct AddSquare {
  template <typename V>
  C10_HOST_DEVICE C10_ALWAYS_INLINE V operator()(V s, V d) const {
    return s + d * d;
  }
};

// Shifted moments of one value: the part of the update that keeps std free of
// cancellation when |mean| >> std.
template <typename V, typename Sq = AddSquare>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_shifted(V v, V shift, V& s1, V& s2, Sq sq = {}) {
  const V d = v - shift;
  s1 += d;
  s2 = sq(s2, d);
}

// Zero count (== 0, including -0). V may also be a GCC vector of floats (the
// CPU loop): compares then yield -1 per true lane, so a vector count runs down.
template <typename V, typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_zero(V v, C& nzero) {
  nzero += (v == V{});
}

// Min and max of a finite value.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_min_max(V v, V& mn, V& mx) {
  mn = v < mn ? v : mn;
  mx = v > mx ? v : mx;
}

// Min, max and zero count of a finite value.
template <typename V, typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_minmax(V v, V& mn, V& mx, C& nzero) {
  push_min_max(v, mn, mx);
  push_zero(v, nzero);
}

// Largest |v| of finite values with extrema mn <= mx (-inf if none): the
// CPU loop derives it from min/max instead of tracking a third extremum.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE V absmax_of(V mn, V mx) {
  const V a = -mn;
  return a > mx ? a : mx;
}

// Extrema and zero count of a finite value.
template <typename V, typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_extrema(V v, V& mn, V& mx, V& amx, C& nzero) {
  push_minmax(v, mn, mx, nzero);
  const V a = v < 0 ? -v : v;
  amx = a > amx ? a : amx;
}

// Update for a value known to be finite (double accumulators: the CUDA
// kernel and the CPU's exact path).
template <typename V, typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_finite(V v, V shift, V& sum, V& sumsq, V& s1,
                                                   V& s2, V& mn, V& mx, V& amx, C& nzero) {
  sum += v;
  sumsq += v * v;
  push_shifted(v, shift, s1, s2);
  push_extrema(v, mn, mx, amx, nzero);
}

// ---------------------------------------------------------------------------
// Wide float64 values. |x| >= 2**kWideExp would square to more than 2**800
// (sums of them overflow), and 0 < |x| < 2**-kWideExp squares to less than
// 2**-800 (all such values: squares lost to underflow). They are scaled by
// a power of two into the middle of double's range (exact) and kept in the
// row's big or small bucket; every other value, and every value of a
// 32-bit or narrower type (which cannot be wide), keeps today's columns.
// ---------------------------------------------------------------------------
constexpr int kWideExp = 400;
constexpr int kWideScale = 600;

// 0: an ordinary value; 1: big; 2: small. `a` is |x| of a finite x.
C10_HOST_DEVICE C10_ALWAYS_INLINE int wide_bucket(double a) {
  return a >= pow2d(kWideExp) ? 1 : (a < pow2d(-kWideExp) && a != 0.0 ? 2 : 0);
}

// Whether finite values with extrema mn <= mx may hold a wide value the
// run's own sums would lose: the largest magnitude is big, or every value
// is small. (A small value beside larger ones adds less than 2**-222 of the
// run's squares per element: it stays with them.)
C10_HOST_DEVICE C10_ALWAYS_INLINE bool may_be_wide(double mn, double mx) {
  const double a = -mn > mx ? -mn : mx;
  return a >= pow2d(kWideExp) || (a < pow2d(-kWideExp) && a != 0.0);
}

// One bucket's partial: moments of its scaled values about `shift` (its
// first value), and their count.
struct WidePart {
  double shift, s1, s2;
  int64_t n;
};

struct WideAcc {
  WidePart big, small;
};

C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_init(WideAcc& w) {
  w.big = WidePart{0.0, 0.0, 0.0, 0};
  w.small = WidePart{0.0, 0.0, 0.0, 0};
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_part_push(WidePart& p, double y) {
  if (p.n == 0) p.shift = y;
  const double d = y - p.shift;
  p.s1 += d;
  p.s2 += d * d;
  ++p.n;
}

// A finite value of bucket b (1 or 2; wide_bucket) into its bucket.
C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_push(WideAcc& w, double v, int b) {
  if (b == 1) {
    wide_part_push(w.big, v * pow2d(-kWideScale));
  } else {
    wide_part_push(w.small, v * pow2d(kWideScale));
  }
}

// Re-express shifted sums of m values from shift `from` to shift `to`:
// sum(x - to) = s1 + m*(from - to); sum((x - to)^2) = s2 + 2*(from - to)*s1 + m*(from - to)^2.
C10_HOST_DEVICE C10_ALWAYS_INLINE void shift_rebase(double& s1, double& s2, double m,
                                                    double from, double to) {
  const double t = from - to;
  s2 += 2.0 * t * s1 + m * t * t;
  s1 += m * t;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_part_merge(WidePart& a, WidePart b) {
  if (b.n == 0) return;
  if (a.n == 0) {
    a = b;
    return;
  }
  shift_rebase(b.s1, b.s2, static_cast<double>(b.n), b.shift, a.shift);
  a.s1 += b.s1;
  a.s2 += b.s2;
  a.n += b.n;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_merge(WideAcc& a, const WideAcc& b) {
  wide_part_merge(a.big, b.big);
  wide_part_merge(a.small, b.small);
}

// A bucket's partial into the ring row's bucket at column `base` (kBigN or
// kSmallN), each element standing for `mult`: the first merge sets the
// bucket's shift, later ones rebase onto it (as kShift).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_part_to_row(int64_t* row, int64_t base, WidePart p,
                                                        int64_t mult) {
  if (p.n == 0) return;
  const int64_t old = Atomics::cas_i64(row + base + 1, kShiftUnset, dbits(p.shift));
  if (old != kShiftUnset) shift_rebase(p.s1, p.s2, static_cast<double>(p.n), p.shift, bitsd(old));
  const double m = static_cast<double>(mult);
  Atomics::add_i64(row + base, p.n * mult);
  Atomics::add_f64(row + base + 2, p.s1 * m);
  Atomics::add_f64(row + base + 3, p.s2 * m);
}

// One wide value of bucket b (1 or 2) straight into the row: the CUDA
// kernel keeps no per-thread bucket state (registers its streaming loop
// needs), at four global atomics per wide value (rare: see wide_bucket).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_value_to_row(int64_t* row, double v, int b, int64_t mult) {
  const double y = v * pow2d(b == 1 ? -kWideScale : kWideScale);
  wide_part_to_row<Atomics>(row, b == 1 ? kBigN : kSmallN, WidePart{y, 0.0, 0.0, 1}, mult);
}

#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void wide_to_row(int64_t* row, const WideAcc& w, int64_t mult) {
  wide_part_to_row<Atomics>(row, kBigN, w.big, mult);
  wide_part_to_row<Atomics>(row, kSmallN, w.small, mult);
}

// Raw sums of m values from their moments about c: sum = m*c + s1 and
// sumsq = s2 + 2*c*s1 + m*c^2. With c near the values' mean, s1 is small and
// every other term is non-negative, so nothing cancels.
C10_HOST_DEVICE C10_ALWAYS_INLINE void moments_to_raw(double s1, double s2, double m, double c,
                                                      double& sum, double& sumsq) {
  sum = m * c + s1;
  sumsq = s2 + 2.0 * c * s1 + m * c * c;
}

// Third and fourth moments about the row's shift K (moments=4): n values
// with sums of (x - K)^3 and (x - K)^4. All partials of a row are about the
// same K, so they add; rows of different shifts merge on the host
// (hookcap/_layout.py moments4_about: the binomial expansion).
struct Moments4 {
  double s3, s4;
  int64_t n;
};

C10_HOST_DEVICE C10_ALWAYS_INLINE void moments4_init(Moments4& m) {
  m.s3 = m.s4 = 0.0;
  m.n = 0;
}

// s + a * b, rounded twice. Callers with a fused multiply-add pass their own
// (one rounding), as for AddSquare.
struct MulAdd {
  template <typename V>
  C10_HOST_DEVICE C10_ALWAYS_INLINE V operator()(V s, V a, V b) const {
    return s + a * b;
  }
};

// One deviation d = x - K.
template <typename V, typename Ma = MulAdd>
C10_HOST_DEVICE C10_ALWAYS_INLINE void push_moments4(V d, V& s3, V& s4, Ma ma = {}) {
  const V d2 = d * d;
  s3 = ma(s3, d2, d);
  s4 = ma(s4, d2, d2);
}

// Re-express the third and fourth shifted sums of m values from shift
// `from` to shift `to` by the binomial expansion, t = from - to:
// sum((x - to)^3) = s3 + 3t*s2 + 3t^2*s1 + m*t^3,
// sum((x - to)^4) = s4 + 4t*s3 + 6t^2*s2 + 4t^3*s1 + m*t^4,
// with s1, s2 the same values' sums about `from` (before shift_rebase moves
// them). hookcap/_layout.py moments4_about is its numpy twin.
C10_HOST_DEVICE C10_ALWAYS_INLINE void shift_rebase4(double& s3, double& s4, double s1, double s2,
                                                     double m, double from, double to) {
  const double t = from - to, t2 = t * t;
  s4 += 4.0 * t * s3 + 6.0 * t2 * s2 + 4.0 * t2 * t * s1 + m * t2 * t2;
  s3 += 3.0 * t * s2 + 3.0 * t2 * s1 + m * t2 * t;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void moments4_merge(Moments4& a, const Moments4& b) {
  a.s3 += b.s3;
  a.s4 += b.s4;
  a.n += b.n;
}

// A partial about the row's shift into the row, each value standing for `mult`.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void moments4_to_row(int64_t* row, const Moments4& m, int64_t mult) {
  if (m.n == 0) return;
  const double md = static_cast<double>(mult);
  Atomics::add_i64(row + kN4, m.n * mult);
  Atomics::add_f64(row + kS3, m.s3 * md);
  Atomics::add_f64(row + kS4, m.s4 * md);
}

// Count v if it is NaN, +Inf or -Inf; returns whether it is finite.
template <typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool push_class(double v, C& nnan, C& npinf, C& nninf) {
  nnan += (v != v);
  npinf += (v == kInf);
  nninf += (v == -kInf);
  return (v < 0 ? -v : v) < kInf;  // NaN stays NaN: false
}

// Any value: classify NaN/+Inf/-Inf, then accumulate finite values. Returns
// whether v was finite.
template <typename D, typename C>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool push_value(double v, double shift, D& sum, D& sumsq,
                                                  D& s1, D& s2, D& mn, D& mx, D& amx,
                                                  C& nnan, C& npinf, C& nninf, C& nzero) {
  const bool finite = push_class(v, nnan, npinf, nninf);
  if (finite) push_finite<double>(v, shift, sum, sumsq, s1, s2, mn, mx, amx, nzero);
  return finite;
}

// Per-thread / per-chunk partial. nfin: finite values (the m of shift_rebase).
struct Acc {
  double sum, sumsq, s1, s2, mn, mx, amx;
  int64_t nnan, npinf, nninf, nzero, nfin;
};

C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_init(Acc& a) {
  a.sum = 0.0;
  a.sumsq = 0.0;
  a.s1 = 0.0;
  a.s2 = 0.0;
  a.mn = kInf;
  a.mx = -kInf;
  a.amx = -kInf;
  a.nnan = a.npinf = a.nninf = a.nzero = a.nfin = 0;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_push(Acc& a, double v, double shift) {
  a.nfin += push_value(v, shift, a.sum, a.sumsq, a.s1, a.s2, a.mn, a.mx, a.amx, a.nnan, a.npinf,
                       a.nninf, a.nzero);
}

// acc_push for a value that may be wide (float64 input): a wide value's
// moments go to its bucket, its extrema to `a` (whose nfin and moments
// count the other values only).
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_push_wide(Acc& a, WideAcc& w, double v, double shift) {
  if (!push_class(v, a.nnan, a.npinf, a.nninf)) return;
  const int b = wide_bucket(v < 0 ? -v : v);
  if (b == 0) {
    push_finite<double>(v, shift, a.sum, a.sumsq, a.s1, a.s2, a.mn, a.mx, a.amx, a.nzero);
    ++a.nfin;
  } else {
    push_extrema(v, a.mn, a.mx, a.amx, a.nzero);
    wide_push(w, v, b);
  }
}

// Merge b into a. All partials of one row share the same shift, so shifted
// sums add directly.
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_merge(Acc& a, const Acc& b) {
  a.sum += b.sum;
  a.sumsq += b.sumsq;
  a.s1 += b.s1;
  a.s2 += b.s2;
  a.mn = b.mn < a.mn ? b.mn : a.mn;
  a.mx = b.mx > a.mx ? b.mx : a.mx;
  a.amx = b.amx > a.amx ? b.amx : a.amx;
  a.nnan += b.nnan;
  a.npinf += b.npinf;
  a.nninf += b.nninf;
  a.nzero += b.nzero;
  a.nfin += b.nfin;
}

// A partial whose every element stands for m elements (a view's stride-0
// dimensions, strided.h): counts and sums times m, extrema unchanged.
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_scale(Acc& a, int64_t m) {
  const double md = static_cast<double>(m);
  a.sum *= md;
  a.sumsq *= md;
  a.s1 *= md;
  a.s2 *= md;
  a.nnan *= m;
  a.npinf *= m;
  a.nninf *= m;
  a.nzero *= m;
  a.nfin *= m;
}

// Move a partial's shifted sums from shift `from` to shift `to`.
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_rebase(Acc& a, double from, double to) {
  if (from != to) shift_rebase(a.s1, a.s2, static_cast<double>(a.nfin), from, to);
}

// acc_rebase of a partial that also has third and fourth sums q (moments=4,
// about the same shift): q moves first, while a's s1, s2 are still about `from`.
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_rebase4(Acc& a, Moments4& q, double from, double to) {
  if (from == to) return;
  shift_rebase4(q.s3, q.s4, a.s1, a.s2, static_cast<double>(a.nfin), from, to);
  shift_rebase(a.s1, a.s2, static_cast<double>(a.nfin), from, to);
}

// A thread's partial in the CUDA kernel, kept small (registers): moments
// about its shift only (the raw sums follow at the end, moments_to_raw),
// extrema in the working type W (float for inputs of 32 bits or fewer: every
// such value is a float), 32-bit counts (a thread sees far fewer than 2**32
// elements). to_acc turns it into an Acc.
template <typename W>
struct ThreadAcc {
  double s1, s2;
  W mn, mx;
  uint32_t nnan, npinf, nninf, nzero, nfin;
};

template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void thread_acc_init(ThreadAcc<W>& a) {
  a.s1 = a.s2 = 0.0;
  a.mn = static_cast<W>(kInf);
  a.mx = static_cast<W>(-kInf);
  a.nnan = a.npinf = a.nninf = a.nzero = a.nfin = 0;
}

// One value in double (a run redone exactly): classified, then its shifted
// moments and extrema.
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void thread_acc_push(ThreadAcc<W>& a, double v, double shift) {
  if (push_class(v, a.nnan, a.npinf, a.nninf)) {
    push_shifted(v, shift, a.s1, a.s2);
    const W w = static_cast<W>(v);
    push_minmax(w, a.mn, a.mx, a.nzero);
    ++a.nfin;
  }
}

// thread_acc_push for a float64 value that may be wide: a wide value's
// extrema go to `a`, its moments nowhere; returns its bucket (0: none, the
// value is ordinary or not finite), for the caller to merge (wide_value_to_row).
C10_HOST_DEVICE C10_ALWAYS_INLINE int thread_acc_push_wide(ThreadAcc<double>& a, double v, double shift) {
  if (!push_class(v, a.nnan, a.npinf, a.nninf)) return 0;
  const int b = wide_bucket(v < 0 ? -v : v);
  push_minmax(v, a.mn, a.mx, a.nzero);
  if (b == 0) {
    push_shifted(v, shift, a.s1, a.s2);
    ++a.nfin;
  }
  return b;
}

// The Acc of a thread's partial whose moments are about `shift`.
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE Acc to_acc(const ThreadAcc<W>& t, double shift) {
  Acc a;
  acc_init(a);
  // Float64: extrema also of wide values (counted in no nfin).
  if (sizeof(W) == sizeof(double) ? t.mn <= t.mx : t.nfin != 0) {
    if (t.nfin) moments_to_raw(t.s1, t.s2, static_cast<double>(t.nfin), shift, a.sum, a.sumsq);
    a.s1 = t.s1;
    a.s2 = t.s2;
    a.mn = static_cast<double>(t.mn);
    a.mx = static_cast<double>(t.mx);
    a.amx = absmax_of(a.mn, a.mx);
  }
  a.nnan = t.nnan;
  a.npinf = t.npinf;
  a.nninf = t.nninf;
  a.nzero = t.nzero;
  a.nfin = t.nfin;
  return a;
}

// Add a run of m finite values with moments s1, s2 about c (float sums) to a
// thread's partial about `shift`.
// scale_exp k > 0: s1, s2 are of the values and c times 2**k (a run of tiny
// values, tiny_run_exp), so they are taken back by 2**-k and 2**-2k (exact).
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void thread_acc_add_run(ThreadAcc<W>& t, W s1, W s2, int64_t m,
                                                          W c, double shift, W mn, W mx,
                                                          uint32_t nz, int scale_exp = 0) {
  double d1 = static_cast<double>(s1), d2 = static_cast<double>(s2);
  if (scale_exp > 0) {
    d1 *= pow2d(-scale_exp);
    d2 *= pow2d(-2 * scale_exp);
  }
  shift_rebase(d1, d2, static_cast<double>(m), static_cast<double>(c), shift);
  t.s1 += d1;
  t.s2 += d2;
  t.mn = mn < t.mn ? mn : t.mn;
  t.mx = mx > t.mx ? mx : t.mx;
  t.nzero += nz;
  t.nfin += static_cast<uint32_t>(m);
}

// moments=4: add a run's third and fourth sums s3, s4 about c (float sums,
// like its s1, s2; scale_exp as for thread_acc_add_run: 2**-3k, 2**-4k) to
// the thread's q, about `shift`.
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void moments4_add_run(Moments4& q, W s1, W s2, W s3, W s4, int64_t m, W c,
                                                        double shift, int scale_exp = 0) {
  double d1 = static_cast<double>(s1), d2 = static_cast<double>(s2);
  double d3 = static_cast<double>(s3), d4 = static_cast<double>(s4);
  if (scale_exp > 0) {
    d1 *= pow2d(-scale_exp);
    d2 *= pow2d(-2 * scale_exp);
    d3 *= pow2d(-3 * scale_exp);
    d4 *= pow2d(-4 * scale_exp);
  }
  shift_rebase4(d3, d4, d1, d2, static_cast<double>(m), static_cast<double>(c), shift);
  q.s3 += d3;
  q.s4 += d4;
}

// ---------------------------------------------------------------------------
// Float runs: inputs of 32 bits or fewer are summed in float about a center c
// over a bounded run of m values (all finite), then flushed into a double
// partial. Shared by the CPU loop (blocks of a chunk) and the CUDA kernel
// (each thread's runs).
// ---------------------------------------------------------------------------

// A run's float sums, in pairs (s1 with s2; with moments=4 also s3 with s4):
// an odd-power sum `odd` of either sign and an even-power sum `even` >= 0.
// Beyond kFloatSumBig a sum may have overflowed; an even-power sum below
// kFloatSumTiny may have lost terms to float underflow (|x - c| < 2**-63
// gives subnormal squares), unless every value equals the center (a
// constant run: the powers are truly zero).
constexpr float kFloatSumBig = 3.0e38f;
constexpr float kFloatSumTiny = 7.9e-31f;  // ~2**-100

// Neither sum of the pair can have overflowed.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_pair_fits(V odd, V even) {
  const V a = odd < 0 ? -odd : odd;
  return a <= V(kFloatSumBig) && even <= V(kFloatSumBig);
}

// The pair can be trusted: it fits, and lost nothing to underflow unless the
// run is constant (s1 == 0, mn == mx: its own first sum and extrema).
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_pair_ok(V odd, V even, V s1, V mn, V mx) {
  return float_pair_fits(odd, even) && (even >= V(kFloatSumTiny) || (mn == mx && s1 == 0));
}

// The pair fails float_pair_ok only because its even powers are too small.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_pair_tiny(V odd, V even, V s1, V mn, V mx) {
  const V a = odd < 0 ? -odd : odd;
  return a <= V(kFloatSumBig) && even < V(kFloatSumTiny) && !(mn == mx && s1 == 0);
}

// Whether a run's float moments can be trusted (float_pair_ok of s1, s2).
// Tiny gradients and huge activations take the double path instead, so they
// never come out silently wrong. Always true for double.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_sums_ok(V s1, V s2, V mn, V mx) {
  if constexpr (sizeof(V) == sizeof(double)) {
    return true;
  } else {
    return float_pair_ok(s1, s2, s1, mn, mx);
  }
}

// A run that failed float_sums_ok only because its squares are too small:
// no NaN/Inf (the caller's check), no overflow, values that differ. Its
// values are tiny (float's spacing at them is below the square root of
// kFloatSumTiny), so summing them again times a power of two (tiny_run_exp)
// is exact and keeps the run in float.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_sums_tiny(V s1, V s2, V mn, V mx) {
  if constexpr (sizeof(V) == sizeof(double)) {
    return false;
  } else {
    return float_pair_tiny(s1, s2, s1, mn, mx);
  }
}

// moments=4: float_sums_ok for a run's third and fourth sums about its
// center (the run is constant as for s1, s2). Its third powers need no
// underflow test of their own: with s4 >= kFloatSumTiny, those lost to
// underflow weigh less than 2**-30 of the largest. Always true for double
// (as the CPU loop, whose double sums overflow to Inf only beyond 2**256).
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_moments4_ok(V s3, V s4, V s1, V mn, V mx) {
  if constexpr (sizeof(V) == sizeof(double)) {
    return true;
  } else {
    return float_pair_ok(s3, s4, s1, mn, mx);
  }
}

// A run that failed float_moments4_ok only because its fourth powers are
// too small (as float_sums_tiny): the candidates for the rescaled path.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool float_moments4_tiny(V s3, V s4, V s1, V mn, V mx) {
  if constexpr (sizeof(V) == sizeof(double)) {
    return false;
  } else {
    return float_pair_tiny(s3, s4, s1, mn, mx);
  }
}

// The exponent k in [1, 127] that brings a run's largest magnitude `amax`
// (finite, below 1) to [1, 2), or 0 if amax is 1 or more (no rescaling):
// the run's values, and any center between them, times 2**k are exact floats.
C10_HOST_DEVICE C10_ALWAYS_INLINE int tiny_run_exp(float amax) {
  int32_t b;
  memcpy(&b, &amax, sizeof(b));
  const int e = (b >> 23) & 0xff;  // biased exponent; 0 for subnormals
  return e >= 127 ? 0 : (127 - e > 127 ? 127 : 127 - e);
}

// Shifted sums of a run are well conditioned when the shift lies within
// `stds` standard deviations of the run mean: (s1/n)^2 <= stds^2 * var. Two
// for the moments; one for moments=4's third and fourth powers (the CUDA
// kernel's float runs), whose sums are then at most ~3.3 times their
// central part (normal data).
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool shift_well_conditioned(V s1, V s2, int64_t n, int stds = 2) {
  const V m = s1 / static_cast<V>(n);
  const V var = s2 / static_cast<V>(n) - m * m;
  return m * m <= static_cast<V>(stds * stds) * var;
}

// Center for the next run, given this run's moments about c: zero when the
// run is well conditioned about zero (|mean| <= 2 std, most activations and
// gradients), so the loop needs no subtract; else c.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE V next_center(V c, V s1, V s2, int64_t n) {
  const V m = s1 / static_cast<V>(n);
  const V var = s2 / static_cast<V>(n) - m * m;
  const V mean = c + m;
  return mean * mean <= V(4) * var ? V(0) : c;
}

// Add a run of m finite values, with moments s1, s2 about c, extrema mn <= mx
// and nz zeros, to a partial whose shifted sums are about `shift`.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE void acc_add_run(Acc& acc, V s1, V s2, int64_t m, V c,
                                                   double shift, V mn, V mx, int64_t nz) {
  const double dm = static_cast<double>(m), dc = static_cast<double>(c);
  double sum, sumsq, d1 = static_cast<double>(s1), d2 = static_cast<double>(s2);
  moments_to_raw(d1, d2, dm, dc, sum, sumsq);
  shift_rebase(d1, d2, dm, dc, shift);
  const Acc run{sum, sumsq, d1, d2, static_cast<double>(mn), static_cast<double>(mx),
                static_cast<double>(absmax_of(mn, mx)), 0, 0, 0, nz, m};
  acc_merge(acc, run);
}

// Shift candidate: the median of the finite values among a few elements
// spread evenly over the tensor (else 0) — a central value: neither one
// outlier nor a run of them at the front (a massive activation in token 0)
// can become the shift. Every block of a launch computes the same
// candidate, so they agree without communicating.
constexpr int kShiftProbe = 8;

#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Load>
C10_HOST_DEVICE C10_ALWAYS_INLINE double shift_candidate(Load load, int64_t n) {
  double vals[kShiftProbe];
  int m = 0;
  const int64_t probe = n < kShiftProbe ? n : kShiftProbe;
  for (int64_t k = 0; k < probe; ++k) {
    const double v = load(k * (n / probe) + (k * (n % probe)) / probe);  // = k·n/probe, no overflow
    const double a = v < 0 ? -v : v;
    if (!(a < kInf) || wide_bucket(a) != 0) continue;  // kShift is an ordinary value's
    int j = m++;
    for (; j > 0 && vals[j - 1] > v; --j) vals[j] = vals[j - 1];  // insertion sort
    vals[j] = v;
  }
  return m == 0 ? 0.0 : vals[(m - 1) / 2];
}

#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void row_merge(int64_t* row, const Acc& a) {
  if (a.nnan) Atomics::add_i64(row + kNan, a.nnan);
  if (a.npinf) Atomics::add_i64(row + kPosInf, a.npinf);
  if (a.nninf) Atomics::add_i64(row + kNegInf, a.nninf);
  if (a.nzero) Atomics::add_i64(row + kZeros, a.nzero);
  if (a.mn <= a.mx) {  // at least one finite element
    Atomics::add_f64(row + kSum, a.sum);
    Atomics::add_f64(row + kSumSq, a.sumsq);
    Atomics::add_f64(row + kS1, a.s1);
    Atomics::add_f64(row + kS2, a.s2);
    Atomics::min_i64(row + kMin, order_key(a.mn));
    Atomics::max_i64(row + kMax, order_key(a.mx));
    Atomics::max_i64(row + kAbsMax, order_key(a.amx));
  }
}

// Timing rows (Monitor(timing=True)): one per module and device, written only
// by hookcap::time_mark. A start mark adds (-now, -1) and an end mark
// (+now, +1, and one completed call) to its phase's (ns, open, ends)
// columns, so a step's paired marks sum to the total duration with the open
// count back at 0 (else that step's timing is incomplete). Every one of these
// columns resets to 0 and merges by addition.
enum TimeCol : int64_t {
  kFwdNs = kCount, kFwdOpen = kNan, kFwdEnds = kZeros,
  kBwdNs = kPosInf, kBwdOpen = kNegInf, kBwdEnds = kCalls,
};

#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Atomics>
C10_HOST_DEVICE C10_ALWAYS_INLINE void row_time_mark(int64_t* row, int64_t phase, bool start,
                                                     int64_t now_ns) {
  const bool fwd = phase == 0;
  Atomics::add_i64(row + (fwd ? kFwdNs : kBwdNs), start ? -now_ns : now_ns);
  Atomics::add_i64(row + (fwd ? kFwdOpen : kBwdOpen), start ? -1 : 1);
  if (!start) Atomics::add_i64(row + (fwd ? kFwdEnds : kBwdEnds), 1);
}

// Value of one cell of a row freshly reset for `step`.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t reset_value(int64_t col, int64_t step) {
  switch (col) {
    case kStepTag: return step;
    case kShift: return kShiftUnset;
    case kBigShift: return kShiftUnset;
    case kSmallShift: return kShiftUnset;
    case kMin: return order_key(kInf);
    case kMax: return order_key(-kInf);
    case kAbsMax: return order_key(-kInf);
    default: return 0;  // counts, histogram, and 0.0 for S1/S2
  }
}

// ---------------------------------------------------------------------------
// Histogram bin index. Returns -1 for values that are not binned (NaN, Inf).
// ---------------------------------------------------------------------------

// IEEE layout of the working types, for exponent extraction from the bits.
template <typename V> struct FloatBits;
template <> struct FloatBits<double> {
  using I = int64_t;
  static constexpr int kMant = 52, kBias = 1023, kSubScaleExp = 64;
  static constexpr I kAbsMask = INT64_MAX;
  static constexpr double kSubScale = 18446744073709551616.0;  // 2**64
};
template <> struct FloatBits<float> {
  using I = int32_t;
  static constexpr int kMant = 23, kBias = 127, kSubScaleExp = 32;
  static constexpr I kAbsMask = INT32_MAX;
  static constexpr float kSubScale = 4294967296.0f;  // 2**32
};

template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE typename FloatBits<V>::I vbits(V v) {
  typename FloatBits<V>::I b;
  memcpy(&b, &v, sizeof(b));
  return b;
}

// Binary exponent e with 2**e <= |v| < 2**(e+1), for finite non-zero v.
// Subnormals are scaled up into the normal range first, so they land in
// their true exponent bin.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t binary_exponent(V v) {
  using B = FloatBits<V>;
  const auto b = vbits(v) & B::kAbsMask;
  const int32_t biased = static_cast<int32_t>(b >> B::kMant);
  V scaled = v * B::kSubScale;
  const int32_t sb = static_cast<int32_t>((vbits(scaled) & B::kAbsMask) >> B::kMant);
  return biased != 0 ? biased - B::kBias : sb - B::kBias - B::kSubScaleExp;
}

// Works in V = float for inputs of 32 bits or fewer, V = double otherwise:
// both give the same bin for the same value.
template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t log2_bin(V v, int32_t lo_exp, int32_t hi_exp) {
  const V a = v < 0 ? -v : v;
  const int32_t e = binary_exponent(a);
  // 1 = underflow (e < lo), hi - lo + 2 = overflow (e >= hi), else 2 + e - lo.
  int32_t bin = 2 + (e - lo_exp);
  bin = bin < 1 ? 1 : bin;
  bin = bin > hi_exp - lo_exp + 2 ? hi_exp - lo_exp + 2 : bin;
  // NaN and Inf (a < inf is false) are not binned; zeros go to bin 0.
  return a < static_cast<V>(kInf) ? (a == V(0) ? 0 : bin) : -1;
}

// The general log2 bins: 2**s bins per octave from the top s mantissa bits
// (s = 0: log2_bin's), and with `sgn` the sign kept. Unsigned layout (as
// log2_bin, octaves split): 0 zeros, 1 underflow, 2 + (e - lo) * 2**s + m
// for 2**e * (1 + m / 2**s) <= |v| < 2**e * (1 + (m + 1) / 2**s), top =
// (hi - lo) * 2**s + 2 overflow. Signed layout, in value order: bin top + u
// for v > 0 (u its unsigned bin), top - u for v < 0, top for zeros (-0 too).
// -1: NaN and Inf, not binned.
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t log2_top(int32_t lo_exp, int32_t hi_exp, int32_t s) {
  return (hi_exp - lo_exp) * (1 << s) + 2;
}

template <typename V>
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t log2_bin_fine(V v, int32_t lo_exp, int32_t hi_exp, int32_t s, bool sgn) {
  using B = FloatBits<V>;
  const V a = v < 0 ? -v : v;
  const auto b = vbits(a) & B::kAbsMask;
  const int32_t biased = static_cast<int32_t>(b >> B::kMant);
  const auto sb = vbits(static_cast<V>(a * B::kSubScale)) & B::kAbsMask;  // subnormals, scaled up exactly
  // (unbiased exponent) * 2**s + the top s mantissa bits.
  const int32_t key = biased != 0 ? static_cast<int32_t>(b >> (B::kMant - s)) - B::kBias * (1 << s)
                                  : static_cast<int32_t>(sb >> (B::kMant - s)) - (B::kBias + B::kSubScaleExp) * (1 << s);
  const int32_t top = log2_top(lo_exp, hi_exp, s);
  int32_t u = 2 + key - lo_exp * (1 << s);
  u = u < 1 ? 1 : (u > top ? top : u);
  u = a < static_cast<V>(kInf) ? (a == V(0) ? 0 : u) : -1;
  return !sgn || u < 0 ? u : top + (v < 0 ? -u : u);
}

// The bin of exact zeros: 0, or the middle of a signed layout.
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t log2_zero_bin(int32_t lo_exp, int32_t hi_exp, int32_t s, bool sgn) {
  return sgn ? log2_top(lo_exp, hi_exp, s) : 0;
}

// The key a float is counted under with bins per octave or signed bins
// (the CPU loop's and the CUDA kernel's key counting): its bits, +-0 made
// +0, shifted right by 23 - s and masked to the exponent and top s mantissa
// bits, and the sign when the mask keeps it.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint32_t log2_key_bits(float v, int32_t shift, uint32_t mask) {
  uint32_t b = static_cast<uint32_t>(vbits(v));
  b = (b << 1) == 0u ? 0u : b;
  return (b >> shift) & mask;
}

// Keys of a histogram with bins per octave or signed bins: 2**(8 + s (+ 1 signed)).
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t log2_keys(const HistSpec& h) {
  return int64_t{1} << (8 + h.sub_shift + (h.sign ? 1 : 0));
}

// The bin of key k (lo_exp >= -126), -1 for NaN/Inf (exponent field 255).
// Field 1..254: the bin of the key's least value. Field 0 holds the zeros
// (all under key 0) and the subnormals, which lie below 2**lo_exp: the
// underflow bin of their sign; the caller moves the zeros (the statistics'
// exact count) from the positive underflow bin to log2_zero_bin.
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t log2_key_bin(uint32_t k, int32_t lo_exp, int32_t hi_exp, int32_t s,
                                                      bool sgn) {
  const int32_t field = static_cast<int32_t>(k >> s) & 0xff;
  if (field == 255) return -1;
  if (field == 0) {
    const bool neg = sgn && (k >> (8 + s)) != 0;
    return log2_zero_bin(lo_exp, hi_exp, s, sgn) + (neg ? -1 : 1);
  }
  return log2_bin_fine(bitsf(static_cast<int32_t>(k << (23 - s))), lo_exp, hi_exp, s, sgn);
}

// Total bins of a log2 histogram: log2_top + 1 unsigned, 2 * log2_top + 1 signed.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t log2_nbins(int64_t lo_exp, int64_t hi_exp, int64_t s, bool sgn) {
  const int64_t top = log2_top(static_cast<int32_t>(lo_exp), static_cast<int32_t>(hi_exp), static_cast<int32_t>(s));
  return sgn ? 2 * top + 1 : top + 1;
}

// Edge i of a linear histogram: lo + i*width, the last edge pinned to hi.
C10_HOST_DEVICE C10_ALWAYS_INLINE double linear_edge(const HistSpec& h, int64_t i) {
  return i >= h.bins ? h.hi : h.lo + static_cast<double>(i) * h.width;
}

// Narrowest linear bin accepted, as a power of two of max(|lo|, |hi|)
// (op_checks.h; hookcap/histogram.py MIN_WIDTH_EXP): edges are then within
// 2^-3 bins of their exact places and linear_bin's estimate within 0.07, so
// the true bin is the estimate's or a neighbour.
constexpr int kLinearMinWidthExp = -48;

C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t linear_bin(double v, const HistSpec& h) {
  const double a = v < 0 ? -v : v;
  if (!(a < kInf)) return -1;
  if (v < h.lo) return 0;
  if (v >= h.hi) return h.bins + 1;
  int64_t i = static_cast<int64_t>((v - h.lo) * h.inv_width);
  i = i < 0 ? 0 : (i >= h.bins ? h.bins - 1 : i);
  // The estimate (a multiply by 1/width: no divide) is within a few ulps of
  // the position, so it can only round across one edge; the edges decide.
  if (v < linear_edge(h, i)) --i;
  else if (v >= linear_edge(h, i + 1)) ++i;
  return 1 + i;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t hist_bin(double v, const HistSpec& h) {
  if (h.kind != kHistLog2) return linear_bin(v, h);
  const int32_t lo = static_cast<int32_t>(h.lo_exp), hi = static_cast<int32_t>(h.hi_exp);
  return h.sub_shift == 0 && h.sign == 0
             ? log2_bin(v, lo, hi)
             : log2_bin_fine(v, lo, hi, static_cast<int32_t>(h.sub_shift), h.sign != 0);
}

}  // namespace hookcap
