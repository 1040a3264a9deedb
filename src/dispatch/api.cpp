// Public entry points: build the problem, validate it once, hand it to the backend.
// The layer above the backends: src/core (below them) never includes a backend.
#include <limits>
#include <string>

#include "core/problem.h"
#include "cpu/cpu_backend.h"
#include "fusednorm/fusednorm.h"
#ifdef FUSEDNORM_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace fusednorm {

using detail::BackwardProblem;
using detail::ForwardProblem;
using detail::NormKind;

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat64:
      return 8;
  }
  throw Error("fusednorm: unsupported dtype value " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat64:
      return "float64";
  }
  return "invalid";
}

bool has_backend(Device device) {
  switch (device) {
    case Device::kCpu:
      return true;
    case Device::kCuda:
#ifdef FUSEDNORM_WITH_CUDA
      return true;
#else
      return false;
#endif
  }
  return false;
}

namespace {

void check_context(const char* op, const Context& ctx) {
  if (ctx.device != Device::kCpu && ctx.device != Device::kCuda) {
    detail::fail(op, "ctx.device", "unknown device");
  }
  if (!has_backend(ctx.device)) {
    detail::fail(op, "ctx.device", "this build of fusednorm has no CUDA backend");
  }
  if (ctx.num_threads < 0) {
    detail::fail(op, "ctx.num_threads", "must be >= 0 (0 = all hardware threads)");
  }
}

void run(const char* op, const Context& ctx, const ForwardProblem& problem) {
  check_context(op, ctx);
  detail::validate(op, problem);
  if (ctx.device == Device::kCpu) {
    if (problem.is_quantized()) detail::validate_host_scales(op, problem);
    cpu::forward(problem, ctx.num_threads);
    return;
  }
#ifdef FUSEDNORM_WITH_CUDA
  cuda::forward(op, problem, ctx.cuda_stream);
#endif
}

void run(const char* op, const Context& ctx, const BackwardProblem& problem) {
  check_context(op, ctx);
  detail::validate(op, problem);
  if (ctx.device == Device::kCpu) {
    cpu::backward(problem, ctx.num_threads);
    return;
  }
#ifdef FUSEDNORM_WITH_CUDA
  cuda::backward(op, problem, ctx.cuda_stream);
#endif
}

// One builder per problem kind: every entry point starts from one of these and sets only
// what is particular to it (phase, sums, residual, quantized output).
ForwardProblem rms_forward_problem(ConstMatrix x, ConstVector weight, Matrix y, float* rstd,
                                   const RmsNormOptions& options) {
  ForwardProblem p;
  p.kind = NormKind::kRms;
  p.x = x;
  p.weight = weight;
  p.y = y;
  p.rstd = rstd;
  p.eps = options.eps;
  p.weight_offset = options.weight_offset;
  return p;
}

// The fused add's residual, which the problem cannot tell from "no residual" when null.
ForwardProblem with_residual(const char* op, ForwardProblem p, Matrix residual) {
  if (residual.data == nullptr && p.x.rows > 0) {
    detail::fail(op, "residual", "data is null but rows > 0");
  }
  p.residual = residual;
  return p;
}

// q replaces y.
ForwardProblem rms_quant_problem(ConstMatrix x, ConstVector weight, Matrix q, QuantScale scale,
                                 const RmsNormOptions& options) {
  ForwardProblem p = rms_forward_problem(x, weight, {}, nullptr, options);
  p.quantized = true;
  p.q = q;
  p.quant_scale = scale;
  return p;
}

ForwardProblem layer_forward_problem(ConstMatrix x, ConstVector weight, ConstVector bias, Matrix y,
                                     float* mean, float* rstd, float eps) {
  ForwardProblem p;
  p.kind = NormKind::kLayer;
  p.x = x;
  p.weight = weight;
  p.bias = bias;
  p.y = y;
  p.mean = mean;
  p.rstd = rstd;
  p.eps = eps;
  return p;
}

BackwardProblem rms_backward_problem(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                     const float* rstd, Matrix dx, Vector dw,
                                     const RmsNormOptions& options, Workspace workspace,
                                     ConstMatrix dx_addend) {
  BackwardProblem p;
  p.kind = NormKind::kRms;
  p.dy = dy;
  p.x = x;
  p.weight = weight;
  p.rstd = rstd;
  p.dx = dx;
  p.dx_addend = dx_addend;
  p.dw = dw;
  p.eps = options.eps;
  p.weight_offset = options.weight_offset;
  p.workspace = workspace;
  return p;
}

BackwardProblem layer_backward_problem(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                       const float* mean, const float* rstd, Matrix dx, Vector dw,
                                       Vector db, float eps, Workspace workspace) {
  BackwardProblem p;
  p.kind = NormKind::kLayer;
  p.dy = dy;
  p.x = x;
  p.weight = weight;
  p.mean = mean;
  p.rstd = rstd;
  p.dx = dx;
  p.dw = dw;
  p.db = db;
  p.eps = eps;
  p.workspace = workspace;
  return p;
}

}  // namespace

