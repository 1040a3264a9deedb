// fusednorm as PyTorch operators: the schemas (TORCH_LIBRARY), the device-neutral bodies and
// the CPU registration. Fake (meta) kernels are registered from Python (fusednorm/_meta.py,
// loaded by `import fusednorm`); set_python_module below names it, and torch checks that
// they are registered from there. Autograd is registered in C++ (autograd.cpp).
//
// Conventions shared by every operator:
//  - x is [..., D]; outputs are new contiguous tensors with x's shape and dtype; per-row
//    statistics (rstd, mean) are fp32 with shape x.shape[:-1].
//  - The forward operators also have an `.out` overload that writes into the caller's
//    tensors (keyword arguments `out`, or `y` and the statistics for the *_fwd operators)
//    and returns nothing: torch.compile functionalizes a custom operator that mutates its
//    arguments only when no output aliases an input (the Python functions return `out`). They must
//    match exactly (shape, dtype, device; statistics contiguous); an out tensor of any row-strided
//    layout is written in place, any other layout through one staging copy; out may be x itself (in
//    place), any other overlap with an input is an error naming the argument. No allocation besides
//    that staging.
//  - Inputs are read through their strides when the last dimension is contiguous and the
//    leading dimensions collapse to one row stride; otherwise one contiguous copy is made.
//  - Absent gradients (no weight, or compute_dw / compute_db false) are returned as empty
//    tensors of shape [0]: optional outputs do not survive torch.compile's functionalization.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "core/quantize.h"
#include "cpu/row_kernels.h"
#include "torch_bridge.h"

namespace fusednorm::torch_ext {

namespace {

float as_float(double v) { return static_cast<float>(v); }

at::Tensor absent_grad(const at::Tensor& x) { return at::empty({0}, x.options()); }

// dw of a backward, in the weight's dtype; absent without a weight or when not computed.
at::Tensor new_weight_grad(const at::Tensor& x, const OptTensor& weight, bool has_weight,
                           bool compute_dw) {
  return (has_weight && compute_dw) ? at::empty({x.size(-1)}, weight->options()) : absent_grad(x);
}

at::Tensor workspace_for(const Context& ctx, const at::Tensor& x, std::int64_t rows,
                         std::int64_t cols, Workspace& workspace) {
  std::size_t bytes = 0;
  call_core([&] { bytes = backward_workspace_bytes(ctx, rows, cols); });
  if (bytes == 0) return {};
  at::Tensor t = at::empty({static_cast<std::int64_t>(bytes)}, x.options().dtype(at::kByte));
  workspace = {t.data_ptr(), bytes};
  return t;
}

// The forward bodies write into views they are given; the operators below differ only in
// where y and the statistics live (fresh tensors, or the caller's out= tensors).
void run_rms_norm(const char* op, const Context& ctx, const at::Tensor& x, const RowView& xv,
                  const OptTensor& weight, const Matrix& y, float* rstd, double eps,
                  double weight_offset) {
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  call_core([&] {
    fusednorm::rms_norm(ctx, xv.const_matrix(), w, y, rstd,
                        {as_float(eps), as_float(weight_offset)});
  });
}

void run_layer_norm(const char* op, const Context& ctx, const at::Tensor& x, const RowView& xv,
                    const OptTensor& weight, const OptTensor& bias, const Matrix& y, float* mean,
                    float* rstd, double eps) {
  at::Tensor w_keep, b_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const ConstVector b = optional_vector(op, "bias", bias, x, b_keep);
  LayerNormOptions options;
  options.eps = as_float(eps);
  call_core([&] { fusednorm::layer_norm(ctx, xv.const_matrix(), w, b, y, mean, rstd, options); });
}

// residual is written in place, so it is never silently replaced by a copy: when its strides
// do not allow a rows x D view, the op works on a contiguous copy and copies the result back.
void run_fused_add_rms_norm(const char* op, const Context& ctx, const at::Tensor& x,
                            const RowView& xv, const at::Tensor& residual, const OptTensor& weight,
                            const Matrix& y, double eps, double weight_offset) {
  const OutputRows rv = output_rows(op, "residual", residual, x, /*keep_contents=*/true);
  check_no_overlap(op, "residual", residual, {{"x", &x}, {"weight", optional_input(weight)}});
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  call_core([&] {
    fusednorm::fused_add_rms_norm(ctx, xv.const_matrix(), rv.matrix(), w, y, nullptr,
                                  {as_float(eps), as_float(weight_offset)});
  });
  rv.finish();
}

at::Tensor new_row_stats(const at::Tensor& x) {
  return at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
}

}  // namespace

at::Tensor rms_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                    double weight_offset) {
  const RowView xv = input_rows("rms_norm", "x", x);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  run_rms_norm("rms_norm", ctx, x, xv, weight, yv, nullptr, eps, weight_offset);
  return y;
}

