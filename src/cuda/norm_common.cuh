// Device building blocks shared by the forward and backward kernels: element conversion,
// vector loads and stores, the weight / bias loader, and team reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fusednorm::cuda {

// ---- Elements: stored as their bit patterns, converted to fp32 in registers ------------

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Bits = std::uint32_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits from_float(float f) { return __float_as_uint(f); }
};

template <>
struct Elem<__half> {
  using Bits = std::uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ Bits from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <>
struct Elem<__nv_bfloat16> {
  using Bits = std::uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
  static __device__ __forceinline__ Bits from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

template <int kBytes>
struct RawWord;
template <>
struct RawWord<16> { using type = uint4; };
template <>
struct RawWord<8> { using type = uint2; };
template <>
struct RawWord<4> { using type = std::uint32_t; };
template <>
struct RawWord<2> { using type = std::uint16_t; };
template <>
struct RawWord<1> { using type = std::uint8_t; };

// kVec consecutive elements, moved as one access of kVec * sizeof(T) bytes (16 bytes when
// vectorized) and kept packed in registers until used.
template <typename T, int kVec>
struct Pack {
  using Bits = typename Elem<T>::Bits;
  using Raw = typename RawWord<sizeof(Bits) * kVec>::type;
  union {
    Raw raw;
    Bits bits[kVec];
  };

  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const Raw*>(p); }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<Raw*>(p) = raw; }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kVec; ++i) bits[i] = 0;
  }
  __device__ __forceinline__ float get(int i) const { return Elem<T>::to_float(bits[i]); }
  __device__ __forceinline__ void set(int i, float f) { bits[i] = Elem<T>::from_float(f); }
};

template <typename T>
__device__ __forceinline__ const T* row_ptr(const void* base, std::int64_t row, std::int64_t stride) {
  return static_cast<const T*>(base) + row * stride;
}
template <typename T>
__device__ __forceinline__ T* row_ptr(void* base, std::int64_t row, std::int64_t stride) {
  return static_cast<T*>(base) + row * stride;
}

// kVec weight (or bias) values from column `col` on, as fp32 plus `offset`. The parameter
// is x's dtype or fp32; that choice is a warp-uniform branch rather than a template
// argument, which halves the kernel instantiations at the cost of one predicate per load.
template <typename T, int kVec>
__device__ __forceinline__ void load_param(const void* p, bool is_f32, std::int64_t col, float offset,
                                           float (&out)[kVec]) {
  if (is_f32) {
    const float* f = static_cast<const float*>(p) + col;
    constexpr int kPiece = kVec < 4 ? kVec : 4;  // 16-byte pieces of fp32
#pragma unroll
    for (int h = 0; h < kVec / kPiece; ++h) {
      Pack<float, kPiece> pk;
      pk.load(f + h * kPiece);
#pragma unroll
      for (int i = 0; i < kPiece; ++i) out[h * kPiece + i] = pk.get(i) + offset;
    }
  } else {
    Pack<T, kVec> pk;
    pk.load(static_cast<const T*>(p) + col);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = pk.get(i) + offset;
  }
}

// ---- Reductions ------------------------------------------------------------------------

constexpr unsigned kFullMask = 0xffffffffu;

// Team reductions: a sum (the norms' statistics) or a maximum (the quantized forward's
// amax of |y|; fmaxf ignores NaN, as the quantization contract asks).
struct SumOp {
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};
struct MaxOp {
  static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
};

// Reduces kN values over a team of `team` threads with Op and gives every team member the
// results. A team of <= 32 threads is an aligned group of lanes of one warp (team a power of two);
// a larger one is blockDim.x == team whole warps, one team per threadIdx.y. All threads
// of the CTA must call this together. The order of operations is fixed by the team size,
// so results are reproducible run to run; the xor butterfly gives all lanes the same bits
// (each step combines the same two values, commutatively). `scratch` holds 32 * kN floats.
// (cub::WarpReduce returns the total in lane 0 only and fixes the width at compile time;
// the team width here is a run-time choice of the planner.)
template <typename Op, int kN>
__device__ __forceinline__ void team_reduce(float (&v)[kN], int team, float* scratch) {
  const int width = team < 32 ? team : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] = Op::apply(v[k], __shfl_xor_sync(kFullMask, v[k], offset));
  }
  if (team <= 32) return;
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int warp = tid / 32;
  __syncthreads();  // the previous call's readers are done with scratch
  if (tid % 32 == 0) {
#pragma unroll
    for (int k = 0; k < kN; ++k) scratch[k * 32 + warp] = v[k];
  }
  __syncthreads();
  const int warps = team / 32;
  const int first = threadIdx.y * warps;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    float total = scratch[k * 32 + first];
    for (int w = 1; w < warps; ++w) total = Op::apply(total, scratch[k * 32 + first + w]);
    v[k] = total;
  }
}

