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
// LayerNorm; a partial pointer that is null is simply not written. kAddend: dx_addend is
// added to dx (RMSNorm's fused-add backward).
template <bool kCentered_, bool kWeight_, bool kAccumulate_, bool kAddend_ = false>
struct BackwardVariant {
  static constexpr bool kCentered = kCentered_;
  static constexpr bool kWeight = kWeight_;
  static constexpr bool kAccumulate = kAccumulate_;
  static constexpr bool kAddend = kAddend_;
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

// ---- The per-element arithmetic, one definition for every backward kernel --------------

// How many row sums the dx formula needs: sum g * x_hat, and sum g for LayerNorm.
template <typename V>
inline constexpr int kGradDots = V::kCentered ? 2 : 1;

// What dx of a row needs besides its elements.
struct RowGrad {
  float mean;  // 0 for RMSNorm
  float rstd;
  float mean_g;       // mean(g); 0 for RMSNorm
  float mean_g_xhat;  // mean(g * x_hat)
};

// kVec weight values for columns from vector j on ((w + offset) as fp32); zeros for a padding
// vector past the row (j >= nvec), whose dy is zero: g = 0, never 0 * garbage.
template <typename T, int kVec, typename V>
__device__ __forceinline__ void load_grad_weight(const BackwardArgs& a, std::int64_t j, std::int64_t nvec,
                                                 float (&w)[kVec]) {
  if constexpr (V::kWeight) {
    if (j < nvec) {
      load_param<T, kVec>(a.weight, a.weight_f32, j * kVec, a.weight_offset, w);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) w[i] = 0.0f;
}

// dots[0] += sum of g * (x - mean) * scale, and for LayerNorm dots[1] += sum of g, over one
// vector (g = dy * w; w unused without a weight).
template <typename V, typename T, int kVec>
__device__ __forceinline__ void add_grad_dots(const Pack<T, kVec>& dy, const Pack<T, kVec>& x,
                                              const float (&w)[kVec], float mean, float scale,
                                              float (&dots)[kGradDots<V>]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float gi = V::kWeight ? dy.get(i) * w[i] : dy.get(i);
    dots[0] += gi * ((V::kCentered ? x.get(i) - mean : x.get(i)) * scale);
    if constexpr (V::kCentered) dots[1] += gi;
  }
}

// Vector j of row `row` of the dx addend (a zero vector, never read, without one). Callers
// load it with dy and x, before any store of dx (which it may alias).
template <typename V, typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_addend(const BackwardArgs& a, std::int64_t row, std::int64_t j) {
  Pack<T, kVec> v;
  if constexpr (V::kAddend) {
    v.load(row_ptr<T>(a.dx_addend, row, a.dx_addend_stride) + j * kVec);
  } else {
    v.zero();
  }
  return v;
}

// dx of one vector (plus the addend, in fp32), rounded once to T; adds dy * x_hat to dw and
// dy to db (when the variant accumulates them).
template <typename V, typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> grad_input(const Pack<T, kVec>& dy, const Pack<T, kVec>& x,
                                                    const float (&w)[kVec], const RowGrad& r,
                                                    float (&dw)[kVec], float (&db)[kVec],
                                                    const Pack<T, kVec>& addend) {
  Pack<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float dyi = dy.get(i);
    const float gi = V::kWeight ? dyi * w[i] : dyi;
    const float xhat = (V::kCentered ? x.get(i) - r.mean : x.get(i)) * r.rstd;
    if constexpr (V::kDw) dw[i] += dyi * xhat;
    if constexpr (V::kDb) db[i] += dyi;
    float dxi = r.rstd * (gi - (V::kCentered ? r.mean_g : 0.0f) - xhat * r.mean_g_xhat);
    if constexpr (V::kAddend) dxi += addend.get(i);
    out.set(i, dxi);
  }
  return out;
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
      const float2 stats = register_row_stats<V::kCentered>(xv, nvec, team, scratch, cols, a.eps);
      mean = stats.x;
      rstd = stats.y;
    }

    float dots[kGradDots<V>] = {};
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      float w[kVec];
      load_grad_weight<T, kVec, V>(a, threadIdx.x + std::int64_t{k} * team, nvec, w);
      add_grad_dots<V>(dyv[k], xv[k], w, mean, rstd, dots);
    }
    team_sum(dots, team, scratch);
    const RowGrad r{mean, rstd, V::kCentered ? dots[kGradDots<V> - 1] / cols : 0.0f, dots[0] / cols};

    if (row_ok) {
      T* dx_row = a.dx != nullptr ? row_ptr<T>(a.dx, row, a.dx_stride) : nullptr;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
        if (j >= nvec) continue;
        float w[kVec];
        load_grad_weight<T, kVec, V>(a, j, nvec, w);
        const Pack<T, kVec> add = load_addend<V, T, kVec>(a, row, j);
        const Pack<T, kVec> out = grad_input<V>(dyv[k], xv[k], w, r, dw[k], db[k], add);
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

// ---- Large D: the row staged in shared memory (one CTA, or a cluster, per row) -----------

// Persistent grid of clusters (a CTA is a cluster of one); cluster c takes rows c,
// c + clusters, ... Each CTA owns the columns of its slice in every row: it stages its dy
// and x slices in shared memory (read from device memory once), and keeps the fp32 dw / db
// sums of those columns over its rows in shared memory beside them, written at the end to
// partial slot c. Every thread reads back only what it staged (same j each pass), so the
// staging needs no barrier; the row sums cross the cluster in rank order (row_total).
//
// Row sums: RMSNorm sums g * x (and x * x when rstd is recomputed) as the row is staged;
// mean(g * x_hat) = rstd * sum(g * x) / D. LayerNorm with the forward's mean / rstd sums
// g * (x - mean) and g while staging; without them it sums x while staging, then
// (x - mean)^2, g * (x - mean) and g in one pass over shared memory.
//
// kStageInputs = false (rows too long for that): only the column sums are in shared memory,
// and the passes after the first read dy and x from device memory again; with a cluster of
// 8 per row, few rows are in flight and the re-reads should hit L2.
template <typename T, int kVec, typename V, RowStorage kStorage, bool kStageInputs>
__global__ void __launch_bounds__(kMaxThreadsPerCta, 1)
    norm_backward_row_kernel(const BackwardArgs a, const std::int64_t slice_vecs) {
  extern __shared__ uint4 smem_words[];
  __shared__ float scratch[32 * 3];
  __shared__ float cluster_slot[2 * 3];
  using Vec = Pack<T, kVec>;
  constexpr int kPiece = kVec < 4 ? kVec : 4;  // fp32 accumulators move in 16-byte pieces
  constexpr int kPieces = kVec / kPiece;
  using Piece = Pack<float, kPiece>;
  constexpr int kBatch = 4;  // vectors per thread loaded before the first is used

  const StagedBackwardSmem layout = staged_backward_smem(slice_vecs, kVec, sizeof(T));
  const std::int64_t stage_bytes = kStageInputs ? layout.stage_bytes : 0;
  char* const smem = reinterpret_cast<char*>(smem_words);
  Vec* const dy_stage = reinterpret_cast<Vec*>(smem);
  Vec* const x_stage = reinterpret_cast<Vec*>(smem + stage_bytes);
  // Piece h of vector j sits at [h * slice_vecs + j]: a warp's accesses are consecutive.
  Piece* const dw_acc = reinterpret_cast<Piece*>(smem + 2 * stage_bytes);
  Piece* const db_acc = reinterpret_cast<Piece*>(smem + 2 * stage_bytes + (V::kDw ? layout.acc_bytes : 0));

  auto read_sums = [&](const Piece* acc, std::int64_t jj, float (&v)[kVec]) {
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      const Piece p = acc[h * slice_vecs + jj];
#pragma unroll
      for (int i = 0; i < kPiece; ++i) v[h * kPiece + i] = p.get(i);
    }
  };
  auto write_sums = [&](Piece* acc, std::int64_t jj, const float (&v)[kVec]) {
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      Piece p;
#pragma unroll
      for (int i = 0; i < kPiece; ++i) p.set(i, v[h * kPiece + i]);
      acc[h * slice_vecs + jj] = p;
    }
  };

  const int team = blockDim.x;
  const std::int64_t nvec = a.cols / kVec;
  const RowSlice slice = row_slice<kStorage>(nvec, slice_vecs);
  const std::int64_t begin = slice.begin, end = slice.end;
  const float cols = static_cast<float>(a.cols);
  const bool given_stats = a.rstd != nullptr;

  if constexpr (V::kAccumulate) {
    const float zeros[kVec] = {};
    for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
      if constexpr (V::kDw) write_sums(dw_acc, j - begin, zeros);
      if constexpr (V::kDb) write_sums(db_acc, j - begin, zeros);
    }
  }

  for (std::int64_t row = slice.first_row(); row < a.rows; row += slice.row_step()) {
    const T* dy = row_ptr<T>(a.dy, row, a.dy_stride);
    const T* x = row_ptr<T>(a.x, row, a.x_stride);
    // Vector j of dy or x after the first pass: from shared memory, or read again.
    auto vec_at = [&](const Vec* staged, const T* src, std::int64_t j) {
      Vec v;
      if constexpr (kStageInputs) {
        v = staged[j - begin];
      } else {
        v.load(src + j * kVec);
      }
      return v;
    };
    float mean = 0.0f, rstd = 0.0f;
    if (given_stats) {
      rstd = a.rstd[row];
      if (V::kCentered) mean = a.mean[row];
    }

    // Staging pass. RMSNorm: {sum g * x, sum x * x}; LayerNorm: {sum g * (x - mean), sum g}
    // with the given mean, else {sum x}.
    float sums[2] = {0.0f, 0.0f};
    for (std::int64_t j0 = begin + threadIdx.x; j0 < end; j0 += std::int64_t{kBatch} * team) {
      Vec dyv[kBatch], xv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const std::int64_t j = j0 + std::int64_t{u} * team;
        if (j < end) {
          dyv[u].load(dy + j * kVec);
          xv[u].load(x + j * kVec);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const std::int64_t j = j0 + std::int64_t{u} * team;
        if (j >= end) continue;
        if constexpr (kStageInputs) {
          dy_stage[j - begin] = dyv[u];
          x_stage[j - begin] = xv[u];
        }
        if (V::kCentered && !given_stats) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) sums[0] += xv[u].get(i);
          continue;
        }
        float w[kVec];
        load_grad_weight<T, kVec, V>(a, j, nvec, w);
        float dots[kGradDots<V>] = {};
        add_grad_dots<V>(dyv[u], xv[u], w, mean, 1.0f, dots);
        sums[0] += dots[0];
        if constexpr (V::kCentered) {
          sums[1] += dots[kGradDots<V> - 1];
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) sums[1] += xv[u].get(i) * xv[u].get(i);
        }
      }
    }

    RowGrad r;
    if constexpr (!V::kCentered) {
      row_total<kStorage>(sums, scratch, cluster_slot);
      if (!given_stats) rstd = 1.0f / sqrtf(sums[1] / cols + a.eps);
      r = RowGrad{0.0f, rstd, 0.0f, rstd * (sums[0] / cols)};
    } else if (given_stats) {
      row_total<kStorage>(sums, scratch, cluster_slot);
      r = RowGrad{mean, rstd, sums[1] / cols, rstd * (sums[0] / cols)};
    } else {
      float total[1] = {sums[0]};
      row_total<kStorage>(total, scratch, cluster_slot);
      mean = total[0] / cols;
      float more[3] = {0.0f, 0.0f, 0.0f};  // sum (x - mean)^2, sum g * (x - mean), sum g
      for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
        const Vec xv = vec_at(x_stage, x, j);
        float w[kVec];
        load_grad_weight<T, kVec, V>(a, j, nvec, w);
        float dots[kGradDots<V>] = {};
        add_grad_dots<V>(vec_at(dy_stage, dy, j), xv, w, mean, 1.0f, dots);
        more[1] += dots[0];
        more[2] += dots[kGradDots<V> - 1];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = xv.get(i) - mean;
          more[0] += d * d;
        }
      }
      row_total<kStorage>(more, scratch, cluster_slot);
      rstd = 1.0f / sqrtf(more[0] / cols + a.eps);
      r = RowGrad{mean, rstd, more[2] / cols, rstd * (more[1] / cols)};
    }

    // dx, and this row's dy * x_hat and dy added to the CTA's column sums.
    T* dx = a.dx != nullptr ? row_ptr<T>(a.dx, row, a.dx_stride) : nullptr;
    for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
      float w[kVec], dw[kVec], db[kVec];
      load_grad_weight<T, kVec, V>(a, j, nvec, w);
      if constexpr (V::kDw) read_sums(dw_acc, j - begin, dw);
      if constexpr (V::kDb) read_sums(db_acc, j - begin, db);
      const Vec out = grad_input<V>(vec_at(dy_stage, dy, j), vec_at(x_stage, x, j), w, r, dw, db,
                                    load_addend<V, T, kVec>(a, row, j));
      if constexpr (V::kDw) write_sums(dw_acc, j - begin, dw);
      if constexpr (V::kDb) write_sums(db_acc, j - begin, db);
      if (dx != nullptr) out.store(dx + j * kVec);
    }
  }

  // The CTA's column sums over its cluster's rows: slot = cluster index.
  const std::int64_t slot = blockIdx.x / slice.cluster_size;
  for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      const std::int64_t col = j * kVec + h * kPiece;
      if constexpr (V::kDw) {
        if (a.dw_partial != nullptr) dw_acc[h * slice_vecs + (j - begin)].store(a.dw_partial + slot * a.cols + col);
      }
      if constexpr (V::kDb) {
        if (a.db_partial != nullptr) db_acc[h * slice_vecs + (j - begin)].store(a.db_partial + slot * a.cols + col);
      }
    }
  }
}

