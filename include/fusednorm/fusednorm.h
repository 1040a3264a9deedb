// fusednorm: fused normalization operators (RMSNorm, LayerNorm) for LLM workloads.
//
// Every operator normalizes over the last dimension D of a rows x D view. The public API
// is backend-neutral: the same call runs on the CPU or, when built with CUDA, on the GPU;
// the Context says which. Arguments are validated on every call; a bad argument throws
// fusednorm::Error whose message names the operator and the argument.
//
// Numerics (all backends): elements are converted to fp32 on load, every sum and every
// product is fp32, eps is added in fp32, and each output element is rounded once (round to
// nearest even) when stored in its dtype.
//
// float64 (kFloat64) is a verification dtype, for gradient checks such as
// torch.autograd.gradcheck, not a speed path: every tensor of the call (x, residual, weight,
// bias, y, dy, dx, dx_addend, dw, db) must then be float64 (no mixing; a float32 weight is
// refused), and every sum, product and row statistic (mean, rstd) is fp64, eps and
// weight_offset widened exactly from their fp32 values. The per-row statistics outputs stay
// fp32 (rstd and mean receive the fp64 values rounded to fp32, for inspection), and a
// float64 backward does not read the rstd / mean it is given: it recomputes them in fp64
// from x, since an fp32 rstd would limit dx to fp32 accuracy. The two-phase operators
// (fp32 row sums) and the quantized operators refuse float64. On the CPU a float64
// backward allocates its own scratch for dw / db (the workspace is not used); on CUDA it
// needs backward_workspace_bytes() like every other dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fusednorm {

// Thrown for any invalid argument or backend failure. what() reads like
// "fusednorm::rms_norm: argument 'weight': size 4095 does not match D = 4096".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// kInt8 and kFloat8E4M3 (OCP E4M3FN: 4 exponent bits, 3 mantissa bits, bias 7, no infinity,
// finite max 448) are output dtypes of the quantized operators only.
enum class DType : std::uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt8 = 3,
  kFloat8E4M3 = 4,
  kFloat64 = 5,  // verification dtype (see Numerics above)
};

// Bytes of one element; throws fusednorm::Error for a value outside the enum.
std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

// A rows x cols view of elements, row r starting at data + r * row_stride elements.
// row_stride >= cols; elements inside a row are contiguous.
struct ConstMatrix {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
};

struct Matrix {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;

  operator ConstMatrix() const { return {data, dtype, rows, cols, row_stride}; }
};

// A contiguous vector (weight, bias and their gradients). data == nullptr means "absent".
struct ConstVector {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t size = 0;
};

struct Vector {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t size = 0;

  operator ConstVector() const { return {data, dtype, size}; }
};

// Convenience constructors for contiguous data.
inline ConstMatrix const_matrix(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                                std::int64_t row_stride = -1) {
  return {data, dtype, rows, cols, row_stride < 0 ? cols : row_stride};
}
inline Matrix matrix(void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                     std::int64_t row_stride = -1) {
  return {data, dtype, rows, cols, row_stride < 0 ? cols : row_stride};
}

enum class Device : std::uint8_t { kCpu = 0, kCuda = 1 };

// Caller-owned scratch memory, on the same device as the data. Only the backward operators
// use it (for the deterministic cross-row reduction of dw / db). On the CPU an empty
// workspace makes the call allocate its own; on CUDA a call never allocates, so the caller
// must pass at least backward_workspace_bytes().
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

struct Context {
  Device device = Device::kCpu;
  // CPU: number of threads; 0 means all hardware threads. Results are bit-identical for
  // any thread count.
  int num_threads = 0;
  // CUDA: the cudaStream_t to launch on (nullptr = the legacy default stream).
  void* cuda_stream = nullptr;
};

struct RmsNormOptions {
  float eps = 1e-6f;
  // The weight is applied as (weight + weight_offset); 1.0 gives Gemma's (1 + w).
  float weight_offset = 0.0f;
};

struct LayerNormOptions {
  float eps = 1e-5f;
};

// Does this build contain the backend?
bool has_backend(Device device);

// ---------------------------------------------------------------------------------------
// RMSNorm
//
// y[r, j] = x[r, j] * rstd[r] * (weight[j] + weight_offset),
// rstd[r] = 1 / sqrt(mean_j(x[r, j]^2) + eps).
// weight may be absent (data == nullptr): then y = x * rstd and weight_offset is ignored.
// weight dtype: x's dtype or fp32. y has x's dtype and shape; y may be x itself (same
// pointer and stride) but must not otherwise overlap it. rstd (nullable) receives one fp32
// per row, for the backward.
void rms_norm(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix y, float* rstd,
              const RmsNormOptions& options = {});

// residual <- x + residual (rounded to the residual's dtype), y = rms_norm(residual).
// One pass over memory. x, residual and y share dtype and shape; y may be x itself.
void fused_add_rms_norm(const Context& ctx, ConstMatrix x, Matrix residual, ConstVector weight,
                        Matrix y, float* rstd, const RmsNormOptions& options = {});

