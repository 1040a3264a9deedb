#include "fusednorm/reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "core/quantize.h"
#include "core/scalar_convert.h"

namespace fusednorm::reference {
namespace {

using detail::load_as_double;

double element(const ConstMatrix& m, std::int64_t r, std::int64_t j) {
  return load_as_double(m.data, m.dtype, r * m.row_stride + j);
}

double weight_at(const ConstVector& w, std::int64_t j, double offset) {
  return w.data == nullptr ? 1.0 : load_as_double(w.data, w.dtype, j) + offset;
}

std::size_t index(std::int64_t r, std::int64_t cols, std::int64_t j) {
  return static_cast<std::size_t>(r * cols + j);
}

// Normalize rows of `source` (row-major rows x cols doubles).
ForwardResult normalize(const std::vector<double>& source, std::int64_t rows, std::int64_t cols,
                        bool centered, ConstVector weight, double weight_offset, ConstVector bias,
                        double eps) {
  ForwardResult out;
  out.y.resize(source.size());
  out.rstd.resize(static_cast<std::size_t>(rows));
  if (centered) out.mean.resize(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0.0;
    if (centered) {
      for (std::int64_t j = 0; j < cols; ++j) mean += source[index(r, cols, j)];
      mean /= static_cast<double>(cols);
      out.mean[r] = mean;
    }
    double mean_square = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double d = source[index(r, cols, j)] - mean;
      mean_square += d * d;
    }
    mean_square /= static_cast<double>(cols);
    // eps is an fp32 value in the API; add it as such.
    const double rstd = 1.0 / std::sqrt(mean_square + eps);
    out.rstd[r] = rstd;
    for (std::int64_t j = 0; j < cols; ++j) {
      double v = (source[index(r, cols, j)] - mean) * rstd * weight_at(weight, j, weight_offset);
      if (bias.data != nullptr) v += load_as_double(bias.data, bias.dtype, j);
      out.y[index(r, cols, j)] = v;
    }
  }
  return out;
}

std::vector<double> to_doubles(const ConstMatrix& m) {
  std::vector<double> v(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t j = 0; j < m.cols; ++j) v[index(r, m.cols, j)] = element(m, r, j);
  }
  return v;
}

BackwardResult backward(ConstMatrix dy, ConstMatrix x, ConstVector weight, double weight_offset,
                        bool centered, bool want_db, double eps, ConstMatrix dx_addend = {}) {
  const std::int64_t rows = x.rows, cols = x.cols;
  const ForwardResult fwd =
      normalize(to_doubles(x), rows, cols, centered, {}, 0.0, {}, eps);  // y = x_hat
  BackwardResult out;
  out.dx.resize(static_cast<std::size_t>(rows * cols));
  if (weight.data != nullptr) out.dw.assign(static_cast<std::size_t>(cols), 0.0);
  if (want_db) out.db.assign(static_cast<std::size_t>(cols), 0.0);
  out.dx_scale.resize(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum_g = 0.0, sum_g_xhat = 0.0, max_g = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = element(dy, r, j) * weight_at(weight, j, weight_offset);
      sum_g += g;
      sum_g_xhat += g * fwd.y[index(r, cols, j)];
      max_g = std::max(max_g, std::fabs(g));
    }
    out.dx_scale[static_cast<std::size_t>(r)] = fwd.rstd[r] * max_g;
    const double mean_g = centered ? sum_g / static_cast<double>(cols) : 0.0;
    const double mean_g_xhat = sum_g_xhat / static_cast<double>(cols);
    for (std::int64_t j = 0; j < cols; ++j) {
      const double xhat = fwd.y[index(r, cols, j)];
      const double d = element(dy, r, j);
      const double g = d * weight_at(weight, j, weight_offset);
      out.dx[index(r, cols, j)] = fwd.rstd[r] * (g - mean_g - xhat * mean_g_xhat);
      if (dx_addend.data != nullptr) {
        const double addend = element(dx_addend, r, j);
        out.dx[index(r, cols, j)] += addend;
        out.dx_scale[static_cast<std::size_t>(r)] =
            std::max(out.dx_scale[static_cast<std::size_t>(r)], std::fabs(addend));
      }
      if (!out.dw.empty()) out.dw[j] += d * xhat;
      if (want_db) out.db[j] += d;
    }
  }
  return out;
}

}  // namespace

