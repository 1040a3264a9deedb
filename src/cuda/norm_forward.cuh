// Forward kernels: RMSNorm (optionally with the fused residual add) and LayerNorm.
//
// Numerics, as on the CPU: elements are widened to fp32, sums are fp32, eps is added in
// fp32, rstd = 1 / sqrtf(mean square + eps) (IEEE sqrt and division as on the CPU, not
// rsqrtf, which is up to 2 ulp off), and every output element is rounded once (to nearest
// even) at the store. The fused add stores residual = round(x + residual) and normalizes
// that stored value.
#pragma once

#include <cstdint>

#include "cuda/kernel_args.h"
#include "cuda/launch_plan.h"
#include "cuda/norm_common.cuh"
#include "cuda/quantize.cuh"

namespace fusednorm::cuda {

// What a forward kernel computes, fixed at compile time: a missing weight or bias is a
// kernel of its own rather than a per-element branch. kQuant (RMSNorm): the output is q,
// y quantized (QuantArgs), instead of y; static or dynamic scale and int8 or FP8 are
// warp-uniform run-time branches of the same kernel (src/cuda/NOTES.md: instantiations).
template <bool kCentered_, bool kResidual_, bool kWeight_, bool kBias_, bool kQuant_ = false>
struct ForwardVariant {
  static constexpr bool kCentered = kCentered_;  // LayerNorm (subtract the mean)
  static constexpr bool kResidual = kResidual_;  // fused residual add (RMSNorm)
  static constexpr bool kWeight = kWeight_;
  static constexpr bool kBias = kBias_;
  static constexpr bool kQuant = kQuant_;
  static_assert(!(kQuant_ && (kCentered_ || kBias_)), "the quantized forward is RMSNorm's");
};

// The fp32 output of a normalized row, before any rounding: (x - mean) * rstd [* w] [+ b].
// The one definition of y: stored (rounded to T), or quantized.
template <typename V, typename T, int kVec>
__device__ __forceinline__ void normalized(const Pack<T, kVec>& v, const float (&w)[kVec], const float (&b)[kVec],
                                           float mean, float rstd, float (&y)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    float o = (V::kCentered ? v.get(i) - mean : v.get(i)) * rstd;
    if constexpr (V::kWeight) o *= w[i];
    if constexpr (V::kBias) o += b[i];
    y[i] = o;
  }
}

template <typename V, typename T, int kVec>
__device__ __forceinline__ void normalize_store(const Pack<T, kVec>& v, const float (&w)[kVec],
                                                const float (&b)[kVec], float mean, float rstd,
                                                T* dst) {
  float y[kVec];
  normalized<V>(v, w, b, mean, rstd, y);
  Pack<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.set(i, y[i]);
  out.store(dst);
}

// The weight and bias of the kVec columns from `col` on (those the variant has).
template <typename V, typename T, int kVec>
__device__ __forceinline__ void load_params(const ForwardArgs& a, std::int64_t col, float (&w)[kVec],
                                            float (&b)[kVec]) {
  if constexpr (V::kWeight) load_param<T, kVec>(a.weight, a.weight_f32, col, a.weight_offset, w);
  if constexpr (V::kBias) load_param<T, kVec>(a.bias, a.bias_f32, col, 0.0f, b);
}

// max over the pack of |y| (NaN ignored: fmaxf returns the other operand), into amax.
template <typename V, typename T, int kVec>
__device__ __forceinline__ void pack_amax(const ForwardArgs& a, const Pack<T, kVec>& v, std::int64_t col,
                                          float rstd, float& amax) {
  float w[kVec], b[kVec], y[kVec];
  load_params<V, T, kVec>(a, col, w, b);
  normalized<V>(v, w, b, 0.0f, rstd, y);
#pragma unroll
  for (int i = 0; i < kVec; ++i) amax = fmaxf(amax, fabsf(y[i]));
}