// Gradients of rms_norm. rstd may be nullptr (then it is recomputed from x with the
// options' eps). dx (nullable data) may be dy itself. dw (nullable data; required to be
// absent when weight is absent) is the sum over ALL rows of dy * x * rstd, reduced across
// rows in a fixed order: bit-identical for any thread count.
//
// dx_addend (data == nullptr: absent) is added to dx in the same pass: dx = round(norm's dx
// + dx_addend), the sum taken in fp32. It has dy's dtype and shape and any row stride, and
// may be dx itself or dy itself (accumulate in place) but must not otherwise overlap dx.
// The fused add's backward: dx then serves as the gradient of both x and residual, given
// the gradient reaching residual_out as the addend. Requires dx.
void rms_norm_backward(const Context& ctx, ConstMatrix dy, ConstMatrix x, ConstVector weight,
                       const float* rstd, Matrix dx, Vector dw, const RmsNormOptions& options = {},
                       Workspace workspace = {}, ConstMatrix dx_addend = {});

// ---------------------------------------------------------------------------------------
// Quantized RMSNorm: the norm's output quantized in the same pass, for the INT8 / FP8 GEMM
// that reads it. y is never rounded to x's dtype and never stored.
//
// y[r, j] is the fp32 value rms_norm computes before rounding (same operations, same order).
// q[r, j] = saturate(round_to_nearest_even(y[r, j] * inv_scale[r])), where inv_scale[r] =
// 1.0f / scale[r] is one correctly rounded fp32 division per row, and the product is fp32.
// A multiplication by the reciprocal, not a division per element, on every backend.
//   q dtype kInt8:       saturate to [-128, 127]; NaN -> 0.
//   q dtype kFloat8E4M3: round to nearest even in E4M3FN (subnormals included), saturate
//                        to +-448 (+-Inf too); NaN -> the canonical NaN 0x7f.
// Scales (fp32, on ctx's device):
//   static:  scale[r] = *static_scale for every row; finite and above about 2^-128 (so that
//            1 / scale is finite: 0 * Inf would be NaN). A pointer, so that a
//            CUDA graph replays with a new value. (The CPU checks the value; CUDA cannot
//            without a synchronisation and does not.)
//   dynamic per token (static_scale == nullptr): amax[r] = max_j |y[r, j]| over the row's
//            non-NaN values (0 if none), then amax[r] = min(amax[r], *scale_upper_bound)
//            when given (it bounds amax, as vLLM's and FBGEMM's scale_ub do), then
//            scale[r] = max(amax[r] / qmax, min_scale) (fp32 division), with qmax = 127 or
//            448 and min_scale = FLT_EPSILON (int8) or 1 / (448 * 512) (FP8), vLLM's values.
//            row_scales receives scale[r]. An all-zero row gets min_scale and q = 0.
// So q[r, j] * scale[r] dequantizes. Exactly one of static_scale and row_scales is given;
// scale_upper_bound (finite, > 0) only with row_scales.
struct QuantScale {
  const float* static_scale = nullptr;
  float* row_scales = nullptr;
  const float* scale_upper_bound = nullptr;
};

// q = quantize(rms_norm(x, weight)). q: rows x D, dtype kInt8 or kFloat8E4M3, any row stride.
void rms_norm_quant(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix q,
                    QuantScale scale, const RmsNormOptions& options = {});

// residual <- x + residual (rounded to the residual's dtype, as fused_add_rms_norm), then
// q = quantize(rms_norm(residual)). One pass over memory.
void fused_add_rms_norm_quant(const Context& ctx, ConstMatrix x, Matrix residual,
                              ConstVector weight, Matrix q, QuantScale scale,
                              const RmsNormOptions& options = {});

// ---------------------------------------------------------------------------------------
// RMSNorm in two phases, for a row whose columns are split across devices or processes (the
// tensor-parallel layout): each holds a column slice of x (and of weight, dy, dx, dw); the
// caller sums the per-row fp32 partials of phase 1 over the slices (an all-reduce) and hands
// the totals to phase 2. full_cols is the whole row's length D (>= the slice's cols).
// With one slice (full_cols == cols), phase 1 then phase 2 give the same bits as the
// one-call operator on the CPU.

// row_sum_squares[r] = sum_j x[r, j]^2 over this slice (fp32, the forward's chunked order).
void rms_norm_partial_sum_squares(const Context& ctx, ConstMatrix x, float* row_sum_squares);

// residual <- x + residual (rounded to the residual's dtype), and row_sum_squares of the
// stored residual: phase 1 of fused_add_rms_norm (its phase 2 is rms_norm_from_sum_squares
// on the residual).
void fused_add_partial_sum_squares(const Context& ctx, ConstMatrix x, Matrix residual,
                                   float* row_sum_squares);