void rms_norm_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                  double weight_offset, at::Tensor& out) {
  const char* op = "rms_norm.out";
  const RowView xv = input_rows(op, "x", x);
  const OutputRows yv = output_rows(op, "out", out, x, /*keep_contents=*/false);
  check_no_overlap(op, "out", out,
                   {{"x", &x, /*may_be_out=*/true}, {"weight", optional_input(weight)}});
  run_rms_norm(op, ctx, x, xv, weight, yv.matrix(), nullptr, eps, weight_offset);
  yv.finish();
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const Context& ctx, const at::Tensor& x,
                                                const OptTensor& weight, double eps,
                                                double weight_offset) {
  const RowView xv = input_rows("rms_norm_fwd", "x", x);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  at::Tensor rstd = new_row_stats(x);
  run_rms_norm("rms_norm_fwd", ctx, x, xv, weight, yv, rstd.data_ptr<float>(), eps, weight_offset);
  return {y, rstd};
}

void rms_norm_fwd_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                      double weight_offset, at::Tensor& y, at::Tensor& rstd) {
  const char* op = "rms_norm_fwd.out";
  const RowView xv = input_rows(op, "x", x);
  const OutputRows yv = output_rows(op, "y", y, x, /*keep_contents=*/false);
  float* rstd_data = row_stats_out(op, "rstd", rstd, x);
  check_no_overlap(op, "y", y, {{"x", &x, true}, {"weight", optional_input(weight)}});
  check_no_overlap(op, "rstd", rstd, {{"x", &x}, {"weight", optional_input(weight)}, {"y", &y}});
  run_rms_norm(op, ctx, x, xv, weight, yv.matrix(), rstd_data, eps, weight_offset);
  yv.finish();
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const Context& ctx, const at::Tensor& dy,
                                                     const at::Tensor& x, const OptTensor& weight,
                                                     const OptTensor& rstd, double eps,
                                                     double weight_offset, bool compute_dw,
                                                     const OptTensor& dx_addend) {
  const char* op = "rms_norm_backward";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, rstd_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* rstd_data = optional_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  at::Tensor dx;
  const Matrix dxv = new_rows(x, xv.dtype, dx);
  at::Tensor dw = new_weight_grad(x, weight, w.data != nullptr, compute_dw);
  const std::optional<RowView> addend = optional_rows(op, "dx_addend", dx_addend, x);
  Workspace workspace;
  at::Tensor workspace_keep = workspace_for(ctx, x, xv.rows, xv.cols, workspace);
  call_core([&] {
    fusednorm::rms_norm_backward(ctx, dyv.const_matrix(), xv.const_matrix(), w, rstd_data, dxv,
                                 vector_view(dw), {as_float(eps), as_float(weight_offset)},
                                 workspace, addend ? addend->const_matrix() : ConstMatrix{});
  });
  return {dx, dw};
}

