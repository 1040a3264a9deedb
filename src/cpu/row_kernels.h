// Per-row building blocks of the CPU backend, written once against Highway's portable
// vectors (row_kernels.cc) and compiled for every SIMD target; row_kernels() returns the
// table of the best target this CPU supports. Each function works on n consecutive
// elements of one row; the caller (cpu_backend.cpp) owns rows, chunks and threads.
//
// Writers come in two flavours: [0] ordinary stores, [1] non-temporal (streaming) stores
// for outputs too large to stay in the caches.
//
// Weights and biases reach these kernels already converted to fp32 (weight_offset folded
// in), so the element type T of x / y / dy / dx is the only dtype dimension.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fusednorm/fusednorm.h"

namespace fusednorm::cpu {

// Sum of x.
using SumFn = float (*)(const void* x, std::int64_t n);
// Sum of (x - center)^2; the uncentered (RMSNorm) variant ignores center.
using SumSquaresFn = float (*)(const void* x, std::int64_t n, float center);
// residual <- round(x + residual); returns the sum of squares of the rounded residual.
using AddResidualFn = float (*)(const void* x, void* residual, std::int64_t n);
// y = (x - mean) * rstd [* w] [+ b].
using NormalizeFn = void (*)(const void* x, const float* w, const float* b, void* y, std::int64_t n,
                             float mean, float rstd);
// With x_hat = (x - mean) * rstd and g = dy [* w]: sum of g * x_hat, and (centered only)
// sum of g.
using BackwardDotsFn = void (*)(const void* dy, const void* x, const float* w, std::int64_t n,
                                float mean, float rstd, float* sum_g_xhat, float* sum_g);
// dx = rstd * (g - mean_g - x_hat * mean_g_xhat) [+ dx_addend]; dw_acc += dy * x_hat;
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

struct DTypeKernels {
  SumFn sum;
  SumSquaresFn sum_squares[2];  // [centered]
  AddResidualFn add_residual;
  NormalizeFn normalize[2][2][2][2];                       // [stream][centered][weight][bias]
  BackwardDotsFn backward_dots[2][2];                      // [centered][weight]
  // [stream][centered][weight][dw][db][addend]; the addend variants are RMSNorm's only.
  BackwardApplyFn backward_apply[2][2][2][2][2][2];
  BackwardApplyPairFn backward_apply_pair[2][2][2][2][2][2];  // as backward_apply
};

struct RowKernels {
  DTypeKernels by_dtype[3];  // indexed by DType
  const char* target_name;
};

// The kernels of the best SIMD target this CPU supports (chosen once, thread-safe).
const RowKernels& row_kernels();

// Tests: the kernels of every target compiled into this binary that this CPU can run.
struct TargetKernels {
  const char* name;
  RowKernels kernels;
};
std::vector<TargetKernels> kernels_for_all_supported_targets();

}  // namespace fusednorm::cpu
