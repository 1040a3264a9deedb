// fusednorm as PyTorch operators: the schemas (TORCH_LIBRARY), the device-neutral bodies and
// the CPU registration. Fake (meta) kernels and autograd are registered from Python
// (fusednorm/_meta.py, loaded by `import fusednorm`); set_python_module below names it, and
// torch checks that they are registered from there.
//
// Conventions shared by every operator:
//  - x is [..., D]; outputs are new contiguous tensors with x's shape and dtype; per-row
//    statistics (rstd, mean) are fp32 with shape x.shape[:-1].
//  - Inputs are read through their strides when the last dimension is contiguous and the
//    leading dimensions collapse to one row stride; otherwise one contiguous copy is made.
//  - Absent gradients (no weight, or compute_dw / compute_db false) are returned as empty
//    tensors of shape [0]: optional outputs do not survive torch.compile's functionalization.
#include "ops.h"

#include <ATen/Parallel.h>

#include "torch_bridge.h"

namespace fusednorm::torch_ext {

namespace {

float as_float(double v) { return static_cast<float>(v); }

at::Tensor absent_grad(const at::Tensor& x) { return at::empty({0}, x.options()); }

at::Tensor workspace_for(const Context& ctx, const at::Tensor& x, std::int64_t rows,
                         std::int64_t cols, Workspace& workspace) {
  std::size_t bytes = 0;
  call_core([&] { bytes = backward_workspace_bytes(ctx, rows, cols); });
  if (bytes == 0) return {};
  at::Tensor t = at::empty({static_cast<std::int64_t>(bytes)}, x.options().dtype(at::kByte));
  workspace = {t.data_ptr(), bytes};
  return t;
}

std::tuple<at::Tensor, at::Tensor> rms_forward(const char* op, const Context& ctx,
                                               const at::Tensor& x, const OptTensor& weight,
                                               double eps, double weight_offset, bool want_rstd) {
  const RowView xv = input_rows(op, "x", x);
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  at::Tensor y;
  const Matrix yv = new_rows(x, y);
  at::Tensor rstd;
  if (want_rstd) rstd = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  call_core([&] {
    fusednorm::rms_norm(ctx, xv.const_matrix(), w, yv, want_rstd ? rstd.data_ptr<float>() : nullptr,
                        {as_float(eps), as_float(weight_offset)});
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_forward(const char* op, const Context& ctx,
                                                             const at::Tensor& x,
                                                             const OptTensor& weight,
                                                             const OptTensor& bias, double eps,
                                                             bool want_stats) {
  const RowView xv = input_rows(op, "x", x);
  at::Tensor w_keep, b_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  const ConstVector b = optional_vector(op, "bias", bias, x, b_keep);
  at::Tensor y, mean, rstd;
  const Matrix yv = new_rows(x, y);
  if (want_stats) {
    mean = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
    rstd = at::empty(row_stats_shape(x), x.options().dtype(at::kFloat));
  }
  LayerNormOptions options;
  options.eps = as_float(eps);
  call_core([&] {
    fusednorm::layer_norm(ctx, xv.const_matrix(), w, b, yv,
                          want_stats ? mean.data_ptr<float>() : nullptr,
                          want_stats ? rstd.data_ptr<float>() : nullptr, options);
  });
  return {y, mean, rstd};
}

}  // namespace

at::Tensor rms_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight, double eps,
                    double weight_offset) {
  return std::get<0>(rms_forward("rms_norm", ctx, x, weight, eps, weight_offset, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const Context& ctx, const at::Tensor& x,
                                                const OptTensor& weight, double eps,
                                                double weight_offset) {
  return rms_forward("rms_norm_fwd", ctx, x, weight, eps, weight_offset, true);
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
  const Matrix dxv = new_rows(x, dx);
  at::Tensor dw = (w.data != nullptr && compute_dw) ? at::empty({x.size(-1)}, weight->options())
                                                    : absent_grad(x);
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
  const char* op = "fused_add_rms_norm";
  const RowView xv = input_rows(op, "x", x);
  // residual is written in place, so it is never silently replaced by a copy: when its
  // strides do not allow a rows x D view, the op works on a contiguous copy and copies the
  // result back.
  check_matching(op, "residual", residual, x);
  std::optional<RowView> rv = rows_without_copy(op, "residual", residual);
  at::Tensor staged;
  if (!rv) {
    staged = residual.contiguous();
    rv = rows_without_copy(op, "residual", staged);
  }
  at::Tensor w_keep;
  const ConstVector w = optional_vector(op, "weight", weight, x, w_keep);
  at::Tensor y;
  const Matrix yv = new_rows(x, y);
  call_core([&] {
    fusednorm::fused_add_rms_norm(ctx, xv.const_matrix(), rv->matrix(), w, yv, nullptr,
                                  {as_float(eps), as_float(weight_offset)});
  });
  if (staged.defined()) residual.copy_(staged);
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
  const Matrix rv = new_rows(x, residual_out);
  residual_out.copy_(residual);
  at::Tensor y;
  const Matrix yv = new_rows(x, y);
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
  const Matrix rv = new_rows(x, residual_out);
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
  const Matrix yv = new_rows(x, y);
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
  const Matrix dxv = new_rows(x, dx);
  at::Tensor dw = (w.data != nullptr && compute_dw) ? at::empty({x.size(-1)}, weight->options())
                                                    : absent_grad(x);
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

at::Tensor layer_norm(const Context& ctx, const at::Tensor& x, const OptTensor& weight,
                      const OptTensor& bias, double eps) {
  return std::get<0>(layer_forward("layer_norm", ctx, x, weight, bias, eps, false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const Context& ctx,
                                                              const at::Tensor& x,
                                                              const OptTensor& weight,
                                                              const OptTensor& bias, double eps) {
  return layer_forward("layer_norm_fwd", ctx, x, weight, bias, eps, true);
}

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
  const Matrix dxv = new_rows(x, dx);
  const bool has_weight = w.data != nullptr;
  at::Tensor dw =
      (has_weight && compute_dw) ? at::empty({x.size(-1)}, weight->options()) : absent_grad(x);
  // db takes the weight's dtype (fp32 master weights give an fp32 db), else x's.
  at::Tensor db = compute_db ? at::empty({x.size(-1)}, has_weight ? weight->options() : x.options())
                             : absent_grad(x);
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
  // Fake kernels and autograd formulas live in Python. A library loaded with
  // torch.ops.load_library alone runs eagerly; `import fusednorm` adds the rest.
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
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) -> Tensor", tags);
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05) "
      "-> (Tensor y, Tensor mean, Tensor rstd)",
      tags);
  m.def(
      "layer_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? mean, Tensor? rstd, "
      "float eps=1e-05, bool compute_dw=True, bool compute_db=True) "
      "-> (Tensor dx, Tensor dw, Tensor db)",
      tags);
}

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  fusednorm::torch_ext::register_kernels<fusednorm::torch_ext::CpuScope>(m);
}