// q of the pack's kVec columns from `col` on, in the row at q_row.
template <typename V, typename T, int kVec>
__device__ __forceinline__ void pack_quantize_store(const ForwardArgs& a, const Pack<T, kVec>& v, std::int64_t col,
                                                    float rstd, float inv_scale, std::uint8_t* q_row) {
  float w[kVec], b[kVec], y[kVec];
  load_params<V, T, kVec>(a, col, w, b);
  normalized<V>(v, w, b, 0.0f, rstd, y);
  quantize_store(y, inv_scale, a.quant.fp8, q_row + col);
}

// residual <- round(x + residual); v becomes the stored (rounded) residual.
template <typename T, int kVec>
__device__ __forceinline__ void add_residual(Pack<T, kVec>& v, Pack<T, kVec>& r, T* dst) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) r.set(i, v.get(i) + r.get(i));
  r.store(dst);
  v = r;
}

// ---- Small and medium D: the row in registers ------------------------------------------
// Block (team, rows_per_cta); each thread holds kK vectors of its row, columns
// (threadIdx.x + k * team) * kVec. Weight and bias are re-read for every row: they stay in
// L1 / L2, and holding them in registers across rows (up to 2 * 32 floats) made ptxas
// spill at large kK.
template <typename T, int kVec, int kK, typename V>
__device__ __forceinline__ void norm_forward_register_rows(const ForwardArgs& a,
                                                           const std::int64_t row_groups) {
  __shared__ float scratch[32];
  const int team = blockDim.x;
  const std::int64_t nvec = a.cols / kVec;
  const float cols = static_cast<float>(a.cols);
  // Quantized output: the static scale is read here, on the device (a graph replays with
  // the value the pointer holds at replay time).
  [[maybe_unused]] const bool dynamic = V::kQuant && a.quant.static_scale == nullptr;
  [[maybe_unused]] const float static_scale = V::kQuant && !dynamic ? *a.quant.static_scale : 1.0f;

  for (std::int64_t g = blockIdx.x; g < row_groups; g += gridDim.x) {
    const std::int64_t row = g * blockDim.y + threadIdx.y;
    const bool row_ok = row < a.rows;
    const T* x = row_ptr<T>(a.x, row, a.x_stride);
    T* res = V::kResidual ? row_ptr<T>(a.residual, row, a.residual_stride) : nullptr;

    // All loads first, so that kK (or 2 kK) 16-byte loads are in flight per thread.
    Pack<T, kVec> v[kK], r[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (row_ok && j < nvec) {
        v[k].load(x + j * kVec);
        if constexpr (V::kResidual) r[k].load(res + j * kVec);
      } else {
        v[k].zero();  // padding contributes nothing to the first statistic
      }
    }
    if constexpr (V::kResidual) {
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
        if (row_ok && j < nvec) add_residual(v[k], r[k], res + j * kVec);
      }
    }
    const float2 stats = register_row_stats<V::kCentered>(v, nvec, team, scratch, cols, a.eps);
    const float mean = stats.x, rstd = stats.y;

    if constexpr (V::kQuant) {
      // Dynamic: the row's amax of |y| from the registers (x is still read once), a second
      // team reduction, then y again (the same operations: the same bits) for q.
      float scale = static_scale;
      if (dynamic) {
        float amax[1] = {0.0f};
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
          if (row_ok && j < nvec) pack_amax<V>(a, v[k], j * kVec, rstd, amax[0]);
        }
        team_reduce<MaxOp>(amax, team, scratch);
        scale = dynamic_row_scale(amax[0], a.quant);
      }
      const float inv_scale = 1.0f / scale;  // once per row, correctly rounded
      if (row_ok) {
        std::uint8_t* q = row_ptr<std::uint8_t>(a.quant.q, row, a.quant.q_stride);
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
          if (j < nvec) pack_quantize_store<V>(a, v[k], j * kVec, rstd, inv_scale, q);
        }
        if (dynamic && threadIdx.x == 0) a.quant.row_scales[row] = scale;
        if (threadIdx.x == 0 && a.rstd != nullptr) a.rstd[row] = rstd;
      }
    } else if (row_ok) {
      T* y = row_ptr<T>(a.y, row, a.y_stride);
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
        if (j >= nvec) continue;
        float w[kVec], b[kVec];
        load_params<V, T, kVec>(a, j * kVec, w, b);
        normalize_store<V>(v[k], w, b, mean, rstd, y + j * kVec);
      }
      if (threadIdx.x == 0) {
        if (a.rstd != nullptr) a.rstd[row] = rstd;
        if (V::kCentered && a.mean != nullptr) a.mean[row] = mean;
      }
    }
  }
}