ForwardResult rms_norm(ConstMatrix x, ConstVector weight, const RmsNormOptions& options) {
  return normalize(to_doubles(x), x.rows, x.cols, false, weight, options.weight_offset, {},
                   options.eps);
}

ForwardResult fused_add_rms_norm(ConstMatrix x, ConstMatrix residual, ConstVector weight,
                                 const RmsNormOptions& options) {
  std::vector<double> updated(static_cast<std::size_t>(x.rows * x.cols));
  for (std::int64_t r = 0; r < x.rows; ++r) {
    for (std::int64_t j = 0; j < x.cols; ++j) {
      // The stored residual is the fp32 sum rounded once to the dtype (float64: the fp64 sum).
      const double exact = element(x, r, j) + element(residual, r, j);
      updated[index(r, x.cols, j)] =
          residual.dtype == DType::kFloat64
              ? exact
              : detail::round_to_dtype(static_cast<float>(exact), residual.dtype);
    }
  }
  ForwardResult out =
      normalize(updated, x.rows, x.cols, false, weight, options.weight_offset, {}, options.eps);
  out.residual = std::move(updated);
  return out;
}

ForwardResult layer_norm(ConstMatrix x, ConstVector weight, ConstVector bias,
                         const LayerNormOptions& options) {
  return normalize(to_doubles(x), x.rows, x.cols, true, weight, 0.0, bias, options.eps);
}

BackwardResult rms_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                 const RmsNormOptions& options, ConstMatrix dx_addend) {
  return backward(dy, x, weight, options.weight_offset, false, false, options.eps, dx_addend);
}

std::vector<double> row_sum_squares(ConstMatrix x) {
  std::vector<double> sums(static_cast<std::size_t>(x.rows), 0.0);
  for (std::int64_t r = 0; r < x.rows; ++r) {
    for (std::int64_t j = 0; j < x.cols; ++j) sums[r] += element(x, r, j) * element(x, r, j);
  }
  return sums;
}

std::vector<double> row_sum_g_xhat(ConstMatrix dy, ConstMatrix x, ConstVector weight,
                                   const float* rstd, const RmsNormOptions& options) {
  std::vector<double> sums(static_cast<std::size_t>(x.rows), 0.0);
  for (std::int64_t r = 0; r < x.rows; ++r) {
    for (std::int64_t j = 0; j < x.cols; ++j) {
      sums[r] += element(dy, r, j) * weight_at(weight, j, options.weight_offset) *
                 (element(x, r, j) * rstd[r]);
    }
  }
  return sums;
}

BackwardResult layer_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight, bool want_db,
                                   const LayerNormOptions& options) {
  return backward(dy, x, weight, 0.0, true, want_db, options.eps);
}

QuantResult rms_norm_quant(ConstMatrix x, ConstMatrix residual, ConstVector weight, DType q_dtype,
                           const float* static_scale, const float* scale_upper_bound,
                           const RmsNormOptions& options) {
  const ForwardResult norm = residual.data != nullptr
                                 ? fused_add_rms_norm(x, residual, weight, options)
                                 : rms_norm(x, weight, options);
  const bool fp8 = q_dtype == DType::kFloat8E4M3;
  const double qmax = fp8 ? detail::kFloat8E4M3Max : detail::kInt8Max;
  const double min_scale = fp8 ? detail::kFloat8E4M3MinScale : detail::kInt8MinScale;
  QuantResult out;
  out.y = norm.y;
  out.residual = norm.residual;
  out.scale.resize(static_cast<std::size_t>(x.rows));
  out.q_exact.resize(out.y.size());
  for (std::int64_t r = 0; r < x.rows; ++r) {
    double scale;
    if (static_scale != nullptr) {
      scale = *static_scale;
    } else {
      double amax = 0.0;  // over the non-NaN values (fmax ignores a NaN operand)
      for (std::int64_t j = 0; j < x.cols; ++j) {
        amax = std::fmax(amax, std::fabs(out.y[index(r, x.cols, j)]));
      }
      if (scale_upper_bound != nullptr) amax = std::min(amax, double{*scale_upper_bound});
      scale = std::max(amax / qmax, min_scale);
    }
    out.scale[static_cast<std::size_t>(r)] = scale;
    for (std::int64_t j = 0; j < x.cols; ++j) {
      out.q_exact[index(r, x.cols, j)] = out.y[index(r, x.cols, j)] / scale;
    }
  }
  return out;
}

}  // namespace fusednorm::reference
