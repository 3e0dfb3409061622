// What the host decides for each accumulate launch, shared by the CUDA
// launcher (stats_launch.cu), the kernels (stats_kernel.cuh) and the CPU
// emulation harness: the block's geometry, the dynamic shared-memory budget
// per device, and how a histogram is counted (HistPlan: its mode, shared
// memory and float constants). Plain C++ with host/device functions, no
// device intrinsics.
#pragma once

#include "hookcap/stats_math.h"
#include "hookcap/strided.h"

#include <cmath>
#include <cstdint>

namespace hookcap {
namespace kernels {

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;  // every accumulate launch (stats_launch.cu)
constexpr int kWarps = kThreads / kWarpSize;

enum HistMode : int {
  kModeNone = 0,
  kModeLog2Exp = 1,    // log2 on float, lo_exp >= -126: the exponent byte counted per warp
                       // (static shared memory), mapped to bins once per block
  kModeLog2 = 2,       // other log2 (float64 input, or bins reaching float subnormals): counts
                       // in dynamic shared memory (at most 2,203 bins, 8.8 KB: always fits)
  kModeLinear = 3,     // linear, counts in dynamic shared memory; float: with the thresholds
  kModeWide = 4,       // linear whose counts do not fit the shared-memory budget: counts go to
                       // the ring by warp-aggregated atomics; float: thresholds in dynamic
                       // shared memory
  kModeWideExact = 5,  // linear on float that float cannot estimate (linear_float_ok false),
                       // or whose thresholds do not fit the budget: counts as kModeWide,
                       // each bin by linear_bin in double
  kModeLog2Key = 6,    // log2 on float, lo_exp >= -126, with bins per octave or the sign: the
                       // float's key (sign, exponent, top mantissa bits: log2_key_bits) counted
                       // in dynamic shared memory, mapped to bins once per block
  kModeLog2Fine = 7,   // kModeLog2 with bins per octave or the sign (log2_bin_fine): its own
                       // specialisation, so plain octaves keep log2_bin's shorter loop
};

// Whether the float estimate of a linear bin, q = fl(v * inv + off) in one
// fma (inv = float(1 / width), off = float(1/2 - lo * inv): linear_thr), is
// close enough to v's exact position plus a half, p + 1/2 with
// p = (v - lo) / width, for linear_bin_thr's one compare to be exact: within
// 0.4 bins for v in [lo, hi], and on the same side of the range outside it.
// With u = 2**-24 and r = |lo| / width: inv's rounding moves v * inv + off by
// u * |p| only (off is formed with the same inv), off's by u * (r + 1/2), and
// the fma's by u * |q|; the double edges lie within 2**-52 * (bins + r) bins
// of lo + i * width. So the error is below (2 * bins + r + 2) * u +
// (bins + r) * 2**-50 + 2**-148 for |p| <= bins (bounded here, with margin,
// by 0.4: v lies strictly between edges j - 1 and j + 1, j = trunc(q));
// beyond the range it grows with |p| only by 2u, so q stays below 1 under lo
// and at or above bins over hi. The r term rules out bins narrower than
// about three floats' spacing at lo (r > ~6.7e6), which bin in double.
// Every quantity must also be a finite normal float: |lo|, |hi| and
// 1 / width below 2**126, 1 / width at least 2**-125.
// False means kModeWideExact.
C10_HOST_DEVICE inline bool linear_float_ok(const HistSpec& h) {
  const double alo = h.lo < 0 ? -h.lo : h.lo, ahi = h.hi < 0 ? -h.hi : h.hi;
  if (!(alo < 0x1p126 && ahi < 0x1p126 && h.inv_width < 0x1p126 && h.inv_width >= 0x1p-125)) return false;
  const double b = static_cast<double>(h.bins), r = alo * h.inv_width;
  return (3.0 * b + r + 2.0) * 0x1p-24 + (b + r) * 0x1p-50 + 0x1p-148 <= 0.4;
}

// Least float >= e (e finite or infinite): a value v (float) is >= e iff
// v >= that float, so float compares give the double edges' bins exactly.
C10_HOST_DEVICE inline float float_at_or_above(double e) {
  float f = static_cast<float>(e);
  if (static_cast<double>(f) < e) f = nextafterf(f, kInf);
  return f;
}

// Block partials merged by a tree instead of each block's atomics on the
// ring row (a launch's per-block cost): each block of a launch of 2 ..
// kMaxTreeBlocks blocks writes its partial (moments, and its histogram
// counts when they fit kTableCounts) to a scratch record and takes a ticket
// of its group of kTreeFan blocks; the group's last block merges the group
// (into a record of the next level, or, at the top, into the ring). So a
// launch sends one ticket per block and per group, and one merge.
// Scratch layout (int64 words): kTicketWords tickets (level 0 group g at g,
// level 1 at kTreeFan; each left at 0 by its group's last block), then the
// records: level 0 at [0, grid), level 1 at [grid, grid + groups).
constexpr int kTreeFan = 32;                             // one warp's lanes
constexpr int64_t kMaxTreeBlocks = kTreeFan * kTreeFan;  // two levels
constexpr int kTableCounts = 256;                        // uint32 counts of a record
constexpr int64_t kRecordHeader = 16;                    // Acc (12 words), shift, moments=4 sums, spare
constexpr int64_t kRecordWords = kRecordHeader + kTableCounts / 2;
constexpr int64_t kTicketWords = 64;

// Scratch words for launches of up to `blocks` blocks (at most kMaxTreeBlocks).
C10_HOST_DEVICE constexpr int64_t tree_scratch_words(int64_t blocks) {
  return kTicketWords + (blocks + (blocks + kTreeFan - 1) / kTreeFan) * kRecordWords;
}

// Static shared memory of the accumulate kernels other than kModeLog2Exp (the
// per-warp partials): the launcher's shared-memory budget leaves room for it.
// (The warps' partials and shifts, and the tree's flag: 16 bytes, aligned.)
constexpr int64_t kStaticSmem = kWarps * static_cast<int64_t>(sizeof(Acc) + sizeof(int64_t)) + 16;

// The static shared memory a histogram's kernel has beyond kStaticSmem: with
// moments=4 each warp's third and fourth sums (taken from its dynamic budget).
C10_HOST_DEVICE constexpr int64_t static_smem_extra(const HistSpec& h) {
  return h.moments4 ? kWarps * static_cast<int64_t>(sizeof(Moments4)) : 0;
}

// The read an accumulate launch makes of a view strided.h's vector_read
// would read as 16-byte vectors: moments=4 reads it by element (its kernels
// are instantiated for flat and element reads only, which keeps the build's
// specialisations to two more per mode and type).
C10_HOST_DEVICE inline ReadKind accumulate_read(ReadKind read, const HistSpec& h) {
  return h.moments4 && read == kReadVectors ? kReadElements : read;
}

// Dynamic shared memory one block may take so that kMinBlocks blocks of
// kThreads fit on an SM with `per_sm` bytes of shared memory, `reserved`
// bytes reserved per block by the system and `optin` bytes at most per block.
// H100 (sm_90): 233472, 1024, 232448 -> 56,496 bytes; A100 (sm_80): 40,112.
constexpr int kMinBlocks = 4;
C10_HOST_DEVICE constexpr int64_t smem_budget(int64_t per_sm, int64_t reserved, int64_t optin) {
  const int64_t fit = per_sm / kMinBlocks - reserved;
  return (fit < optin ? fit : optin) - kStaticSmem;
}

// Float constants of linear bins by threshold (linear_bin_thr), computed on
// the host once per launch (so no double arithmetic is left in the kernel to
// be recomputed inside its loop).
struct LinearThr {
  float inv;  // float(1 / width)
  float off;  // float(1/2 - lo * inv): lo's place in bins and the rounding half
  int bins;
};

C10_HOST_DEVICE inline LinearThr linear_thr(const HistSpec& h) {
  LinearThr f{};
  f.inv = static_cast<float>(h.inv_width);
  f.off = static_cast<float>(0.5 - h.lo * static_cast<double>(f.inv));
  f.bins = static_cast<int>(h.bins);
  return f;
}

// How a launch counts a histogram: the mode, the dynamic shared memory per
// block and the float constants.
struct HistPlan {
  int mode;
  int64_t smem;
  LinearThr lin;
};

// The plan for a histogram, a working type and the device's budget
// (smem_budget). The same on the host launcher and the emulation harness.
C10_HOST_DEVICE inline HistPlan hist_plan(const HistSpec& h, bool work_is_float, int64_t budget) {
  HistPlan p{kModeNone, 0, {}};
  if (h.kind == kHistNone) return p;
  const int64_t counts = 4 * (h.nbins + 1);  // [0]: values not binned (NaN/Inf)
  if (h.kind == kHistLog2) {
    const bool fine = h.sub_shift != 0 || h.sign != 0;
    if (work_is_float && h.lo_exp >= -126 && !fine) {
      p.mode = kModeLog2Exp;
    } else if (work_is_float && h.lo_exp >= -126 && 4 * log2_keys(h) <= budget) {
      p.mode = kModeLog2Key;
      p.smem = 4 * log2_keys(h);
    } else {
      p.mode = fine ? kModeLog2Fine : kModeLog2;
      p.smem = counts;  // <= 4,405 bins (kMaxLog2Octaves): under any device's budget
    }
    return p;
  }
  const int64_t thr = work_is_float ? 4 * (h.bins + 1) : 0;  // least float >= each edge
  // Float thresholds beyond the budget would need a table in global memory,
  // allocated per call: such histograms (> ~14,000 bins on an H100) bin in
  // double instead, as those float cannot estimate.
  if (work_is_float && (!linear_float_ok(h) || thr > budget)) {
    p.mode = kModeWideExact;
    return p;
  }
  if (counts + thr <= budget) {  // float: as bins + 2 (threshold, count) pairs, the same bytes
    p.mode = kModeLinear;
    p.smem = counts + thr;
  } else {
    p.mode = kModeWide;
    p.smem = thr;
  }
  if (work_is_float) p.lin = linear_thr(h);
  return p;
}

}  // namespace kernels
}  // namespace hookcap
