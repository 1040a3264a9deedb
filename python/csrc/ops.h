// The fusednorm PyTorch operators, device-neutral: each takes the fusednorm::Context its
// device's registration built (CPU threads, or the current CUDA stream) and calls the core.
// ops.cpp defines the schemas and registers these for CPU; ops_cuda.cpp for CUDA.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "fusednorm/fusednorm.h"

namespace fusednorm::torch_ext {

using OptTensor = std::optional<at::Tensor>;

at::Tensor rms_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                    double weight_offset);
void rms_norm_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                  double weight_offset, at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const Context& ctx, const at::Tensor& x,
                                                const OptTensor& weight, double eps,
                                                double weight_offset);
void rms_norm_fwd_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                      double weight_offset, at::Tensor& y, at::Tensor& rstd);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const Context& ctx, const at::Tensor& dy,
                                                     const at::Tensor& x, const OptTensor& weight,
                                                     const OptTensor& rstd, double eps,
                                                     double weight_offset, bool compute_dw,
                                                     const OptTensor& dx_addend);
at::Tensor fused_add_rms_norm(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                              const OptTensor& weight, double eps, double weight_offset);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_fwd(
    const Context& ctx, const at::Tensor& x, const at::Tensor& residual, const OptTensor& weight,
    double eps, double weight_offset);

// Two phases of RMSNorm over a row split by columns (tensor parallel): per-row fp32 partial
// sums of this slice, reduced by the caller, then the normalization / backward given them.
at::Tensor rms_norm_partial_sum_squares(const Context& ctx, const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> fused_add_partial_sum_squares(const Context& ctx,
                                                                 const at::Tensor& x,
                                                                 const at::Tensor& residual);
std::tuple<at::Tensor, at::Tensor> rms_norm_from_sum_squares(
    const Context& ctx, const at::Tensor& x, const OptTensor& weight, const at::Tensor& sum_squares,
    std::int64_t full_cols, double eps, double weight_offset);
at::Tensor rms_norm_backward_partial_sums(const Context& ctx, const at::Tensor& dy,
                                          const at::Tensor& x, const OptTensor& weight,
                                          const at::Tensor& rstd, double weight_offset);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_from_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& rstd, const at::Tensor& sum_g_xhat, std::int64_t full_cols,
    double weight_offset, bool compute_dw, const OptTensor& dx_addend);
void fused_add_rms_norm_out(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                            const OptTensor& weight, double eps, double weight_offset,
                            at::Tensor& out);
at::Tensor layer_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                      const OptTensor& bias, double eps);
void layer_norm_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                    const OptTensor& bias, double eps, at::Tensor& out);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const Context& ctx,
                                                              const at::Tensor& x,
                                                              const OptTensor& weight,
                                                              const OptTensor& bias, double eps);
void layer_norm_fwd_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                        const OptTensor& bias, double eps, at::Tensor& y, at::Tensor& mean,
                        at::Tensor& rstd);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const OptTensor& mean, const OptTensor& rstd, double eps, bool compute_dw, bool compute_db);

// Quantized RMSNorm (static scale or dynamic per token; see ops.cpp's schemas). The
// allocating forms return (q, per-token scales), the scales empty [0] in static mode.
std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const Context& ctx, const at::Tensor& x,
                                                  const OptTensor& weight, double eps,
                                                  double weight_offset, at::ScalarType dtype,
                                                  const OptTensor& scale,
                                                  const OptTensor& scale_ub);
void rms_norm_quant_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                        double eps, double weight_offset, const OptTensor& scale,
                        const OptTensor& scale_ub, at::Tensor& out, const OptTensor& row_scales);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_quant(
    const Context& ctx, const at::Tensor& x, at::Tensor& residual, const OptTensor& weight,
    double eps, double weight_offset, at::ScalarType dtype, const OptTensor& scale,
    const OptTensor& scale_ub);
void fused_add_rms_norm_quant_out(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                                  const OptTensor& weight, double eps, double weight_offset,
                                  const OptTensor& scale, const OptTensor& scale_ub,
                                  at::Tensor& out, const OptTensor& row_scales);

// LayerNorm's phases over a row split by columns, as RMSNorm's above.
at::Tensor layer_norm_partial_sums(const Context& ctx, const at::Tensor& x);
at::Tensor layer_norm_partial_squared_deviations(const Context& ctx, const at::Tensor& x,
                                                 const at::Tensor& row_sum, std::int64_t full_cols);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_from_sums(
    const Context& ctx, const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
    const at::Tensor& row_sum, const at::Tensor& row_sum_squared_deviations, std::int64_t full_cols,
    double eps);
