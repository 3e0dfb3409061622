// How a kernel reads a tensor of any layout. Statistics do not depend on
// element order, so the host reorders a view's dimensions freely: stride-0
// dimensions become a multiplicity (each element read once, counted `mult`
// times), the rest are sorted by stride (innermost smallest: coalesced reads)
// and merged where they tile. A view that ends up as one run of stride 1 is
// read flat (dense views of any permutation, expanded contiguous tensors);
// others are walked by logical index through `StridedDesc` with a
// multiply-shift division per dimension. Plain C++ shared by the CPU loop,
// the CUDA launcher and the emulation harness.
#pragma once

#include <c10/macros/Macros.h>
#include <cstdint>

namespace hookcap {

// Dimensions a kernel walks; a view with more after merging (it then has
// at least 2**26 elements) is split by the host into one read per index of
// its outermost dimensions (DimPlan::outer).
constexpr int kMaxDims = 25;
constexpr int kMaxTensorDims = 64;

// High 64 bits of a * b (a portable shim over the CUDA intrinsic).
C10_HOST_DEVICE C10_ALWAYS_INLINE uint64_t umul64hi(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

struct StridedDesc {
  int64_t ndim;
  int64_t sizes[kMaxDims];    // outermost first
  int64_t strides[kMaxDims];  // in elements, > 0
  // i / sizes[k] == (umul64hi(i, magic[k]) + i) >> shift[k] for i < 2**63
  // (round-up multiply-shift division, Granlund & Montgomery 1994).
  uint64_t magic[kMaxDims];
  int32_t shift[kMaxDims];
};

inline void set_divisor(StridedDesc& d, int k, int64_t size) {
  int32_t l = 0;
  while ((uint64_t{1} << l) < static_cast<uint64_t>(size)) ++l;
  const unsigned __int128 num = static_cast<unsigned __int128>((uint64_t{1} << l) - static_cast<uint64_t>(size)) << 64;
  d.sizes[k] = size;
  d.magic[k] = static_cast<uint64_t>(num / static_cast<uint64_t>(size)) + 1;
  d.shift[k] = l;
}

// u / d.sizes[k] for u < 2**63.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint64_t div_dim(const StridedDesc& d, int64_t k, uint64_t u) {
  return (umul64hi(u, d.magic[k]) + u) >> d.shift[k];
}

// Storage offset (in elements) of logical index i of the walk (0 <= i < the
// product of sizes); the outermost dimension needs no division.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t strided_offset(const StridedDesc& d, int64_t i) {
  uint64_t u = static_cast<uint64_t>(i);
  int64_t off = 0;
  for (int64_t k = d.ndim - 1; k > 0; --k) {
    const uint64_t q = div_dim(d, k, u);
    off += static_cast<int64_t>(u - q * static_cast<uint64_t>(d.sizes[k])) * d.strides[k];
    u = q;
  }
  return d.ndim > 0 ? off + static_cast<int64_t>(u) * d.strides[0] : off;
}

// The read of one view: `visit` elements from the base pointer (flat, or
// through `desc`), each standing for `mult` logical elements; views with
// more than kMaxDims merged dimensions repeat that read at the storage
// offset of every index of the `nouter` outer dimensions.
struct DimPlan {
  bool flat;
  int64_t visit;
  int64_t mult;
  StridedDesc desc;
  int64_t nouter;
  int64_t outer_sizes[kMaxTensorDims];
  int64_t outer_strides[kMaxTensorDims];
};

// Plan the read of a view with `ndim` <= kMaxTensorDims dimensions (sizes
// >= 0, strides >= 0 as torch has them). `max_walk` (<= kMaxDims) is lowered
// only by tests, to split small views.
inline DimPlan plan_dims(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                         int64_t max_walk = kMaxDims) {
  DimPlan p{};
  p.mult = 1;
  int64_t sz[kMaxTensorDims], st[kMaxTensorDims];
  int64_t m = 0;
  for (int64_t k = 0; k < ndim; ++k) {
    if (sizes[k] == 0) {  // empty view: nothing to read
      p.flat = true;
      p.visit = 0;
      return p;
    }
    if (sizes[k] == 1) continue;
    if (strides[k] == 0) {
      p.mult *= sizes[k];
      continue;
    }
    // Insertion by stride, largest first; equal strides keep their order.
    int64_t j = m++;
    for (; j > 0 && st[j - 1] < strides[k]; --j) {
      sz[j] = sz[j - 1];
      st[j] = st[j - 1];
    }
    sz[j] = sizes[k];
    st[j] = strides[k];
  }
  int64_t r = 0;  // merged dims: an outer dim that steps over a whole inner one joins it
  for (int64_t k = 0; k < m; ++k) {
    if (r > 0 && st[r - 1] == st[k] * sz[k]) {
      sz[r - 1] *= sz[k];
      st[r - 1] = st[k];
    } else {
      sz[r] = sz[k];
      st[r] = st[k];
      ++r;
    }
  }
  if (r == 0 || (r == 1 && st[0] == 1)) {
    p.flat = true;
    p.visit = r == 0 ? 1 : sz[0];
    return p;
  }
  p.nouter = r > max_walk ? r - max_walk : 0;
  for (int64_t k = 0; k < p.nouter; ++k) {
    p.outer_sizes[k] = sz[k];
    p.outer_strides[k] = st[k];
  }
  p.desc.ndim = r - p.nouter;
  p.visit = 1;
  for (int64_t k = 0; k < p.desc.ndim; ++k) {
    set_divisor(p.desc, static_cast<int>(k), sz[p.nouter + k]);
    p.desc.strides[k] = st[p.nouter + k];
    p.visit *= sz[p.nouter + k];
  }
  return p;
}

