#include "stepwise.h"

#include <cmath>
#include <vector>

#include "core/scalar_convert.h"

namespace fusednorm::bench {
namespace {

using detail::load_as_float;
using detail::store_from_float;

using Buffer = std::vector<float>;  // rows x cols, contiguous

Buffer upcast(ConstMatrix m, int threads) {
  Buffer out(static_cast<size_t>(m.rows * m.cols));
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t j = 0; j < m.cols; ++j) {
      out[r * m.cols + j] = load_as_float(m.data, m.dtype, r * m.row_stride + j);
    }
  }
  return out;
}

Buffer weight_as_float(ConstVector w, std::int64_t cols) {
  Buffer out(static_cast<size_t>(cols), 1.0f);
  for (std::int64_t j = 0; w.data != nullptr && j < cols; ++j)
    out[j] = load_as_float(w.data, w.dtype, j);
  return out;
}

Buffer square(const Buffer& a, int threads) {
  Buffer out(a.size());
#pragma omp parallel for num_threads(threads)
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(a.size()); ++i) out[i] = a[i] * a[i];
  return out;
}

Buffer row_mean(const Buffer& a, std::int64_t rows, std::int64_t cols, int threads) {
  Buffer out(static_cast<size_t>(rows));
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (std::int64_t j = 0; j < cols; ++j) sum += a[r * cols + j];
    out[r] = sum / static_cast<float>(cols);
  }
  return out;
}

Buffer rsqrt_plus_eps(const Buffer& mean_square, float eps) {
  Buffer out(mean_square.size());
  for (size_t r = 0; r < out.size(); ++r) out[r] = 1.0f / std::sqrt(mean_square[r] + eps);
  return out;
}

// out[r, j] = a[r, j] * row[r]
Buffer scale_rows(const Buffer& a, const Buffer& row, std::int64_t cols, int threads) {
  Buffer out(a.size());
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < static_cast<std::int64_t>(row.size()); ++r) {
    for (std::int64_t j = 0; j < cols; ++j) out[r * cols + j] = a[r * cols + j] * row[r];
  }
  return out;
}

// out[r, j] = a[r, j] * col[j]
Buffer scale_cols(const Buffer& a, const Buffer& col, int threads) {
  Buffer out(a.size());
  const auto cols = static_cast<std::int64_t>(col.size());
  const auto rows = static_cast<std::int64_t>(a.size()) / cols;
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) out[r * cols + j] = a[r * cols + j] * col[j];
  }
  return out;
}

void downcast(const Buffer& a, Matrix out, int threads) {
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < out.rows; ++r) {
    for (std::int64_t j = 0; j < out.cols; ++j) {
      store_from_float(out.data, out.dtype, r * out.row_stride + j, a[r * out.cols + j]);
    }
  }
}

}  // namespace

void stepwise_rms_norm(ConstMatrix x, ConstVector weight, Matrix y, float eps, int threads) {
  const Buffer xf = upcast(x, threads);
  const Buffer rstd = rsqrt_plus_eps(row_mean(square(xf, threads), x.rows, x.cols, threads), eps);
  const Buffer normalized = scale_rows(xf, rstd, x.cols, threads);
  downcast(scale_cols(normalized, weight_as_float(weight, x.cols), threads), y, threads);
}

void stepwise_rms_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight, Matrix dx,
                                Vector dw, float eps, int threads) {
  const std::int64_t rows = x.rows, cols = x.cols;
  const Buffer xf = upcast(x, threads);
  const Buffer dyf = upcast(dy, threads);
  const Buffer rstd = rsqrt_plus_eps(row_mean(square(xf, threads), rows, cols, threads), eps);
  const Buffer x_hat = scale_rows(xf, rstd, cols, threads);
  const Buffer g = scale_cols(dyf, weight_as_float(weight, cols), threads);
  Buffer g_xhat(g.size());
#pragma omp parallel for num_threads(threads)
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(g.size()); ++i)
    g_xhat[i] = g[i] * x_hat[i];
  const Buffer mean_g_xhat = row_mean(g_xhat, rows, cols, threads);
  Buffer dxf(g.size());
#pragma omp parallel for num_threads(threads)
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t i = r * cols + j;
      dxf[i] = rstd[r] * (g[i] - x_hat[i] * mean_g_xhat[r]);
    }
  }
  downcast(dxf, dx, threads);
  if (dw.data == nullptr) return;
  Buffer dy_xhat(g.size());
#pragma omp parallel for num_threads(threads)
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(g.size()); ++i)
    dy_xhat[i] = dyf[i] * x_hat[i];
#pragma omp parallel for num_threads(threads)
  for (std::int64_t j = 0; j < cols; ++j) {
    float sum = 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) sum += dy_xhat[r * cols + j];
    store_from_float(dw.data, dw.dtype, j, sum);
  }
}

}  // namespace fusednorm::bench
