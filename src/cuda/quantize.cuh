// The quantized forward's output step on the device (fusednorm.h, "Quantized RMSNorm"):
// the row's scale, and y -> int8 / FP8 E4M3FN bits. The scalar definitions these must
// match bit for bit are src/core/quantize.h's (the emulation's <cuda_fp8.h> maps to them;
// the GPU test compares the hardware's bits with the CPU backend's).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/quantize.h"
#include "cuda/kernel_args.h"
#include "cuda/norm_common.cuh"

namespace fusednorm::cuda {

// kVec quantized elements, stored as one access of kVec bytes.
template <int kVec>
struct QuantPack {
  using Raw = typename RawWord<kVec>::type;
  union {
    Raw raw;
    std::uint8_t bits[kVec];
  };
  __device__ __forceinline__ void store(void* p) const { *reinterpret_cast<Raw*>(p) = raw; }
};

// Round to nearest even, saturate to [-128, 127], NaN -> 0. cvt.rni.s32.f32 would also
// give 0 for NaN, but the clamp before it must not see NaN (fmaxf(NaN, -128) is -128), so
// NaN is tested first, explicitly.
__device__ __forceinline__ std::uint8_t quantize_int8(float v) {
  if (v != v) return 0;
  const float clamped = fminf(fmaxf(v, -128.0f), 127.0f);
  return static_cast<std::uint8_t>(static_cast<std::int8_t>(__float2int_rn(clamped)));
}

// y * inv_scale for kVec values, converted to the q dtype (a warp-uniform branch: one kernel
// serves int8 and FP8, which halves the quantized instantiations). FP8: the hardware's paired
// conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_89+; cuda_fp8.h emulates it below), round to
// nearest even, saturating to +-448, NaN -> NaN.
template <int kVec>
__device__ __forceinline__ void quantize_store(const float (&y)[kVec], float inv_scale, bool fp8,
                                               void* dst) {
  QuantPack<kVec> q;
  if (fp8) {
    if constexpr (kVec % 2 == 0) {
#pragma unroll
      for (int i = 0; i < kVec; i += 2) {
        const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(
            make_float2(y[i] * inv_scale, y[i + 1] * inv_scale), __NV_SATFINITE, __NV_E4M3);
        q.bits[i] = static_cast<std::uint8_t>(pair & 0xffu);  // .x in the low byte
        q.bits[i + 1] = static_cast<std::uint8_t>(pair >> 8);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        q.bits[i] = __nv_cvt_float_to_fp8(y[i] * inv_scale, __NV_SATFINITE, __NV_E4M3);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) q.bits[i] = quantize_int8(y[i] * inv_scale);
  }
  q.store(dst);
}

// A dynamic row's scale from its amax of |y| (NaN excluded): the host's formula.
__device__ __forceinline__ float dynamic_row_scale(float amax, const QuantArgs& quant) {
  return detail::dynamic_quant_scale(amax, quant.scale_upper_bound,
                                     quant.fp8 ? DType::kFloat8E4M3 : DType::kInt8);
}

}  // namespace fusednorm::cuda