std::tuple<at::Tensor, at::Tensor> layer_norm_backward_partial_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_from_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& sum_g,
    const at::Tensor& sum_g_xhat, std::int64_t full_cols, double eps, bool compute_dw,
    bool compute_db);

// Registers every operator for one dispatch key. DeviceScope is constructed from x for the
// duration of the call (a device guard on CUDA) and exposes the Context as `ctx`.
template <typename DeviceScope>
void register_kernels(torch::Library& m) {
  m.impl("rms_norm",
         [](const at::Tensor& x, const OptTensor& weight, double eps, double weight_offset) {
           DeviceScope scope(x);
           return rms_norm(scope.ctx, x, weight, eps, weight_offset);
         });
  m.impl("rms_norm_fwd",
         [](const at::Tensor& x, const OptTensor& weight, double eps, double weight_offset) {
           DeviceScope scope(x);
           return rms_norm_fwd(scope.ctx, x, weight, eps, weight_offset);
         });
  m.impl("rms_norm.out", [](const at::Tensor& x, const OptTensor& weight, double eps,
                            double weight_offset, at::Tensor& out) {
    DeviceScope scope(x);
    rms_norm_out(scope.ctx, x, weight, eps, weight_offset, out);
  });
  m.impl("rms_norm_fwd.out", [](const at::Tensor& x, const OptTensor& weight, double eps,
                                double weight_offset, at::Tensor& y, at::Tensor& rstd) {
    DeviceScope scope(x);
    rms_norm_fwd_out(scope.ctx, x, weight, eps, weight_offset, y, rstd);
  });
  m.impl("rms_norm_backward", [](const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
                                 const OptTensor& rstd, double eps, double weight_offset,
                                 bool compute_dw, const OptTensor& dx_addend) {
    DeviceScope scope(x);
    return rms_norm_backward(scope.ctx, dy, x, weight, rstd, eps, weight_offset, compute_dw,
                             dx_addend);
  });
  m.impl("fused_add_rms_norm", [](const at::Tensor& x, at::Tensor& residual,
                                  const OptTensor& weight, double eps, double weight_offset) {
    DeviceScope scope(x);
    return fused_add_rms_norm(scope.ctx, x, residual, weight, eps, weight_offset);
  });
  m.impl("fused_add_rms_norm_fwd", [](const at::Tensor& x, const at::Tensor& residual,
                                      const OptTensor& weight, double eps, double weight_offset) {
    DeviceScope scope(x);
    return fused_add_rms_norm_fwd(scope.ctx, x, residual, weight, eps, weight_offset);
  });
  m.impl("rms_norm_partial_sum_squares", [](const at::Tensor& x) {
    DeviceScope scope(x);
    return rms_norm_partial_sum_squares(scope.ctx, x);
  });
  m.impl("fused_add_partial_sum_squares", [](const at::Tensor& x, const at::Tensor& residual) {
    DeviceScope scope(x);
    return fused_add_partial_sum_squares(scope.ctx, x, residual);
  });
  m.impl("rms_norm_from_sum_squares",
         [](const at::Tensor& x, const OptTensor& weight, const at::Tensor& sum_squares,
            std::int64_t full_cols, double eps, double weight_offset) {
           DeviceScope scope(x);
           return rms_norm_from_sum_squares(scope.ctx, x, weight, sum_squares, full_cols, eps,
                                            weight_offset);
         });
  m.impl("rms_norm_backward_partial_sums",
         [](const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
            const at::Tensor& rstd, double weight_offset) {
           DeviceScope scope(x);
           return rms_norm_backward_partial_sums(scope.ctx, dy, x, weight, rstd, weight_offset);
         });
  m.impl("rms_norm_backward_from_sums",
         [](const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
            const at::Tensor& rstd, const at::Tensor& sum_g_xhat, std::int64_t full_cols,
            double weight_offset, bool compute_dw, const OptTensor& dx_addend) {
           DeviceScope scope(x);
           return rms_norm_backward_from_sums(scope.ctx, dy, x, weight, rstd, sum_g_xhat, full_cols,
                                              weight_offset, compute_dw, dx_addend);
         });
  m.impl("fused_add_rms_norm.out",
         [](const at::Tensor& x, at::Tensor& residual, const OptTensor& weight, double eps,
            double weight_offset, at::Tensor& out) {
           DeviceScope scope(x);
           fused_add_rms_norm_out(scope.ctx, x, residual, weight, eps, weight_offset, out);
         });
  m.impl("rms_norm_quant",
         [](const at::Tensor& x, const OptTensor& weight, double eps, double weight_offset,
            at::ScalarType dtype, const OptTensor& scale, const OptTensor& scale_ub) {
           DeviceScope scope(x);
           return rms_norm_quant(scope.ctx, x, weight, eps, weight_offset, dtype, scale, scale_ub);
         });
  m.impl("rms_norm_quant.out", [](const at::Tensor& x, const OptTensor& weight, double eps,
                                  double weight_offset, const OptTensor& scale,
                                  const OptTensor& scale_ub, at::Tensor& out,
                                  const OptTensor& row_scales) {
    DeviceScope scope(x);
    rms_norm_quant_out(scope.ctx, x, weight, eps, weight_offset, scale, scale_ub, out, row_scales);
  });
  m.impl("fused_add_rms_norm_quant",
         [](const at::Tensor& x, at::Tensor& residual, const OptTensor& weight, double eps,
            double weight_offset, at::ScalarType dtype, const OptTensor& scale,
            const OptTensor& scale_ub) {
           DeviceScope scope(x);
           return fused_add_rms_norm_quant(scope.ctx, x, residual, weight, eps, weight_offset,
                                           dtype, scale, scale_ub);
         });
  m.impl("fused_add_rms_norm_quant.out",
         [](const at::Tensor& x, at::Tensor& residual, const OptTensor& weight, double eps,
            double weight_offset, const OptTensor& scale, const OptTensor& scale_ub,
            at::Tensor& out, const OptTensor& row_scales) {
           DeviceScope scope(x);
           fused_add_rms_norm_quant_out(scope.ctx, x, residual, weight, eps, weight_offset, scale,
                                        scale_ub, out, row_scales);
         });
  m.impl("layer_norm.out", [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                              double eps, at::Tensor& out) {
    DeviceScope scope(x);
    layer_norm_out(scope.ctx, x, weight, bias, eps, out);
  });
  m.impl("layer_norm_fwd.out",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
            at::Tensor& y, at::Tensor& mean, at::Tensor& rstd) {
           DeviceScope scope(x);
           layer_norm_fwd_out(scope.ctx, x, weight, bias, eps, y, mean, rstd);
         });
  m.impl("layer_norm",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
           DeviceScope scope(x);
           return layer_norm(scope.ctx, x, weight, bias, eps);
         });
  m.impl("layer_norm_fwd",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
           DeviceScope scope(x);
           return layer_norm_fwd(scope.ctx, x, weight, bias, eps);
         });
  m.impl("layer_norm_backward", [](const at::Tensor& dy, const at::Tensor& x,
                                   const OptTensor& weight, const OptTensor& mean,
                                   const OptTensor& rstd, double eps, bool compute_dw,
                                   bool compute_db) {
    DeviceScope scope(x);
    return layer_norm_backward(scope.ctx, dy, x, weight, mean, rstd, eps, compute_dw, compute_db);
  });
  m.impl("layer_norm_partial_sums", [](const at::Tensor& x) {
    DeviceScope scope(x);
    return layer_norm_partial_sums(scope.ctx, x);
  });
  m.impl("layer_norm_partial_squared_deviations",
         [](const at::Tensor& x, const at::Tensor& row_sum, std::int64_t full_cols) {
           DeviceScope scope(x);
           return layer_norm_partial_squared_deviations(scope.ctx, x, row_sum, full_cols);
         });
  m.impl("layer_norm_from_sums",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
            const at::Tensor& row_sum, const at::Tensor& row_sum_squared_deviations,
            std::int64_t full_cols, double eps) {
           DeviceScope scope(x);
           return layer_norm_from_sums(scope.ctx, x, weight, bias, row_sum,
                                       row_sum_squared_deviations, full_cols, eps);
         });
  m.impl("layer_norm_backward_partial_sums",
         [](const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
            const at::Tensor& mean, const at::Tensor& rstd) {
           DeviceScope scope(x);
           return layer_norm_backward_partial_sums(scope.ctx, dy, x, weight, mean, rstd);
         });
  m.impl(
      "layer_norm_backward_from_sums",
      [](const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight, const at::Tensor& mean,
         const at::Tensor& rstd, const at::Tensor& sum_g, const at::Tensor& sum_g_xhat,
         std::int64_t full_cols, double eps, bool compute_dw, bool compute_db) {
        DeviceScope scope(x);
        return layer_norm_backward_from_sums(scope.ctx, dy, x, weight, mean, rstd, sum_g,
                                             sum_g_xhat, full_cols, eps, compute_dw, compute_db);
      });
}

}  // namespace fusednorm::torch_ext
