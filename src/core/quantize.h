// The quantization step of the quantized operators (fusednorm.h, "Quantized RMSNorm"),
// scalar, in one place: the reference, the CPU backend's scalar paths, the CUDA emulation's
// <cuda_fp8.h>, the tests and the benchmark all use these. The CPU's SIMD kernels must give
// the same bits (tested on every target).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/scalar_convert.h"

// The scale formula below runs on the host and in the CUDA kernels (src/cuda/quantize.cuh),
// so that both backends compute a dynamic scale from one definition. (The CUDA emulation
// compiles the kernels as host code: __CUDACC__ is not defined there.)
#if defined(__CUDACC__)
#define FUSEDNORM_HOST_DEVICE __host__ __device__
#else
#define FUSEDNORM_HOST_DEVICE
#endif

namespace fusednorm::detail {

constexpr float kInt8Max = 127.0f;
constexpr float kFloat8E4M3Max = 448.0f;
// The floor of a dynamic per-token scale (vLLM's values, so that scales agree with its
// kernels): keeps 1 / scale finite and makes an all-zero row quantize to zeros.
constexpr float kInt8MinScale = FLT_EPSILON;
constexpr float kFloat8E4M3MinScale = 1.0f / (448.0f * 512.0f);

FUSEDNORM_HOST_DEVICE inline float quant_max(DType q_dtype) {
  return q_dtype == DType::kFloat8E4M3 ? kFloat8E4M3Max : kInt8Max;
}
FUSEDNORM_HOST_DEVICE inline float quant_min_scale(DType q_dtype) {
  return q_dtype == DType::kFloat8E4M3 ? kFloat8E4M3MinScale : kInt8MinScale;
}

// A row's dynamic per-token scale from the max |y| of its non-NaN values (fusednorm.h):
// bounded by *upper_bound when given, divided by qmax (an IEEE division on both backends:
// nvcc's default -prec-div=true), floored at min_scale; fp32 throughout.
FUSEDNORM_HOST_DEVICE inline float dynamic_quant_scale(float amax, const float* upper_bound,
                                                       DType q_dtype) {
  if (upper_bound != nullptr) amax = fminf(amax, *upper_bound);
  return fmaxf(amax / quant_max(q_dtype), quant_min_scale(q_dtype));
}

// What a static scale needs beyond "finite and > 0": q = y * (1 / scale) (fusednorm.h), and
// from about 2^-128 down that fp32 reciprocal is Inf (y = 0 would give 0 * Inf = NaN). The
// host checks of the core (validate.cpp) and of the PyTorch binding both use these.
inline bool static_scale_reciprocal_is_finite(float scale) { return std::isfinite(1.0f / scale); }
inline std::string static_scale_reciprocal_error(float scale) {
  char value[32];
  std::snprintf(value, sizeof value, "%g", static_cast<double>(scale));
  return std::string(
             "must exceed about 2.94e-39 (2^-128) so that 1 / scale is finite in fp32, "
             "got ") +
         value;
}

// Round to nearest even and saturate to [-128, 127]; NaN -> 0 (what CUDA's
// cvt.rni.sat.s8.f32 does).
inline std::int8_t float_to_int8_saturate(float v) {
  if (std::isnan(v)) return 0;
  const float clamped = std::fmin(std::fmax(v, -128.0f), 127.0f);
  // Adding and subtracting 1.5 * 2^23 rounds |clamped| <= 128 to an integer, to nearest even.
  const float rounded = (clamped + 12582912.0f) - 12582912.0f;
  return static_cast<std::int8_t>(rounded);
}

// fp32 -> OCP FP8 E4M3FN bits: round to nearest even (subnormals included), saturate to
// +-448 (Inf too), NaN -> the canonical NaN 0x7f whatever its sign. What CUDA's
// __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) does: its software path (sm_80)
// canonicalises a NaN before converting, and sm_89+'s cvt.rn.satfinite.e4m3x2.f32 returns
// the canonical NaN.
inline std::uint8_t float_to_e4m3_saturate(float v) {
  const std::uint32_t u = float_bits(v);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7fu;          // NaN
  if (abs_bits >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and Inf): saturate to 448
  if (abs_bits < 0x3c800000u) {
    // Below 2^-6, the smallest normal: the result is m * 2^-9. Adding 2^14 (whose fp32 ulp
    // is 2^-9) lets the fp32 adder round to nearest even; m = 8 is 2^-6, encoded 0x08.
    const float magic = 16384.0f;
    const float sum = bits_float(abs_bits) + magic;
    return sign | static_cast<std::uint8_t>(float_bits(sum) - float_bits(magic));
  }
  // Normal: round the 20 dropped mantissa bits to nearest even, then rebias the exponent
  // (127 -> 7). Below 448 nothing rounds past 448.
  const std::uint32_t rounded = abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u);
  return sign | static_cast<std::uint8_t>((rounded >> 20) - (120u << 3));
}

}  // namespace fusednorm::detail
