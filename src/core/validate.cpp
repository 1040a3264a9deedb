#include <cmath>
#include <limits>
#include <string>

#include "core/problem.h"
#include "core/quantize.h"

namespace fusednorm::detail {

void fail(const char* op, const char* argument, const std::string& message) {
  throw Error(std::string("fusednorm::") + op + ": argument '" + argument + "': " + message);
}

namespace {

bool valid_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat64;
}

ByteRange float_range(const float* data, std::int64_t rows) {
  return byte_range(data, DType::kFloat32, rows, 1, 1);
}

bool quantized_dtype(DType dtype) { return dtype == DType::kInt8 || dtype == DType::kFloat8E4M3; }

void check_dtype(const char* op, const char* name, DType dtype) {
  if (quantized_dtype(dtype)) {
    fail(op, name,
         std::string("dtype ") + dtype_name(dtype) +
             " is an output dtype of the quantized operators only (inputs: float32, float16, "
             "bfloat16, float64)");
  }
  if (!valid_dtype(dtype)) {
    fail(op, name, "unsupported dtype value " + std::to_string(static_cast<int>(dtype)));
  }
}

// Checks shared by every matrix argument: shape, stride, null data, index overflow.
void check_view(const char* op, const char* name, const ConstMatrix& m) {
  if (m.rows < 0) fail(op, name, "rows must be >= 0, got " + std::to_string(m.rows));
  if (m.cols <= 0) fail(op, name, "D (cols) must be >= 1, got " + std::to_string(m.cols));
  if (m.row_stride < m.cols) {
    fail(op, name,
         "row_stride " + std::to_string(m.row_stride) +
             " is smaller than D = " + std::to_string(m.cols));
  }
  if (m.rows > 0 && m.data == nullptr) fail(op, name, "data is null but rows > 0");
  // Every element index and byte offset must fit: (rows - 1) * row_stride + cols <=
  // max_elements. cols is checked on its own first: for a too-long row the quotient below
  // is negative and truncates to 0, which would let a single-row view through.
  const auto max_elements = std::numeric_limits<std::int64_t>::max() / 8;
  if (m.cols > max_elements ||
      (m.rows > 0 && (m.rows - 1) > (max_elements - m.cols) / m.row_stride)) {
    fail(op, name, "view spans more elements than 64-bit indexing allows");
  }
}

// Every matrix argument of the unquantized operators and every input matrix.
void check_matrix(const char* op, const char* name, const ConstMatrix& m) {
  check_dtype(op, name, m.dtype);
  check_view(op, name, m);
}

void check_same_shape(const char* op, const char* name, const ConstMatrix& m,
                      const ConstMatrix& x) {
  check_matrix(op, name, m);
  if (m.rows != x.rows || m.cols != x.cols) {
    fail(op, name,
         "shape " + std::to_string(m.rows) + " x " + std::to_string(m.cols) +
             " does not match x's " + std::to_string(x.rows) + " x " + std::to_string(x.cols));
  }
  if (m.dtype != x.dtype) {
    fail(
        op, name,
        std::string("dtype ") + dtype_name(m.dtype) + " does not match x's " + dtype_name(x.dtype));
  }
}

// A weight-like vector: absent, or D elements of x's dtype or fp32.
void check_vector(const char* op, const char* name, const ConstVector& v, const ConstMatrix& x) {
  if (v.data == nullptr) {
    if (v.size != 0) fail(op, name, "data is null but size is " + std::to_string(v.size));
    return;
  }
  check_dtype(op, name, v.dtype);
  if (x.dtype == DType::kFloat64 && v.dtype != DType::kFloat64) {
    fail(op, name,
         std::string("dtype ") + dtype_name(v.dtype) +
             " must be float64 like x's (a float64 call takes no other dtype)");
  }
  if (v.dtype != x.dtype && v.dtype != DType::kFloat32) {
    fail(op, name,
         std::string("dtype ") + dtype_name(v.dtype) + " must be x's dtype (" +
             dtype_name(x.dtype) + ") or float32");
  }
  if (v.size != x.cols) {
    fail(op, name,
         "size " + std::to_string(v.size) + " does not match D = " + std::to_string(x.cols));
  }
}

void check_eps(const char* op, float eps) {
  if (!std::isfinite(eps) || eps < 0.0f) {
    fail(op, "eps", "must be finite and >= 0, got " + std::to_string(eps));
  }
}

// An output must not overlap an input unless it is exactly the same view (in-place).
void check_no_overlap(const char* op, const char* out_name, const ByteRange& out,
                      const char* in_name, const ByteRange& in) {
  if (out.overlaps(in)) {
    fail(op, out_name, std::string("overlaps '") + in_name + "'");
  }
}

bool same_view(const ConstMatrix& a, const ConstMatrix& b) {
  return a.data == b.data && a.row_stride == b.row_stride;
}

// Phase 2's whole-row length: at least this slice's.
void check_full_cols(const char* op, std::int64_t full_cols, const ConstMatrix& x) {
  if (full_cols < x.cols) {
    fail(op, "full_cols",
         std::to_string(full_cols) + " is smaller than the slice's D = " + std::to_string(x.cols));
  }
}

// A per-row fp32 array the call cannot do without.
void check_required_rows(const char* op, const char* name, const float* data, std::int64_t rows) {
  if (data == nullptr && rows > 0) fail(op, name, "is null but rows > 0 (required)");
}

// float64 is a verification dtype of the one-call operators (fusednorm.h, Numerics): the
// phased operators exchange fp32 row sums, and the quantized ones are an inference path.
constexpr const char* kPhasedFloat64 =
    "the two-phase operators (their row sums are fp32; use the one-call operator)";
void refuse_float64(const char* op, const ConstMatrix& x, const char* why) {
  if (x.dtype == DType::kFloat64) {
    fail(op, "x", std::string("dtype float64 is not supported by ") + why);
  }
}

// Phase 1 of the forward: x (and residual), the sums out (LayerNorm's deviations: and the
// whole row's sums in), nothing else.
void validate_partial_sums(const char* op, const ForwardProblem& p) {
  check_matrix(op, "x", p.x);
  if (p.has_residual()) check_same_shape(op, "residual", p.residual, p.x);
  const char* out_name = p.kind == NormKind::kRms               ? "row_sum_squares"
                         : p.phase == Phase::kPartialDeviations ? "row_sum_squared_deviations"
                                                                : "row_sum";
  check_required_rows(op, out_name, p.partial_sums, p.rows());
  const ByteRange sums = float_range(p.partial_sums, p.rows());
  check_no_overlap(op, out_name, sums, "x", byte_range(p.x));
  if (p.has_residual()) {
    const ByteRange residual = byte_range(p.residual);
    check_no_overlap(op, "residual", residual, "x", byte_range(p.x));
    check_no_overlap(op, out_name, sums, "residual", residual);
  }
  if (p.phase == Phase::kPartialDeviations) {
    check_required_rows(op, "row_sum", p.row_sum, p.rows());
    check_full_cols(op, p.full_cols, p.x);
    check_no_overlap(op, out_name, sums, "row_sum", float_range(p.row_sum, p.rows()));
  }
}

// The quantized operators: x (and residual) in, residual (updated in place), q and the row
// scales out; static scale and upper bound in.
void validate_quantized(const char* op, const ForwardProblem& p) {
  check_matrix(op, "x", p.x);
  refuse_float64(op, p.x, "the quantized operators (inputs: float32, float16, bfloat16)");
  if (p.has_residual()) check_same_shape(op, "residual", p.residual, p.x);
  if (!quantized_dtype(p.q.dtype)) {
    const bool known = valid_dtype(p.q.dtype);
    fail(op, "q",
         std::string("dtype ") +
             (known ? dtype_name(p.q.dtype) : std::to_string(static_cast<int>(p.q.dtype))) +
             " is not a quantized dtype (int8 or float8_e4m3fn)");
  }
  check_view(op, "q", p.q);
  if (p.q.rows != p.x.rows || p.q.cols != p.x.cols) {
    fail(op, "q",
         "shape " + std::to_string(p.q.rows) + " x " + std::to_string(p.q.cols) +
             " does not match x's " + std::to_string(p.x.rows) + " x " + std::to_string(p.x.cols));
  }
  check_vector(op, "weight", p.weight, p.x);
  check_eps(op, p.eps);
  if (!std::isfinite(p.weight_offset)) fail(op, "weight_offset", "must be finite");

  const QuantScale& s = p.quant_scale;
  // Zero rows need no row_scales (an empty buffer may have no address: torch's have none).
  if (s.static_scale == nullptr && s.row_scales == nullptr && p.rows() > 0) {
    fail(op, "scale",
         "neither static_scale nor row_scales is given (exactly one: a static scale, or "
         "row_scales for dynamic per-token scales)");
  }
  if (s.static_scale != nullptr && s.row_scales != nullptr) {
    fail(op, "scale",
         "both static_scale and row_scales are given (exactly one: a static scale, or "
         "row_scales for dynamic per-token scales)");
  }
  if (s.scale_upper_bound != nullptr && s.static_scale != nullptr) {
    fail(op, "scale.scale_upper_bound", "is only for dynamic scales (row_scales), not static");
  }

  const ByteRange x = byte_range(p.x);
  const ByteRange residual = byte_range(p.residual);
  const ByteRange q = byte_range(p.q);
  const ByteRange weight = byte_range(p.weight);
  const ByteRange static_scale = float_range(s.static_scale, 1);
  const ByteRange upper_bound = float_range(s.scale_upper_bound, 1);
  const ByteRange row_scales = float_range(s.row_scales, p.rows());
  const std::pair<const char*, ByteRange> inputs[] = {{"x", x},
                                                      {"weight", weight},
                                                      {"scale.static_scale", static_scale},
                                                      {"scale.scale_upper_bound", upper_bound}};
  const std::pair<const char*, ByteRange> outputs[] = {
      {"residual", residual}, {"q", q}, {"scale.row_scales", row_scales}};
  for (const auto& [out_name, out] : outputs) {
    for (const auto& [in_name, in] : inputs) check_no_overlap(op, out_name, out, in_name, in);
  }
  check_no_overlap(op, "q", q, "residual", residual);
  check_no_overlap(op, "scale.row_scales", row_scales, "residual", residual);
  check_no_overlap(op, "scale.row_scales", row_scales, "q", q);
}

}  // namespace