template <int kN>
__device__ __forceinline__ void team_sum(float (&v)[kN], int team, float* scratch) {
  team_reduce<SumOp>(v, team, scratch);
}

// mean and rstd of a row held in registers (kK packs of kVec elements per thread, the
// team's threads striding over nvec packs; padding packs are zero). The one definition
// shared by the forward and the backward's recomputation, so both give the same bits.
template <bool kCentered, typename T, int kVec, int kK>
__device__ __forceinline__ float2 register_row_stats(const Pack<T, kVec> (&v)[kK], std::int64_t nvec, int team,
                                                     float* scratch, float cols, float eps) {
  // The sum (LayerNorm) or sum of squares (RMSNorm); zero padding adds nothing.
  float first[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < kK; ++k) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float f = v[k].get(i);
      first[0] += kCentered ? f : f * f;
    }
  }
  team_sum(first, team, scratch);
  float mean = 0.0f, variance;
  if constexpr (kCentered) {
    mean = first[0] / cols;
    float dev[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const std::int64_t j = threadIdx.x + std::int64_t{k} * team;
      if (j < nvec) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = v[k].get(i) - mean;
          dev[0] += d * d;
        }
      }
    }
    team_sum(dev, team, scratch);
    variance = dev[0] / cols;
  } else {
    variance = first[0] / cols;
  }
  return make_float2(mean, 1.0f / sqrtf(variance + eps));
}

// ---- Rows staged in shared memory (one CTA, or one thread-block cluster, per row) --------

enum class RowStorage {
  kSmem,     // the whole row staged in this CTA's shared memory
  kCluster,  // a cluster splits the row; each CTA stages its slice (sm_90)
  kGlobal,   // no staging: every pass reads the row from device memory again
};

// The columns (in vectors) this CTA owns of every row it works on: [begin, end), and the
// CTA's place in its cluster. Rows go to clusters round-robin: cluster c takes rows c,
// c + clusters, ...; a CTA without a cluster is a cluster of one.
struct RowSlice {
  int cluster_size;
  int rank;
  std::int64_t begin;
  std::int64_t end;
  __device__ __forceinline__ std::int64_t first_row() const { return blockIdx.x / cluster_size; }
  __device__ __forceinline__ std::int64_t row_step() const { return gridDim.x / cluster_size; }
};

template <RowStorage kStorage>
__device__ __forceinline__ RowSlice row_slice(std::int64_t nvec, std::int64_t slice_vecs) {
  RowSlice s{1, 0, 0, nvec};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kStorage == RowStorage::kCluster) {
    s.cluster_size = static_cast<int>(cooperative_groups::this_cluster().num_blocks());
    s.rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
  }
#endif
  s.begin = s.rank * slice_vecs;
  s.end = s.begin + slice_vecs < nvec ? s.begin + slice_vecs : nvec;
  return s;
}

// The CTA's (or, for a cluster, the whole row's) totals of v (sums, or Op's reduction);
// every thread gets them. scratch: 32 * kN floats; cluster_slot: 2 * kN floats of static
// shared memory.
template <RowStorage kStorage, typename Op = SumOp, int kN>
__device__ __forceinline__ void row_total(float (&v)[kN], float* scratch, float* cluster_slot) {
  team_reduce<Op>(v, blockDim.x, scratch);
  if constexpr (kStorage == RowStorage::kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < kN; ++k) cluster_slot[k] = v[k];
    }
    cluster.sync();
    if (threadIdx.x == 0) {
      // Every CTA adds the same partials in rank order: the same bits everywhere.
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        float total = *cluster.map_shared_rank(cluster_slot + k, 0u);
        for (unsigned rank = 1; rank < cluster.num_blocks(); ++rank) {
          total = Op::apply(total, *cluster.map_shared_rank(cluster_slot + k, rank));
        }
        cluster_slot[kN + k] = total;
      }
    }
    // Orders cluster_slot[kN..] for this CTA and keeps every CTA's first half alive until
    // read (the next call writes it only after this barrier).
    cluster.sync();
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] = cluster_slot[kN + k];
#else
    __trap();  // the planner launches clusters on sm_90 and newer only
#endif
  }
}

}  // namespace fusednorm::cuda
