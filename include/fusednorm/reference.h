// The fp64 scalar reference of every fusednorm operator: the definition the backends are
// tested against and the benchmark checks its results with. Inputs are read through the
// same views as the real operators (strides honoured); results are unrounded doubles in
// contiguous rows x cols order, except `residual`, which is what the fused add stores
// (rounded to the dtype) because the normalization is defined on the stored value.
#pragma once

#include <vector>

#include "fusednorm/fusednorm.h"

namespace fusednorm::reference {

struct ForwardResult {
  std::vector<double> y;
  std::vector<double> residual;  // fused add only
  std::vector<double> mean;      // LayerNorm only
  std::vector<double> rstd;
};

struct BackwardResult {
  std::vector<double> dx;
  std::vector<double> dw;  // empty without weight
  std::vector<double> db;  // LayerNorm with bias gradient only
  // Per row: rstd * max_j |g_j| (g = dy * weight), the size of the terms whose difference dx
  // is. dx cancels (D = 1 makes it eps-small), so an fp32 dx's error is judged against
  // this scale, not against |dx| itself.
  std::vector<double> dx_scale;
};

ForwardResult rms_norm(ConstMatrix x, ConstVector weight, const RmsNormOptions& options = {});
ForwardResult fused_add_rms_norm(ConstMatrix x, ConstMatrix residual, ConstVector weight,
                                 const RmsNormOptions& options = {});
ForwardResult layer_norm(ConstMatrix x, ConstVector weight, ConstVector bias,
                         const LayerNormOptions& options = {});

// rstd / mean are recomputed in fp64 from x. dx_addend (nullable data) is added to dx (the
// fused add's backward); dx_scale then also covers max |dx_addend| of the row.
BackwardResult rms_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                 const RmsNormOptions& options = {}, ConstMatrix dx_addend = {});
BackwardResult layer_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight, bool want_db,
                                   const LayerNormOptions& options = {});

// The two-phase (column-sliced) RMSNorm's phase-1 sums, per row: sum of x^2, and sum of
// g * x_hat with g = dy * (w + offset), x_hat = x * rstd[r] (rstd given as the library's fp32).
std::vector<double> row_sum_squares(ConstMatrix x);
std::vector<double> row_sum_g_xhat(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                   const float* rstd, const RmsNormOptions& options = {});

// The quantized operators (fusednorm.h, "Quantized RMSNorm") in fp64: y, the scale and
// y / scale unrounded, so that a test can tell a rounding-boundary case from an error.
struct QuantResult {
  std::vector<double> y;         // rows x cols, the norm's output before quantization
  std::vector<double> residual;  // fused add only: the stored (rounded) residual
  // Per row: the static scale, or the dynamic one from the fp64 amax (bounded by
  // scale_upper_bound, divided by qmax, floored at the dtype's min_scale).
  std::vector<double> scale;
  std::vector<double> q_exact;  // rows x cols: y / scale, before rounding and saturation
};

// residual.data == nullptr: rms_norm_quant; otherwise fused_add_rms_norm_quant. q_dtype is
// DType::kInt8 or DType::kFloat8E4M3; static_scale == nullptr means dynamic per token, and
// scale_upper_bound (nullable) then bounds each row's amax. Pointers are host pointers.
QuantResult rms_norm_quant(ConstMatrix x, ConstMatrix residual, ConstVector weight, DType q_dtype,
                           const float* static_scale, const float* scale_upper_bound,
                           const RmsNormOptions& options = {});

}  // namespace fusednorm::reference
