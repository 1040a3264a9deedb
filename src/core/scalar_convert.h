// Scalar fp16 / bf16 <-> fp32 conversions, round to nearest even, NaN and Inf preserved.
// The one place these bit manipulations live: the reference, the scalar paths of every
// backend, the tests and the benchmark all use them.
#pragma once

#include <cstdint>
#include <cstring>

#include "fusednorm/fusednorm.h"

namespace fusednorm::detail {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t{h} << 16); }

inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN after truncation
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u | ((abs_bits >> 13) & 0x3ffu);  // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero) in fp16: let fp32 arithmetic do the rounding by adding
    // a magic number whose ulp is the fp16 subnormal step 2^-24.
    const float magic = bits_float(0x3f000000u);  // 0.5: ulp 2^-24
    const float sum = bits_float(abs_bits) + magic;
    return sign | static_cast<std::uint16_t>(float_bits(sum) - 0x3f000000u);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t rebased = abs_bits - ((127u - 15u) << 23);
  const std::uint32_t rounding_bias = 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rebased + rounding_bias) >> 13);
}

// OCP FP8 E4M3FN bits -> fp32 (exact). The other direction, a quantization, is in quantize.h.
inline float e4m3_to_float(std::uint8_t b) {
  const std::uint32_t sign = std::uint32_t{b & 0x80u} << 24;
  const std::uint32_t exponent = (b >> 3) & 0xfu;
  const std::uint32_t mantissa = b & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // m * 2^-9, exact
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Load element i of a buffer of the given dtype as fp32.
inline float load_as_float(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DType::kFloat16:
      return fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::kInt8:
      return static_cast<float>(static_cast<const std::int8_t*>(data)[i]);
    case DType::kFloat8E4M3:
      return e4m3_to_float(static_cast<const std::uint8_t*>(data)[i]);
    case DType::kFloat64:
      return static_cast<float>(static_cast<const double*>(data)[i]);
  }
  return 0.0f;
}

// Load element i as a double: exact for every dtype (float64 included, which
// load_as_float would round).
inline double load_as_double(const void* data, DType dtype, std::int64_t i) {
  if (dtype == DType::kFloat64) return static_cast<const double*>(data)[i];
  return load_as_float(data, dtype, i);
}

// Store an fp32 value as element i, rounding once to the dtype.
inline void store_from_float(void* data, DType dtype, std::int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(data)[i] = value;
      return;
    case DType::kFloat16:
      static_cast<std::uint16_t*>(data)[i] = float_to_fp16(value);
      return;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(data)[i] = float_to_bf16(value);
      return;
    case DType::kInt8:
    case DType::kFloat8E4M3:
      return;  // quantized outputs are stored by quantize.h's saturating conversions only
    case DType::kFloat64:
      static_cast<double*>(data)[i] = value;
      return;
  }
}

// The value an fp32 number takes once stored in the dtype.
inline float round_to_dtype(float value, DType dtype) {
  std::uint16_t bits;
  switch (dtype) {
    case DType::kFloat32:
      return value;
    case DType::kFloat16:
      bits = float_to_fp16(value);
      break;
    case DType::kBFloat16:
      bits = float_to_bf16(value);
      break;
    default:
      return value;
  }
  return load_as_float(&bits, dtype, 0);
}

}  // namespace fusednorm::detail
