// Arguments of the CUDA kernels: device pointers and scalars of one call, passed by value.
// Plain C++ so that the host side (cuda_backend.cu) needs no kernel headers.
#pragma once

#include <cstdint>

namespace fusednorm::cuda {

// The quantized forward's output (fusednorm.h's QuantScale; RMSNorm only): q replaces y.
struct QuantArgs {
  void* q;  // rows x cols bytes, int8 or FP8 E4M3FN
  std::int64_t q_stride;
  bool fp8;                   // FP8 E4M3FN, else int8
  const float* static_scale;  // device pointer, read in the kernel (CUDA graphs); null: dynamic
  float* row_scales;          // dynamic: one fp32 scale per row
  const float* scale_upper_bound;  // dynamic, nullable: bounds each row's amax
};

// Device pointers and scalars of one forward call, passed by value to every kernel.
struct ForwardArgs {
  bool centered;  // LayerNorm
  const void* x;
  std::int64_t x_stride;
  void* residual;  // fused add only
  std::int64_t residual_stride;
  void* y;
  std::int64_t y_stride;
  const void* weight;  // nullable; x's dtype or fp32
  bool weight_f32;
  const void* bias;  // nullable (LayerNorm); x's dtype or fp32
  bool bias_f32;
  float* mean;  // nullable
  float* rstd;  // nullable
  std::int64_t rows;
  std::int64_t cols;
  float eps;
  float weight_offset;
  // Two-phase calls (two-pass row kernel only; fusednorm.h's phased operators). Phase 1
  // writes one fp32 per row to partial_sums and no y: RMSNorm's sum of squares (of the
  // updated residual for the fused add); LayerNorm's sum of x, or with row_sum given its sum
  // of squared deviations from the whole row's mean. Phase 2 takes the whole row's sums over
  // full_cols: RMSNorm's row_sum_squares; LayerNorm's row_sum and row_sum_squared_deviations.
  float* partial_sums;
  const float* row_sum_squares;
  const float* row_sum;
  const float* row_sum_squared_deviations;
  std::int64_t full_cols;
  QuantArgs quant;  // used by the quantized kernels (ForwardVariant::kQuant) only
};

struct BackwardArgs {
  bool centered;  // LayerNorm
  const void* dy;
  std::int64_t dy_stride;
  const void* x;
  std::int64_t x_stride;
  const void* weight;  // nullable; x's dtype or fp32
  bool weight_f32;
  const float* mean;  // nullable: recomputed from x (LayerNorm: given with rstd or not at all)
  const float* rstd;  // nullable: recomputed from x
  void* dx;           // nullable: dx not wanted; may equal dy (same view)
  std::int64_t dx_stride;
  const void* dx_addend;  // nullable (RMSNorm): added to dx before rounding; may be dx or dy
  std::int64_t dx_addend_stride;
  float* dw_partial;  // nullable: [partial_slots][cols]
  float* db_partial;  // nullable: [partial_slots][cols]
  float* coef;  // two-pass path: per row {mean, rstd, mean(g), mean(g * x_hat)}, 16-byte aligned
  std::int64_t rows;
  std::int64_t cols;
  float eps;
  float weight_offset;
  // Two-phase calls (two-pass kernels only). Phase 1: each row's sum of g * x_hat goes to
  // partial_sum_g_xhat (LayerNorm: and its sum of g to partial_sum_g), nothing else is
  // written. Phase 2: those sums over the whole row are row_sum_g_xhat[row] (and
  // row_sum_g[row]), over full_cols.
  float* partial_sum_g_xhat;
  float* partial_sum_g;
  const float* row_sum_g_xhat;
  const float* row_sum_g;
  std::int64_t full_cols;
};

// Matches fusednorm::DType's values.
enum class OutDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace fusednorm::cuda
