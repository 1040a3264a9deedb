// Per-row kernels of the quantized RMSNorm (fusednorm.h, "Quantized RMSNorm"), written once
// against Highway's portable vectors (quant_kernels.cc, its own translation unit so that
// the row kernels' compile time does not grow) and compiled for every SIMD target.
//
// A row's statistics (sum of squares, the fused add's residual update) come from
// row_kernels.h's kernels, so y's rstd has rms_norm's bits; normalize_amax then computes
// y = x * rstd [* (w + w_offset)] exactly as row_kernels' normalize does, into an fp32
// staging buffer (with the amax), and quantize turns staged y into q. The caller
// (cpu_backend.cpp) owns rows, staging, scales and threads.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/row_kernels.h"

namespace fusednorm::cpu {

// y[j] = x[j] * rstd [* (w[j] + w_offset)] (fp32) for j < n; returns max_j |y[j]| over the
// non-NaN y (0 if none).
using NormalizeAmaxFn = float (*)(const void* x, const void* w, float* y, std::int64_t n,
                                  float rstd, float w_offset);
// Static scale: q[j] = quantize(y[j] * inv_scale) with y[j] as NormalizeAmaxFn computes it,
// never stored; w: none or prepared (normalize_amax_prepared's), j < n.
using NormalizeQuantizeFn = void (*)(const void* x, const void* w, void* q, std::int64_t n,
                                     float rstd, float inv_scale);
// q[j] = quantize(y[j] * inv_scale) with quantize.h's saturating conversion, j < n.
using QuantizeFn = void (*)(const float* y, void* q, std::int64_t n, float inv_scale);

struct QuantKernels {
  // [x DType][weight ParamType]; for fp32 rows kFloat32Param and kElementParam are the same.
  NormalizeAmaxFn normalize_amax[3][3];
  // [x DType], w: fp32 (w + w_offset), computed by the caller exactly as the kernels above
  // add it; w_offset is ignored. For calls of many rows: the weight is then converted once.
  NormalizeAmaxFn normalize_amax_prepared[3];
  QuantizeFn quantize[2];  // [0: int8, 1: float8 e4m3]
  // [x DType][0: no weight, 1: prepared weight][quant_index]
  NormalizeQuantizeFn normalize_quantize[3][2][2];
  const char* target_name;
};

inline int quant_index(DType q_dtype) { return q_dtype == DType::kFloat8E4M3 ? 1 : 0; }

// The kernels of the target row_kernels() runs (FUSEDNORM_CPU_TARGET honoured).
const QuantKernels& quant_kernels();

// Tests: the kernels of every target compiled into this binary that this CPU can run.
struct TargetQuantKernels {
  const char* name;
  QuantKernels kernels;
};
std::vector<TargetQuantKernels> quant_kernels_for_all_supported_targets();

}  // namespace fusednorm::cpu
