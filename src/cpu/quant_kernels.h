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

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/row_kernels.h"

namespace fusednorm::cpu {

// max |y| over the non-NaN y of a row or piece (0 if none), and whether any y was NaN.
struct RowAmax {
  float amax;
  bool has_nan;
};
// y[j] = x[j] * rstd [* (w[j] + w_offset)] (fp32) for j < n, and their RowAmax.
// ahead (here and in NormalizeQuantizeFn): the row this thread reads next, at the same
// element offsets as x, fetched into L2 one line per vector of x while this row (in L1) is
// worked on, as row_kernels.h's NormalizeFn does; nullptr: no next row. Values unchanged.
using NormalizeAmaxFn = RowAmax (*)(const void* x, const void* w, float* y, std::int64_t n,
                                    float rstd, float w_offset, const void* ahead);
// Static scale: q[j] = quantize(y[j] * inv_scale) with y[j] as NormalizeAmaxFn computes it,
// never stored; w: none or prepared (normalize_amax_prepared's), j < n. For rows where no
// y[j] * inv_scale can be NaN (skips the NaN select): x, rstd, the prepared weight and
// inv_scale all finite, as they are when the row's sum of squares is finite (x^2 would
// overflow first) and all_finite holds for the weight (a y that overflows to Inf
// saturates). Other rows go through normalize_amax and quantize.
using NormalizeQuantizeFn = void (*)(const void* x, const void* w, void* q, std::int64_t n,
                                     float rstd, float inv_scale, const void* ahead);
// q[j] = quantize(y[j] * inv_scale) with quantize.h's saturating conversion, j < n.
using QuantizeFn = void (*)(const float* y, void* q, std::int64_t n, float inv_scale);
// The quantizing kernels (quantize, quantize_in_range, normalize_quantize) come in two store
// kinds, their tables' first index: 0 ordinary stores; 1 streamed, for a q too large for the
// caches: q's whole 64-byte lines go out with non-temporal stores (same values), and the
// caller fences before q is read (cpu_backend.cpp's parallel_for does).

struct QuantKernels {
  // [x DType][weight ParamType]; for fp32 rows kFloat32Param and kElementParam are the same.
  NormalizeAmaxFn normalize_amax[3][3];
  // [x DType], w: fp32 (w + w_offset), computed by the caller exactly as the kernels above
  // add it; w_offset is ignored. For calls of many rows: the weight is then converted once.
  NormalizeAmaxFn normalize_amax_prepared[3];
  QuantizeFn quantize[2][2];  // [streamed][0: int8, 1: float8 e4m3]
  // The same bits as quantize for values that are finite with |v| <= qmax * (1 + 2^-20),
  // which is all a dynamic scale's row gives when none of its y is NaN or Inf and the scale
  // is not bounded by scale_ub (quant_in_range): y * (1 / (amax / qmax)) exceeds qmax by at
  // most three fp32 roundings, and such values round to qmax. Skips the NaN and saturation
  // work: callgrind, PERFORMANCE.md "seventh session".
  QuantizeFn quantize_in_range[2][2];  // [streamed][quant_index]
  // [streamed][x DType][0: no weight, 1: prepared weight][quant_index]
  NormalizeQuantizeFn normalize_quantize[2][3][2][2];
  bool (*all_finite)(const float* v, std::int64_t n);
  const char* target_name;
};

inline int quant_index(DType q_dtype) { return q_dtype == DType::kFloat8E4M3 ? 1 : 0; }

// Whether a dynamic-scale row may go through quantize_in_range: no NaN y, a finite amax, and
// a scale from the amax itself (a scale_ub below it would make values saturate; a scale
// floored at min_scale only makes them smaller).
inline bool quant_in_range(const RowAmax& row, const float* scale_upper_bound) {
  return !row.has_nan && std::isfinite(row.amax) &&
         (scale_upper_bound == nullptr || row.amax <= *scale_upper_bound);
}

// The kernels of the target row_kernels() runs (FUSEDNORM_CPU_TARGET honoured).
const QuantKernels& quant_kernels();

// Tests: the kernels of every target compiled into this binary that this CPU can run.
struct TargetQuantKernels {
  const char* name;
  QuantKernels kernels;
};
std::vector<TargetQuantKernels> quant_kernels_for_all_supported_targets();

}  // namespace fusednorm::cpu
