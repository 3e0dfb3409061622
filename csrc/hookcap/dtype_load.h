// Element load + widening to double, shared by CPU, CUDA and emulation.
// fp16/bf16/fp8 widen exactly through float; float and double are exact too,
// so every statistic sees the true value of each element.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace hookcap {

C10_HOST_DEVICE C10_ALWAYS_INLINE float float_of_bits(uint32_t b) {
  float v;
  memcpy(&v, &b, sizeof(v));
  return v;
}

// fp8 -> float, exact and branch-free (a few integer ops and one multiply,
// where the generic conversion normalises subnormals in a loop): the
// exponent and mantissa bits placed at the top of float's exponent field
// give the value times 2**-(127 - bias), subnormals as float subnormals
// (exact: neither the builds nor the kernels flush them), and one multiply
// rebiases. NaN (and e5m2's Inf) patterns are selected.
C10_HOST_DEVICE C10_ALWAYS_INLINE float fp8_e4m3fn_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const float f = float_of_bits(((b & 0x80u) << 24) | (mag << 20)) * 0x1p120f;
  return mag == 0x7fu ? float_of_bits(0x7fc00000u) : f;
}

C10_HOST_DEVICE C10_ALWAYS_INLINE float fp8_e5m2_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7fu, sign = (b & 0x80u) << 24;
  const float f = float_of_bits(sign | (mag << 21)) * 0x1p112f;
  return mag < 0x7cu ? f : float_of_bits(sign | (mag == 0x7cu ? 0x7f800000u : 0x7fc00000u));
}

// Any element type widened to float (exact for every type of 32 bits or fewer).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE float widen_float(T v) {
  return static_cast<float>(v);
}
template <>
C10_HOST_DEVICE C10_ALWAYS_INLINE float widen_float<c10::Float8_e4m3fn>(c10::Float8_e4m3fn v) {
  return fp8_e4m3fn_to_float(v.x);
}
template <>
C10_HOST_DEVICE C10_ALWAYS_INLINE float widen_float<c10::Float8_e5m2>(c10::Float8_e5m2 v) {
  return fp8_e5m2_to_float(v.x);
}

// An element in the working type W of the CUDA kernel (double for double
// input, float otherwise).
template <typename W, typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE W widen(T v) {
  if constexpr (sizeof(W) == sizeof(double)) {
    return static_cast<W>(v);
  } else {
    return widen_float(v);
  }
}

template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE double load_double(const T* p) {
  return static_cast<double>(widen_float(*p));
}

template <>
C10_HOST_DEVICE C10_ALWAYS_INLINE double load_double<double>(const double* p) {
  return *p;
}

// Load in the CPU fast path's working precision: float for every type of
// 32 bits or fewer (exact), double for double.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE float load_float(const T* p) {
  return widen_float(*p);
}

}  // namespace hookcap