// Storage offset, in vectors, of vector i of a kReadVectors walk: (row, vector
// in the row), the inner stride 1; one division.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t vector_offset(const StridedDesc& d, int64_t i) {
  const auto u = static_cast<uint64_t>(i);
  const uint64_t q = div_dim(d, 1, u);
  return static_cast<int64_t>(q) * d.strides[0] + static_cast<int64_t>(u - q * static_cast<uint64_t>(d.sizes[1]));
}

// How a kernel reads its elements: one contiguous run (16-byte vectors plus
// a scalar head and tail), 16-byte vectors through a descriptor in vector
// units (views whose innermost dimension is contiguous and whose rows start
// 16-byte aligned: slices of rows, splits of a last dimension, padded rows),
// or element by element through the descriptor.
enum ReadKind : int { kReadFlat = 0, kReadVectors = 1, kReadElements = 2 };

// What a kReadVectors walk leaves of rows that are not whole vectors (a row
// length such as a vocabulary's 50,257 with the row stride padded): the last
// sizes[1] (< one vector) elements of every row, read element by element
// through `desc` from element `offset` of each read's start. visit 0: none.
struct RowTails {
  int64_t offset = 0;
  int64_t visit = 0;
  StridedDesc desc{};
};

// For a strided plan read from `base` (each read's start: base plus a
// multiple of the outer strides), with elements of `elem_size` bytes: the
// same walk in 16-byte vectors in `vec` when it is two dimensions (rows, and
// the contiguous innermost one), every row starts 16-byte aligned and holds
// at least one whole vector (kReadVectors: the kernel's index is one division
// per vector), else kReadElements (vec untouched). Rows that end in part of
// a vector leave those elements to `tails`; tails.visit is 0 otherwise.
inline ReadKind vector_read(const DimPlan& p, int64_t elem_size, uintptr_t base, StridedDesc& vec,
                            RowTails& tails) {
  tails = RowTails{};
  if (p.flat) return kReadFlat;
  const int64_t per = 16 / elem_size;
  const StridedDesc& d = p.desc;  // [0] rows, [1] the innermost dimension
  if (d.ndim != 2 || base % 16 != 0 || d.strides[1] != 1 || d.strides[0] % per != 0 || d.sizes[1] < per) {
    return kReadElements;
  }
  for (int64_t k = 0; k < p.nouter; ++k) {
    if (p.outer_strides[k] % per != 0) return kReadElements;
  }
  const int64_t whole = d.sizes[1] / per, rest = d.sizes[1] % per;
  vec = d;
  vec.strides[0] = d.strides[0] / per;
  set_divisor(vec, 1, whole);
  if (rest != 0) {
    tails.offset = whole * per;
    tails.visit = d.sizes[0] * rest;
    tails.desc = d;
    set_divisor(tails.desc, 1, rest);
  }
  return kReadVectors;
}

// The kernel passes over a view read as `read` (after any narrowing of
// vector_read's choice): the plan's walk, counting the view once, then with
// kReadVectors its rows' tails by element, if any.
// f(kind, desc, skip (elements from each read's start), visit, counts).
template <typename F>
void for_each_pass(const DimPlan& p, ReadKind read, const StridedDesc& vec, const RowTails& tails, F&& f) {
  if (read != kReadVectors) {
    f(read, p.desc, int64_t{0}, p.visit, true);
    return;
  }
  f(kReadVectors, vec, int64_t{0}, p.visit - tails.visit, true);
  if (tails.visit > 0) f(kReadElements, tails.desc, tails.offset, tails.visit, false);
}

// f(storage offset, first) for each read of the plan: once at offset 0, or
// once per index of the outer dimensions.
template <typename F>
void for_each_read(const DimPlan& p, F&& f) {
  int64_t idx[kMaxTensorDims] = {};
  int64_t off = 0;
  bool first = true;
  while (true) {
    f(off, first);
    first = false;
    int64_t k = p.nouter - 1;  // odometer step, innermost outer dim first
    for (; k >= 0; --k) {
      off += p.outer_strides[k];
      if (++idx[k] < p.outer_sizes[k]) break;
      off -= idx[k] * p.outer_strides[k];
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

}  // namespace hookcap
