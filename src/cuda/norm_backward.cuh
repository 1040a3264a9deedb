// Backward kernels of RMSNorm and LayerNorm.
//
// With x_hat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * (w + weight_offset):
//   dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))   (mean(g) only for LayerNorm)
//   dw = sum over rows of dy * x_hat,  db = sum over rows of dy.
// dw / db are deterministic: each CTA (or row block) sums its rows into one fp32 partial
// row of the workspace, in a fixed order, and finish_column_sums_kernel adds the partial
// rows in slot order. No float atomics anywhere.
#pragma once

#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda/kernel_args.h"
#include "cuda/launch_plan.h"
#include "cuda/norm_common.cuh"

namespace fusednorm::cuda {

// kAccumulate: dw or db is wanted. dw is accumulated when there is a weight, db for
// LayerNorm; a partial pointer that is null is simply not written.
template <bool kCentered_, bool kWeight_, bool kAccumulate_>
struct BackwardVariant {
  static constexpr bool kCentered = kCentered_;
  static constexpr bool kWeight = kWeight_;
  static constexpr bool kAccumulate = kAccumulate_;
  static constexpr bool kDw = kAccumulate_ && kWeight_;
  static constexpr bool kDb = kAccumulate_ && kCentered_;
};

// Writes kVec fp32 values to dst (16-byte stores where the vector allows).
template <int kVec>
__device__ __forceinline__ void store_floats(const float (&v)[kVec], float* dst) {
  constexpr int kPiece = kVec < 4 ? kVec : 4;
#pragma unroll
  for (int h = 0; h < kVec / kPiece; ++h) {
    Pack<float, kPiece> pk;
#pragma unroll
    for (int i = 0; i < kPiece; ++i) pk.set(i, v[h * kPiece + i]);
    pk.store(dst + h * kPiece);
  }
}

// ---- Small and medium D: dy and x in registers, dw / db accumulated in registers -------

// The CTA's partial row: sub-team sums (one per threadIdx.y) are added in threadIdx.y
// order through shared memory, then written to slot blockIdx.x.
template <int kVec, int kK>
__device__ void write_partial_row(const float (&acc)[kK][kVec], float* partial, std::int64_t cols,
                                  float* combine) {
  const int team = blockDim.x;
  const std::int64_t nvec = cols / kVec;
  float* dst = partial + static_cast<std::int64_t>(blockIdx.x) * cols;
  if (blockDim.y == 1) {
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (j < nvec) store_floats(acc[k], dst + j * kVec);
    }
    return;
  }
  const int row_floats = team * kK * kVec;
#pragma unroll
  for (int k = 0; k < kK; ++k) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      combine[threadIdx.y * row_floats + (threadIdx.x + k * team) * kVec + i] = acc[k][i];
    }
  }
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (j >= nvec) continue;
      float total[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) total[i] = 0.0f;
      for (int y = 0; y < static_cast<int>(blockDim.y); ++y) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) total[i] += combine[y * row_floats + (threadIdx.x + k * team) * kVec + i];
      }
      store_floats(total, dst + j * kVec);
    }
  }
  __syncthreads();  // combine is reused by the next call
}

// Block (team, rows_per_cta), persistent grid: the grid is the number of partial slots.
template <typename T, int kVec, int kK, typename V>
__global__ void __launch_bounds__(512, 1)
    norm_backward_register_kernel(const BackwardArgs a, const std::int64_t row_groups) {
  extern __shared__ float combine[];
  __shared__ float scratch[64];
  const int team = blockDim.x;
  const std::int64_t nvec = a.cols / kVec;
  const float cols = static_cast<float>(a.cols);

  // The weight is re-read (from L1 / L2) where it is used: held across rows next to dy, x
  // and the dw / db accumulators it made ptxas spill.
  auto load_w = [&](std::int64_t j, float (&w)[kVec]) {
    if constexpr (V::kWeight) load_param<T, kVec>(a.weight, a.weight_f32, j * kVec, a.weight_offset, w);
  };
  float dw[kK][kVec], db[kK][kVec];
#pragma unroll
  for (int k = 0; k < kK; ++k) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dw[k][i] = db[k][i] = 0.0f;
  }

  for (std::int64_t g = blockIdx.x; g < row_groups; g += gridDim.x) {
    const std::int64_t row = g * blockDim.y + threadIdx.y;
    const bool row_ok = row < a.rows;
    const T* dy_row = row_ptr<T>(a.dy, row, a.dy_stride);
    const T* x_row = row_ptr<T>(a.x, row, a.x_stride);

    Pack<T, kVec> dyv[kK], xv[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (row_ok && j < nvec) {
        dyv[k].load(dy_row + j * kVec);
        xv[k].load(x_row + j * kVec);
      } else {
        dyv[k].zero();  // g = 0 on padding: no contribution to the dot products
        xv[k].zero();
      }
    }

    float mean = 0.0f, rstd;
    if (a.rstd != nullptr) {
      rstd = row_ok ? a.rstd[row] : 0.0f;
      if (V::kCentered && row_ok) mean = a.mean[row];
    } else {
      // Recompute exactly as the forward does.
      float s[1] = {0.0f};
#pragma unroll
      for (int k = 0; k < kK; ++k) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float f = xv[k].get(i);
          s[0] += V::kCentered ? f : f * f;
        }
      }
      team_sum(s, team, scratch);
      const float2 stats =
          register_row_stats<V::kCentered>(xv, s[0], nvec, team, scratch, cols, a.eps);
      mean = stats.x;
      rstd = stats.y;
    }

    constexpr int kDots = V::kCentered ? 2 : 1;
    float dots[kDots];  // sum g * x_hat [, sum g]
