// One warp's 16 x 16 product of two 16-bit tiles with float32 accumulation:
// tensor cores (nvcuda::wmma, a CUDA C++ API) under nvcc; under the CPU
// emulation harness (HOOKCAP_CUDA_EMU) each lane computes 8 of the 256
// sums itself, in float. Every product of two bfloat16 or float16 values is
// exact in float32; only the order of the additions differs between the two.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#ifndef HOOKCAP_CUDA_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#endif

#include <type_traits>

namespace hookcap {
namespace kernels {

#ifndef HOOKCAP_CUDA_EMU
template <typename T>
struct MmaType;
template <>
struct MmaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct MmaType<c10::Half> {
  using type = __half;
};

template <typename T>
__device__ __forceinline__ void wmma_abt(const T* a, int lda, const T* b, int ldb, int kdim, float* c, int ldc) {
  namespace w = nvcuda::wmma;
  using M = typename MmaType<T>::type;
  w::fragment<w::accumulator, 16, 16, 16, float> acc;
  w::fill_fragment(acc, 0.f);
  for (int k = 0; k < kdim; k += 16) {
    w::fragment<w::matrix_a, 16, 16, 16, M, w::row_major> fa;
    w::fragment<w::matrix_b, 16, 16, 16, M, w::col_major> fb;  // b^T, column-major: b's rows
    w::load_matrix_sync(fa, reinterpret_cast<const M*>(a + k), lda);
    w::load_matrix_sync(fb, reinterpret_cast<const M*>(b + k), ldb);
    w::mma_sync(acc, fa, fb, acc);
  }
  w::store_matrix_sync(c, acc, ldc, w::mem_row_major);
  __syncwarp();
}
#endif

// c[16 x 16] (row-major, ldc floats) = a[16 x kdim] . b[16 x kdim]^T, with a
// and b row-major (lda, ldb elements, multiples of 8; rows 32-byte aligned),
// kdim a multiple of 16, in shared memory. Every lane of the warp calls it;
// c is visible to the whole warp on return. bfloat16 needs sm_80.
template <typename T>
__device__ __forceinline__ void warp_mma_abt(const T* a, int lda, const T* b, int ldb, int kdim, float* c,
                                             int ldc) {
#ifdef HOOKCAP_CUDA_EMU
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int e = lane; e < 256; e += 32) {
    const int i = e / 16, j = e % 16;
    float s = 0.f;
    for (int k = 0; k < kdim; ++k) s += static_cast<float>(a[i * lda + k]) * static_cast<float>(b[j * ldb + k]);
    c[i * ldc + j] = s;
  }
  __syncwarp();
#else
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __trap();  // the launcher takes this path on sm_80 and later only
  } else {
    wmma_abt(a, lda, b, ldb, kdim, c, ldc);
  }
#else
  wmma_abt(a, lda, b, ldb, kdim, c, ldc);
#endif
#endif
}

}  // namespace kernels
}  // namespace hookcap