template <typename T, int kVec, int kK, typename V>
__global__ void __launch_bounds__(kMaxThreadsPerCta, 1)
    norm_forward_register_kernel(const ForwardArgs a, const std::int64_t row_groups) {
  norm_forward_register_rows<T, kVec, kK, V>(a, row_groups);
}

// The quantized register row with at most kQuantRegisterCap registers per thread, for an
// A/B on a device (PlanOptions::quant_register_cap, FUSEDNORM_CUDA_QUANT_REGISTER_CAP=1):
// under __launch_bounds__(512, 1) ptxas gives the weighted bf16 kernel of 4 vectors per
// thread 94 registers (sm_90), so only 2 of its 256-thread CTAs fit an SM; at <= 80, 3 do
// (no spills at 80: check_sass.py). Whether the extra CTA's loads in flight pay for a tighter
// schedule is the device's to say (src/cuda/NOTES.md, the quantized forward on the H200).
// __maxnreg__ cannot be combined with __launch_bounds__; at 80 registers a 512-thread CTA
// still fits an SM.
template <typename T, int kVec, int kK, typename V>
__global__ void __maxnreg__(kQuantRegisterCap)
    norm_forward_register_capped_kernel(const ForwardArgs a, const std::int64_t row_groups) {
  static_assert(V::kQuant, "the register cap is an A/B for the quantized forward");
  norm_forward_register_rows<T, kVec, kK, V>(a, row_groups);
}

// ---- Large D: one CTA (or one cluster) per row ------------------------------------------

