// CPU emulation (see cuda_runtime.h): fp16 as its bit pattern, converted with the library's
// own round-to-nearest-even conversions (src/core/scalar_convert.h).
#pragma once

#include <cstdint>

#include "core/scalar_convert.h"
#include "cuda_runtime.h"

struct __half {
  std::uint16_t bits;
};
inline float __half2float(__half h) { return fusednorm::detail::fp16_to_float(h.bits); }
inline __half __float2half_rn(float f) { return {fusednorm::detail::float_to_fp16(f)}; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
