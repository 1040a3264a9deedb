// CPU emulation (see cuda_runtime.h): the FP8 conversions the kernels use, mapped to the
// library's scalar quantizer (src/core/quantize.h), so that the emulated kernels' FP8 bits
// are quantize.h's by construction. Whether the hardware's cvt.rn.satfinite.e4m3x2.f32 (and
// sm_80's software path in the toolkit's cuda_fp8.hpp) gives the same bits is checked on a
// GPU: tests/cuda/cuda_ops_test.cpp compares the CUDA backend's q with the CPU backend's.
#pragma once

#include <cstdint>

#include "core/quantize.h"
#include "cuda_runtime.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

// Only what the kernels use is emulated: E4M3 with saturation to the finite range.
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                __nv_fp8_interpretation_t interpretation) {
  if (saturate != __NV_SATFINITE || interpretation != __NV_E4M3) cuda_emu::trap();
  return fusednorm::detail::float_to_e4m3_saturate(x);
}

// .x in the low byte, .y in the high byte (as the toolkit's cvt ... e4m3x2 %0, y, x).
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t saturate,
                                                     __nv_fp8_interpretation_t interpretation) {
  const unsigned lo = __nv_cvt_float_to_fp8(x.x, saturate, interpretation);
  const unsigned hi = __nv_cvt_float_to_fp8(x.y, saturate, interpretation);
  return static_cast<__nv_fp8x2_storage_t>(lo | (hi << 8));
}
