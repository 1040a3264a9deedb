// CPU emulation (see cuda_runtime.h): bf16 as its bit pattern, converted with the library's
// own round-to-nearest-even conversions (src/core/scalar_convert.h).
#pragma once

#include <cstdint>

#include "core/scalar_convert.h"
#include "cuda_runtime.h"

struct __nv_bfloat16 {
  std::uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) { return fusednorm::detail::bf16_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {fusednorm::detail::float_to_bf16(f)}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