void validate_host_scales(const char* op, const ForwardProblem& p) {
  const std::pair<const char*, const float*> scalars[] = {
      {"scale.static_scale", p.quant_scale.static_scale},
      {"scale.scale_upper_bound", p.quant_scale.scale_upper_bound}};
  for (const auto& [name, value] : scalars) {
    if (value != nullptr && !(std::isfinite(*value) && *value > 0.0f)) {
      fail(op, name, "must be finite and > 0, got " + std::to_string(*value));
    }
  }
  const float* static_scale = p.quant_scale.static_scale;
  if (static_scale != nullptr && !detail::static_scale_reciprocal_is_finite(*static_scale)) {
    fail(op, "scale.static_scale", detail::static_scale_reciprocal_error(*static_scale));
  }
}

void validate(const char* op, const ForwardProblem& p) {
  if (p.is_quantized()) {
    validate_quantized(op, p);
    return;
  }
  if (p.phase != Phase::kWhole) {
    check_matrix(op, "x", p.x);
    refuse_float64(op, p.x, kPhasedFloat64);
  }
  if (p.phase == Phase::kPartialSums || p.phase == Phase::kPartialDeviations) {
    validate_partial_sums(op, p);
    return;
  }
  check_matrix(op, "x", p.x);
  if (p.has_residual()) check_same_shape(op, "residual", p.residual, p.x);
  check_same_shape(op, "y", p.y, p.x);
  if (p.phase == Phase::kFromSums) {
    check_full_cols(op, p.full_cols, p.x);
    const std::pair<const char*, const float*> sums[] = {
        {"row_sum_squares", p.row_sum_squares},
        {"row_sum", p.row_sum},
        {"row_sum_squared_deviations", p.row_sum_squared_deviations}};
    for (int i = 0; i < 3; ++i) {
      const auto& [name, data] = sums[i];
      if ((p.kind == NormKind::kRms) != (i == 0))
        continue;  // RMSNorm: the first; LayerNorm: the others
      check_required_rows(op, name, data, p.rows());
      const ByteRange in = float_range(data, p.rows());
      check_no_overlap(op, "y", byte_range(p.y), name, in);
      check_no_overlap(op, "rstd", float_range(p.rstd, p.rows()), name, in);
      check_no_overlap(op, "mean", float_range(p.mean, p.rows()), name, in);
    }
  }
  check_vector(op, "weight", p.weight, p.x);
  check_vector(op, "bias", p.bias, p.x);
  check_eps(op, p.eps);
  if (!std::isfinite(p.weight_offset)) fail(op, "weight_offset", "must be finite");

  const ByteRange y = byte_range(p.y);
  if (!same_view(p.y, p.x)) check_no_overlap(op, "y", y, "x", byte_range(p.x));
  if (p.has_residual()) {
    const ByteRange residual = byte_range(p.residual);
    check_no_overlap(op, "residual", residual, "x", byte_range(p.x));
    check_no_overlap(op, "y", y, "residual", residual);
  }
  const ByteRange rstd = float_range(p.rstd, p.rows());
  const ByteRange mean = float_range(p.mean, p.rows());
  for (const auto& [name, range] : {std::pair{"rstd", rstd}, std::pair{"mean", mean}}) {
    check_no_overlap(op, name, range, "x", byte_range(p.x));
    check_no_overlap(op, name, range, "y", y);
    check_no_overlap(op, name, range, "residual", byte_range(p.residual));
    check_no_overlap(op, name, range, "weight", byte_range(p.weight));
    check_no_overlap(op, name, range, "bias", byte_range(p.bias));
  }
  check_no_overlap(op, "rstd", rstd, "mean", mean);
  for (const auto& [name, range] :
       {std::pair{"weight", byte_range(p.weight)}, std::pair{"bias", byte_range(p.bias)}}) {
    check_no_overlap(op, "y", y, name, range);
    check_no_overlap(op, "residual", byte_range(p.residual), name, range);
  }
}