at::Tensor fused_add_rms_norm(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                              const OptTensor& weight, double eps, double weight_offset) {
  const RowView xv = input_rows("fused_add_rms_norm", "x", x);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  run_fused_add_rms_norm("fused_add_rms_norm", ctx, x, xv, residual, weight, yv, eps,
                         weight_offset);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_fwd(
    const Context& ctx, const at::Tensor& x, const at::Tensor& residual, const OptTensor& weight,
    double eps, double weight_offset) {
  const char* op = "fused_add_rms_norm_fwd";
  const RowView xv = input_rows(op, "x", x);
  check_matching(op, "residual", residual, x);
  check_same_dtype(op, "residual", residual, x);
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  // The core adds in place; the functional form adds into a fresh copy of residual, so no
  // input is mutated (one extra read and write of residual, measured in bench_distributed).
  at::Tensor residual_out;
  const Matrix rv = new_rows(x, xv.dtype, residual_out);
  residual_out.copy_(residual);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  at::Tensor rstd = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  call_core([&] {
    fusednorm::fused_add_rms_norm(ctx, xv.const_matrix(), rv, w, yv, rstd.data_ptr<float>(),
                                  {as_float(eps), as_float(weight_offset)});
  });
  return {y, residual_out, rstd};
}

at::Tensor rms_norm_partial_sum_squares(const Context& ctx, const at::Tensor& x) {
  const char* op = "rms_norm_partial_sum_squares";
  const RowView xv = input_rows(op, "x", x);
  at::Tensor sums = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  call_core([&] {
    fusednorm::rms_norm_partial_sum_squares(ctx, xv.const_matrix(), sums.data_ptr<float>());
  });
  return sums;
}

std::tuple<at::Tensor, at::Tensor> fused_add_partial_sum_squares(const Context& ctx,
                                                                 const at::Tensor& x,
                                                                 const at::Tensor& residual) {
  const char* op = "fused_add_partial_sum_squares";
  const RowView xv = input_rows(op, "x", x);
  check_matching(op, "residual", residual, x);
  check_same_dtype(op, "residual", residual, x);
  at::Tensor residual_out;
  const Matrix rv = new_rows(x, xv.dtype, residual_out);
  residual_out.copy_(residual);
  at::Tensor sums = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  call_core([&] {
    fusednorm::fused_add_partial_sum_squares(ctx, xv.const_matrix(), rv, sums.data_ptr<float>());
  });
  return {residual_out, sums};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_from_sum_squares(
    const Context& ctx, const at::Tensor& x, const OptTensor& weight, const at::Tensor& sum_squares,
    std::int64_t full_cols, double eps, double weight_offset) {
  const char* op = "rms_norm_from_sum_squares";
  const RowView xv = input_rows(op, "x", x);
  at::Tensor w_keep, sums_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* sums = required_row_stats(op, "sum_squares", sum_squares, x, xv.rows, sums_keep);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  at::Tensor rstd = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  call_core([&] {
    fusednorm::rms_norm_from_sum_squares(ctx, xv.const_matrix(), w, yv, sums, full_cols,
                                         rstd.data_ptr<float>(),
                                         {as_float(eps), as_float(weight_offset)});
  });
  return {y, rstd};
}

at::Tensor rms_norm_backward_partial_sums(const Context& ctx, const at::Tensor& dy,
                                          const at::Tensor& x, const OptTensor& weight,
                                          const at::Tensor& rstd, double weight_offset) {
  const char* op = "rms_norm_backward_partial_sums";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, rstd_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* rstd_data = required_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  at::Tensor sums = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  RmsNormOptions options;
  options.weight_offset = as_float(weight_offset);
  call_core([&] {
    fusednorm::rms_norm_backward_partial_sums(ctx, dyv.const_matrix(), xv.const_matrix(), w,
                                              rstd_data, sums.data_ptr<float>(), options);
  });
  return sums;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_from_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& rstd, const at::Tensor& sum_g_xhat, std::int64_t full_cols,
    double weight_offset, bool compute_dw, const OptTensor& dx_addend) {
  const char* op = "rms_norm_backward_from_sums";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, rstd_keep, sums_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* rstd_data = required_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  const float* sums = required_row_stats(op, "sum_g_xhat", sum_g_xhat, x, xv.rows, sums_keep);
  const std::optional<RowView> addend = optional_rows(op, "dx_addend", dx_addend, x);
  at::Tensor dx;
  const Matrix dxv = new_rows(x, xv.dtype, dx);
  at::Tensor dw = new_weight_grad(x, weight, w.data != nullptr, compute_dw);
  Workspace workspace;
  at::Tensor workspace_keep = workspace_for(ctx, x, xv.rows, xv.cols, workspace);
  RmsNormOptions options;
  options.weight_offset = as_float(weight_offset);
  call_core([&] {
    fusednorm::rms_norm_backward_from_sums(
        ctx, dyv.const_matrix(), xv.const_matrix(), w, rstd_data, sums, full_cols, dxv,
        vector_view(dw), options, workspace, addend ? addend->const_matrix() : ConstMatrix{});
  });
  return {dx, dw};
}

void fused_add_rms_norm_out(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                            const OptTensor& weight, double eps, double weight_offset,
                            at::Tensor& out) {
  const char* op = "fused_add_rms_norm.out";
  const RowView xv = input_rows(op, "x", x);
  const OutputRows yv = output_rows(op, "out", out, x, /*keep_contents=*/false);
  check_no_overlap(op, "out", out,
                   {{"x", &x, /*may_be_out=*/true},
                    {"residual", &residual},
                    {"weight", optional_input(weight)}});
  run_fused_add_rms_norm(op, ctx, x, xv, residual, weight, yv.matrix(), eps, weight_offset);
  yv.finish();
}

at::Tensor layer_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                      const OptTensor& bias, double eps) {
  const RowView xv = input_rows("layer_norm", "x", x);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  run_layer_norm("layer_norm", ctx, x, xv, weight, bias, yv, nullptr, nullptr, eps);
  return y;
}

void layer_norm_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                    const OptTensor& bias, double eps, at::Tensor& out) {
  const char* op = "layer_norm.out";
  const RowView xv = input_rows(op, "x", x);
  const OutputRows yv = output_rows(op, "out", out, x, /*keep_contents=*/false);
  check_no_overlap(op, "out", out,
                   {{"x", &x, /*may_be_out=*/true},
                    {"weight", optional_input(weight)},
                    {"bias", optional_input(bias)}});
  run_layer_norm(op, ctx, x, xv, weight, bias, yv.matrix(), nullptr, nullptr, eps);
  yv.finish();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const Context& ctx,
                                                              const at::Tensor& x,
                                                              const OptTensor& weight,
                                                              const OptTensor& bias, double eps) {
  const RowView xv = input_rows("layer_norm_fwd", "x", x);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  at::Tensor mean = new_row_stats(x);
  at::Tensor rstd = new_row_stats(x);
  run_layer_norm("layer_norm_fwd", ctx, x, xv, weight, bias, yv, mean.data_ptr<float>(),
                 rstd.data_ptr<float>(), eps);
  return {y, mean, rstd};
}

