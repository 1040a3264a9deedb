// The float64 kernels: a verification dtype (fusednorm.h, Numerics; for gradient checks),
// not a speed path, so they are plain: one CTA per row (a grid-stride loop over rows), one
// element per access, each row's sums reduced by a fixed shared-memory tree (the same bits
// on every run and every schedule), statistics always computed in fp64 from x. dw / db come
// from a column kernel that walks the rows in order (deterministic, no partial slots): it
// needs only the rows' fp64 mean and rstd, which fit in the coefficient region of the
// workspace the other dtypes use (4 floats per row), so backward_workspace_bytes is the same
// for every dtype.
#include <math.h>

#include <algorithm>
#include <cstdint>

#include "cuda/launch_util.cuh"
#include "cuda/launchers.h"

namespace fusednorm::cuda {
namespace {

constexpr int kThreads = kFloat64Threads;
static_assert(kThreads * sizeof(double) <= kStaticSmemReserve, "the reduction's shared memory");
// Enough CTAs to fill any GPU; a larger problem loops over its rows.
constexpr std::int64_t kMaxRowCtas = 65535;

template <typename T>
__device__ __forceinline__ T* row_at(T* base, std::int64_t row, std::int64_t stride) {
  return base + row * stride;
}

// The CTA's sum of v (one value per thread), added in a fixed tree order; every thread
// gets the total. scratch holds kThreads doubles and is free again on return.
__device__ double cta_sum(double v, double* scratch) {
  const int t = static_cast<int>(threadIdx.x);
  scratch[t] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) scratch[t] += scratch[t + half];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

struct Stats {
  double mean;  // 0 for RMSNorm
  double rstd;
};

__device__ Stats row_stats(const double* x, std::int64_t cols, bool centered, double eps,
                           double* scratch) {
  const auto count = static_cast<double>(cols);
  double mean = 0.0;
  if (centered) {
    double s = 0.0;
    for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) s += x[j];
    mean = cta_sum(s, scratch) / count;
  }
  double s = 0.0;
  for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const double d = x[j] - mean;
    s += d * d;
  }
  return {mean, 1.0 / sqrt(cta_sum(s, scratch) / count + eps)};
}

// Each thread reads and writes only its own columns (j = threadIdx.x mod kThreads), so the
// fused add's residual update and an in-place y (= x) need no barrier of their own.
__global__ void __launch_bounds__(kThreads) forward_f64_kernel(ForwardArgs a) {
  __shared__ double scratch[kThreads];
  const double* weight = static_cast<const double*>(a.weight);
  const double* bias = static_cast<const double*>(a.bias);
  const double offset = a.weight_offset;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const double* source = row_at(static_cast<const double*>(a.x), r, a.x_stride);
    if (a.residual != nullptr) {
      double* residual = row_at(static_cast<double*>(a.residual), r, a.residual_stride);
      for (std::int64_t j = threadIdx.x; j < a.cols; j += kThreads) residual[j] += source[j];
      source = residual;
    }
    const Stats s = row_stats(source, a.cols, a.centered, a.eps, scratch);
    double* y = row_at(static_cast<double*>(a.y), r, a.y_stride);
    for (std::int64_t j = threadIdx.x; j < a.cols; j += kThreads) {
      double v = (source[j] - s.mean) * s.rstd;
      if (weight != nullptr) v *= weight[j] + offset;
      if (bias != nullptr) v += bias[j];
      y[j] = v;
    }
    if (threadIdx.x == 0) {
      if (a.rstd != nullptr) a.rstd[r] = static_cast<float>(s.rstd);
      if (a.mean != nullptr) a.mean[r] = static_cast<float>(s.mean);
    }
  }
}

// Each row's fp64 mean and rstd, for the column kernel: stats[2 r], stats[2 r + 1].
__global__ void __launch_bounds__(kThreads) row_stats_f64_kernel(BackwardArgs a, double* stats) {
  __shared__ double scratch[kThreads];
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Stats s = row_stats(row_at(static_cast<const double*>(a.x), r, a.x_stride), a.cols,
                              a.centered, a.eps, scratch);
    if (threadIdx.x == 0) {
      stats[2 * r] = s.mean;
      stats[2 * r + 1] = s.rstd;
    }
  }
}