// rms_norm given the whole row's sum of squares: rstd[r] = 1 / sqrt(row_sum_squares[r] /
// full_cols + eps), computed exactly as rms_norm computes it; y = x * rstd * (w + offset)
// on this slice. rstd (nullable) receives one fp32 per row.
void rms_norm_from_sum_squares(const Context& ctx, ConstMatrix x, ConstVector weight, Matrix y,
                               const float* row_sum_squares, std::int64_t full_cols, float* rstd,
                               const RmsNormOptions& options = {});

// Backward phase 1: row_sum_g_xhat[r] = sum_j g * x_hat over this slice, with g = dy * (w +
// offset) and x_hat = x * rstd. rstd is required (the forward's, or phase 2's output).
void rms_norm_backward_partial_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                    ConstVector weight, const float* rstd, float* row_sum_g_xhat,
                                    const RmsNormOptions& options = {});

// Backward phase 2: rms_norm_backward with mean(g * x_hat) = row_sum_g_xhat / full_cols
// from the reduced phase-1 sums; dw is this slice's columns (summed over this call's rows).
// Arguments otherwise as rms_norm_backward's (rstd required).
void rms_norm_backward_from_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                 ConstVector weight, const float* rstd, const float* row_sum_g_xhat,
                                 std::int64_t full_cols, Matrix dx, Vector dw,
                                 const RmsNormOptions& options = {}, Workspace workspace = {},
                                 ConstMatrix dx_addend = {});

// ---------------------------------------------------------------------------------------
// LayerNorm
//
// y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps), var the biased
// (population) variance. weight and bias are each optional. mean and rstd (nullable)
// receive one fp32 per row.
void layer_norm(const Context& ctx, ConstMatrix x, ConstVector weight, ConstVector bias, Matrix y,
                float* mean, float* rstd, const LayerNormOptions& options = {});

// Gradients of layer_norm. mean and rstd must both be given or both be nullptr
// (recomputed). dw and db are cross-row reductions with the same determinism as
// rms_norm_backward.
void layer_norm_backward(const Context& ctx, ConstMatrix dy, ConstMatrix x, ConstVector weight,
                         const float* mean, const float* rstd, Matrix dx, Vector dw, Vector db,
                         const LayerNormOptions& options = {}, Workspace workspace = {});

// LayerNorm in phases, for column-sliced rows as RMSNorm's above (sums fp32, one per row,
// added over the slices by the caller between phases; full_cols the whole row's D). The
// forward needs two reductions: the sums of x, then the squared deviations from the whole
// row's mean (row_sum / full_cols). With one slice the phases give the one-call bits on
// the CPU.

// row_sum[r] = sum_j x[r, j] over this slice.
void layer_norm_partial_sums(const Context& ctx, ConstMatrix x, float* row_sum);

// row_sum_squared_deviations[r] = sum_j (x[r, j] - mean[r])^2 over this slice, with mean[r]
// = row_sum[r] / full_cols from the whole row's sums.
void layer_norm_partial_squared_deviations(const Context& ctx, ConstMatrix x, const float* row_sum,
                                           std::int64_t full_cols,
                                           float* row_sum_squared_deviations);

// layer_norm given the whole row's sums: mean = row_sum / full_cols, rstd = 1 / sqrt(
// row_sum_squared_deviations / full_cols + eps), exactly as layer_norm computes them; y on
// this slice (weight, bias: the slice's). mean and rstd (nullable) receive one fp32 per row.
void layer_norm_from_sums(const Context& ctx, ConstMatrix x, ConstVector weight, ConstVector bias,
                          Matrix y, const float* row_sum, const float* row_sum_squared_deviations,
                          std::int64_t full_cols, float* mean, float* rstd,
                          const LayerNormOptions& options = {});

// Backward phase 1: row_sum_g[r] = sum_j g and row_sum_g_xhat[r] = sum_j g * x_hat over this
// slice (g = dy * w, x_hat = (x - mean) * rstd). mean and rstd are required.
void layer_norm_backward_partial_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                      ConstVector weight, const float* mean, const float* rstd,
                                      float* row_sum_g, float* row_sum_g_xhat);

// Backward phase 2: layer_norm_backward with mean(g) and mean(g * x_hat) from the whole
// row's phase-1 sums over full_cols; dw / db are this slice's columns. mean, rstd required.
void layer_norm_backward_from_sums(const Context& ctx, ConstMatrix dy, ConstMatrix x,
                                   ConstVector weight, const float* mean, const float* rstd,
                                   const float* row_sum_g, const float* row_sum_g_xhat,
                                   std::int64_t full_cols, Matrix dx, Vector dw, Vector db,
                                   const LayerNormOptions& options = {}, Workspace workspace = {});

// Scratch bytes the backward operators need for a rows x cols problem on ctx's device.
std::size_t backward_workspace_bytes(const Context& ctx, std::int64_t rows, std::int64_t cols);

}  // namespace fusednorm