// ---- Beyond a cluster: per-row coefficients, then column tiles ----------------------------


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

    // Two-phase calls (uniform across the CTA, so the barriers stay uniform): phase 2 takes
    // the whole row's sums of g * x_hat (and g), phase 1 stops after storing its own.
    float2 totals;
    float count = cols;
    if (a.row_sum_g_xhat != nullptr) {
      totals = make_float2(a.row_sum_g_xhat[row], V::kCentered ? a.row_sum_g[row] : 0.0f);
      count = static_cast<float>(a.full_cols);
    } else {
      float dots[kGradDots<V>] = {};
#pragma unroll 4
      for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
        Pack<T, kVec> dyv, xv;
        dyv.load(dy + j * kVec);
        xv.load(x + j * kVec);
        float w[kVec];
        load_grad_weight<T, kVec, V>(a, j, nvec, w);
        add_grad_dots<V>(dyv, xv, w, mean, rstd, dots);
      }
      totals = block_sum(make_float2(dots[0], dots[kGradDots<V> - 1]));
    }
    if (a.partial_sum_g_xhat != nullptr) {
      if (threadIdx.x == 0) {
        a.partial_sum_g_xhat[row] = totals.x;
        if (V::kCentered) a.partial_sum_g[row] = totals.y;
      }
      continue;
    }
    const RowGrad r{mean, rstd, V::kCentered ? totals.y / count : 0.0f, totals.x / count};

    if constexpr (kWriteDx) {
      T* dx = row_ptr<T>(a.dx, row, a.dx_stride);
      float unused[kVec];  // the dx-only variant accumulates no dw / db
      for (std::int64_t j = threadIdx.x; j < nvec; j += kCoefThreads) {
        Pack<T, kVec> dyv, xv;
        dyv.load(dy + j * kVec);
        xv.load(x + j * kVec);
        float w[kVec];
        load_grad_weight<T, kVec, V>(a, j, nvec, w);
        grad_input<V>(dyv, xv, w, r, unused, unused, load_addend<V, T, kVec>(a, row, j)).store(dx + j * kVec);
      }
    } else if (threadIdx.x == 0) {
      reinterpret_cast<float4*>(a.coef)[row] = make_float4(r.mean, r.rstd, r.mean_g, r.mean_g_xhat);
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
  load_grad_weight<T, kVec, V>(a, j, nvec, w);
  float dw[kVec], db[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) dw[i] = db[i] = 0.0f;

  for (std::int64_t r = r0; r < r1; r += kTileRowBatch) {
    // Batch the loads of several rows before the first dx store (dx may alias dy).
    Pack<T, kVec> dyv[kTileRowBatch], xv[kTileRowBatch], addv[kTileRowBatch];
    float4 c[kTileRowBatch];
#pragma unroll
    for (int u = 0; u < kTileRowBatch; ++u) {
      if (r + u < r1) {
        dyv[u].load(row_ptr<T>(a.dy, r + u, a.dy_stride) + j * kVec);
        xv[u].load(row_ptr<T>(a.x, r + u, a.x_stride) + j * kVec);
        addv[u] = load_addend<V, T, kVec>(a, r + u, j);
        c[u] = reinterpret_cast<const float4*>(a.coef)[r + u];
      }
    }
#pragma unroll
    for (int u = 0; u < kTileRowBatch; ++u) {
      if (r + u >= r1) continue;
      const Pack<T, kVec> out =
          grad_input<V>(dyv[u], xv[u], w, RowGrad{c[u].x, c[u].y, c[u].z, c[u].w}, dw, db, addv[u]);
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