void layer_norm_fwd_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                        const OptTensor& bias, double eps, at::Tensor& y, at::Tensor& mean,
                        at::Tensor& rstd) {
  const char* op = "layer_norm_fwd.out";
  const RowView xv = input_rows(op, "x", x);
  const OutputRows yv = output_rows(op, "y", y, x, /*keep_contents=*/false);
  float* mean_data = row_stats_out(op, "mean", mean, x);
  float* rstd_data = row_stats_out(op, "rstd", rstd, x);
  const at::Tensor* w = optional_input(weight);
  const at::Tensor* b = optional_input(bias);
  check_no_overlap(op, "y", y, {{"x", &x, true}, {"weight", w}, {"bias", b}});
  check_no_overlap(op, "mean", mean, {{"x", &x}, {"weight", w}, {"bias", b}, {"y", &y}});
  check_no_overlap(op, "rstd", rstd,
                   {{"x", &x}, {"weight", w}, {"bias", b}, {"y", &y}, {"mean", &mean}});
  run_layer_norm(op, ctx, x, xv, weight, bias, yv.matrix(), mean_data, rstd_data, eps);
  yv.finish();
}

namespace {

// dw and db of a LayerNorm backward (absent when not computed): dw in the weight's dtype; db
// too (fp32 master weights give an fp32 db), or x's without a weight.
std::pair<at::Tensor, at::Tensor> new_layer_norm_grads(const at::Tensor& x, const OptTensor& weight,
                                                       bool has_weight, bool compute_dw,
                                                       bool compute_db) {
  at::Tensor dw = new_weight_grad(x, weight, has_weight, compute_dw);
  at::Tensor db = compute_db ? at::empty({x.size(-1)}, has_weight ? weight->options() : x.options())
                             : absent_grad(x);
  return {dw, db};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const OptTensor& mean, const OptTensor& rstd, double eps, bool compute_dw, bool compute_db) {
  const char* op = "layer_norm_backward";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, mean_keep, rstd_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* mean_data = optional_row_stats(op, "mean", mean, x, xv.rows, mean_keep);
  const float* rstd_data = optional_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  at::Tensor dx;
  const Matrix dxv = new_rows(x, xv.dtype, dx);
  at::Tensor dw, db;  // not a structured binding: C++17 lambdas cannot capture one
  std::tie(dw, db) = new_layer_norm_grads(x, weight, w.data != nullptr, compute_dw, compute_db);
  Workspace workspace;
  at::Tensor workspace_keep = workspace_for(ctx, x, xv.rows, xv.cols, workspace);
  LayerNormOptions options;
  options.eps = as_float(eps);
  call_core([&] {
    fusednorm::layer_norm_backward(ctx, dyv.const_matrix(), xv.const_matrix(), w, mean_data,
                                   rstd_data, dxv, vector_view(dw), vector_view(db), options,
                                   workspace);
  });
  return {dx, dw, db};
}

// ---- Quantized RMSNorm -----------------------------------------------------------------
// One body per operator, writing into the q (and per-row scales) it is given; the allocating
// forms allocate them and call it, so the .out forms are the only path into the core.

namespace {

// Shape of the dynamic per-token scales: x.shape[:-1] + (1,), so that q * scale dequantizes.
std::vector<std::int64_t> token_scales_shape(const at::Tensor& x) {
  auto shape = row_stats_shape(x);
  shape.push_back(1);
  return shape;
}

// A one-element fp32 tensor on x's device (static scale, scale_ub). On the CPU its value is
// checked here (finite, > 0), before the core's own check, so that the error names the
// Python argument; on CUDA reading it would synchronize with the device, so it is not.
const float* one_fp32(const char* op, const char* argument, const OptTensor& t,
                      const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return nullptr;
  if (t->scalar_type() != at::kFloat) {
    fail(op, argument,
         std::string("dtype must be float32, got ") + c10::toString(t->scalar_type()));
  }
  if (t->numel() != 1) {
    fail(op, argument, "must have exactly one element, got " + std::to_string(t->numel()));
  }
  if (t->device() != x.device()) {
    fail(op, argument, "is on " + t->device().str() + " but x is on " + x.device().str());
  }
  const float* data = t->data_ptr<float>();
  if (t->is_cpu() && !(std::isfinite(*data) && *data > 0.0f)) {
    fail(op, argument, "must be finite and > 0, got " + std::to_string(*data));
  }
  if (t->is_cpu() && std::strcmp(argument, "scale") == 0 &&
      !detail::static_scale_reciprocal_is_finite(*data)) {
    fail(op, argument, detail::static_scale_reciprocal_error(*data));
  }
  return data;
}

// The scale arguments of either mode: static (scale given: no row_scales, no scale_ub) or
// dynamic per token (row_scales written, scale_ub optional).
QuantScale quant_scale(const char* op, const at::Tensor& x, const OptTensor& scale,
                       const OptTensor& scale_ub, const OptTensor& row_scales) {
  QuantScale s;
  s.static_scale = one_fp32(op, "scale", scale, x);
  s.scale_upper_bound = one_fp32(op, "scale_ub", scale_ub, x);
  const bool has_row_scales = row_scales.has_value() && row_scales->defined();
  if (s.static_scale != nullptr) {
    if (s.scale_upper_bound != nullptr) {
      fail(op, "scale_ub",
           "bounds the dynamic per-token scale; it cannot be given with a static scale");
    }
    if (has_row_scales) {
      fail(op, "row_scales",
           "is written only in dynamic mode (scale=None); a static scale is given");
    }
    return s;
  }
  if (!has_row_scales) fail(op, "row_scales", "is required in dynamic mode (scale=None)");
  const at::Tensor& r = *row_scales;
  if (r.scalar_type() != at::kFloat) {
    fail(op, "row_scales",
         std::string("dtype must be float32, got ") + c10::toString(r.scalar_type()));
  }
  const auto shape = token_scales_shape(x);
  if (r.sizes() != at::IntArrayRef(shape)) {
    std::ostringstream msg;
    msg << "shape " << r.sizes() << " must be x.shape[:-1] + (1,) = " << at::IntArrayRef(shape);
    fail(op, "row_scales", msg.str());
  }
  if (r.device() != x.device()) {
    fail(op, "row_scales", "is on " + r.device().str() + " but x is on " + x.device().str());
  }
  if (!r.is_contiguous()) fail(op, "row_scales", "must be contiguous");
  s.row_scales = r.data_ptr<float>();
  return s;
}

// The quant operators' body: residual (optional) is added into in place first.
void run_rms_norm_quant(const char* op, const Context& ctx, const at::Tensor& x,
                        const OptTensor& residual, const OptTensor& weight, double eps,
                        double weight_offset, const OptTensor& scale, const OptTensor& scale_ub,
                        at::Tensor& out, const OptTensor& row_scales) {
  const RowView xv = input_rows(op, "x", x);
  const OutputRows qv = quantized_output_rows(op, "out", out, x);
  const QuantScale qs = quant_scale(op, x, scale, scale_ub, row_scales);
  const at::Tensor* residual_in = optional_input(residual);
  check_no_overlap(op, "out", out,
                   {{"x", &x},
                    {"residual", residual_in},
                    {"weight", optional_input(weight)},
                    {"scale", optional_input(scale)},
                    {"scale_ub", optional_input(scale_ub)}});
  if (row_scales.has_value()) {
    check_no_overlap(op, "row_scales", *row_scales,
                     {{"x", &x},
                      {"residual", residual_in},
                      {"weight", optional_input(weight)},
                      {"scale_ub", optional_input(scale_ub)},
                      {"out", &out}});
  }
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const RmsNormOptions options{as_float(eps), as_float(weight_offset)};
  if (residual_in == nullptr) {
    call_core(
        [&] { fusednorm::rms_norm_quant(ctx, xv.const_matrix(), w, qv.matrix(), qs, options); });
  } else {
    check_same_dtype(op, "residual", *residual, x);
    const OutputRows rv = output_rows(op, "residual", *residual, x, /*keep_contents=*/true);
    check_no_overlap(op, "residual", *residual,
                     {{"x", &x},
                      {"weight", optional_input(weight)},
                      {"scale", optional_input(scale)},
                      {"scale_ub", optional_input(scale_ub)}});
    call_core([&] {
      fusednorm::fused_add_rms_norm_quant(ctx, xv.const_matrix(), rv.matrix(), w, qv.matrix(), qs,
                                          options);
    });
    rv.finish();
  }
  qv.finish();
}

// Allocates q (and the per-token scales in dynamic mode; an empty [0] tensor in static mode,
// where the caller's scale is the scale) and runs the body.
std::tuple<at::Tensor, at::Tensor> rms_norm_quant_alloc(
    const char* op, const Context& ctx, const at::Tensor& x, const OptTensor& residual,
    const OptTensor& weight, double eps, double weight_offset, at::ScalarType dtype,
    const OptTensor& scale, const OptTensor& scale_ub) {
  to_quant_dtype(op, "dtype", dtype);
  check_input(op, "x", x);  // before x's shape is used
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  const bool dynamic = !scale.has_value() || !scale->defined();
  at::Tensor row_scales = dynamic ? at::empty(token_scales_shape(x), x.options().dtype(at::kFloat))
                                  : at::empty({0}, x.options().dtype(at::kFloat));
  run_rms_norm_quant(op, ctx, x, residual, weight, eps, weight_offset, scale, scale_ub, q,
                     dynamic ? OptTensor(row_scales) : std::nullopt);
  return {q, row_scales};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const Context& ctx, const at::Tensor& x,
                                                  const OptTensor& weight, double eps,
                                                  double weight_offset, at::ScalarType dtype,
                                                  const OptTensor& scale,
                                                  const OptTensor& scale_ub) {
  return rms_norm_quant_alloc("rms_norm_quant", ctx, x, std::nullopt, weight, eps, weight_offset,
                              dtype, scale, scale_ub);
}

void rms_norm_quant_out(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                        double eps, double weight_offset, const OptTensor& scale,
                        const OptTensor& scale_ub, at::Tensor& out, const OptTensor& row_scales) {
  run_rms_norm_quant("rms_norm_quant.out", ctx, x, std::nullopt, weight, eps, weight_offset, scale,
                     scale_ub, out, row_scales);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_quant(
    const Context& ctx, const at::Tensor& x, at::Tensor& residual, const OptTensor& weight,
    double eps, double weight_offset, at::ScalarType dtype, const OptTensor& scale,
    const OptTensor& scale_ub) {
  return rms_norm_quant_alloc("fused_add_rms_norm_quant", ctx, x, residual, weight, eps,
                              weight_offset, dtype, scale, scale_ub);
}

void fused_add_rms_norm_quant_out(const Context& ctx, const at::Tensor& x, at::Tensor& residual,
                                  const OptTensor& weight, double eps, double weight_offset,
                                  const OptTensor& scale, const OptTensor& scale_ub,
                                  at::Tensor& out, const OptTensor& row_scales) {
  run_rms_norm_quant("fused_add_rms_norm_quant.out", ctx, x, residual, weight, eps, weight_offset,
                     scale, scale_ub, out, row_scales);
}

at::Tensor layer_norm_partial_sums(const Context& ctx, const at::Tensor& x) {
  const char* op = "layer_norm_partial_sums";
  const RowView xv = input_rows(op, "x", x);
  at::Tensor sums = new_row_stats(x);
  call_core(
      [&] { fusednorm::layer_norm_partial_sums(ctx, xv.const_matrix(), sums.data_ptr<float>()); });
  return sums;
}

at::Tensor layer_norm_partial_squared_deviations(const Context& ctx, const at::Tensor& x,
                                                 const at::Tensor& row_sum,
                                                 std::int64_t full_cols) {
  const char* op = "layer_norm_partial_squared_deviations";
  const RowView xv = input_rows(op, "x", x);
  at::Tensor sum_keep;
  const float* sums = required_row_stats(op, "row_sum", row_sum, x, xv.rows, sum_keep);
  at::Tensor deviations = new_row_stats(x);
  call_core([&] {
    fusednorm::layer_norm_partial_squared_deviations(ctx, xv.const_matrix(), sums, full_cols,
                                                     deviations.data_ptr<float>());
  });
  return deviations;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_from_sums(
    const Context& ctx, const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
    const at::Tensor& row_sum, const at::Tensor& row_sum_squared_deviations, std::int64_t full_cols,
    double eps) {
  const char* op = "layer_norm_from_sums";
  const RowView xv = input_rows(op, "x", x);
  at::Tensor w_keep, b_keep, sum_keep, dev_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const ConstVector b = optional_vector(op, "bias", bias, x, b_keep);
  const float* sums = required_row_stats(op, "row_sum", row_sum, x, xv.rows, sum_keep);
  const float* deviations = required_row_stats(op, "row_sum_squared_deviations",
                                               row_sum_squared_deviations, x, xv.rows, dev_keep);
  at::Tensor y;
  const Matrix yv = new_rows(x, xv.dtype, y);
  at::Tensor mean = new_row_stats(x);
  at::Tensor rstd = new_row_stats(x);
  LayerNormOptions options;
  options.eps = as_float(eps);
  call_core([&] {
    fusednorm::layer_norm_from_sums(ctx, xv.const_matrix(), w, b, yv, sums, deviations, full_cols,
                                    mean.data_ptr<float>(), rstd.data_ptr<float>(), options);
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor> layer_norm_backward_partial_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd) {
  const char* op = "layer_norm_backward_partial_sums";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, mean_keep, rstd_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* mean_data = required_row_stats(op, "mean", mean, x, xv.rows, mean_keep);
  const float* rstd_data = required_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  at::Tensor sum_g = new_row_stats(x);
  at::Tensor sum_g_xhat = new_row_stats(x);
  call_core([&] {
    fusednorm::layer_norm_backward_partial_sums(ctx, dyv.const_matrix(), xv.const_matrix(), w,
                                                mean_data, rstd_data, sum_g.data_ptr<float>(),
                                                sum_g_xhat.data_ptr<float>());
  });
  return {sum_g, sum_g_xhat};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_from_sums(
    const Context& ctx, const at::Tensor& dy, const at::Tensor& x, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& sum_g,
    const at::Tensor& sum_g_xhat, std::int64_t full_cols, double eps, bool compute_dw,
    bool compute_db) {
  const char* op = "layer_norm_backward_from_sums";
  const RowView xv = input_rows(op, "x", x);
  const RowView dyv = matching_rows(op, "dy", dy, x);
  at::Tensor w_keep, mean_keep, rstd_keep, g_keep, gx_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const float* mean_data = required_row_stats(op, "mean", mean, x, xv.rows, mean_keep);
  const float* rstd_data = required_row_stats(op, "rstd", rstd, x, xv.rows, rstd_keep);
  const float* g_sums = required_row_stats(op, "sum_g", sum_g, x, xv.rows, g_keep);
  const float* gx_sums = required_row_stats(op, "sum_g_xhat", sum_g_xhat, x, xv.rows, gx_keep);
  at::Tensor dx;
  const Matrix dxv = new_rows(x, xv.dtype, dx);
  at::Tensor dw, db;  // not a structured binding: C++17 lambdas cannot capture one
  std::tie(dw, db) = new_layer_norm_grads(x, weight, w.data != nullptr, compute_dw, compute_db);
  Workspace workspace;
  at::Tensor workspace_keep = workspace_for(ctx, x, xv.rows, xv.cols, workspace);
  LayerNormOptions options;
  options.eps = as_float(eps);
  call_core([&] {
    fusednorm::layer_norm_backward_from_sums(ctx, dyv.const_matrix(), xv.const_matrix(), w,
                                             mean_data, rstd_data, g_sums, gx_sums, full_cols, dxv,
                                             vector_view(dw), vector_view(db), options, workspace);
  });
  return {dx, dw, db};
}

namespace {

struct CpuScope {
  Context ctx;
  explicit CpuScope(const at::Tensor&) {
    ctx.device = Device::kCpu;
    // Follow torch.set_num_threads, so our ops share PyTorch's intra-op thread budget.
    ctx.num_threads = at::get_num_threads();
  }
};

}  // namespace

}  // namespace fusednorm::torch_ext

TORCH_LIBRARY(fusednorm, m) {
  // Fake kernels live in Python (autograd: autograd.cpp). A library loaded with
  // torch.ops.load_library alone runs eagerly with autograd; `import fusednorm` adds the
  // fake kernels that torch.compile needs.
  m.set_python_module("fusednorm._meta");
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("rms_norm(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0.) -> Tensor",
        tags);
  m.def(
      "rms_norm_fwd(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0.) "
      "-> (Tensor y, Tensor rstd)",
      tags);
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? rstd, float eps=1e-06, "
      "float weight_offset=0., bool compute_dw=True, Tensor? dx_addend=None) "
      "-> (Tensor dx, Tensor dw)",
      tags);
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor? weight, float eps=1e-06, "
      "float weight_offset=0.) -> Tensor",
      tags);
  m.def(
      "fused_add_rms_norm_fwd(Tensor x, Tensor residual, Tensor? weight, float eps=1e-06, "
      "float weight_offset=0.) -> (Tensor y, Tensor residual_out, Tensor rstd)",
      tags);
  m.def("rms_norm_partial_sum_squares(Tensor x) -> Tensor", tags);
  m.def(
      "fused_add_partial_sum_squares(Tensor x, Tensor residual) "
      "-> (Tensor residual_out, Tensor sum_squares)",
      tags);
  m.def(
      "rms_norm_from_sum_squares(Tensor x, Tensor? weight, Tensor sum_squares, int full_cols, "
      "float eps=1e-06, float weight_offset=0.) -> (Tensor y, Tensor rstd)",
      tags);
  m.def(
      "rms_norm_backward_partial_sums(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, "
      "float weight_offset=0.) -> Tensor",
      tags);
  m.def(
      "rms_norm_backward_from_sums(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, "
      "Tensor sum_g_xhat, int full_cols, float weight_offset=0., bool compute_dw=True, "
      "Tensor? dx_addend=None) -> (Tensor dx, Tensor dw)",
      tags);
  m.def(
      "rms_norm.out(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0., *, "
      "Tensor(a!) out) -> ()",
      tags);
  m.def(
      "rms_norm_fwd.out(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0., *, "
      "Tensor(a!) y, Tensor(b!) rstd) -> ()",
      tags);
  m.def(
      "fused_add_rms_norm.out(Tensor x, Tensor(a!) residual, Tensor? weight, float eps=1e-06, "
      "float weight_offset=0., *, Tensor(b!) out) -> ()",
      tags);
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) -> Tensor", tags);
  m.def(
      "layer_norm.out(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05, *, "
      "Tensor(a!) out) -> ()",
      tags);
  m.def(
      "layer_norm_fwd.out(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05, *, "
      "Tensor(a!) y, Tensor(b!) mean, Tensor(c!) rstd) -> ()",
      tags);
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) "
      "-> (Tensor y, Tensor mean, Tensor rstd)",
      tags);
  m.def(
      "layer_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? mean, Tensor? rstd, "
      "float eps=1e-05, bool compute_dw=True, bool compute_db=True) "
      "-> (Tensor dx, Tensor dw, Tensor db)",
      tags);
  // Quantized RMSNorm (fusednorm.h): q int8 / float8_e4m3fn; `scale` given: static, and the
  // second output is an empty [0] tensor (an output may not alias an input); scale None:
  // dynamic per token, the second output is the fp32 scales, shape x.shape[:-1] + (1,).
  m.def(
      "rms_norm_quant(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0., *, "
      "ScalarType dtype, Tensor? scale=None, Tensor? scale_ub=None) -> (Tensor q, Tensor scale)",
      tags);
  m.def(
      "rms_norm_quant.out(Tensor x, Tensor? weight, float eps=1e-06, float weight_offset=0., *, "
      "Tensor? scale=None, Tensor? scale_ub=None, Tensor(a!) out, Tensor(b!)? row_scales=None) "
      "-> ()",
      tags);
  m.def(
      "fused_add_rms_norm_quant(Tensor x, Tensor(a!) residual, Tensor? weight, float eps=1e-06, "
      "float weight_offset=0., *, ScalarType dtype, Tensor? scale=None, Tensor? scale_ub=None) "
      "-> (Tensor q, Tensor scale)",
      tags);
  m.def(
      "fused_add_rms_norm_quant.out(Tensor x, Tensor(a!) residual, Tensor? weight, "
      "float eps=1e-06, float weight_offset=0., *, Tensor? scale=None, Tensor? scale_ub=None, "
      "Tensor(b!) out, Tensor(c!)? row_scales=None) -> ()",
      tags);
  m.def("layer_norm_partial_sums(Tensor x) -> Tensor", tags);
  m.def("layer_norm_partial_squared_deviations(Tensor x, Tensor row_sum, int full_cols) -> Tensor",
        tags);
  m.def(
      "layer_norm_from_sums(Tensor x, Tensor? weight, Tensor? bias, Tensor row_sum, "
      "Tensor row_sum_squared_deviations, int full_cols, float eps=1e-05) "
      "-> (Tensor y, Tensor mean, Tensor rstd)",
      tags);
  m.def(
      "layer_norm_backward_partial_sums(Tensor dy, Tensor x, Tensor? weight, Tensor mean, "
      "Tensor rstd) -> (Tensor sum_g, Tensor sum_g_xhat)",
      tags);
  m.def(
      "layer_norm_backward_from_sums(Tensor dy, Tensor x, Tensor? weight, Tensor mean, "
      "Tensor rstd, Tensor sum_g, Tensor sum_g_xhat, int full_cols, float eps=1e-05, "
      "bool compute_dw=True, bool compute_db=True) -> (Tensor dx, Tensor dw, Tensor db)",
      tags);
  // The Highway target the CPU kernels run on this machine, for benchmark reports.
  m.def("cpu_simd_target() -> str",
        [] { return std::string(fusednorm::cpu::row_kernels().target_name); });
}

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  fusednorm::torch_ext::register_kernels<fusednorm::torch_ext::CpuScope>(m);
}