void validate(const char* op, const BackwardProblem& p) {
  check_matrix(op, "x", p.x);
  if (p.phase != Phase::kWhole) refuse_float64(op, p.x, kPhasedFloat64);
  check_same_shape(op, "dy", p.dy, p.x);
  if (p.dx.data != nullptr) check_same_shape(op, "dx", p.dx, p.x);
  const bool centered = p.kind == NormKind::kLayer;
  if (p.phase != Phase::kWhole) {
    // The statistics are the whole row's: they cannot be recomputed from a slice.
    if (centered) check_required_rows(op, "mean", p.mean, p.rows());
    check_required_rows(op, "rstd", p.rstd, p.rows());
  }
  if (p.phase == Phase::kPartialSums) {
    check_vector(op, "weight", p.weight, p.x);
    check_eps(op, p.eps);
    if (!std::isfinite(p.weight_offset)) fail(op, "weight_offset", "must be finite");
    check_required_rows(op, "row_sum_g_xhat", p.partial_sum_g_xhat, p.rows());
    if (centered) check_required_rows(op, "row_sum_g", p.partial_sum_g, p.rows());
    const ByteRange g_xhat = float_range(p.partial_sum_g_xhat, p.rows());
    const ByteRange g = float_range(p.partial_sum_g, p.rows());
    for (const auto& [name, range] :
         {std::pair{"dy", byte_range(p.dy)}, std::pair{"x", byte_range(p.x)},
          std::pair{"weight", byte_range(p.weight)},
          std::pair{"mean", float_range(p.mean, p.rows())},
          std::pair{"rstd", float_range(p.rstd, p.rows())}}) {
      check_no_overlap(op, "row_sum_g_xhat", g_xhat, name, range);
      check_no_overlap(op, "row_sum_g", g, name, range);
    }
    check_no_overlap(op, "row_sum_g", g, "row_sum_g_xhat", g_xhat);
    return;
  }
  if (p.phase == Phase::kFromSums) {
    check_required_rows(op, "row_sum_g_xhat", p.row_sum_g_xhat, p.rows());
    if (centered) check_required_rows(op, "row_sum_g", p.row_sum_g, p.rows());
    check_full_cols(op, p.full_cols, p.x);
  }
  if (p.has_addend()) {
    check_same_shape(op, "dx_addend", p.dx_addend, p.x);
    if (p.dx.data == nullptr) fail(op, "dx_addend", "given, but dx is absent");
    // In place (the addend is dx's own view) is fine: each element is read before it is
    // written. The addend may also be dy's view (dx then may or may not be dy too).
    if (!same_view(p.dx_addend, p.dx)) {
      check_no_overlap(op, "dx", byte_range(p.dx), "dx_addend", byte_range(p.dx_addend));
    }
  }
  check_vector(op, "weight", p.weight, p.x);
  check_vector(op, "dw", p.dw, p.x);
  check_vector(op, "db", p.db, p.x);
  check_eps(op, p.eps);
  if (!std::isfinite(p.weight_offset)) fail(op, "weight_offset", "must be finite");
  if (p.dw.data != nullptr && p.weight.data == nullptr) {
    fail(op, "dw", "given, but there is no weight to differentiate");
  }
  if (p.kind == NormKind::kLayer && ((p.mean == nullptr) != (p.rstd == nullptr))) {
    fail(op, p.mean == nullptr ? "mean" : "rstd", "mean and rstd must be given together");
  }

  const ByteRange dx = byte_range(p.dx);
  const ByteRange dw = byte_range(p.dw);
  const ByteRange db = byte_range(p.db);
  const ByteRange workspace{reinterpret_cast<std::uintptr_t>(p.workspace.data),
                            reinterpret_cast<std::uintptr_t>(p.workspace.data) +
                                (p.workspace.data ? p.workspace.bytes : 0)};
  if (!same_view(p.dx, p.dy)) check_no_overlap(op, "dx", dx, "dy", byte_range(p.dy));
  const std::pair<const char*, ByteRange> inputs[] = {
      {"x", byte_range(p.x)},
      {"weight", byte_range(p.weight)},
      {"mean", float_range(p.mean, p.rows())},
      {"rstd", float_range(p.rstd, p.rows())},
      {"row_sum_g_xhat", float_range(p.row_sum_g_xhat, p.rows())},
      {"row_sum_g", float_range(p.row_sum_g, p.rows())},
  };
  const std::pair<const char*, ByteRange> outputs[] = {
      {"dx", dx}, {"dw", dw}, {"db", db}, {"workspace", workspace}};
  for (const auto& [out_name, out] : outputs) {
    for (const auto& [in_name, in] : inputs) check_no_overlap(op, out_name, out, in_name, in);
  }
  for (const auto& [name, range] :
       {std::pair{"dw", dw}, std::pair{"db", db}, std::pair{"workspace", workspace}}) {
    check_no_overlap(op, name, range, "dy", byte_range(p.dy));
    check_no_overlap(op, name, range, "dx", dx);
    check_no_overlap(op, name, range, "dx_addend", byte_range(p.dx_addend));
  }
  check_no_overlap(op, "db", db, "dw", dw);
  check_no_overlap(op, "workspace", workspace, "dw", dw);
  check_no_overlap(op, "workspace", workspace, "db", db);
}

}  // namespace fusednorm::detail