#pragma unroll
    for (int d = 0; d < kDots; ++d) dots[d] = 0.0f;
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      float w[kVec];
      if (j < nvec) load_w(j, w);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gi = V::kWeight && j < nvec ? dyv[k].get(i) * w[i] : dyv[k].get(i);
        const float xhat = (V::kCentered ? xv[k].get(i) - mean : xv[k].get(i)) * rstd;
        dots[0] += gi * xhat;
        if constexpr (V::kCentered) dots[kDots - 1] += gi;
      }
    }
    team_sum(dots, team, scratch);
    const float mean_g_xhat = dots[0] / cols;
    const float mean_g = V::kCentered ? dots[kDots - 1] / cols : 0.0f;

    if (row_ok) {
      T* dx_row = a.dx != nullptr ? row_ptr<T>(a.dx, row, a.dx_stride) : nullptr;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
        if (j >= nvec) continue;
        float w[kVec];
        load_w(j, w);
        Pack<T, kVec> out;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float dyi = dyv[k].get(i);
          const float gi = V::kWeight ? dyi * w[i] : dyi;
          const float xhat = (V::kCentered ? xv[k].get(i) - mean : xv[k].get(i)) * rstd;
          if constexpr (V::kDw) dw[k][i] += dyi * xhat;
          if constexpr (V::kDb) db[k][i] += dyi;
          out.set(i, rstd * (gi - mean_g - xhat * mean_g_xhat));
        }
        if (dx_row != nullptr) out.store(dx_row + j * kVec);
      }
    }
  }

  if constexpr (V::kDw) {
    if (a.dw_partial != nullptr) write_partial_row<kVec, kK>(dw, a.dw_partial, a.cols, combine);
  }
  if constexpr (V::kDb) {
    if (a.db_partial != nullptr) write_partial_row<kVec, kK>(db, a.db_partial, a.cols, combine);
  }
}

// ---- Large D: per-row coefficients, then column tiles ----------------------------------

inline constexpr int kCoefThreads = kTwoPassThreads;
inline constexpr int kTileRowBatch = 4;

struct AddFloat2 {
  __device__ __forceinline__ float2 operator()(float2 p, float2 q) const {
    return make_float2(p.x + q.x, p.y + q.y);
  }
};

// One CTA of kCoefThreads per row (grid-stride). Computes the row's mean / rstd (given or
// recomputed) and mean(g), mean(g * x_hat). kWriteDx: also writes dx in a third pass over
// the row (used when only dx is wanted, which needs no workspace); otherwise stores the
// four coefficients for the column-tile kernel.
template <typename T, int kVec, typename V, bool kWriteDx>
__global__ void __launch_bounds__(kCoefThreads, 1) norm_backward_coef_kernel(const BackwardArgs a) {
  using BlockReduce = cub::BlockReduce<float2, kCoefThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ float2 broadcast;
  const std::int64_t nvec = a.cols / kVec;
  const float cols = static_cast<float>(a.cols);
  auto block_sum = [&](float2 v) {
    const float2 total = BlockReduce(temp).Reduce(v, AddFloat2{});
    if (threadIdx.x == 0) broadcast = total;
    __syncthreads();
    const float2 result = broadcast;
    __syncthreads();  // temp and broadcast are reused by the next reduction
    return result;
  };

  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* dy = row_ptr<T>(a.dy, row, a.dy_stride);
    const T* x = row_ptr<T>(a.x, row, a.x_stride);
    float mean = 0.0f, rstd;
    if (a.rstd != nullptr) {
      rstd = a.rstd[row];
      if (V::kCentered) mean = a.mean[row];
    } else {
      float s = 0.0f;
#pragma unroll 4
      for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
        Pack<T, kVec> xv;
        xv.load(x + j * kVec);
#pragma unroll
        for (int i = 0; i < kVec; ++i) s += V::kCentered ? xv.get(i) : xv.get(i) * xv.get(i);
      }
      float variance = block_sum(make_float2(s, 0.0f)).x / cols;
      if constexpr (V::kCentered) {
        mean = variance;
        float dev = 0.0f;
#pragma unroll 4
        for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
          Pack<T, kVec> xv;
          xv.load(x + j * kVec);
#pragma unroll
          for (int i = 0; i < kVec; ++i) dev += (xv.get(i) - mean) * (xv.get(i) - mean);
        }
        variance = block_sum(make_float2(dev, 0.0f)).x / cols;
      }
      rstd = 1.0f / sqrtf(variance + a.eps);
    }

    float2 dots = make_float2(0.0f, 0.0f);  // sum g * x_hat, sum g
