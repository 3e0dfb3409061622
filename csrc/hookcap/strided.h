// Logical-index -> storage-offset mapping for non-dense inputs (expanded,
// sliced, overlapping). Dense inputs of any permutation never use it: their
// elements are read straight from storage, since the statistics do not
// depend on element order.
#pragma once

#include <c10/macros/Macros.h>
#include <cstdint>

namespace hookcap {

constexpr int kMaxDims = 12;

struct StridedDesc {
  int64_t ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// Storage offset (in elements) of row-major logical index i.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t strided_offset(const StridedDesc& d, int64_t i) {
  int64_t off = 0;
  for (int64_t k = d.ndim - 1; k >= 0; --k) {
    const int64_t q = i / d.sizes[k];
    off += (i - q * d.sizes[k]) * d.strides[k];
    i = q;
  }
  return off;
}

}  // namespace hookcap