// One row per CTA (per cluster for kCluster); blockDim.x threads stride over the CTA's
// slice of slice_vecs vectors. Each thread reads back only the staged vectors it wrote, so
// the staging needs no barrier.
template <typename T, int kVec, typename V, RowStorage kStorage>
__global__ void __launch_bounds__(kMaxThreadsPerCta, 1)
    norm_forward_row_kernel(const ForwardArgs a, const std::int64_t slice_vecs) {
  extern __shared__ uint4 stage_words[];
  Pack<T, kVec>* stage = reinterpret_cast<Pack<T, kVec>*>(stage_words);
  __shared__ float scratch[32];
  __shared__ float cluster_slot[2];
  constexpr bool kStaged = kStorage != RowStorage::kGlobal;
  constexpr int kBatch = 4;  // vectors per thread loaded before the first is used

  const int team = blockDim.x;
  const RowSlice slice = row_slice<kStorage>(a.cols / kVec, slice_vecs);
  const std::int64_t begin = slice.begin, end = slice.end;
  const std::int64_t step = std::int64_t{kBatch} * team;
  const float cols = static_cast<float>(a.cols);
  // Two-phase calls (the unstaged kind only; uniform across the CTA; kernel_args.h). Given
  // the whole row's first statistic (RMSNorm's phase 2; LayerNorm's deviations phase and
  // phase 2) the first pass is skipped; LayerNorm's phase 2 skips the second too. Phase 1
  // stores the row's partial sum of the pass it ran last and writes nothing else.
  constexpr bool kPhased = kStorage == RowStorage::kGlobal;
  const bool given_sum = kPhased && (V::kCentered ? a.row_sum : a.row_sum_squares) != nullptr;
  const bool given_deviations = kPhased && V::kCentered && a.row_sum_squared_deviations != nullptr;
  float* const partial_sums = kPhased ? a.partial_sums : nullptr;
  const float full_cols = static_cast<float>(a.full_cols);
  [[maybe_unused]] const bool dynamic = V::kQuant && a.quant.static_scale == nullptr;
  [[maybe_unused]] const float static_scale = V::kQuant && !dynamic ? *a.quant.static_scale : 1.0f;

  for (std::int64_t row = slice.first_row(); row < a.rows; row += slice.row_step()) {
    const T* x = row_ptr<T>(a.x, row, a.x_stride);
    T* res = V::kResidual ? row_ptr<T>(a.residual, row, a.residual_stride) : nullptr;
    // The value that is normalized: the updated residual for the fused add, else x.
    const T* src = V::kResidual ? res : x;

    float stat[1] = {0.0f};
    for (std::int64_t j0 = begin + threadIdx.x; j0 < end && !given_sum; j0 += step) {
      Pack<T, kVec> v[kBatch], r[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const std::int64_t j = j0 + std::int64_t{u} * team;
        if (j < end) {
          v[u].load(x + j * kVec);
          if constexpr (V::kResidual) r[u].load(res + j * kVec);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const std::int64_t j = j0 + std::int64_t{u} * team;
        if (j < end) {
          if constexpr (V::kResidual) add_residual(v[u], r[u], res + j * kVec);
          if constexpr (kStaged) stage[j - begin] = v[u];
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float f = v[u].get(i);
            stat[0] += V::kCentered ? f : f * f;
          }
        }
      }
    }
    if (!given_sum) row_total<kStorage>(stat, scratch, cluster_slot);
    if (partial_sums != nullptr && !given_sum) {
      if (threadIdx.x == 0) partial_sums[row] = stat[0];
      continue;
    }

    auto staged = [&](std::int64_t j) {
      Pack<T, kVec> v;
      if constexpr (kStaged) {
        v = stage[j - begin];
      } else {
        v.load(src + j * kVec);
      }
      return v;
    };

    float mean = 0.0f, variance;
    if constexpr (V::kCentered) {
      mean = given_sum ? a.row_sum[row] / full_cols : stat[0] / cols;
      if (given_deviations) {
        variance = a.row_sum_squared_deviations[row] / full_cols;
      } else {
        float dev[1] = {0.0f};
        for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
          const Pack<T, kVec> v = staged(j);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float d = v.get(i) - mean;
            dev[0] += d * d;
          }
        }
        row_total<kStorage>(dev, scratch, cluster_slot);
        if (partial_sums != nullptr) {
          if (threadIdx.x == 0) partial_sums[row] = dev[0];
          continue;
        }
        variance = dev[0] / cols;
      }
    } else if (given_sum) {
      variance = a.row_sum_squares[row] / full_cols;
    } else {
      variance = stat[0] / cols;
    }
    const float rstd = 1.0f / sqrtf(variance + a.eps);

    if constexpr (V::kQuant) {
      // Dynamic: one more pass over the staged row (shared memory; the two-pass kernel
      // reads x from device memory a third time) for the amax, reduced over the CTA or
      // cluster, before the pass that writes q.
      float scale = static_scale;
      if (dynamic) {
        float amax[1] = {0.0f};
        for (std::int64_t j = begin + threadIdx.x; j < end; j += team) pack_amax<V>(a, staged(j), j * kVec, rstd, amax[0]);
        row_total<kStorage, MaxOp>(amax, scratch, cluster_slot);
        scale = dynamic_row_scale(amax[0], a.quant);
        if (slice.rank == 0 && threadIdx.x == 0) a.quant.row_scales[row] = scale;
      }
      const float inv_scale = 1.0f / scale;  // once per row, correctly rounded
      std::uint8_t* q = row_ptr<std::uint8_t>(a.quant.q, row, a.quant.q_stride);
      for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
        pack_quantize_store<V>(a, staged(j), j * kVec, rstd, inv_scale, q);
      }
    } else {
      T* y = row_ptr<T>(a.y, row, a.y_stride);
      for (std::int64_t j = begin + threadIdx.x; j < end; j += team) {
        float w[kVec], b[kVec];
        load_params<V, T, kVec>(a, j * kVec, w, b);
        normalize_store<V>(staged(j), w, b, mean, rstd, y + j * kVec);
      }
    }
    if (slice.rank == 0 && threadIdx.x == 0) {
      if (a.rstd != nullptr) a.rstd[row] = rstd;
      if (V::kCentered && a.mean != nullptr) a.mean[row] = mean;
    }
  }
}

}  // namespace fusednorm::cuda