// dw[j] = sum_r dy[r, j] * x_hat[r, j] and db[j] = sum_r dy[r, j], rows added in order.
__global__ void __launch_bounds__(kThreads)
    weight_grads_f64_kernel(BackwardArgs a, const double* stats, double* dw, double* db) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= a.cols) return;
  double sum_w = 0.0, sum_b = 0.0;
  for (std::int64_t r = 0; r < a.rows; ++r) {
    const double d = row_at(static_cast<const double*>(a.dy), r, a.dy_stride)[j];
    const double x = row_at(static_cast<const double*>(a.x), r, a.x_stride)[j];
    sum_w += d * ((x - stats[2 * r]) * stats[2 * r + 1]);
    sum_b += d;
  }
  if (dw != nullptr) dw[j] = sum_w;
  if (db != nullptr) db[j] = sum_b;
}

// dx (+ dx_addend). dx may be dy or the addend: each thread reads its elements before it
// writes them, and its columns are its own.
__global__ void __launch_bounds__(kThreads) dx_f64_kernel(BackwardArgs a) {
  __shared__ double scratch[kThreads];
  const double* weight = static_cast<const double*>(a.weight);
  const double offset = a.weight_offset;
  const auto count = static_cast<double>(a.cols);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const double* x = row_at(static_cast<const double*>(a.x), r, a.x_stride);
    const double* dy = row_at(static_cast<const double*>(a.dy), r, a.dy_stride);
    const Stats s = row_stats(x, a.cols, a.centered, a.eps, scratch);
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (std::int64_t j = threadIdx.x; j < a.cols; j += kThreads) {
      const double g = weight != nullptr ? dy[j] * (weight[j] + offset) : dy[j];
      sum_g += g;
      sum_g_xhat += g * ((x[j] - s.mean) * s.rstd);
    }
    const double mean_g = a.centered ? cta_sum(sum_g, scratch) / count : 0.0;
    const double mean_g_xhat = cta_sum(sum_g_xhat, scratch) / count;
    const double* addend = a.dx_addend != nullptr ? row_at(static_cast<const double*>(a.dx_addend),
                                                           r, a.dx_addend_stride)
                                                  : nullptr;
    double* dx = row_at(static_cast<double*>(a.dx), r, a.dx_stride);
    for (std::int64_t j = threadIdx.x; j < a.cols; j += kThreads) {
      const double g = weight != nullptr ? dy[j] * (weight[j] + offset) : dy[j];
      double v = s.rstd * (g - mean_g - ((x[j] - s.mean) * s.rstd) * mean_g_xhat);
      if (addend != nullptr) v += addend[j];
      dx[j] = v;
    }
  }
}

dim3 row_grid(std::int64_t rows) {
  return dim3(static_cast<unsigned>(std::min(rows, kMaxRowCtas)));
}

}  // namespace

cudaError_t launch_forward_f64(const ForwardArgs& args, cudaStream_t stream) {
  return launch_kernel(forward_f64_kernel, row_grid(args.rows), dim3(kThreads), 0, 1, stream, args);
}

cudaError_t launch_backward_f64(const BackwardArgs& args, double* row_stats, void* dw, void* db,
                                cudaStream_t stream) {
  // dw / db first: dx may overwrite dy (in place).
  if (dw != nullptr || db != nullptr) {
    cudaError_t err = launch_kernel(row_stats_f64_kernel, row_grid(args.rows), dim3(kThreads), 0, 1,
                                    stream, args, row_stats);
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>((args.cols + kThreads - 1) / kThreads));
    err = launch_kernel(weight_grads_f64_kernel, grid, dim3(kThreads), 0, 1, stream, args,
                        static_cast<const double*>(row_stats), static_cast<double*>(dw),
                        static_cast<double*>(db));
    if (err != cudaSuccess) return err;
  }
  if (args.dx == nullptr) return cudaSuccess;
  return launch_kernel(dx_f64_kernel, row_grid(args.rows), dim3(kThreads), 0, 1, stream, args);
}

}  // namespace fusednorm::cuda
