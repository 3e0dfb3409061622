// CPU implementation of the hookcap ops. One pass over the tensor, split into
// a fixed number of chunks (independent of the thread count, so results are
// bitwise reproducible for any OMP_NUM_THREADS), each chunk reduced with
// lane arrays the compiler vectorises; the chunk loop is compiled twice —
// AVX2+FMA and baseline — and picked at run time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

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

constexpr int kLanes = 8;        // independent accumulators per chunk
constexpr int kHistCopies = 4;   // sub-histograms to break store->load chains
constexpr int64_t kLocalBins = 1024;  // wider histograms count into the ring
constexpr int64_t kMinChunk = 32768;
constexpr int64_t kMaxChunks = 64;

struct Lanes {
  double s1[kLanes], s2[kLanes], mn[kLanes], mx[kLanes], amx[kLanes];
  int64_t nnan[kLanes], npinf[kLanes], nninf[kLanes], nzero[kLanes];
};

// Per-chunk histogram sink: local uint32 counts (kHistCopies interleaved
// copies) or, for wide histograms, the ring row itself.
struct HistSink {
  const HistSpec* spec;
  uint32_t* local;   // kHistCopies * nbins, or nullptr
  int64_t* ring_bins;
};

template <typename T, bool kUnit, int kHist>
HC_ALWAYS_INLINE void run_segment(const T* x, int64_t stride, int64_t n, double shift,
                                  Lanes& ln, const HistSink& hs) {
  auto at = [&](int64_t i) -> const T* { return kUnit ? x + i : x + i * stride; };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      push_value(load_double(at(i + j)), shift, ln.s1[j], ln.s2[j], ln.mn[j], ln.mx[j],
                 ln.amx[j], ln.nnan[j], ln.npinf[j], ln.nninf[j], ln.nzero[j]);
    }
    if (kHist != kHistNone) {
      for (int j = 0; j < kLanes; ++j) {
        const double v = load_double(at(i + j));
        const int64_t b = kHist == kHistLog2 ? log2_bin(v, hs.spec->lo_exp, hs.spec->hi_exp)
                                             : linear_bin(v, *hs.spec);
        if (b >= 0) {
          if (hs.local) {
            ++hs.local[(j % kHistCopies) * hs.spec->nbins + b];
          } else {
            HostAtomics::add_i64(hs.ring_bins + b, 1);
          }
        }
      }
    }
  }
  for (; i < n; ++i) {
    const double v = load_double(at(i));
    push_value(v, shift, ln.s1[0], ln.s2[0], ln.mn[0], ln.mx[0], ln.amx[0], ln.nnan[0],
               ln.npinf[0], ln.nninf[0], ln.nzero[0]);
    if (kHist != kHistNone) {
      const int64_t b = hist_bin(v, *hs.spec);
      if (b >= 0) {
        if (hs.local) {
          ++hs.local[b];
        } else {
          HostAtomics::add_i64(hs.ring_bins + b, 1);
        }
      }
    }
  }
}

// Logical elements [begin, end) of x, walked as runs along the innermost
// coalesced dimension (dense inputs are a single run).
template <typename T, int kHist>
HC_ALWAYS_INLINE void run_range(const T* x, bool flat, const StridedDesc& d, int64_t begin,
                                int64_t end, double shift, Lanes& ln, const HistSink& hs) {
  if (flat || d.ndim <= 1) {
    const int64_t st = flat ? 1 : (d.ndim == 1 ? d.strides[0] : 0);
    if (st == 1) {
      run_segment<T, true, kHist>(x + begin, 1, end - begin, shift, ln, hs);
    } else {
      run_segment<T, false, kHist>(x + begin * st, st, end - begin, shift, ln, hs);
    }
    return;
  }
  const int64_t inner = d.sizes[d.ndim - 1];
  const int64_t ist = d.strides[d.ndim - 1];
  int64_t i = begin;
  while (i < end) {
    const int64_t in0 = i % inner;
    const int64_t len = std::min(inner - in0, end - i);
    const T* p = x + strided_offset(d, i);
    if (ist == 1) {
      run_segment<T, true, kHist>(p, 1, len, shift, ln, hs);
    } else {
      run_segment<T, false, kHist>(p, ist, len, shift, ln, hs);
    }
    i += len;
  }
}

template <typename T, int kHist>
HC_ALWAYS_INLINE void chunk_impl(const T* x, bool flat, const StridedDesc& d, int64_t begin,
                                 int64_t end, double shift, Acc& out, const HistSink& hs) {
  Lanes ln;
  for (int j = 0; j < kLanes; ++j) {
    ln.s1[j] = ln.s2[j] = 0.0;
    ln.mn[j] = kInf;
    ln.mx[j] = -kInf;
    ln.amx[j] = -kInf;
    ln.nnan[j] = ln.npinf[j] = ln.nninf[j] = ln.nzero[j] = 0;
  }
  run_range<T, kHist>(x, flat, d, begin, end, shift, ln, hs);
  acc_init(out);
  for (int j = 0; j < kLanes; ++j) {
    const Acc lane{ln.s1[j], ln.s2[j], ln.mn[j], ln.mx[j], ln.amx[j],
                   ln.nnan[j], ln.npinf[j], ln.nninf[j], ln.nzero[j]};
    acc_merge(out, lane);
  }
}

// The same chunk loop, compiled for AVX2+FMA and for the baseline ISA.
template <typename T, int kHist>
__attribute__((target("avx2,fma"))) void chunk_avx2(const T* x, bool flat,
                                                    const StridedDesc& d, int64_t b,
                                                    int64_t e, double shift, Acc& out,
                                                    const HistSink& hs) {
  chunk_impl<T, kHist>(x, flat, d, b, e, shift, out, hs);
}