void rms_norm(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix y, float* rstd,
              const RmsNormOptions& options) {
  run("rms_norm", ctx, rms_forward_problem(x, weight, y, rstd, options));
}

void fused_add_rms_norm(const Context& ctx, ConstMatrix x, Matrix residual, ConstVector weight,
                        Matrix y, float* rstd, const RmsNormOptions& options) {
  constexpr const char* op = "fused_add_rms_norm";
  run(op, ctx, with_residual(op, rms_forward_problem(x, weight, y, rstd, options), residual));
}

void rms_norm_quant(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix q,
                    QuantScale scale, const RmsNormOptions& options) {
  constexpr const char* op = "rms_norm_quant";
  run(op, ctx, rms_quant_problem(x, weight, q, scale, options));
}

void fused_add_rms_norm_quant(const Context& ctx, ConstMatrix x, Matrix residual,
                              ConstVector weight, Matrix q, QuantScale scale,
                              const RmsNormOptions& options) {
  constexpr const char* op = "fused_add_rms_norm_quant";
  run(op, ctx, with_residual(op, rms_quant_problem(x, weight, q, scale, options), residual));
}

void rms_norm_backward(const Context& ctx, ConstMatrix dy, ConstMatrix x, ConstVector weight,
                       const float* rstd, Matrix dx, Vector dw, const RmsNormOptions& options,
                       Workspace workspace, ConstMatrix dx_addend) {
  run("rms_norm_backward", ctx,
      rms_backward_problem(dy, x, weight, rstd, dx, dw, options, workspace, dx_addend));
}

void rms_norm_partial_sum_squares(const Context& ctx, ConstMatrix x, float* row_sum_squares) {
  ForwardProblem p = rms_forward_problem(x, {}, {}, nullptr, {});
  p.phase = detail::Phase::kPartialSums;
  p.partial_sums = row_sum_squares;
  run("rms_norm_partial_sum_squares", ctx, p);
}

void fused_add_partial_sum_squares(const Context& ctx, ConstMatrix x, Matrix residual,
                                   float* row_sum_squares) {
  constexpr const char* op = "fused_add_partial_sum_squares";
  ForwardProblem p = with_residual(op, rms_forward_problem(x, {}, {}, nullptr, {}), residual);
  p.phase = detail::Phase::kPartialSums;
  p.partial_sums = row_sum_squares;
  run(op, ctx, p);
}

void rms_norm_from_sum_squares(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix y,
                               const float* row_sum_squares, std::int64_t full_cols, float* rstd,
                               const RmsNormOptions& options) {
  ForwardProblem p = rms_forward_problem(x, weight, y, rstd, options);
  p.phase = detail::Phase::kFromSums;
  p.row_sum_squares = row_sum_squares;
  p.full_cols = full_cols;
  run("rms_norm_from_sum_squares", ctx, p);
}

void rms_norm_backward_partial_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                    ConstVector weight, const float* rstd, float* row_sum_g_xhat,
                                    const RmsNormOptions& options) {
  BackwardProblem p = rms_backward_problem(dy, x, weight, rstd, {}, {}, options, {}, {});
  p.phase = detail::Phase::kPartialSums;
  p.partial_sum_g_xhat = row_sum_g_xhat;
  run("rms_norm_backward_partial_sums", ctx, p);
}

void rms_norm_backward_from_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                 ConstVector weight, const float* rstd, const float* row_sum_g_xhat,
                                 std::int64_t full_cols, Matrix dx, Vector dw,
                                 const RmsNormOptions& options, Workspace workspace,
                                 ConstMatrix dx_addend) {
  BackwardProblem p =
      rms_backward_problem(dy, x, weight, rstd, dx, dw, options, workspace, dx_addend);
  p.phase = detail::Phase::kFromSums;
  p.row_sum_g_xhat = row_sum_g_xhat;
  p.full_cols = full_cols;
  run("rms_norm_backward_from_sums", ctx, p);
}

