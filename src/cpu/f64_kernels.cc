// Plain scalar loops in fp64, one row at a time: every sum, product and statistic is a
// double, and the statistics are recomputed from x wherever they are needed (the API's
// per-row statistics are fp32). Threads take whole rows; dw / db are summed over the same
// fixed row blocks as the fp32 backward (row_blocks), block partials added in block order, so
// the results are bit-identical for any thread count.
#include "cpu/f64_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/cpu_backend.h"

namespace fusednorm::cpu {
namespace {

using detail::BackwardProblem;
using detail::ForwardProblem;
using detail::NormKind;

const double* row_of(const ConstMatrix& m, std::int64_t r) {
  return static_cast<const double*>(m.data) + r * m.row_stride;
}
double* row_of(const Matrix& m, std::int64_t r) {
  return static_cast<double*>(m.data) + r * m.row_stride;
}
const double* vector_of(const ConstVector& v) { return static_cast<const double*>(v.data); }

struct RowStats {
  double mean;  // 0 for RMSNorm
  double rstd;
};

RowStats row_stats(const double* x, std::int64_t cols, bool centered, double eps) {
  const auto count = static_cast<double>(cols);
  double mean = 0.0;
  if (centered) {
    for (std::int64_t j = 0; j < cols; ++j) mean += x[j];
    mean /= count;
  }
  double sum_squares = 0.0;
  for (std::int64_t j = 0; j < cols; ++j) {
    const double d = x[j] - mean;
    sum_squares += d * d;
  }
  return {mean, 1.0 / std::sqrt(sum_squares / count + eps)};
}

int threads_for(std::int64_t rows, std::int64_t cols, int streams, int num_threads) {
  const auto bytes = static_cast<std::size_t>(streams * rows * cols) * sizeof(double);
  return plan_threads(rows, cols, bytes, num_threads).threads;
}

}  // namespace

void forward_f64(const ForwardProblem& p, int num_threads) {
  const std::int64_t rows = p.rows(), cols = p.cols();
  const bool centered = p.kind == NormKind::kLayer;
  const double eps = p.eps;
  const double offset = centered ? 0.0 : static_cast<double>(p.weight_offset);
  const double* w = vector_of(p.weight);
  const double* b = vector_of(p.bias);
  const int threads = threads_for(rows, cols, p.has_residual() ? 4 : 2, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* source = row_of(p.x, r);
    if (p.has_residual()) {
      // residual <- x + residual, then the stored residual is normalized. Every x element is
      // read before y (which may be x) is written.
      double* residual = row_of(p.residual, r);
      for (std::int64_t j = 0; j < cols; ++j) residual[j] += source[j];
      source = residual;
    }
    const RowStats s = row_stats(source, cols, centered, eps);
    double* y = row_of(p.y, r);
    for (std::int64_t j = 0; j < cols; ++j) {
      double v = (source[j] - s.mean) * s.rstd;
      if (w != nullptr) v *= w[j] + offset;
      if (b != nullptr) v += b[j];
      y[j] = v;
    }
    if (p.rstd != nullptr) p.rstd[r] = static_cast<float>(s.rstd);
    if (p.mean != nullptr) p.mean[r] = static_cast<float>(s.mean);
  }
}

void backward_f64(const BackwardProblem& p, int num_threads) {
  const std::int64_t rows = p.rows(), cols = p.cols();
  const bool centered = p.kind == NormKind::kLayer;
  const double eps = p.eps;
  const double offset = centered ? 0.0 : static_cast<double>(p.weight_offset);
  const double* w = vector_of(p.weight);
  const bool want_dx = p.dx.data != nullptr;
  const bool want_dw = p.dw.data != nullptr;
  const bool want_db = p.db.data != nullptr;
  const RowBlocks blocks = row_blocks(rows);
  // One row of partial sums per row block (fp64; the caller's workspace is sized for fp32).
  std::vector<double> dw_partial(want_dw ? static_cast<std::size_t>(blocks.count * cols) : 0);
  std::vector<double> db_partial(want_db ? static_cast<std::size_t>(blocks.count * cols) : 0);
  const int threads = threads_for(rows, cols, p.has_addend() ? 4 : 3, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t block = 0; block < blocks.count; ++block) {
    double* dw_acc = want_dw ? dw_partial.data() + block * cols : nullptr;
    double* db_acc = want_db ? db_partial.data() + block * cols : nullptr;
    const std::int64_t end = std::min(rows, (block + 1) * blocks.rows_per_block);
    for (std::int64_t r = block * blocks.rows_per_block; r < end; ++r) {
      const double* x = row_of(p.x, r);
      const double* dy = row_of(p.dy, r);
      // The given rstd / mean are fp32: recomputed here in fp64 (fusednorm.h, Numerics).
      const RowStats s = row_stats(x, cols, centered, eps);
      double sum_g = 0.0, sum_g_xhat = 0.0;
      for (std::int64_t j = 0; j < cols; ++j) {
        const double g = w != nullptr ? dy[j] * (w[j] + offset) : dy[j];
        sum_g += g;
        sum_g_xhat += g * (x[j] - s.mean) * s.rstd;
      }
      const double mean_g = centered ? sum_g / static_cast<double>(cols) : 0.0;
      const double mean_g_xhat = sum_g_xhat / static_cast<double>(cols);
      const double* addend = p.has_addend() ? row_of(p.dx_addend, r) : nullptr;
      double* dx = want_dx ? row_of(p.dx, r) : nullptr;
      // dx may be dy or the addend itself: each element is read before it is written.
      for (std::int64_t j = 0; j < cols; ++j) {
        const double d = dy[j];
        const double xhat = (x[j] - s.mean) * s.rstd;
        if (dw_acc != nullptr) dw_acc[j] += d * xhat;
        if (db_acc != nullptr) db_acc[j] += d;
        if (dx == nullptr) continue;
        const double g = w != nullptr ? d * (w[j] + offset) : d;
        double v = s.rstd * (g - mean_g - xhat * mean_g_xhat);
        if (addend != nullptr) v += addend[j];
        dx[j] = v;
      }
    }
  }
  // The block partials, added in block order.
  auto finish = [&](const std::vector<double>& partial, const Vector& out) {
    double* dst = static_cast<double*>(out.data);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::int64_t j = 0; j < cols; ++j) {
      double total = 0.0;
      for (std::int64_t block = 0; block < blocks.count; ++block)
        total += partial[block * cols + j];
      dst[j] = total;
    }
  };
  if (want_dw) finish(dw_partial, p.dw);
  if (want_db) finish(db_partial, p.db);
}

}  // namespace fusednorm::cpu
