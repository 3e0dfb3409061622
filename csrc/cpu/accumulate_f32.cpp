// The CPU statistics loop for float32 inputs (a file per dtype: the build
// compiles them in parallel), and the statistics of floats other kernels
// produce (floats_*: accumulate_update), with the same loop instantiations.
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(float);

namespace {

// The local counts into the row, then cleared.
template <int kHist>
void floats_flush_counts(FloatsPartial& p) {
  flush_local_counts<kHist>(p.local, p.copies, p.cs, p.zeros, 1, p.row, *p.h,
                            kHist == kHistLog2Exp ? exp_bin_table(*p.h) : nullptr,
                            kHist == kHistLog2Key ? key_bin_table(*p.h) : nullptr);
  std::memset(p.local, 0, sizeof(uint32_t) * p.copies * p.cs);
  p.pending = p.zeros = 0;
}

template <int kHist>
void floats_run(FloatsPartial& p, const float* x, int64_t n) {
  if (p.local && p.pending + n > int64_t{UINT32_MAX}) floats_flush_counts<kHist>(p);  // a uint32 count could overflow
  const HistSink hs{p.h, p.local, p.row + kHeader, p.cs, 1, p.copies};
  Acc a;
  WideAcc w;
  if (!kBaselineLoop<kHist> || use_avx2()) {
    chunk_avx2<float, kHist>(x, true, StridedDesc{}, 0, n, p.shift, a, w, hs);
  } else if constexpr (kBaselineLoop<kHist>) {
    chunk_base<float, kHist>(x, true, StridedDesc{}, 0, n, p.shift, a, w, hs);
  }
  acc_merge(p.acc, a);
  wide_merge(p.wide, w);
  p.pending += n;
  p.zeros += a.nzero;
}

template <typename F>
void with_kind(const FloatsPartial& p, F&& f) {
  switch (p.kind) {
    case kHistNone: f(std::integral_constant<int, kHistNone>{}); break;
    case kHistLog2: f(std::integral_constant<int, kHistLog2>{}); break;
    case kHistLog2Fine: f(std::integral_constant<int, kHistLog2Fine>{}); break;
    case kHistLog2Exp: f(std::integral_constant<int, kHistLog2Exp>{}); break;
    case kHistLog2Key: f(std::integral_constant<int, kHistLog2Key>{}); break;
    default: f(std::integral_constant<int, kHistLinear>{}); break;
  }
}

}  // namespace

void floats_begin(FloatsPartial& p, int64_t* row, const HistSpec& h, uint32_t* local) {
  static_assert(kDoublesLocalWords == kHistCopies * (kLocalBins + 1), "stats_cpu.h's local histogram size");
  acc_init(p.acc);
  wide_init(p.wide);
  p.row = row;
  p.h = &h;
  p.kind = kHistNone;
  with_loop_kind<float>(h, kDirectHistBelow, [&](auto kind) {
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

void floats_push(FloatsPartial& p, const float* x, int64_t n) {
  if (n == 0) return;
  if (!p.started) {
    p.shift = row_shift(p.row, shift_candidate([&](int64_t i) { return static_cast<double>(x[i]); }, n));
    p.started = true;
  }
  with_kind(p, [&](auto kind) { floats_run<decltype(kind)::value>(p, x, n); });
}

void floats_flush(FloatsPartial& p) {
  if (!p.started) return;
  row_merge<HostAtomics>(p.row, p.acc);
  wide_to_row<HostAtomics>(p.row, p.wide, 1);
  if (!p.local || p.pending == 0) return;
  with_kind(p, [&](auto kind) { floats_flush_counts<decltype(kind)::value>(p); });
}

}  // namespace hookcap
