// accumulate_bins' per-element math, shared by the CPU loop, the CUDA kernel
// and the emulation harness: which bin (expert) an index names, and the value
// the element adds to that bin's row (its weight, or 1 where there is none).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "hookcap/stats_math.h"

namespace hookcap {

// Bins per launch of the CUDA kernel: their rows travel in its arguments.
constexpr int kBinsPerLaunch = 256;

// The bin of routing index `idx`: 0 <= idx < bins, else -1 (in no bin: a
// capacity router's marker of a dropped token).
template <typename I>
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t bin_of(I idx, int64_t bins) {
  const int64_t b = static_cast<int64_t>(idx);
  return b >= 0 && b < bins ? b : -1;
}

// Element i's value: weight[i] in double (exact for every weight dtype), or
// 1 without weights.
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE double bins_value(const W* weight, int64_t i) {
  if (weight == nullptr) return 1.0;
  if constexpr (std::is_same_v<W, double>) {
    return weight[i];
  } else {
    return static_cast<double>(static_cast<float>(weight[i]));
  }
}

// The shift candidate of every bin's row in one call (stats_math.h's rule
// over the first values; 1 without weights): each row keeps its first
// writer's, as everywhere.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename W>
C10_HOST_DEVICE C10_ALWAYS_INLINE double bins_shift_candidate(const W* weight, int64_t n) {
  return weight == nullptr ? 1.0 : shift_candidate([&](int64_t i) { return bins_value(weight, i); }, n);
}

}  // namespace hookcap