#pragma unroll 4
    for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
      Pack<T, kVec> dyv, xv;
      dyv.load(dy + j * kVec);
      xv.load(x + j * kVec);
      float w[kVec];
      if constexpr (V::kWeight) load_param<T, kVec>(a.weight, a.weight_f32, j * kVec, a.weight_offset, w);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gi = V::kWeight ? dyv.get(i) * w[i] : dyv.get(i);
        dots.x += gi * ((V::kCentered ? xv.get(i) - mean : xv.get(i)) * rstd);
        dots.y += gi;
      }
    }
    dots = block_sum(dots);
    const float mean_g_xhat = dots.x / cols;
    const float mean_g = V::kCentered ? dots.y / cols : 0.0f;

    if constexpr (kWriteDx) {
      T* dx = row_ptr<T>(a.dx, row, a.dx_stride);
      for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
        Pack<T, kVec> dyv, xv, out;
        dyv.load(dy + j * kVec);
        xv.load(x + j * kVec);
        float w[kVec];
        if constexpr (V::kWeight) load_param<T, kVec>(a.weight, a.weight_f32, j * kVec, a.weight_offset, w);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float gi = V::kWeight ? dyv.get(i) * w[i] : dyv.get(i);
          const float xhat = (V::kCentered ? xv.get(i) - mean : xv.get(i)) * rstd;
          out.set(i, rstd * (gi - mean_g - xhat * mean_g_xhat));
        }
        out.store(dx + j * kVec);
      }
    } else if (threadIdx.x == 0) {
      reinterpret_cast<float4*>(a.coef)[row] = make_float4(mean, rstd, mean_g, mean_g_xhat);
    }
  }
}

// Grid (col_tiles, row_blocks), kTileThreads threads, one vector of columns per thread:
// dx for the tile's rows, and the tile's dw / db partial sums over its row block, written
// to slot blockIdx.y.
template <typename T, int kVec, typename V>
__global__ void __launch_bounds__(kTileThreads)
    norm_backward_tile_kernel(const BackwardArgs a, const std::int64_t rows_per_block) {
  const std::int64_t nvec = a.cols / kVec;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kTileThreads + threadIdx.x;
  if (j >= nvec) return;  // no barriers below
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * rows_per_block;
  const std::int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;

  float w[kVec];
  if constexpr (V::kWeight) load_param<T, kVec>(a.weight, a.weight_f32, j * kVec, a.weight_offset, w);
  float dw[kVec], db[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) dw[i] = db[i] = 0.0f;

  for (std::int64_t r = r0; r < r1; r += kTileRowBatch) {
    // Batch the loads of several rows before the first dx store (dx may alias dy).
    Pack<T, kVec> dyv[kTileRowBatch], xv[kTileRowBatch];
    float4 c[kTileRowBatch];
#pragma unroll
    for (int u = 0; u < kTileRowBatch; ++u) {
      if (r + u < r1) {
        dyv[u].load(row_ptr<T>(a.dy, r + u, a.dy_stride) + j * kVec);
        xv[u].load(row_ptr<T>(a.x, r + u, a.x_stride) + j * kVec);
        c[u] = reinterpret_cast<const float4*>(a.coef)[r + u];
      }
    }
#pragma unroll
    for (int u = 0; u < kTileRowBatch; ++u) {
      if (r + u >= r1) continue;
      const float mean = c[u].x, rstd = c[u].y, mean_g = c[u].z, mean_g_xhat = c[u].w;
      Pack<T, kVec> out;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float dyi = dyv[u].get(i);
        const float gi = V::kWeight ? dyi * w[i] : dyi;
        const float xhat = (V::kCentered ? xv[u].get(i) - mean : xv[u].get(i)) * rstd;
        if constexpr (V::kDw) dw[i] += dyi * xhat;
        if constexpr (V::kDb) db[i] += dyi;
        out.set(i, rstd * (gi - (V::kCentered ? mean_g : 0.0f) - xhat * mean_g_xhat));
      }
      if (a.dx != nullptr) out.store(row_ptr<T>(a.dx, r + u, a.dx_stride) + j * kVec);
    }
  }
  const std::int64_t slot = blockIdx.y;
  if constexpr (V::kDw) {
    if (a.dw_partial != nullptr) store_floats(dw, a.dw_partial + slot * a.cols + j * kVec);
  }
  if constexpr (V::kDb) {
    if (a.db_partial != nullptr) store_floats(db, a.db_partial + slot * a.cols + j * kVec);
  }
}

}  // namespace fusednorm::cuda
