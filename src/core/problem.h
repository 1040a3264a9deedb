// The validated, backend-neutral description of one operator call. The public entry
// points (src/dispatch/api.cpp) build one of these, validate it once (validate.cpp), and
// hand it to a backend.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fusednorm/fusednorm.h"

namespace fusednorm::detail {

// Half-open byte range [begin, end) a view touches; empty when it has no rows.
// The bytes of a row-strided view: rows of `width` bytes, `pitch` bytes apart, within the
// extent [begin, end) (pitch 0: a single run, the whole extent; width is then ignored). overlaps()
// is exact for two views with the same pitch, or where either is a single run: two column slices of
// one matrix (x[:, :64] and x[:, 64:]) do not overlap. Otherwise it compares the extents, which
// errs on the safe side.
struct ByteRange {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  std::uintptr_t width = 0;
  std::uintptr_t pitch = 0;
  std::size_t bytes() const { return end - begin; }
  bool overlaps(const ByteRange& other) const {
    if (!(begin < end && other.begin < other.end && begin < other.end && other.begin < end)) {
      return false;
    }
    const std::uintptr_t p = pitch != 0 ? pitch : other.pitch;
    if (p == 0) return true;  // two single runs whose extents meet
    const std::uintptr_t w = run_width(), ow = other.run_width();
    if ((pitch != 0 && other.pitch != 0 && pitch != other.pitch) || w > p || ow > p) return true;
    // Row i here is [begin + i p, + width), row j there [other.begin + j p, + other.width):
    // they meet iff -other.width < d + k p < width for d = other.begin - begin and some
    // k = j - i with i, j within the row counts.
    const auto ip = static_cast<std::int64_t>(p);
    const std::int64_t d = static_cast<std::int64_t>(other.begin - begin);  // two's complement
    auto floor_div = [](std::int64_t a, std::int64_t b) { return a / b - (a % b != 0 && a < 0); };
    const auto sw = static_cast<std::int64_t>(w), sow = static_cast<std::int64_t>(ow);
    const std::int64_t k_low = std::max(floor_div(-sow - d, ip) + 1, -(row_count() - 1));
    const std::int64_t k_high = std::min(-floor_div(d - sw, ip) - 1, other.row_count() - 1);
    return k_low <= k_high;
  }
  std::uintptr_t run_width() const { return pitch == 0 ? end - begin : width; }
  std::int64_t row_count() const {
    return pitch == 0 ? 1 : static_cast<std::int64_t>((end - begin - width) / pitch) + 1;
  }
};

inline ByteRange byte_range(const void* data, DType dtype, std::int64_t rows, std::int64_t stride,
                            std::int64_t cols) {
  if (rows == 0 || data == nullptr) return {};
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const auto esize = static_cast<std::uintptr_t>(dtype_size(dtype));
  const auto elements = static_cast<std::uintptr_t>((rows - 1) * stride + cols);
  const std::uintptr_t pitch = rows > 1 ? static_cast<std::uintptr_t>(stride) * esize : 0;
  return {begin, begin + elements * esize,
          pitch == 0 ? elements * esize : static_cast<std::uintptr_t>(cols) * esize, pitch};
}

inline ByteRange byte_range(const ConstMatrix& m) {
  return byte_range(m.data, m.dtype, m.rows, m.row_stride, m.cols);
}
inline ByteRange byte_range(const ConstVector& v) {
  return byte_range(v.data, v.dtype, 1, 0, v.size);
}

enum class NormKind { kRms, kLayer };

// The weight offset as both backends add it: without one, -0.0f, which leaves every value,
// -0.0 included, unchanged (+0.0f would turn a -0.0 weight into +0.0), so a -0.0 weight
// gives the same signed zeros on the CPU and the GPU.
inline float kernel_weight_offset(float weight_offset) {
  return weight_offset == 0.0f ? -0.0f : weight_offset;
}

// Which part of an operator a call runs (see fusednorm.h's phased operators): the whole
// operator; phase 1 (per-row partial sums of a column slice, nothing else; LayerNorm's
// forward has two: the sums of x, then the squared deviations from the whole row's mean); or
// phase 2 (the rest, given the whole row's sums over full_cols columns).
enum class Phase { kWhole, kPartialSums, kPartialDeviations, kFromSums };

struct ForwardProblem {
  NormKind kind = NormKind::kRms;
  ConstMatrix x;
  Matrix residual;  // fused add only: residual <- x + residual, then normalize residual
  ConstVector weight;
  ConstVector bias;  // LayerNorm only
  Matrix y;
  float* mean = nullptr;  // LayerNorm only
  float* rstd = nullptr;
  float eps = 0.0f;
  float weight_offset = 0.0f;  // RMSNorm only
  Phase phase = Phase::kWhole;
  // Phase 1's output, per row: RMSNorm's sum of squares, LayerNorm's sum of x
  // (kPartialSums) or of squared deviations from the row's mean (kPartialDeviations).
  float* partial_sums = nullptr;
  // Over the whole row (full_cols columns), per row: RMSNorm's sum of squares (kFromSums);
  // LayerNorm's sum of x (kPartialDeviations, kFromSums) and sum of squared deviations
  // (kFromSums).
  const float* row_sum_squares = nullptr;
  const float* row_sum = nullptr;
  const float* row_sum_squared_deviations = nullptr;
  std::int64_t full_cols = 0;
  // Quantized operators (RMSNorm only): q (kInt8 or kFloat8E4M3) replaces y, which is then
  // absent; quant_scale as fusednorm.h's QuantScale. `quantized` says which operator this
  // is (q.data may be null when there are no rows).
  bool quantized = false;
  Matrix q;
  QuantScale quant_scale;

  bool has_residual() const { return residual.data != nullptr; }
  bool is_quantized() const { return quantized; }
  std::int64_t rows() const { return x.rows; }
  std::int64_t cols() const { return x.cols; }
};

struct BackwardProblem {
  NormKind kind = NormKind::kRms;
  ConstMatrix dy;
  ConstMatrix x;
  ConstVector weight;
  const float* mean = nullptr;  // LayerNorm only
  const float* rstd = nullptr;
  Matrix dx;
  ConstMatrix dx_addend;  // RMSNorm only; nullable: dx = norm's dx + dx_addend
  Vector dw;
  Vector db;  // LayerNorm only
  float eps = 0.0f;
  float weight_offset = 0.0f;
  Workspace workspace;
  Phase phase = Phase::kWhole;
  // kPartialSums: per row, sum of g * x_hat and (LayerNorm) sum of g over the slice.
  float* partial_sum_g_xhat = nullptr;
  float* partial_sum_g = nullptr;
  // kFromSums: the same sums over the whole row of full_cols columns.
  const float* row_sum_g_xhat = nullptr;
  const float* row_sum_g = nullptr;
  std::int64_t full_cols = 0;

  bool has_addend() const { return dx_addend.data != nullptr; }

  std::int64_t rows() const { return x.rows; }
  std::int64_t cols() const { return x.cols; }
};

// Throw fusednorm::Error naming `op` and the offending argument if the problem is invalid.
void validate(const char* op, const ForwardProblem& problem);
void validate(const char* op, const BackwardProblem& problem);
// The quantized operators' static scale and scale upper bound must be finite and > 0: checked
// where their values can be read without a synchronisation (host memory: the CPU backend).
void validate_host_scales(const char* op, const ForwardProblem& problem);

[[noreturn]] void fail(const char* op, const char* argument, const std::string& message);

}  // namespace fusednorm::detail