template <typename T, int kHist>
void chunk_base(const T* x, bool flat, const StridedDesc& d, int64_t b, int64_t e,
                double shift, Acc& out, const HistSink& hs) {
  chunk_impl<T, kHist>(x, flat, d, b, e, shift, out, hs);
}

bool use_avx2() {
  static const bool yes = [] {
    const char* force = std::getenv("HOOKCAP_CPU_ISA");
    if (force && std::strcmp(force, "baseline") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

template <typename T, int kHist>
void accumulate_typed(const T* x, bool flat, const StridedDesc& d, int64_t n, int64_t* row,
                      const HistSpec& h) {
  // Fix the slot's shift (first writer wins), as the CUDA kernel does.
  auto load = [&](int64_t i) -> double {
    return flat ? load_double(x + i) : load_double(x + strided_offset(d, i));
  };
  const double cand = shift_candidate(load, n);
  int64_t expected = kShiftUnset;
  __atomic_compare_exchange_n(row + kShift, &expected, dbits(cand), false, __ATOMIC_RELAXED,
                              __ATOMIC_RELAXED);
  const double shift = expected == kShiftUnset ? cand : bitsd(expected);

  const int64_t chunk = std::max(kMinChunk, (n + kMaxChunks - 1) / kMaxChunks);
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const bool local_hist = kHist != kHistNone && h.nbins <= kLocalBins;
  const bool avx2 = use_avx2();
  Acc partial[kMaxChunks];

  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    uint32_t local[kHistCopies * kLocalBins];
    for (int64_t c = c0; c < c1; ++c) {
      if (local_hist) std::memset(local, 0, sizeof(uint32_t) * kHistCopies * h.nbins);
      const HistSink hs{&h, local_hist ? local : nullptr, row + kHeader};
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      if (avx2) {
        chunk_avx2<T, kHist>(x, flat, d, b, e, shift, partial[c], hs);
      } else {
        chunk_base<T, kHist>(x, flat, d, b, e, shift, partial[c], hs);
      }
      if (local_hist) {
        for (int64_t k = 0; k < h.nbins; ++k) {
          int64_t cnt = 0;
          for (int r = 0; r < kHistCopies; ++r) cnt += local[r * h.nbins + k];
          if (cnt) HostAtomics::add_i64(row + kHeader + k, cnt);
        }
      }
    }
  });
  // Merge in chunk order: the same sums for any number of threads.
  Acc total;
  acc_init(total);
  for (int64_t c = 0; c < nchunks; ++c) acc_merge(total, partial[c]);
  row_merge<HostAtomics>(row, total);
}

void accumulate_cpu(const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state,
                    int64_t row_index, int64_t hist_kind, double hist_lo, double hist_hi,
                    int64_t hist_bins) {
  check_accumulate(x_in, ring, state, row_index);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = st[kStateSlot];
  TORCH_CHECK(slot >= 0 && slot < ring.size(0), "hookcap: state slot ", slot,
              " out of range for ", ring.size(0), " slots");
  int64_t* row = ring.data_ptr<int64_t>() + (slot * ring.size(1) + row_index) * ring.size(2);
  const int64_t n = x_in.numel();
  HostAtomics::add_i64(row + kCount, n);
  HostAtomics::add_i64(row + kCalls, 1);
  if (n == 0) return;

  at::Tensor x = x_in;
  StridedDesc d{};
  bool flat = is_flat_readable(x);
  // Rare: more than kMaxDims non-mergeable dims. Read a contiguous copy.
  if (!flat && !make_strided_desc(x, d)) {
    x = x.contiguous();
    flat = true;
  }
  AT_DISPATCH_FLOATING_TYPES_AND4(
      at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, x.scalar_type(),
      "hookcap_accumulate_cpu", [&] {
        const scalar_t* p = x.const_data_ptr<scalar_t>();
        switch (h.kind) {
          case kHistNone: accumulate_typed<scalar_t, kHistNone>(p, flat, d, n, row, h); break;
          case kHistLog2: accumulate_typed<scalar_t, kHistLog2>(p, flat, d, n, row, h); break;
          default: accumulate_typed<scalar_t, kHistLinear>(p, flat, d, n, row, h); break;
        }
      });
}

void reset_rows(int64_t* base, int64_t rows, int64_t width, int64_t step) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) base[r * width + c] = reset_value(c, step);
  }
}

void reset_slot_cpu(at::Tensor& ring, const at::Tensor& state) {
  check_ring_state(ring, state);
  const int64_t* st = state.data_ptr<int64_t>();
  const int64_t slot = st[kStateSlot];
  TORCH_CHECK(slot >= 0 && slot < ring.size(0), "hookcap: state slot ", slot,
              " out of range for ", ring.size(0), " slots");
  reset_rows(ring.data_ptr<int64_t>() + slot * ring.size(1) * ring.size(2), ring.size(1),
             ring.size(2), st[kStateStep]);
}

void advance_cpu(at::Tensor& ring, at::Tensor& state, int64_t every) {
  check_ring_state(ring, state);
  TORCH_CHECK(every >= 1, "hookcap.advance: every must be >= 1, got ", every);
  int64_t* st = state.data_ptr<int64_t>();
  const StepState next = next_state(st, every, ring.size(0));
  if (next.enabled) {
    reset_rows(ring.data_ptr<int64_t>() + next.slot * ring.size(1) * ring.size(2),
               ring.size(1), ring.size(2), next.step);
  }
  st[kStateStep] = next.step;
  st[kStateEnabled] = next.enabled;
  st[kStateSlot] = next.slot;
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("accumulate", &accumulate_cpu);
  m.impl("reset_slot", &reset_slot_cpu);
  m.impl("advance", &advance_cpu);
}

}  // namespace hookcap