void layer_norm(const Context& ctx, ConstMatrix x, ConstVector weight, ConstVector bias, Matrix y,
                float* mean, float* rstd, const LayerNormOptions& options) {
  run("layer_norm", ctx, layer_forward_problem(x, weight, bias, y, mean, rstd, options.eps));
}

void layer_norm_partial_sums(const Context& ctx, ConstMatrix x, float* row_sum) {
  ForwardProblem p = layer_forward_problem(x, {}, {}, {}, nullptr, nullptr, 0.0f);
  p.phase = detail::Phase::kPartialSums;
  p.partial_sums = row_sum;
  run("layer_norm_partial_sums", ctx, p);
}

void layer_norm_partial_squared_deviations(const Context& ctx, ConstMatrix x, const float* row_sum,
                                           std::int64_t full_cols,
                                           float* row_sum_squared_deviations) {
  ForwardProblem p = layer_forward_problem(x, {}, {}, {}, nullptr, nullptr, 0.0f);
  p.phase = detail::Phase::kPartialDeviations;
  p.row_sum = row_sum;
  p.full_cols = full_cols;
  p.partial_sums = row_sum_squared_deviations;
  run("layer_norm_partial_squared_deviations", ctx, p);
}

void layer_norm_from_sums(const Context& ctx, ConstMatrix x, ConstVector weight, ConstVector bias,
                          Matrix y, const float* row_sum, const float* row_sum_squared_deviations,
                          std::int64_t full_cols, float* mean, float* rstd,
                          const LayerNormOptions& options) {
  ForwardProblem p = layer_forward_problem(x, weight, bias, y, mean, rstd, options.eps);
  p.phase = detail::Phase::kFromSums;
  p.row_sum = row_sum;
  p.row_sum_squared_deviations = row_sum_squared_deviations;
  p.full_cols = full_cols;
  run("layer_norm_from_sums", ctx, p);
}

void layer_norm_backward_partial_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                      ConstVector weight, const float* mean, const float* rstd,
                                      float* row_sum_g, float* row_sum_g_xhat) {
  // eps is unused: the statistics are given.
  BackwardProblem p =
      layer_backward_problem(dy, x, weight, mean, rstd, {}, {}, {}, LayerNormOptions{}.eps, {});
  p.phase = detail::Phase::kPartialSums;
  p.partial_sum_g = row_sum_g;
  p.partial_sum_g_xhat = row_sum_g_xhat;
  run("layer_norm_backward_partial_sums", ctx, p);
}

void layer_norm_backward_from_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                   ConstVector weight, const float* mean, const float* rstd,
                                   const float* row_sum_g, const float* row_sum_g_xhat,
                                   std::int64_t full_cols, Matrix dx, Vector dw, Vector db,
                                   const LayerNormOptions& options, Workspace workspace) {
  BackwardProblem p =
      layer_backward_problem(dy, x, weight, mean, rstd, dx, dw, db, options.eps, workspace);
  p.phase = detail::Phase::kFromSums;
  p.row_sum_g = row_sum_g;
  p.row_sum_g_xhat = row_sum_g_xhat;
  p.full_cols = full_cols;
  run("layer_norm_backward_from_sums", ctx, p);
}

void layer_norm_backward(const Context& ctx, ConstMatrix dy, ConstMatrix x, ConstVector weight,
                         const float* mean, const float* rstd, Matrix dx, Vector dw, Vector db,
                         const LayerNormOptions& options, Workspace workspace) {
  run("layer_norm_backward", ctx,
      layer_backward_problem(dy, x, weight, mean, rstd, dx, dw, db, options.eps, workspace));
}

std::size_t backward_workspace_bytes(const Context& ctx, std::int64_t rows, std::int64_t cols) {
  check_context("backward_workspace_bytes", ctx);
  if (rows < 0) detail::fail("backward_workspace_bytes", "rows", "must be >= 0");
  if (cols <= 0) detail::fail("backward_workspace_bytes", "cols", "must be >= 1");
  // The same bound as a view's: a row longer than this cannot be indexed anyway.
  if (cols > std::numeric_limits<std::int64_t>::max() / 8 / 128) {
    detail::fail("backward_workspace_bytes", "cols", "is larger than any valid view allows");
  }
#ifdef FUSEDNORM_WITH_CUDA
  if (ctx.device == Device::kCuda) return cuda::backward_workspace_bytes(rows, cols);
#endif
  return cpu::backward_workspace_bytes(rows, cols);
}

}  // namespace fusednorm
