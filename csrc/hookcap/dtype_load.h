// Element load + widening to double, shared by CPU, CUDA and emulation.
// fp16/bf16/fp8 widen exactly through float; float and double are exact too,
// so every statistic sees the true value of each element.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace hookcap {

template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE double load_double(const T* p) {
  return static_cast<double>(static_cast<float>(*p));
}

template <>
C10_HOST_DEVICE C10_ALWAYS_INLINE double load_double<double>(const double* p) {
  return *p;
}

// Load in the CPU fast path's working precision: float for every type of
// 32 bits or fewer (exact), double for double.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE float load_float(const T* p) {
  return static_cast<float>(*p);
}

}  // namespace hookcap
