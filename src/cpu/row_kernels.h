// Per-row building blocks of the CPU backend, written once against Highway's portable
// vectors (row_kernels.cc) and compiled for every SIMD target; row_kernels() returns the
// table of the best target this CPU supports. Each function works on n consecutive
// elements of one row; the caller (cpu_backend.cpp) owns rows, chunks and threads.
//
// Writers come in two flavours: [0] ordinary stores, [1] non-temporal (streaming) stores
// for outputs too large to stay in the caches.
//
// The forward kernels read a weight or bias in the dtype it is stored in (fp32 or the rows'
// own dtype) and add RMSNorm's weight_offset in fp32 as they load it, which gives the bits
// of folding the offset in first: no per-call conversion or buffer. (The backend still hands
// fp16 rows of a many-row call that fits the caches an fp32 copy, made once per call,
// because F16C conversions bound that loop there: cpu_backend.cpp, prepares_half_params.) The
// backward kernels take the weight as fp32 with the offset folded in.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

#include "fusednorm/fusednorm.h"

namespace fusednorm::cpu {

// How a forward kernel finds a weight or bias: absent, fp32, or in the rows' dtype (for fp32
// rows the last two are the same kernels).
enum ParamType : int { kNoParam = 0, kFloat32Param = 1, kElementParam = 2 };
inline ParamType param_type(const ConstVector& v) {
  if (v.data == nullptr) return kNoParam;
  return v.dtype == DType::kFloat32 ? kFloat32Param : kElementParam;
}

// rstd from the mean of squares: the one formula of the forward, the backward's
// recomputation and the multi-row kernels.
inline float rstd_from_mean_square(float mean_square, float eps) {
  return 1.0f / std::sqrt(mean_square + eps);
}

// v, with a NaN made the default NaN, whose payload's low 16 bits are zero (what bf16's
// rounding needs: NaNPayloads in element_io-inl.h).
inline float NarrowNaN(float v) { return v == v ? v : std::numeric_limits<float>::quiet_NaN(); }

// The table slot of the kernels for a weight offset from detail::kernel_weight_offset()
// (core/problem.h): [0] for none (-0.0f: those kernels skip the add, an identity, and give
// the same bits), [1] for the kernels that add it. The add cost 2 of 31 instructions per 16
// bf16 elements of the RMSNorm write loop on AVX2, 2 of 18 for fp16 (callgrind, 16 x 4096:
// Normalize -7 % bf16, -11 % fp16, -17 % fp32).
inline int offset_slot(float kernel_offset) { return kernel_offset == 0.0f ? 0 : 1; }

// Sum of x.
using SumFn = float (*)(const void* x, std::int64_t n);
// Sum of (x - center)^2; the uncentered (RMSNorm) variant ignores center.
using SumSquaresFn = float (*)(const void* x, std::int64_t n, float center);
// The first statistic of two rows of n elements, read side by side: sums[k] has the bits of
// the one-row kernel's result for row k (SumSquaresFn uncentered, or SumFn).
using RowPairSumFn = void (*)(const void* x0, const void* x1, std::int64_t n, float* sums);
// residual <- round(x + residual); returns the sum of squares of the rounded residual.
using AddResidualFn = float (*)(const void* x, void* residual, std::int64_t n);
// The same for two rows side by side: sums[k] has the bits of row k's add_residual.
using AddResidualPairFn = void (*)(const void* x0, const void* x1, void* residual0, void* residual1,
                                   std::int64_t n, float* sums);
// y = (x - mean) * rstd [* (w + w_offset)] [+ b]; w and b in the dtypes of the table slot
// (ParamType). w_offset comes from kernel_weight_offset(); the kernels of offset slot 0 and
// the centered (LayerNorm) kernels have none and ignore it.
// ahead: the row this thread reads next (at the same element offsets as x), or nullptr; the
// streaming kernels fetch it into L2 while they write y (the other kernels ignore it).
using NormalizeFn = void (*)(const void* x, const void* w, const void* b, void* y, std::int64_t n,
                             float mean, float rstd, float w_offset, const void* ahead);

// A block of RMSNorm rows short enough to be normalized in one pass each (D up to
// kMaxShortRow): the statistics of several rows are gathered at once, and each weight vector
// is loaded once for all of them. Per row, the arithmetic (and so every bit) is that of
// sum_squares / add_residual followed by normalize: a row's result does not depend on the
// rows it is grouped with. Strides are in elements; residual is null without the fused add.
struct RmsRows {
  const void* x;
  std::int64_t x_stride;
  void* residual;
  std::int64_t residual_stride;
  void* y;
  std::int64_t y_stride;
  const void* w;
  float w_offset;  // from kernel_weight_offset()
  float eps;
  float* rstd;  // one per row, or null
  std::int64_t rows, n;
};
using RmsRowsFn = void (*)(const RmsRows& rows);
constexpr std::int64_t kMaxShortRow = 1024;
// The LayerNorm counterpart of RmsRows: per row the bits of sum, then sum_squares[1], then
// normalize (the statistics as the backend's compute_row_stats makes them from one chunk).
// mean and rstd: one per row, or null.
struct LayerRows {
  const void* x;
  std::int64_t x_stride;
  void* y;
  std::int64_t y_stride;
  const void* w;
  const void* b;
  float eps;
  float* mean;
  float* rstd;
  std::int64_t rows, n;
};
using LayerRowsFn = void (*)(const LayerRows& rows);
// With x_hat = (x - mean) * rstd and g = dy [* w]: sum of g * x_hat, and (centered only)
// sum of g.
using BackwardDotsFn = void (*)(const void* dy, const void* x, const float* w, std::int64_t n,
                                float mean, float rstd, float* sum_g_xhat, float* sum_g);
// The rows a backward_dots_pair call works on (kRows = 2; the one-row backward_dots shares
// its implementation with kRows = 1): per row, dy / x, its mean and rstd, and where its two
// sums go (BackwardDotsFn's).
template <std::size_t kRows>
struct BackwardDotRows {
  const void* dy[kRows];
  const void* x[kRows];
  float mean[kRows], rstd[kRows];
  float* sum_g_xhat;  // kRows floats
  float* sum_g;       // kRows floats
};
// BackwardDotsFn of two rows with the same w and n: each row's sums have the bits of a
// one-row call (its own accumulators, the same order).
using BackwardDotsPairFn = void (*)(const BackwardDotRows<2>& rows, const float* w, std::int64_t n);
// dx = rstd * (g - mean_g - x_hat * mean_g_xhat) [+ dx_addend]; dw_acc += dy * x_hat;
// w's NaNs, if any, must have their low 16 payload bits zero (bf16's dx rounding relies on
// it; NaNPayloads::kNarrow in element_io-inl.h): the backend's PreparedVector sees to it.
// db_acc += dy. The addend (the fused add's incoming residual gradient) is added in fp32
// before dx's one rounding; it may be dx or dy itself (each element is read before it is
// written).
using BackwardApplyFn = void (*)(const void* dy, const void* x, const float* w,
                                 const void* dx_addend, void* dx, float* dw_acc, float* db_acc,
                                 std::int64_t n, float mean, float rstd, float mean_g,
                                 float mean_g_xhat);

// The rows a backward_apply_pair call works on (kRows = 2; the one-row backward_apply
// shares its implementation with kRows = 1): per row, dy / x / dx and the coefficients.
template <std::size_t kRows>
struct BackwardRows {
  const void* dy[kRows];
  const void* x[kRows];
  const void* dx_addend[kRows];  // unused by the variants without an addend
  void* dx[kRows];
  float mean[kRows], rstd[kRows], mean_g[kRows], mean_g_xhat[kRows];
};
// BackwardApplyFn of two rows: dw_acc / db_acc take row 0's terms then row 1's, the bits of
// two one-row calls, but are loaded and stored once. When streamed, both dx rows must have
// the same address modulo 64.
using BackwardApplyPairFn = void (*)(const BackwardRows<2>& rows, const float* w, float* dw_acc,
                                     float* db_acc, std::int64_t n);

// A block of consecutive short rows for the backward (D <= kMaxShortRow, one column chunk),
// with their statistics given: each pair of rows gets its dots, then its dx and dw / db terms,
// through the same code as backward_dots_pair and backward_apply_pair, and a last odd row
// the one-row code; so the bits are those of the calls row pair by row pair. Strides are in
// elements; when streamed, the dx rows must share their address modulo 64.
struct BackwardBlock {
  const void* dy;
  const void* x;
  const void* dx_addend;  // unused by the variants without an addend
  void* dx;
  std::int64_t dy_stride, x_stride, addend_stride, dx_stride;
  const float* mean;  // per row (LayerNorm); unused by RMSNorm, whose mean is 0
  const float* rstd;  // per row
  std::int64_t rows, n;
};
using BackwardBlockFn = void (*)(const BackwardBlock& block, const float* w, float* dw_acc,
                                 float* db_acc);

// dst[j] = sum over b < blocks of partials[b * stride + j], for j < n: each column's
// terms added in block order to +0.0f, rounded once to the table's dtype (the gradient's
// dtype, which may differ from the rows'), as detail::store_from_float rounds.
using ColumnSumsFn = void (*)(const float* partials, std::int64_t blocks, std::int64_t stride,
                              std::int64_t n, void* dst);

struct DTypeKernels {
  SumFn sum;
  SumSquaresFn sum_squares[2];      // [centered]
  RowPairSumFn first_stat_pair[2];  // [centered]: sum_squares[0] (RMSNorm) or sum (LayerNorm)
  AddResidualFn add_residual;
  AddResidualPairFn add_residual_pair;
  // [stream][centered][weight ParamType][bias ParamType][offset_slot]
  NormalizeFn normalize[2][2][3][3][2];
  // [stream][fused residual add][weight ParamType][offset_slot]; stream: y's whole 64-byte
  // lines with non-temporal stores (the rows must share their address modulo 64).
  RmsRowsFn rms_rows[2][2][3][2];
  LayerRowsFn layer_rows[2][3][3];              // [stream][weight ParamType][bias ParamType]
  BackwardDotsFn backward_dots[2][2];           // [centered][weight]
  BackwardDotsPairFn backward_dots_pair[2][2];  // as backward_dots
  // [stream][centered][weight][dw][db][addend]; the addend variants are RMSNorm's only.
  BackwardApplyFn backward_apply[2][2][2][2][2][2];
  BackwardApplyPairFn backward_apply_pair[2][2][2][2][2][2];  // as backward_apply
  BackwardBlockFn backward_block[2][2][2][2][2][2];           // as backward_apply
  ColumnSumsFn column_sums;  // the backward's dw / db, stored in this dtype
};

// dst[0, bytes) = src[0, bytes), with non-temporal stores for every whole 64-byte line of
// dst and ordinary stores for the partial lines at its ends. The caller fences.
// [ahead, ahead + ahead_bytes): what the caller reads next, fetched into L2 a few lines per
// copied line, so that memory reads it while the copy writes (ahead_bytes 0: nothing).
using StreamCopyFn = void (*)(void* dst, const void* src, std::int64_t bytes, const void* ahead,
                              std::int64_t ahead_bytes);

// Fetches the line holding p into L2 (prefetcht1: the lines in L1, the ones being worked
// on, stay where they are).
inline void prefetch_line_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
// The row a kernel's prefetches walk beside x: `ahead`, the row read next, or without one
// (nullptr) x's own lines, already cached, so the loop keeps one unconditional prefetch.
template <typename T>
inline const T* prefetch_row(const void* ahead, const void* x) {
  return static_cast<const T*>(ahead != nullptr ? ahead : x);
}
// The same for [p, p + bytes), one prefetch per 64-byte line.
inline void prefetch_to_l2(const void* p, std::int64_t bytes) {
  const char* line = static_cast<const char*>(p);
  for (std::int64_t i = 0; i < bytes; i += 64) prefetch_line_to_l2(line + i);
}

struct RowKernels {
  DTypeKernels by_dtype[3];  // indexed by DType
  StreamCopyFn stream_copy;
  const char* target_name;  // Highway's name of `target`, or kAvx3Bf16TargetName
  std::int64_t target;      // the Highway target (HWY_AVX2, ...) the tables were compiled for
  // Lanes of the kernels' fp32 vectors: a row of T is written 2 * float_lanes * sizeof(T)
  // bytes per streamed store pair (WriteRows).
  std::int64_t float_lanes;
};

// AVX3 with its bf16 kernels compiled again with AVX512_BF16's conversions
// (row_kernels_bf16_avx512bf16.cc): the best target where the CPU has both.
inline constexpr const char kAvx3Bf16TargetName[] = "AVX3_BF16";

// Replaces *k with the bf16 kernels built with AVX512_BF16 and returns true, when this build
// has them and the CPU supports AVX512_BF16; otherwise returns false and leaves *k. The
// caller must hold AVX3's table (the rest of the CPU features they use).
bool fill_avx512bf16_kernels(DTypeKernels* k);

// The kernels of the best SIMD target this CPU supports (chosen once, thread-safe), or of
// the target named by the environment variable FUSEDNORM_CPU_TARGET (a Highway target name
// such as AVX2, AVX3, SSE4, EMU128, or AVX3_BF16; case-insensitive) to run and time a chosen
// target on a CPU that supports more. A name that is not compiled in or not supported by
// this CPU throws fusednorm::Error listing the ones that are.
const RowKernels& row_kernels();

// Tests: the kernels of every target compiled into this binary that this CPU can run.
struct TargetKernels {
  const char* name;
  RowKernels kernels;
};
std::vector<TargetKernels> kernels_for_all_supported_targets();

// Guards Highway's process-global target mock (hwy::SetSupportedTargetsForTest), set while
// a chosen target's table is built: by this file's tables and quant_kernels.h's.
std::mutex& target_mock_mutex();

}  // namespace fusednorm::cpu
