// GPU correctness of every operator against the fp64 reference (include/fusednorm/reference.h),
// over dtypes, D from 1 to 262144, row strides, unaligned data (the scalar path), weight
// dtypes, Gemma's weight offset, aliasing, graph capture and dw determinism.
// Without a CUDA device every test skips with a visible message.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/quantize.h"
#include "core/scalar_convert.h"
#include "fusednorm/fusednorm.h"
#include "fusednorm/reference.h"

namespace fusednorm {
namespace {

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define REQUIRE_GPU()                                                            \
  do {                                                                           \
    if (!have_device()) GTEST_SKIP() << "no CUDA device: GPU test skipped";      \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

const Context kGpu{Device::kCuda, 0, nullptr};

// Host bytes of a dtype buffer plus a device copy at a chosen misalignment (in elements).
class Buffer {
 public:
  Buffer(DType dtype, std::int64_t elements, int misalign = 0)
      : dtype_(dtype), elements_(elements), misalign_(misalign),
        host_(static_cast<std::size_t>(elements) * dtype_size(dtype)) {
    const std::size_t bytes = host_.size() + 64;
    if (cudaMalloc(&device_base_, bytes) != cudaSuccess) device_base_ = nullptr;
  }
  ~Buffer() { cudaFree(device_base_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void fill_random(std::mt19937& rng, float lo = -2.0f, float hi = 2.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    for (std::int64_t i = 0; i < elements_; ++i) detail::store_from_float(host_.data(), dtype_, i, dist(rng));
  }
  void fill(float v) {
    for (std::int64_t i = 0; i < elements_; ++i) detail::store_from_float(host_.data(), dtype_, i, v);
  }
  float get(std::int64_t i) const { return detail::load_as_float(host_.data(), dtype_, i); }
  void* host() { return host_.data(); }
  void* device() { return static_cast<char*>(device_base_) + misalign_ * dtype_size(dtype_); }
  bool ok() const { return device_base_ != nullptr; }
  void upload() { cudaMemcpy(device(), host_.data(), host_.size(), cudaMemcpyHostToDevice); }
  void download() { cudaMemcpy(host_.data(), device(), host_.size(), cudaMemcpyDeviceToHost); }
  DType dtype() const { return dtype_; }

 private:
  DType dtype_;
  std::int64_t elements_;
  int misalign_;
  std::vector<unsigned char> host_;
  void* device_base_ = nullptr;
};

// rtol per dtype: one rounding of the output plus fp32 arithmetic.
double tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 2e-5;
    case DType::kFloat16: return 1.0 / 1024;
    case DType::kBFloat16: return 1.0 / 128;
    default: break;
  }
  return 0;
}

// |got - ref| <= rtol * (|ref| + floor): relative, with an absolute floor at the tensor's
// own scale (rms of ref; cancellation in LayerNorm leaves small elements with an error
// relative to the row, not to themselves), or per element where `floor` is given.
void expect_close(const std::vector<double>& ref, const std::function<float(std::int64_t)>& got, double rtol,
                  const std::string& what, const std::vector<double>* floor = nullptr) {
  double ms = 0;
  for (double r : ref) ms += r * r;
  const double scale = ref.empty() ? 0 : std::sqrt(ms / static_cast<double>(ref.size()));
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = got(static_cast<std::int64_t>(i));
    const double err = std::abs(g - ref[i]);
    if (!(err <= rtol * (std::abs(ref[i]) + (floor != nullptr ? (*floor)[i] : scale)))) {
      if (bad++ < 5) ADD_FAILURE() << what << "[" << i << "]: got " << g << ", reference " << ref[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " elements out of tolerance";
}

struct Case {
  DType dtype;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t pad = 0;   // row_stride = cols + pad
  int misalign = 0;       // device pointers this many elements past 256-byte alignment
  bool weight = true;
  bool weight_f32 = false;
  float offset = 0.0f;
  std::string name() const {
    return std::string(dtype_name(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols) +
           " pad " + std::to_string(pad) + " misalign " + std::to_string(misalign) + (weight ? " w" : " no-w") +
           (weight_f32 ? "(f32)" : "") + " offset " + std::to_string(offset);
  }
};

// FUSEDNORM_TEST_QUICK=1 (bench/gpu/run.sh sets it under compute-sanitizer, which runs
// kernels far slower): every D of the sweep, so every kernel kind, but at most 3 rows.
bool quick() {
  const char* env = std::getenv("FUSEDNORM_TEST_QUICK");
  return env != nullptr && env[0] != '\0' && env[0] != '0';
}

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // 12288: fp32 rows of exactly 48 KB in shared memory (needs the opt-in with static smem).
    for (std::int64_t cols : {1, 7, 64, 128, 1000, 4096, 5120, 12288, 16384, 32768, 65536, 262144}) {
      const std::int64_t rows = cols >= 65536 || quick() ? 3 : cols >= 4096 ? 37 : 301;
      cases.push_back({dt, rows, cols});
      if (cols == 128 || cols == 4096 || cols == 65536) {
        cases.push_back({dt, rows, cols, 8, 0, true, true, 1.0f});  // strided, fp32 weight, Gemma
        cases.push_back({dt, rows, cols, 3, 1, false});             // unaligned: scalar path
      }
      // Rows of whole vectors at an address off by one element: only the pointer test keeps
      // them off the 16-byte path.
      if (cols == 4096) cases.push_back({dt, rows, cols, 0, 1});
    }
  }
  return cases;
}

std::mt19937 rng_for(const Case& c) {
  return std::mt19937(static_cast<unsigned>(c.cols * 131 + c.rows * 7 + static_cast<int>(c.dtype)));
}

void check_rms_norm(const Case& c) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad;
  Buffer x(c.dtype, c.rows * stride, c.misalign), y(c.dtype, c.rows * stride, c.misalign);
  Buffer w(c.weight_f32 ? DType::kFloat32 : c.dtype, c.cols, c.misalign), rstd(DType::kFloat32, c.rows);
  ASSERT_TRUE(x.ok() && y.ok() && w.ok() && rstd.ok());
  x.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  y.fill(NAN);  // poisoned: every element must be written
  x.upload();
  w.upload();
  y.upload();
  const RmsNormOptions opt{1e-6f, c.offset};
  const ConstVector wv = c.weight ? ConstVector{w.device(), w.dtype(), c.cols} : ConstVector{};
  rms_norm(kGpu, const_matrix(x.device(), c.dtype, c.rows, c.cols, stride), wv,
           matrix(y.device(), c.dtype, c.rows, c.cols, stride), static_cast<float*>(rstd.device()), opt);
  CUDA_OK(cudaDeviceSynchronize());
  y.download();
  rstd.download();
  const ConstVector wh = c.weight ? ConstVector{w.host(), w.dtype(), c.cols} : ConstVector{};
  const auto ref = reference::rms_norm(const_matrix(x.host(), c.dtype, c.rows, c.cols, stride), wh, opt);
  expect_close(ref.y, [&](std::int64_t i) { return y.get(i / c.cols * stride + i % c.cols); }, tolerance(c.dtype), "y");
  expect_close(ref.rstd, [&](std::int64_t i) { return rstd.get(i); }, 2e-5, "rstd");
}

void check_fused_add_rms_norm(const Case& c) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad;
  Buffer x(c.dtype, c.rows * stride, c.misalign), res(c.dtype, c.rows * stride, c.misalign);
  Buffer w(c.weight_f32 ? DType::kFloat32 : c.dtype, c.cols, c.misalign), rstd(DType::kFloat32, c.rows);
  ASSERT_TRUE(x.ok() && res.ok() && w.ok() && rstd.ok());
  x.fill_random(rng);
  res.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  x.upload();
  res.upload();
  w.upload();
  const RmsNormOptions opt{1e-6f, c.offset};
  const ConstVector wh = c.weight ? ConstVector{w.host(), w.dtype(), c.cols} : ConstVector{};
  const auto ref = reference::fused_add_rms_norm(const_matrix(x.host(), c.dtype, c.rows, c.cols, stride),
                                                 const_matrix(res.host(), c.dtype, c.rows, c.cols, stride), wh, opt);
  // y written in place over x.
  const ConstVector wv = c.weight ? ConstVector{w.device(), w.dtype(), c.cols} : ConstVector{};
  fused_add_rms_norm(kGpu, const_matrix(x.device(), c.dtype, c.rows, c.cols, stride),
                     matrix(res.device(), c.dtype, c.rows, c.cols, stride), wv,
                     matrix(x.device(), c.dtype, c.rows, c.cols, stride), static_cast<float*>(rstd.device()), opt);
  CUDA_OK(cudaDeviceSynchronize());
  x.download();
  res.download();
  auto at = [&](std::int64_t i) { return i / c.cols * stride + i % c.cols; };
  // The stored residual is x + residual rounded once: exact match expected.
  expect_close(ref.residual, [&](std::int64_t i) { return res.get(at(i)); }, 0.0, "residual");
  expect_close(ref.y, [&](std::int64_t i) { return x.get(at(i)); }, tolerance(c.dtype), "y");
}

void check_layer_norm(const Case& c) {
  for (bool bias : {false, true}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    std::mt19937 rng = rng_for(c);
    const std::int64_t stride = c.cols + c.pad;
    const DType pdt = c.weight_f32 ? DType::kFloat32 : c.dtype;
    Buffer x(c.dtype, c.rows * stride, c.misalign), y(c.dtype, c.rows * stride, c.misalign);
    Buffer w(pdt, c.cols, c.misalign), b(pdt, c.cols, c.misalign);
    Buffer mean(DType::kFloat32, c.rows), rstd(DType::kFloat32, c.rows);
    ASSERT_TRUE(x.ok() && y.ok() && w.ok() && b.ok() && mean.ok() && rstd.ok());
    x.fill_random(rng, -1.0f, 3.0f);  // non-zero mean
    w.fill_random(rng, 0.5f, 1.5f);
    b.fill_random(rng);
    y.fill(NAN);
    x.upload();
    w.upload();
    b.upload();
    y.upload();
    const ConstVector wv = c.weight ? ConstVector{w.device(), pdt, c.cols} : ConstVector{};
    const ConstVector bv = bias ? ConstVector{b.device(), pdt, c.cols} : ConstVector{};
    layer_norm(kGpu, const_matrix(x.device(), c.dtype, c.rows, c.cols, stride), wv, bv,
               matrix(y.device(), c.dtype, c.rows, c.cols, stride), static_cast<float*>(mean.device()),
               static_cast<float*>(rstd.device()));
    CUDA_OK(cudaDeviceSynchronize());
    y.download();
    mean.download();
    rstd.download();
    const ConstVector wh = c.weight ? ConstVector{w.host(), pdt, c.cols} : ConstVector{};
    const ConstVector bh = bias ? ConstVector{b.host(), pdt, c.cols} : ConstVector{};
    const auto ref = reference::layer_norm(const_matrix(x.host(), c.dtype, c.rows, c.cols, stride), wh, bh);
    expect_close(ref.y, [&](std::int64_t i) { return y.get(i / c.cols * stride + i % c.cols); }, tolerance(c.dtype), "y");
    expect_close(ref.mean, [&](std::int64_t i) { return mean.get(i); }, 2e-5, "mean");
    expect_close(ref.rstd, [&](std::int64_t i) { return rstd.get(i); }, 2e-4, "rstd");
  }
}

TEST(CudaForward, RmsNormMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    check_rms_norm(c);
  }
}

TEST(CudaForward, FusedAddRmsNormMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    check_fused_add_rms_norm(c);
  }
}

TEST(CudaForward, LayerNormMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    check_layer_norm(c);
  }
}

// RMSNorm's dx addend: none, its own buffer, or dx's view (dy's when dx is written over dy).
enum class Addend { kNone, kSeparate, kIntoDx };

// Backward of either norm; checks dx, dw, db against the reference and that dw / db are
// bit-identical on a second run.
void check_backward(const Case& c, bool layer, bool want_dx, bool want_dw, bool want_db,
                    bool pass_stats, bool dx_over_dy, Addend addend = Addend::kNone) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad;
  const DType pdt = c.weight_f32 ? DType::kFloat32 : c.dtype;
  Buffer x(c.dtype, c.rows * stride, c.misalign), dy(c.dtype, c.rows * stride, c.misalign);
  Buffer dx(c.dtype, c.rows * stride, c.misalign), w(pdt, c.cols, c.misalign);
  Buffer dw(pdt, c.cols), db(pdt, c.cols), dw2(pdt, c.cols);
  Buffer mean(DType::kFloat32, std::max<std::int64_t>(c.rows, 1)), rstd(DType::kFloat32, std::max<std::int64_t>(c.rows, 1));
  const std::size_t ws_bytes = backward_workspace_bytes(kGpu, c.rows, c.cols);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
  ASSERT_TRUE(x.ok() && dy.ok() && dx.ok() && w.ok() && dw.ok() && db.ok());
  x.fill_random(rng, layer ? -1.0f : -2.0f, layer ? 3.0f : 2.0f);
  dy.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  dx.fill(NAN);
  dw.fill(NAN);
  db.fill(NAN);
  // The addend's values; kIntoDx puts them into dx first (dx over dy: the addend is dy).
  Buffer add(c.dtype, c.rows * stride, c.misalign);
  add.fill_random(rng);
  if (addend == Addend::kIntoDx && !dx_over_dy)
    std::memcpy(dx.host(), add.host(), c.rows * stride * dtype_size(c.dtype));
  x.upload();
  dy.upload();
  w.upload();
  dx.upload();
  dw.upload();
  db.upload();
  add.upload();

  const ConstMatrix xd = const_matrix(x.device(), c.dtype, c.rows, c.cols, stride);
  const ConstMatrix dyd = const_matrix(dy.device(), c.dtype, c.rows, c.cols, stride);
  void* dx_ptr = !want_dx ? nullptr : dx_over_dy ? dy.device() : dx.device();
  const Matrix dxd = dx_ptr ? matrix(dx_ptr, c.dtype, c.rows, c.cols, stride) : Matrix{};
  const ConstVector wv = c.weight ? ConstVector{w.device(), pdt, c.cols} : ConstVector{};
  const ConstMatrix addd = addend == Addend::kSeparate
                               ? const_matrix(add.device(), c.dtype, c.rows, c.cols, stride)
                           : addend == Addend::kIntoDx ? ConstMatrix(dxd)
                                                       : ConstMatrix{};
  auto run = [&](void* dw_ptr) {
    const Vector dwv = want_dw ? Vector{dw_ptr, pdt, c.cols} : Vector{};
    const Vector dbv = want_db ? Vector{db.device(), pdt, c.cols} : Vector{};
    if (layer) {
      const float* m = pass_stats ? static_cast<float*>(mean.device()) : nullptr;
      const float* r = pass_stats ? static_cast<float*>(rstd.device()) : nullptr;
      layer_norm_backward(kGpu, dyd, xd, wv, m, r, dxd, dwv, dbv, {}, {ws, ws_bytes});
    } else {
      const float* r = pass_stats ? static_cast<float*>(rstd.device()) : nullptr;
      rms_norm_backward(kGpu, dyd, xd, wv, r, dxd, dwv, {1e-6f, c.offset}, {ws, ws_bytes}, addd);
    }
  };
  if (pass_stats) {  // the forward's statistics, as autograd would pass them
    Buffer y(c.dtype, c.rows * stride, c.misalign);
    if (layer) {
      layer_norm(kGpu, xd, {}, {}, matrix(y.device(), c.dtype, c.rows, c.cols, stride),
                 static_cast<float*>(mean.device()), static_cast<float*>(rstd.device()));
    } else {
      rms_norm(kGpu, xd, {}, matrix(y.device(), c.dtype, c.rows, c.cols, stride),
               static_cast<float*>(rstd.device()), {1e-6f, c.offset});
    }
  }
  // Results from a second run (dx input restored first when it overwrote dy).
  run(dw2.device());
  if (dx_over_dy) dy.upload();
  if (addend == Addend::kIntoDx && !dx_over_dy) dx.upload();
  run(dw.device());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (dx_over_dy) dy.download(); else dx.download();
  dw.download();
  dw2.download();
  db.download();
  cudaFree(ws);

  const ConstMatrix xh = const_matrix(x.host(), c.dtype, c.rows, c.cols, stride);
  Buffer dy_in(c.dtype, c.rows * stride);
  { std::mt19937 rng2 = rng_for(c); x.fill_random(rng2, layer ? -1.0f : -2.0f, layer ? 3.0f : 2.0f); dy_in.fill_random(rng2); }
  const ConstMatrix dyh = const_matrix(dy_in.host(), c.dtype, c.rows, c.cols, stride);
  const ConstVector wh = c.weight ? ConstVector{w.host(), pdt, c.cols} : ConstVector{};
  const ConstMatrix addh = addend == Addend::kNone ? ConstMatrix{}
                           : addend == Addend::kIntoDx && dx_over_dy
                               ? dyh
                               : const_matrix(add.host(), c.dtype, c.rows, c.cols, stride);
  const auto ref = layer ? reference::layer_norm_backward(dyh, xh, wh, want_db)
                         : reference::rms_norm_backward(dyh, xh, wh, {1e-6f, c.offset}, addh);
  Buffer& dx_out = dx_over_dy ? dy : dx;
  const double tol = tolerance(c.dtype) * 2;
  if (want_dx) {
    // dx is a difference of terms of size ref.dx_scale (per row), which bounds its error.
    std::vector<double> scale(ref.dx.size());
    for (std::size_t i = 0; i < scale.size(); ++i) scale[i] = ref.dx_scale[i / static_cast<std::size_t>(c.cols)];
    expect_close(ref.dx, [&](std::int64_t i) { return dx_out.get(i / c.cols * stride + i % c.cols); }, tol, "dx",
                 &scale);
  }
  // dw / db in the parameter dtype: one rounding of an fp32 sum over all rows.
  const double ptol = std::max(tolerance(pdt), 1e-4);
  if (want_dw) {
    expect_close(ref.dw, [&](std::int64_t i) { return dw.get(i); }, ptol, "dw");
    EXPECT_EQ(std::memcmp(dw.host(), dw2.host(), static_cast<std::size_t>(c.cols) * dtype_size(pdt)), 0)
        << "dw differs between two identical runs";
  }
  if (want_db) expect_close(ref.db, [&](std::int64_t i) { return db.get(i); }, ptol, "db");
}

TEST(CudaBackward, RmsNormMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    check_backward(c, false, true, c.weight, false, c.cols % 2 == 0, false);
  }
}

TEST(CudaBackward, LayerNormMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    check_backward(c, true, true, c.weight, true, c.cols % 2 == 0, false);
  }
}

// Rows beyond register capacity are staged in shared memory, one CTA or cluster per row;
// with more rows than clusters each CTA sums dw / db over several rows before writing its
// slot. (fp32 16384: one CTA per row; bf16 32768: clusters of 2; fp16 65536 LayerNorm with
// dw and db: clusters of 4 on an H200.)
TEST(CudaBackward, StagedRowsSumOverManyRowsPerCluster) {
  REQUIRE_GPU();
  const std::int64_t rows = 301;  // more than the clusters of every plan here (quick too)
  for (const Case& c : {Case{DType::kFloat32, rows, 16384}, Case{DType::kBFloat16, rows, 32768},
                        Case{DType::kFloat16, rows, 65536, 0, 0, true, true, 1.0f}}) {
    SCOPED_TRACE(c.name());
    for (bool pass_stats : {false, true}) {
      check_backward(c, false, true, true, false, pass_stats, false);
      check_backward(c, true, true, true, true, pass_stats, false);
    }
    check_backward(c, false, true, true, false, true, true);  // dx over dy
  }
}

// Rows whose dy and x do not fit a cluster of 8 (bf16 D = 262144 with dw: 2 MB): the column
// sums alone are in shared memory and every pass reads dy and x again; more rows than
// clusters, so each CTA's sums run over several rows. fp32 LayerNorm with dw and db at that
// D takes the two-kernel path.
TEST(CudaBackward, UnstagedClusterRowsMatchReference) {
  REQUIRE_GPU();
  for (const Case& c : {Case{DType::kBFloat16, 40, 262144}, Case{DType::kFloat32, 20, 262144, 4, 0, true, true, 1.0f}}) {
    SCOPED_TRACE(c.name());
    check_backward(c, false, true, true, false, false, false);
    check_backward(c, false, true, true, false, true, true);  // given rstd, dx over dy
    check_backward(c, true, true, true, true, false, false);
    check_backward(c, true, true, true, true, true, false);
  }
}

// FUSEDNORM_CUDA_STAGED_ROWS=0 sends rows beyond register capacity to the two-pass kernels
// (gpu_bench's A/B rows; on an H200 the forward reaches them otherwise only past D = 8 x
// 227 KB): the same checks on them.
TEST(CudaTwoPass, MatchesReferenceWhenStagingIsOff) {
  REQUIRE_GPU();
  setenv("FUSEDNORM_CUDA_STAGED_ROWS", "0", 1);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (const Case& c : {Case{dt, 37, 16384}, Case{dt, 3, 65536, 8, 0, true, true, 1.0f}, Case{dt, 5, 12288, 3, 1, false}}) {
      SCOPED_TRACE(c.name());
      check_rms_norm(c);
      check_fused_add_rms_norm(c);
      check_layer_norm(c);
      check_backward(c, false, true, c.weight, false, true, false);
      check_backward(c, true, true, c.weight, true, false, false);
    }
  }
  unsetenv("FUSEDNORM_CUDA_STAGED_ROWS");
}

TEST(CudaBackward, PartialOutputsAndAliasing) {
  REQUIRE_GPU();
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (std::int64_t cols : {128, 4096, 65536}) {
      const Case c{dt, 19, cols};
      SCOPED_TRACE(c.name());
      check_backward(c, false, true, false, false, true, true);   // dx over dy, dx only
      check_backward(c, false, false, true, false, true, false);  // dw only
      check_backward(c, true, false, false, true, false, false);  // db only, stats recomputed
      check_backward(c, true, true, true, false, true, true);     // dx over dy with dw
    }
  }
}

// The fused add's backward: dx = norm's dx + dx_addend, in every backward kernel family
// (register rows, staged rows, clusters, the two-pass kernels).
TEST(CudaBackward, DxAddendMatchesReference) {
  REQUIRE_GPU();
  int n = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    const Addend addend = n++ % 2 == 0 ? Addend::kSeparate : Addend::kIntoDx;
    check_backward(c, false, true, c.weight, false, c.cols % 2 == 0, false, addend);
  }
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (std::int64_t cols : {128, 4096, 65536}) {
      const Case c{dt, 19, cols};
      SCOPED_TRACE(c.name());
      check_backward(c, false, true, false, false, true, true,
                     Addend::kIntoDx);  // dx = dy = addend, dx only
      check_backward(c, false, true, true, false, false, true,
                     Addend::kSeparate);  // dx over dy with dw
    }
  }
}

TEST(CudaBackward, DxAddendOnTheTwoPassKernels) {
  REQUIRE_GPU();
  setenv("FUSEDNORM_CUDA_STAGED_ROWS", "0", 1);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (const Case& c : {Case{dt, 37, 16384}, Case{dt, 5, 12288, 3, 1, false}}) {
      SCOPED_TRACE(c.name());
      check_backward(c, false, true, c.weight, false, true, false,
                     Addend::kSeparate);  // coef + tile kernels
      check_backward(c, false, true, false, false, true, false,
                     Addend::kIntoDx);  // coef kernel writes dx
    }
  }
  unsetenv("FUSEDNORM_CUDA_STAGED_ROWS");
}

// The two-phase RMSNorm: the row cut into `cuts` slices (column sub-views of the same device
// buffers), phase-1 sums added in slice order on the host as an all-reduce would, against the
// reference of the whole row: fused-add forward (residual, y, rstd) and backward with the
// dx addend (dx, dw).
void check_two_phase(const Case& c, const std::vector<std::int64_t>& cuts) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad;
  const std::size_t slices = cuts.size() - 1;
  const DType pdt = c.weight_f32 ? DType::kFloat32 : c.dtype;
  const std::size_t esize = dtype_size(c.dtype), psize = dtype_size(pdt);
  Buffer x(c.dtype, c.rows * stride, c.misalign), res(c.dtype, c.rows * stride, c.misalign);
  Buffer y(c.dtype, c.rows * stride, c.misalign), dy(c.dtype, c.rows * stride, c.misalign);
  Buffer dx(c.dtype, c.rows * stride, c.misalign), add(c.dtype, c.rows * stride, c.misalign);
  Buffer w(pdt, c.cols, c.misalign), dw(pdt, c.cols);
  Buffer rstd(DType::kFloat32, c.rows), partial(DType::kFloat32, c.rows),
      total(DType::kFloat32, c.rows);
  x.fill_random(rng);
  res.fill_random(rng);
  dy.fill_random(rng);
  add.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  y.fill(NAN);
  dx.fill(NAN);
  dw.fill(NAN);
  for (Buffer* b : {&x, &res, &y, &dy, &dx, &add, &w, &dw}) b->upload();
  const RmsNormOptions opt{1e-6f, c.offset};
  const ConstVector wh = c.weight ? ConstVector{w.host(), pdt, c.cols} : ConstVector{};
  const auto ref = reference::fused_add_rms_norm(
      const_matrix(x.host(), c.dtype, c.rows, c.cols, stride),
      const_matrix(res.host(), c.dtype, c.rows, c.cols, stride), wh, opt);
  auto cols_of = [&](Buffer& b, std::size_t k) {
    return matrix(static_cast<char*>(b.device()) + cuts[k] * esize, c.dtype, c.rows,
                  cuts[k + 1] - cuts[k], stride);
  };
  auto weight_of = [&](Buffer& b, std::size_t k) {
    return c.weight ? Vector{static_cast<char*>(b.device()) + cuts[k] * psize, pdt,
                             cuts[k + 1] - cuts[k]}
                    : Vector{};
  };
  // The "all-reduce": per-slice partial sums added in slice order.
  auto all_reduce = [&](const std::function<void(std::size_t, float*)>& phase1) {
    std::vector<float> sum(static_cast<std::size_t>(c.rows), 0.0f);
    for (std::size_t k = 0; k < slices; ++k) {
      phase1(k, static_cast<float*>(partial.device()));
      CUDA_OK(cudaDeviceSynchronize());
      partial.download();
      for (std::int64_t r = 0; r < c.rows; ++r) sum[r] += partial.get(r);
    }
    std::memcpy(total.host(), sum.data(), sum.size() * sizeof(float));
    total.upload();
  };
  all_reduce([&](std::size_t k, float* out) {
    fused_add_partial_sum_squares(kGpu, cols_of(x, k), cols_of(res, k), out);
  });
  for (std::size_t k = 0; k < slices; ++k) {
    rms_norm_from_sum_squares(kGpu, cols_of(res, k), weight_of(w, k), cols_of(y, k),
                              static_cast<const float*>(total.device()), c.cols,
                              static_cast<float*>(rstd.device()), opt);
  }
  CUDA_OK(cudaDeviceSynchronize());
  y.download();
  res.download();
  rstd.download();
  auto at = [&](std::int64_t i) { return i / c.cols * stride + i % c.cols; };
  expect_close(
      ref.residual, [&](std::int64_t i) { return res.get(at(i)); }, 0.0, "residual");
  expect_close(
      ref.y, [&](std::int64_t i) { return y.get(at(i)); }, tolerance(c.dtype), "y");
  expect_close(
      ref.rstd, [&](std::int64_t i) { return rstd.get(i); }, 2e-5, "rstd");

  const std::size_t ws_bytes = backward_workspace_bytes(kGpu, c.rows, c.cols);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
  const float* rstd_d = static_cast<const float*>(rstd.device());
  all_reduce([&](std::size_t k, float* out) {
    rms_norm_backward_partial_sums(kGpu, cols_of(dy, k), cols_of(res, k), weight_of(w, k), rstd_d,
                                   out, opt);
  });
  for (std::size_t k = 0; k < slices; ++k) {
    rms_norm_backward_from_sums(kGpu, cols_of(dy, k), cols_of(res, k), weight_of(w, k), rstd_d,
                                static_cast<const float*>(total.device()), c.cols, cols_of(dx, k),
                                weight_of(dw, k), opt, {ws, ws_bytes}, cols_of(add, k));
  }
  CUDA_OK(cudaDeviceSynchronize());
  cudaFree(ws);
  dx.download();
  dw.download();
  const auto grad =
      reference::rms_norm_backward(const_matrix(dy.host(), c.dtype, c.rows, c.cols, stride),
                                   const_matrix(res.host(), c.dtype, c.rows, c.cols, stride), wh,
                                   opt, const_matrix(add.host(), c.dtype, c.rows, c.cols, stride));
  std::vector<double> scale(grad.dx.size());
  for (std::size_t i = 0; i < scale.size(); ++i)
    scale[i] = grad.dx_scale[i / static_cast<std::size_t>(c.cols)];
  expect_close(
      grad.dx, [&](std::int64_t i) { return dx.get(at(i)); }, tolerance(c.dtype) * 2, "dx", &scale);
  if (c.weight)
    expect_close(
        grad.dw, [&](std::int64_t i) { return dw.get(i); }, std::max(tolerance(pdt), 1e-4), "dw");
}

TEST(CudaTwoPhase, SlicesMatchReference) {
  REQUIRE_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const Case& c : {Case{dt, 37, 1024}, Case{dt, 5, 4096, 8, 0, true, true, 1.0f},
                          Case{dt, 7, 999, 3, 1, false}, Case{dt, 3, 16384}}) {
      SCOPED_TRACE(c.name());
      check_two_phase(c, {0, c.cols});                                    // one slice
      check_two_phase(c, {0, c.cols / 2, c.cols});                        // two even slices
      check_two_phase(c, {0, c.cols / 3 + 1, 2 * (c.cols / 3), c.cols});  // three uneven ones
    }
  }
}

// ---- The two-phase LayerNorm ---------------------------------------------------------------

// One backend's buffers for the LayerNorm phases: host pointers for the CPU backend, device
// pointers for CUDA (per-row sums cross between phases through the host, as an all-reduce).
struct LayerPhaseBuffers {
  Context ctx;
  const void *x, *dy, *w, *b;                // w, b nullable
  void *y, *dx, *dw, *db;                    // dw, db nullable
  float *mean, *rstd, *partial, *partial_g;  // per-row fp32
  Workspace workspace;
};

// Runs the LayerNorm phases over the column slices `cuts` of rows x cols matrices with row
// stride `stride`; every phase-1 sum is added in slice order on the host.
void run_layer_phases(const LayerPhaseBuffers& b, DType dtype, DType pdt, std::int64_t rows,
                      std::int64_t cols, std::int64_t stride,
                      const std::vector<std::int64_t>& cuts) {
  const bool device = b.ctx.device == Device::kCuda;
  const std::size_t esize = dtype_size(dtype), psize = dtype_size(pdt);
  const auto row_bytes = static_cast<std::size_t>(rows) * sizeof(float);
  auto to_host = [&](std::vector<float>& dst, const float* src) {
    if (device) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dst.data(), src, row_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::memcpy(dst.data(), src, row_bytes);
    }
  };
  // The all-reduced sums, where the next phase reads them (device memory for CUDA).
  std::vector<float*> totals;
  auto on_backend = [&](const std::vector<float>& host) -> const float* {
    float* p = nullptr;
    if (device) {
      void* raw = nullptr;
      EXPECT_EQ(cudaMalloc(&raw, std::max<std::size_t>(row_bytes, 4)), cudaSuccess);
      p = static_cast<float*>(raw);
      EXPECT_EQ(cudaMemcpy(p, host.data(), row_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      p = new float[std::max<std::size_t>(host.size(), 1)];
      std::memcpy(p, host.data(), row_bytes);
    }
    totals.push_back(p);
    return p;
  };
  auto cm = [&](const void* base, std::size_t k) {
    return const_matrix(static_cast<const char*>(base) + cuts[k] * esize, dtype, rows,
                        cuts[k + 1] - cuts[k], stride);
  };
  auto mm = [&](void* base, std::size_t k) {
    return matrix(static_cast<char*>(base) + cuts[k] * esize, dtype, rows, cuts[k + 1] - cuts[k],
                  stride);
  };
  auto cv = [&](const void* base, std::size_t k) {
    return base ? ConstVector{static_cast<const char*>(base) + cuts[k] * psize, pdt,
                              cuts[k + 1] - cuts[k]}
                : ConstVector{};
  };
  auto mv = [&](void* base, std::size_t k) {
    return base ? Vector{static_cast<char*>(base) + cuts[k] * psize, pdt, cuts[k + 1] - cuts[k]}
                : Vector{};
  };
  const std::size_t slices = cuts.size() - 1;
  auto all_reduce = [&](const std::function<void(std::size_t)>& phase1, const float* out,
                        std::vector<float>& sum, const float* out2 = nullptr,
                        std::vector<float>* sum2 = nullptr) {
    sum.assign(static_cast<std::size_t>(rows), 0.0f);
    if (sum2 != nullptr) sum2->assign(static_cast<std::size_t>(rows), 0.0f);
    std::vector<float> part(static_cast<std::size_t>(rows));
    for (std::size_t k = 0; k < slices; ++k) {
      phase1(k);
      to_host(part, out);
      for (std::int64_t r = 0; r < rows; ++r) sum[r] += part[r];
      if (sum2 == nullptr) continue;
      to_host(part, out2);
      for (std::int64_t r = 0; r < rows; ++r) (*sum2)[r] += part[r];
    }
  };
  const std::int64_t full = cols;
  std::vector<float> sum, dev, g, g_xhat;
  all_reduce([&](std::size_t k) { layer_norm_partial_sums(b.ctx, cm(b.x, k), b.partial); },
             b.partial, sum);
  const float* sum_b = on_backend(sum);
  all_reduce(
      [&](std::size_t k) {
        layer_norm_partial_squared_deviations(b.ctx, cm(b.x, k), sum_b, full, b.partial);
      },
      b.partial, dev);
  const float* dev_b = on_backend(dev);
  for (std::size_t k = 0; k < slices; ++k) {
    layer_norm_from_sums(b.ctx, cm(b.x, k), cv(b.w, k), cv(b.b, k), mm(b.y, k), sum_b, dev_b, full,
                         b.mean, b.rstd);
  }
  all_reduce(
      [&](std::size_t k) {
        layer_norm_backward_partial_sums(b.ctx, cm(b.dy, k), cm(b.x, k), cv(b.w, k), b.mean, b.rstd,
                                         b.partial_g, b.partial);
      },
      b.partial_g, g, b.partial, &g_xhat);
  const float* g_b = on_backend(g);
  const float* g_xhat_b = on_backend(g_xhat);
  for (std::size_t k = 0; k < slices; ++k) {
    layer_norm_backward_from_sums(b.ctx, cm(b.dy, k), cm(b.x, k), cv(b.w, k), b.mean, b.rstd, g_b,
                                  g_xhat_b, full, mm(b.dx, k), mv(b.dw, k), mv(b.db, k), {},
                                  b.workspace);
  }
  if (device) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  for (float* p : totals) {
    if (device) {
      cudaFree(p);
    } else {
      delete[] p;
    }
  }
}

// The LayerNorm phases on the GPU against the same phases on the CPU backend (same slices,
// same sums order) and against the fp64 reference of the whole row, with the tolerances of
// the one-call LayerNorm tests above.
void check_layer_two_phase(const Case& c, bool bias, const std::vector<std::int64_t>& cuts) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad, n = c.rows * stride;
  const DType pdt = c.weight_f32 ? DType::kFloat32 : c.dtype;
  Buffer x(c.dtype, n, c.misalign), dy(c.dtype, n, c.misalign), y(c.dtype, n, c.misalign),
      dx(c.dtype, n, c.misalign);
  Buffer w(pdt, c.cols, c.misalign), b(pdt, c.cols, c.misalign), dw(pdt, c.cols), db(pdt, c.cols);
  const std::int64_t rows1 = std::max<std::int64_t>(c.rows, 1);
  Buffer mean(DType::kFloat32, rows1), rstd(DType::kFloat32, rows1),
      partial(DType::kFloat32, rows1), partial_g(DType::kFloat32, rows1);
  x.fill_random(rng, -1.0f, 3.0f);  // non-zero mean
  dy.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  b.fill_random(rng);
  for (Buffer* buf : {&y, &dx, &dw, &db})
    buf->fill(NAN);  // poisoned: every element must be written
  for (Buffer* buf : {&x, &dy, &y, &dx, &w, &b, &dw, &db}) buf->upload();
  // The CPU backend's run starts from the same (poisoned) host bytes.
  std::vector<unsigned char> y_cpu(static_cast<std::size_t>(n) * dtype_size(c.dtype));
  std::memcpy(y_cpu.data(), y.host(), y_cpu.size());
  std::vector<unsigned char> dx_cpu(y_cpu),
      dw_cpu(static_cast<std::size_t>(c.cols) * dtype_size(pdt)), db_cpu(dw_cpu);
  std::vector<float> mean_cpu(rows1), rstd_cpu(rows1), partial_cpu(rows1), partial_g_cpu(rows1);

  const std::size_t ws_bytes = backward_workspace_bytes(kGpu, c.rows, c.cols);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
  const LayerPhaseBuffers gpu{kGpu,
                              x.device(),
                              dy.device(),
                              c.weight ? w.device() : nullptr,
                              bias ? b.device() : nullptr,
                              y.device(),
                              dx.device(),
                              c.weight ? dw.device() : nullptr,
                              c.weight ? db.device() : nullptr,
                              static_cast<float*>(mean.device()),
                              static_cast<float*>(rstd.device()),
                              static_cast<float*>(partial.device()),
                              static_cast<float*>(partial_g.device()),
                              {ws, ws_bytes}};
  run_layer_phases(gpu, c.dtype, pdt, c.rows, c.cols, stride, cuts);
  cudaFree(ws);
  const LayerPhaseBuffers cpu{Context{},
                              x.host(),
                              dy.host(),
                              c.weight ? w.host() : nullptr,
                              bias ? b.host() : nullptr,
                              y_cpu.data(),
                              dx_cpu.data(),
                              c.weight ? dw_cpu.data() : nullptr,
                              c.weight ? db_cpu.data() : nullptr,
                              mean_cpu.data(),
                              rstd_cpu.data(),
                              partial_cpu.data(),
                              partial_g_cpu.data(),
                              {}};
  run_layer_phases(cpu, c.dtype, pdt, c.rows, c.cols, stride, cuts);
  for (Buffer* buf : {&y, &dx, &dw, &db, &mean, &rstd}) buf->download();

  auto at = [&](std::int64_t i) { return i / c.cols * stride + i % c.cols; };
  auto cpu_values = [&](const std::vector<unsigned char>& bytes, DType dt, std::int64_t count,
                        bool strided) {
    std::vector<double> v(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i)
      v[i] = detail::load_as_float(bytes.data(), dt, strided ? at(i) : i);
    return v;
  };
  const ConstMatrix xh = const_matrix(x.host(), c.dtype, c.rows, c.cols, stride);
  const ConstVector wh = c.weight ? ConstVector{w.host(), pdt, c.cols} : ConstVector{};
  const ConstVector bh = bias ? ConstVector{b.host(), pdt, c.cols} : ConstVector{};
  const auto ref = reference::layer_norm(xh, wh, bh);
  const auto grad = reference::layer_norm_backward(
      const_matrix(dy.host(), c.dtype, c.rows, c.cols, stride), xh, wh, c.weight);
  std::vector<double> dx_scale(grad.dx.size());
  for (std::size_t i = 0; i < dx_scale.size(); ++i)
    dx_scale[i] = grad.dx_scale[i / static_cast<std::size_t>(c.cols)];
  const double ptol = std::max(tolerance(pdt), 1e-4);
  const std::int64_t elems = c.rows * c.cols;
  const std::vector<double> mean_c(mean_cpu.begin(), mean_cpu.begin() + c.rows),
      rstd_c(rstd_cpu.begin(), rstd_cpu.begin() + c.rows);
  for (const bool against_cpu : {false, true}) {
    SCOPED_TRACE(against_cpu ? "against the CPU backend's phases" : "against the reference");
    expect_close(
        against_cpu ? cpu_values(y_cpu, c.dtype, elems, true) : ref.y,
        [&](std::int64_t i) { return y.get(at(i)); }, tolerance(c.dtype), "y");
    expect_close(
        against_cpu ? mean_c : ref.mean, [&](std::int64_t i) { return mean.get(i); }, 2e-5, "mean");
    expect_close(
        against_cpu ? rstd_c : ref.rstd, [&](std::int64_t i) { return rstd.get(i); }, 2e-4, "rstd");
    expect_close(
        against_cpu ? cpu_values(dx_cpu, c.dtype, elems, true) : grad.dx,
        [&](std::int64_t i) { return dx.get(at(i)); }, tolerance(c.dtype) * 2, "dx", &dx_scale);
    if (c.weight) {
      expect_close(
          against_cpu ? cpu_values(dw_cpu, pdt, c.cols, false) : grad.dw,
          [&](std::int64_t i) { return dw.get(i); }, ptol, "dw");
      expect_close(
          against_cpu ? cpu_values(db_cpu, pdt, c.cols, false) : grad.db,
          [&](std::int64_t i) { return db.get(i); }, ptol, "db");
    }
  }
}

TEST(CudaTwoPhase, LayerNormSlicesMatchTheCpuBackendAndReference) {
  REQUIRE_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const Case& c :
         {Case{dt, 37, 1024}, Case{dt, 5, 4096, 8, 0, true, true}, Case{dt, 7, 999, 3, 1, false},
          Case{dt, 4, 7, 2}, Case{dt, 3, 1}, Case{dt, 3, 16384}}) {
      for (const bool bias : {false, true}) {
        SCOPED_TRACE(c.name() + (bias ? " bias" : " no bias"));
        check_layer_two_phase(c, bias, {0, c.cols});  // one slice
        if (c.cols < 3) continue;
        check_layer_two_phase(c, bias, {0, c.cols / 2, c.cols});  // two even slices
        check_layer_two_phase(c, bias,
                              {0, c.cols / 3 + 1, 2 * (c.cols / 3), c.cols});  // three uneven ones
      }
    }
  }
}

// With one slice the phases run the one-call LayerNorm's two-pass kernels (staging off, rows
// too long for registers), whose sums they reproduce: the same bits.
TEST(CudaTwoPhase, LayerNormOneSliceGivesTheTwoPassBits) {
  REQUIRE_GPU();
  setenv("FUSEDNORM_CUDA_STAGED_ROWS", "0", 1);
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const Case c{dt, 3, 40960, 8};
    SCOPED_TRACE(c.name());
    const std::int64_t stride = c.cols + c.pad, n = c.rows * stride;
    std::mt19937 rng = rng_for(c);
    Buffer x(dt, n), dy(dt, n), y1(dt, n), y2(dt, n), dx1(dt, n), dx2(dt, n), w(dt, c.cols),
        b(dt, c.cols);
    Buffer dw1(dt, c.cols), dw2(dt, c.cols), db1(dt, c.cols), db2(dt, c.cols),
        partial(DType::kFloat32, c.rows), partial_g(DType::kFloat32, c.rows);
    Buffer mean1(DType::kFloat32, c.rows), rstd1(DType::kFloat32, c.rows),
        mean2(DType::kFloat32, c.rows), rstd2(DType::kFloat32, c.rows);
    x.fill_random(rng, -1.0f, 3.0f);
    dy.fill_random(rng);
    w.fill_random(rng, 0.5f, 1.5f);
    b.fill_random(rng);
    for (Buffer* buf : {&x, &dy, &w, &b}) buf->upload();
    const std::size_t ws_bytes = backward_workspace_bytes(kGpu, c.rows, c.cols);
    void* ws = nullptr;
    ASSERT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
    const ConstMatrix xd = const_matrix(x.device(), dt, c.rows, c.cols, stride);
    const ConstVector wd{w.device(), dt, c.cols}, bd{b.device(), dt, c.cols};
    auto f32 = [](Buffer& buf) { return static_cast<float*>(buf.device()); };
    layer_norm(kGpu, xd, wd, bd, matrix(y1.device(), dt, c.rows, c.cols, stride), f32(mean1),
               f32(rstd1));
    layer_norm_backward(kGpu, const_matrix(dy.device(), dt, c.rows, c.cols, stride), xd, wd,
                        f32(mean1), f32(rstd1), matrix(dx1.device(), dt, c.rows, c.cols, stride),
                        {dw1.device(), dt, c.cols}, {db1.device(), dt, c.cols}, {}, {ws, ws_bytes});
    const LayerPhaseBuffers gpu{kGpu,           x.device(),    dy.device(),  w.device(),
                                b.device(),     y2.device(),   dx2.device(), dw2.device(),
                                db2.device(),   f32(mean2),    f32(rstd2),   f32(partial),
                                f32(partial_g), {ws, ws_bytes}};
    run_layer_phases(gpu, dt, dt, c.rows, c.cols, stride, {0, c.cols});
    cudaFree(ws);
    auto same_bits = [&](Buffer& one, Buffer& two, std::int64_t count, const char* what) {
      one.download();
      two.download();
      EXPECT_EQ(std::memcmp(one.host(), two.host(),
                            static_cast<std::size_t>(count) * dtype_size(one.dtype())),
                0)
          << what;
    };
    // Row padding is never written by either: compare whole rows' worth of bytes row by row.
    for (Buffer* buf : {&y1, &y2, &dx1, &dx2}) buf->download();
    for (std::int64_t r = 0; r < c.rows; ++r) {
      const std::size_t off = static_cast<std::size_t>(r * stride) * dtype_size(dt);
      const std::size_t len = static_cast<std::size_t>(c.cols) * dtype_size(dt);
      EXPECT_EQ(std::memcmp(static_cast<char*>(y1.host()) + off,
                            static_cast<char*>(y2.host()) + off, len),
                0)
          << "y row " << r;
      EXPECT_EQ(std::memcmp(static_cast<char*>(dx1.host()) + off,
                            static_cast<char*>(dx2.host()) + off, len),
                0)
          << "dx row " << r;
    }
    same_bits(mean1, mean2, c.rows, "mean");
    same_bits(rstd1, rstd2, c.rows, "rstd");
    same_bits(dw1, dw2, c.cols, "dw");
    same_bits(db1, db2, c.cols, "db");
  }
  unsetenv("FUSEDNORM_CUDA_STAGED_ROWS");
}

TEST(CudaTwoPhase, LayerNormBadInputThrows) {
  REQUIRE_GPU();
  const DType dt = DType::kBFloat16;
  const std::int64_t rows = 4, cols = 64;
  Buffer x(dt, rows * cols), y(dt, rows * cols), w(dt, cols), dw(dt, cols),
      stats(DType::kFloat32, 4 * rows);
  const ConstMatrix xd = const_matrix(x.device(), dt, rows, cols);
  float* s = static_cast<float*>(stats.device());
  auto throws_naming = [](const std::function<void()>& call, const std::string& op,
                          const std::string& arg) {
    try {
      call();
      ADD_FAILURE() << op << ": no error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(op), std::string::npos) << what;
      EXPECT_NE(what.find(arg), std::string::npos) << what;
    }
  };
  throws_naming([&] { layer_norm_partial_sums(kGpu, xd, nullptr); }, "layer_norm_partial_sums",
                "row_sum");
  throws_naming([&] { layer_norm_partial_squared_deviations(kGpu, xd, s, cols - 1, s + rows); },
                "layer_norm_partial_squared_deviations", "full_cols");
  throws_naming(
      [&] {
        layer_norm_from_sums(kGpu, xd, {}, {}, matrix(y.device(), dt, rows, cols), s, nullptr, cols,
                             nullptr, nullptr);
      },
      "layer_norm_from_sums", "row_sum_squared_deviations");
  throws_naming(
      [&] {
        layer_norm_backward_partial_sums(kGpu, xd, xd, {}, nullptr, s, s + rows, s + 2 * rows);
      },
      "layer_norm_backward_partial_sums", "mean");
  // dw wanted with no workspace: CUDA calls never allocate.
  throws_naming(
      [&] {
        layer_norm_backward_from_sums(
            kGpu, xd, xd, {w.device(), dt, cols}, s, s + rows, s + 2 * rows, s + 3 * rows, cols,
            matrix(y.device(), dt, rows, cols), {dw.device(), dt, cols}, {});
      },
      "layer_norm_backward_from_sums", "workspace");
}

TEST(CudaEdgeCases, ZeroRowsAndZeroRowValues) {
  REQUIRE_GPU();
  // rows == 0: forward is a no-op, backward writes zero dw / db.
  Buffer dw(DType::kBFloat16, 64), db(DType::kFloat32, 64), w(DType::kBFloat16, 64);
  dw.fill(NAN);
  db.fill(NAN);
  dw.upload();
  db.upload();
  Buffer one(DType::kBFloat16, 64);
  layer_norm_backward(kGpu, const_matrix(one.device(), DType::kBFloat16, 0, 64),
                      const_matrix(one.device(), DType::kBFloat16, 0, 64), {w.device(), DType::kBFloat16, 64}, nullptr,
                      nullptr, Matrix{}, {dw.device(), DType::kBFloat16, 64}, {db.device(), DType::kFloat32, 64});
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dw.download();
  db.download();
  for (int j = 0; j < 64; ++j) {
    EXPECT_EQ(dw.get(j), 0.0f);
    EXPECT_EQ(db.get(j), 0.0f);
  }
  // An all-zero row with eps > 0 normalizes to zeros.
  Buffer x(DType::kFloat16, 4 * 4096), y(DType::kFloat16, 4 * 4096);
  x.fill(0.0f);
  y.fill(NAN);
  x.upload();
  y.upload();
  rms_norm(kGpu, const_matrix(x.device(), DType::kFloat16, 4, 4096), {}, matrix(y.device(), DType::kFloat16, 4, 4096),
           nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  y.download();
  for (int i = 0; i < 4 * 4096; ++i) ASSERT_EQ(y.get(i), 0.0f) << i;
}

// A -0.0 weight element gives the CPU backend's signed zeros (both add the weight offset as
// -0.0f when there is none; +0.0f would turn the weight into +0.0 and flip y's zero sign).
TEST(CudaEdgeCases, NegativeZeroWeightGivesTheCpuBackendsSignedZeros) {
  REQUIRE_GPU();
  const std::int64_t rows = 3, cols = 64;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::mt19937 rng(7);
    Buffer x(dtype, rows * cols), w(dtype, cols), y(dtype, rows * cols);
    x.fill_random(rng);
    w.fill_random(rng);
    for (std::int64_t j = 0; j < cols; j += 3) detail::store_from_float(w.host(), dtype, j, -0.0f);
    x.upload();
    w.upload();
    rms_norm(kGpu, const_matrix(x.device(), dtype, rows, cols), {w.device(), dtype, cols},
             matrix(y.device(), dtype, rows, cols), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    y.download();
    std::vector<unsigned char> y_cpu(static_cast<std::size_t>(rows * cols) * dtype_size(dtype));
    rms_norm(Context{}, const_matrix(x.host(), dtype, rows, cols), {w.host(), dtype, cols},
             matrix(y_cpu.data(), dtype, rows, cols), nullptr);
    std::int64_t negative_zeros = 0;
    for (std::int64_t i = 0; i < rows * cols; ++i) {
      const float cpu = detail::load_as_float(y_cpu.data(), dtype, i);
      ASSERT_EQ(std::signbit(y.get(i)), std::signbit(cpu)) << i;
      negative_zeros += cpu == 0.0f && std::signbit(cpu);
    }
    EXPECT_GT(negative_zeros, 0);  // the case is exercised: x > 0 times -0.0
  }
}

TEST(CudaEdgeCases, SmallWorkspaceThrowsWithoutAllocating) {
  REQUIRE_GPU();
  Buffer x(DType::kFloat32, 8 * 256), dy(DType::kFloat32, 8 * 256), w(DType::kFloat32, 256), dw(DType::kFloat32, 256);
  Buffer small(DType::kFloat32, 4);  // 16 bytes of its own (one overlapping x fails validation first)
  const std::size_t needed = backward_workspace_bytes(kGpu, 8, 256);
  try {
    rms_norm_backward(kGpu, const_matrix(dy.device(), DType::kFloat32, 8, 256),
                      const_matrix(x.device(), DType::kFloat32, 8, 256), {w.device(), DType::kFloat32, 256}, nullptr,
                      Matrix{}, {dw.device(), DType::kFloat32, 256}, {}, {small.device(), 16});
    FAIL() << "expected fusednorm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(needed)), std::string::npos) << e.what();
  }
}

TEST(CudaEdgeCases, CallsCaptureIntoACudaGraph) {
  REQUIRE_GPU();
  const std::int64_t rows = 64, cols = 4096;
  std::mt19937 rng(7);
  Buffer x(DType::kBFloat16, rows * cols), y(DType::kBFloat16, rows * cols), w(DType::kBFloat16, cols);
  Buffer dy(DType::kBFloat16, rows * cols), dx(DType::kBFloat16, rows * cols), dw(DType::kBFloat16, cols);
  Buffer rstd(DType::kFloat32, rows);
  x.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  dy.fill_random(rng);
  x.upload();
  w.upload();
  dy.upload();
  const std::size_t ws_bytes = backward_workspace_bytes(kGpu, rows, cols);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Context ctx{Device::kCuda, 0, stream};
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  rms_norm(ctx, const_matrix(x.device(), DType::kBFloat16, rows, cols), {w.device(), DType::kBFloat16, cols},
           matrix(y.device(), DType::kBFloat16, rows, cols), static_cast<float*>(rstd.device()));
  rms_norm_backward(ctx, const_matrix(dy.device(), DType::kBFloat16, rows, cols),
                    const_matrix(x.device(), DType::kBFloat16, rows, cols), {w.device(), DType::kBFloat16, cols},
                    static_cast<float*>(rstd.device()), matrix(dx.device(), DType::kBFloat16, rows, cols),
                    {dw.device(), DType::kBFloat16, cols}, {}, {ws, ws_bytes});
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  y.download();
  dx.download();
  const ConstVector wh{w.host(), DType::kBFloat16, cols};
  const auto ref = reference::rms_norm(const_matrix(x.host(), DType::kBFloat16, rows, cols), wh);
  expect_close(ref.y, [&](std::int64_t i) { return y.get(i); }, tolerance(DType::kBFloat16), "y (graph)");
  const auto bref = reference::rms_norm_backward(const_matrix(dy.host(), DType::kBFloat16, rows, cols),
                                                 const_matrix(x.host(), DType::kBFloat16, rows, cols), wh);
  expect_close(bref.dx, [&](std::int64_t i) { return dx.get(i); }, 2 * tolerance(DType::kBFloat16), "dx (graph)");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(ws);
}

// ---- Quantized RMSNorm (issue 9) -----------------------------------------------------------

enum class QuantMode { kStatic, kDynamic, kDynamicBounded };
const char* quant_mode_name(QuantMode m) {
  return m == QuantMode::kStatic ? "static" : m == QuantMode::kDynamic ? "dynamic" : "dynamic+ub";
}

struct QuantCall {
  DType q_dtype;
  QuantMode mode;
  bool residual;
  std::string name() const {
    return std::string(dtype_name(q_dtype)) + " " + quant_mode_name(mode) +
           (residual ? " +residual" : "");
  }
};

// The static scale and scale_upper_bound the tests use: small enough that some |y| / scale
// saturate (|y| reaches ~3 for x in [-2, 2] and w up to 1.5; 2.5 with the offset).
float test_static_scale(DType q_dtype) { return q_dtype == DType::kInt8 ? 0.02f : 0.005f; }
constexpr float kTestScaleUpperBound = 1.5f;

// q's value as a double (int8, or E4M3FN decoded; NaN for its NaN codes).
double q_value(const std::vector<std::uint8_t>& q, DType q_dtype, std::int64_t i) {
  return q_dtype == DType::kInt8 ? static_cast<double>(static_cast<std::int8_t>(q[i]))
                                 : detail::e4m3_to_float(q[i]);
}

// q rounded from the exact quotient as the contract says, in fp64 (int8) or from the fp32
// value (FP8: a double rounding only within an fp32 ulp of a midpoint, i.e. at a boundary).
double q_expected(double q_exact, DType q_dtype) {
  if (q_dtype == DType::kInt8) {
    if (std::isnan(q_exact)) return 0;
    return std::nearbyint(std::min(std::max(q_exact, -128.0), 127.0));
  }
  return detail::e4m3_to_float(detail::float_to_e4m3_saturate(static_cast<float>(q_exact)));
}

// One step of the q dtype at magnitude m (E4M3: 3 mantissa bits; subnormal step 2^-9).
double q_step(double m, DType q_dtype) {
  if (q_dtype == DType::kInt8) return 1;
  return m < 0.015625 ? 0.001953125 : std::ldexp(1.0, std::ilogb(m) - 3);
}

// Every q element against the reference: equal to the contract's rounding of the exact
// quotient, or one step off where that quotient lies within fp32 arithmetic error (rtol)
// of the midpoint between the two. Returns the number of saturated elements.
std::int64_t expect_q_matches(const reference::QuantResult& ref, const std::vector<std::uint8_t>& q,
                              DType q_dtype, std::int64_t rows, std::int64_t cols,
                              std::int64_t q_stride, double rtol = 2e-5) {
  const double qmax = q_dtype == DType::kInt8 ? 127 : 448;
  std::int64_t bad = 0, saturated = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const double exact = ref.q_exact[r * cols + j];
      const double want = q_expected(exact, q_dtype);
      const double got = q_value(q, q_dtype, r * q_stride + j);
      if (std::abs(want) >= qmax) ++saturated;
      if (std::isnan(want) && std::isnan(got)) continue;
      if (got == want) continue;
      const bool one_step =
          std::abs(got - want) <= q_step(std::max(std::abs(got), std::abs(want)), q_dtype);
      const bool at_boundary = std::abs(exact - (got + want) / 2) <= rtol * std::abs(exact) + 1e-30;
      if (!(one_step && at_boundary)) {
        if (bad++ < 5) {
          ADD_FAILURE() << "q[" << r << ", " << j << "]: got " << got << ", expected " << want
                        << " (exact " << exact << ")";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " q elements wrong";
  return saturated;
}

constexpr std::uint8_t kQSentinel = 0x5a;

// Runs rms_norm_quant / fused_add_rms_norm_quant on the GPU for case c and checks q, the
// scales and the residual against the fp64 reference, and that nothing outside q's rows
// (the row padding) and the scales' rows was written. Returns the saturated count.
std::int64_t check_quant(const Case& c, const QuantCall& call) {
  std::mt19937 rng = rng_for(c);
  const std::int64_t stride = c.cols + c.pad;
  const DType pdt = c.weight_f32 ? DType::kFloat32 : c.dtype;
  Buffer x(c.dtype, c.rows * stride, c.misalign), res(c.dtype, c.rows * stride, c.misalign);
  Buffer w(pdt, c.cols, c.misalign);
  Buffer q(call.q_dtype, c.rows * stride, c.misalign), scales(DType::kFloat32, c.rows + 1);
  Buffer scale_in(DType::kFloat32, 1), bound(DType::kFloat32, 1);
  if (!(x.ok() && res.ok() && w.ok() && q.ok() && scales.ok() && scale_in.ok() && bound.ok())) {
    ADD_FAILURE() << "cudaMalloc failed";
    return 0;
  }
  x.fill_random(rng);
  res.fill_random(rng);
  w.fill_random(rng, 0.5f, 1.5f);
  std::memset(q.host(), kQSentinel, static_cast<std::size_t>(c.rows * stride));
  scales.fill(NAN);
  scale_in.fill(test_static_scale(call.q_dtype));
  bound.fill(kTestScaleUpperBound);
  for (Buffer* b : {&x, &res, &w, &q, &scales, &scale_in, &bound}) b->upload();

  const RmsNormOptions opt{1e-6f, c.offset};
  QuantScale qs;
  if (call.mode == QuantMode::kStatic) {
    qs.static_scale = static_cast<const float*>(scale_in.device());
  } else {
    qs.row_scales = static_cast<float*>(scales.device());
    if (call.mode == QuantMode::kDynamicBounded)
      qs.scale_upper_bound = static_cast<const float*>(bound.device());
  }
  const ConstVector wv = c.weight ? ConstVector{w.device(), pdt, c.cols} : ConstVector{};
  const Matrix qd = matrix(q.device(), call.q_dtype, c.rows, c.cols, stride);
  const ConstMatrix xd = const_matrix(x.device(), c.dtype, c.rows, c.cols, stride);
  if (call.residual) {
    fused_add_rms_norm_quant(kGpu, xd, matrix(res.device(), c.dtype, c.rows, c.cols, stride), wv,
                             qd, qs, opt);
  } else {
    rms_norm_quant(kGpu, xd, wv, qd, qs, opt);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Buffer res_in(c.dtype, c.rows * stride);
  std::memcpy(res_in.host(), res.host(),
              static_cast<std::size_t>(c.rows * stride) * dtype_size(c.dtype));
  q.download();
  scales.download();
  res.download();

  const ConstVector wh = c.weight ? ConstVector{w.host(), pdt, c.cols} : ConstVector{};
  const float static_value = test_static_scale(call.q_dtype);
  const auto ref = reference::rms_norm_quant(
      const_matrix(x.host(), c.dtype, c.rows, c.cols, stride),
      call.residual ? const_matrix(res_in.host(), c.dtype, c.rows, c.cols, stride) : ConstMatrix{},
      wh, call.q_dtype, call.mode == QuantMode::kStatic ? &static_value : nullptr,
      call.mode == QuantMode::kDynamicBounded ? &kTestScaleUpperBound : nullptr, opt);
  if (call.residual) {
    expect_close(
        ref.residual, [&](std::int64_t i) { return res.get(i / c.cols * stride + i % c.cols); },
        0.0, "residual");
  }
  if (call.mode != QuantMode::kStatic) {
    // One fp32 amax (exact: a max of fp32 values of y) and one division: y's fp32 error.
    expect_close(
        ref.scale, [&](std::int64_t i) { return scales.get(i); }, 2e-5, "scale");
    EXPECT_TRUE(std::isnan(scales.get(c.rows))) << "a scale written past the last row";
  } else {
    for (std::int64_t i = 0; i <= c.rows; ++i)
      EXPECT_TRUE(std::isnan(scales.get(i))) << "static call wrote scale " << i;
  }
  const std::vector<std::uint8_t> qh(static_cast<const std::uint8_t*>(q.host()),
                                     static_cast<const std::uint8_t*>(q.host()) + c.rows * stride);
  std::int64_t padding_written = 0;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    for (std::int64_t j = c.cols; j < stride; ++j)
      padding_written += qh[r * stride + j] != kQSentinel;
  }
  EXPECT_EQ(padding_written, 0) << "bytes written in q's row padding";
  return expect_q_matches(ref, qh, call.q_dtype, c.rows, c.cols, stride);
}

// Every mode x q dtype x input dtype x weight variant x residual, on register rows (D =
// 1000: 125 vectors of bf16 per row) with a row stride.
TEST(CudaQuant, EveryModeAndDtypeMatchesReference) {
  REQUIRE_GPU();
  std::int64_t saturated = 0;
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const std::vector<Case> weights = {Case{dt, 3, 1000, 24, 0, true},
                                       Case{dt, 3, 1000, 24, 0, false},
                                       Case{dt, 3, 1000, 24, 0, true, true, 1.0f}};
    for (const Case& c : weights) {
      for (DType qdt : {DType::kInt8, DType::kFloat8E4M3}) {
        for (QuantMode mode :
             {QuantMode::kStatic, QuantMode::kDynamic, QuantMode::kDynamicBounded}) {
          for (bool residual : {false, true}) {
            const QuantCall call{qdt, mode, residual};
            SCOPED_TRACE(c.name() + " " + call.name());
            saturated += check_quant(c, call);
          }
        }
      }
    }
  }
  EXPECT_GT(saturated, 0) << "no element saturated: the saturation is not tested";
}

// One shape per kernel kind (rows per CTA, register rows, the scalar path, shared-memory
// rows, clusters; the two-pass kernels below), each in four of the modes.
std::vector<QuantCall> kind_calls() {
  return {{DType::kInt8, QuantMode::kDynamic, true},
          {DType::kFloat8E4M3, QuantMode::kDynamic, false},
          {DType::kFloat8E4M3, QuantMode::kStatic, true},
          {DType::kInt8, QuantMode::kDynamicBounded, false}};
}

std::vector<Case> kind_cases() {
  const std::int64_t few = quick() ? 3 : 19;
  return {Case{DType::kBFloat16, few, 64},                        // rows per CTA
          Case{DType::kFloat32, few, 7, 3, 1, true, true, 1.0f},  // scalar (vec 1), misaligned
          Case{DType::kFloat16, few, 4096, 8},                    // register rows
          Case{DType::kFloat32, 3, 16384},                        // one CTA per row, smem
          Case{DType::kBFloat16, 3, 262144, 16, 0, true, true, 1.0f}};  // clusters (sm_90)
}

TEST(CudaQuant, EveryKernelKindMatchesReference) {
  REQUIRE_GPU();
  for (const Case& c : kind_cases()) {
    for (const QuantCall& call : kind_calls()) {
      SCOPED_TRACE(c.name() + " " + call.name());
      check_quant(c, call);
    }
  }
}

// The two-pass kernel (staging off; bf16 32768 and unaligned fp32 12288 exceed register rows):
// the dynamic amax pass reads x from device memory again.
TEST(CudaQuant, TwoPassKernelMatchesReference) {
  REQUIRE_GPU();
  setenv("FUSEDNORM_CUDA_STAGED_ROWS", "0", 1);
  for (const Case& c :
       {Case{DType::kBFloat16, 3, 32768, 8}, Case{DType::kFloat32, 3, 12288, 3, 1, false}}) {
    for (const QuantCall& call : kind_calls()) {
      SCOPED_TRACE(c.name() + " " + call.name());
      check_quant(c, call);
    }
  }
  unsetenv("FUSEDNORM_CUDA_STAGED_ROWS");
}

// Inputs whose sums of squares are exact in fp32 in any order (x and w multiples of 1/8
// below 2): rstd, y and hence q and the scales are the same bits on the CPU and the GPU
// (FP8: the CUDA conversion's bits; NaN codes compare as NaN). The first device run checks
// the hardware's FP8 conversion (and sm_80's software one) against quantize.h's here.
TEST(CudaQuant, SameBitsAsTheCpuBackend) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> eighths(-15, 15), weights(4, 12);
  for (const Case& c : {Case{DType::kBFloat16, 5, 64}, Case{DType::kFloat16, 5, 4096},
                        Case{DType::kFloat32, 3, 16384}}) {
    const std::int64_t n = c.rows * c.cols;
    Buffer x(c.dtype, n), res(c.dtype, n), w(c.dtype, c.cols);
    for (std::int64_t i = 0; i < n; ++i) {
      detail::store_from_float(x.host(), c.dtype, i, eighths(rng) / 8.0f);
      detail::store_from_float(res.host(), c.dtype, i,
                               eighths(rng) / 16.0f);  // x + res: multiples of 1/16
    }
    for (std::int64_t i = 0; i < c.cols; ++i)
      detail::store_from_float(w.host(), c.dtype, i, weights(rng) / 8.0f);
    for (DType qdt : {DType::kInt8, DType::kFloat8E4M3}) {
      for (QuantMode mode : {QuantMode::kStatic, QuantMode::kDynamic, QuantMode::kDynamicBounded}) {
        for (bool residual : {false, true}) {
          SCOPED_TRACE(c.name() + " " + QuantCall({qdt, mode, residual}).name());
          Buffer q(qdt, n), scales(DType::kFloat32, c.rows), scale_in(DType::kFloat32, 1),
              bound(DType::kFloat32, 1);
          Buffer res_gpu(c.dtype, n);
          std::memcpy(res_gpu.host(), res.host(),
                      static_cast<std::size_t>(n) * dtype_size(c.dtype));
          scale_in.fill(test_static_scale(qdt));
          bound.fill(kTestScaleUpperBound);
          for (Buffer* b : {&x, &res_gpu, &w, &scale_in, &bound}) b->upload();
          auto scale_of = [&](bool gpu, void* row_scales) {
            QuantScale qs;
            if (mode == QuantMode::kStatic) {
              qs.static_scale =
                  static_cast<const float*>(gpu ? scale_in.device() : scale_in.host());
            } else {
              qs.row_scales = static_cast<float*>(row_scales);
              if (mode == QuantMode::kDynamicBounded) {
                qs.scale_upper_bound =
                    static_cast<const float*>(gpu ? bound.device() : bound.host());
              }
            }
            return qs;
          };
          // GPU
          const ConstVector wd{w.device(), c.dtype, c.cols};
          if (residual) {
            fused_add_rms_norm_quant(kGpu, const_matrix(x.device(), c.dtype, c.rows, c.cols),
                                     matrix(res_gpu.device(), c.dtype, c.rows, c.cols), wd,
                                     matrix(q.device(), qdt, c.rows, c.cols),
                                     scale_of(true, scales.device()));
          } else {
            rms_norm_quant(kGpu, const_matrix(x.device(), c.dtype, c.rows, c.cols), wd,
                           matrix(q.device(), qdt, c.rows, c.cols),
                           scale_of(true, scales.device()));
          }
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          q.download();
          scales.download();
          // CPU, on host copies
          const Context cpu{Device::kCpu, 0, nullptr};
          std::vector<std::uint8_t> q_cpu(static_cast<std::size_t>(n));
          std::vector<float> scales_cpu(static_cast<std::size_t>(c.rows), NAN);
          std::vector<unsigned char> res_cpu(
              static_cast<const unsigned char*>(res.host()),
              static_cast<const unsigned char*>(res.host()) + n * dtype_size(c.dtype));
          const ConstVector wh{w.host(), c.dtype, c.cols};
          if (residual) {
            fused_add_rms_norm_quant(cpu, const_matrix(x.host(), c.dtype, c.rows, c.cols),
                                     matrix(res_cpu.data(), c.dtype, c.rows, c.cols), wh,
                                     matrix(q_cpu.data(), qdt, c.rows, c.cols),
                                     scale_of(false, scales_cpu.data()));
          } else {
            rms_norm_quant(cpu, const_matrix(x.host(), c.dtype, c.rows, c.cols), wh,
                           matrix(q_cpu.data(), qdt, c.rows, c.cols),
                           scale_of(false, scales_cpu.data()));
          }
          const auto* qg = static_cast<const std::uint8_t*>(q.host());
          std::int64_t differ = 0;
          for (std::int64_t i = 0; i < n; ++i) {
            const bool both_nan = qdt == DType::kFloat8E4M3 &&
                                  std::isnan(detail::e4m3_to_float(qg[i])) &&
                                  std::isnan(detail::e4m3_to_float(q_cpu[i]));
            if (qg[i] != q_cpu[i] && !both_nan && differ++ < 5) {
              ADD_FAILURE() << "q[" << i << "]: GPU 0x" << std::hex << int{qg[i]} << ", CPU 0x"
                            << int{q_cpu[i]};
            }
          }
          EXPECT_EQ(differ, 0) << differ << " q bytes differ between the GPU and the CPU";
          if (mode != QuantMode::kStatic) {
            for (std::int64_t r = 0; r < c.rows; ++r) {
              EXPECT_EQ(detail::float_bits(scales.get(r)),
                        detail::float_bits(scales_cpu[static_cast<std::size_t>(r)]))
                  << "scale of row " << r;
            }
          }
        }
      }
    }
  }
}

// A zero row (dynamic: scale = min_scale and q = 0), a row with a NaN (its y is all NaN: q
// = 0 for int8, NaN for FP8; dynamic scale = min_scale, as no |y| is a number), and a
// normal row, which the other two must not disturb. Then a call with no rows.
TEST(CudaQuant, ZeroAndNaNRows) {
  REQUIRE_GPU();
  const std::int64_t rows = 3;
  for (std::int64_t cols : {64, 4096, 16384}) {
    for (DType qdt : {DType::kInt8, DType::kFloat8E4M3}) {
      for (QuantMode mode : {QuantMode::kStatic, QuantMode::kDynamic}) {
        SCOPED_TRACE(std::to_string(cols) + " " + QuantCall({qdt, mode, false}).name());
        std::mt19937 rng(5);
        Buffer x(DType::kBFloat16, rows * cols), q(qdt, rows * cols), scales(DType::kFloat32, rows);
        Buffer scale_in(DType::kFloat32, 1);
        x.fill_random(rng);
        for (std::int64_t j = 0; j < cols; ++j)
          detail::store_from_float(x.host(), DType::kBFloat16, j, 0.0f);
        detail::store_from_float(x.host(), DType::kBFloat16, cols + cols / 2, NAN);
        scale_in.fill(test_static_scale(qdt));
        x.upload();
        scale_in.upload();
        QuantScale qs;
        if (mode == QuantMode::kStatic)
          qs.static_scale = static_cast<const float*>(scale_in.device());
        else
          qs.row_scales = static_cast<float*>(scales.device());
        rms_norm_quant(kGpu, const_matrix(x.device(), DType::kBFloat16, rows, cols), {},
                       matrix(q.device(), qdt, rows, cols), qs);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        q.download();
        scales.download();
        const auto* qb = static_cast<const std::uint8_t*>(q.host());
        const float min_scale =
            qdt == DType::kInt8 ? detail::kInt8MinScale : detail::kFloat8E4M3MinScale;
        if (mode != QuantMode::kStatic) {
          EXPECT_EQ(scales.get(0), min_scale) << "zero row";
          EXPECT_EQ(scales.get(1), min_scale) << "NaN row";
          EXPECT_GT(scales.get(2), min_scale) << "normal row";
        }
        std::int64_t bad_zero = 0, bad_nan = 0;
        for (std::int64_t j = 0; j < cols; ++j) {
          bad_zero += qb[j] != 0;
          const std::uint8_t b = qb[cols + j];
          bad_nan += qdt == DType::kInt8 ? b != 0 : (b & 0x7f) != 0x7f;
        }
        EXPECT_EQ(bad_zero, 0) << "zero row: q not all 0";
        EXPECT_EQ(bad_nan, 0) << "NaN row: q not all " << (qdt == DType::kInt8 ? "0" : "NaN");
        const ConstMatrix xh = const_matrix(x.host(), DType::kBFloat16, rows, cols);
        const float static_value = test_static_scale(qdt);
        const auto ref = reference::rms_norm_quant(
            xh, {}, {}, qdt, mode == QuantMode::kStatic ? &static_value : nullptr, nullptr);
        std::vector<std::uint8_t> last(qb + 2 * cols, qb + 3 * cols);
        reference::QuantResult row2;
        row2.q_exact.assign(ref.q_exact.begin() + 2 * cols, ref.q_exact.end());
        expect_q_matches(row2, last, qdt, 1, cols, cols);
      }
    }
  }
  // No rows: nothing to do, nothing written.
  Buffer untouched(DType::kFloat32, 1);
  untouched.fill(NAN);
  untouched.upload();
  QuantScale none;
  none.row_scales = static_cast<float*>(untouched.device());
  rms_norm_quant(kGpu, const_matrix(nullptr, DType::kBFloat16, 0, 64), {}, matrix(nullptr, DType::kInt8, 0, 64),
                 none);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  untouched.download();
  EXPECT_TRUE(std::isnan(untouched.get(0)));
}

// Validation is the backends' shared code; on a CUDA context it refuses before any launch.
TEST(CudaQuant, BadInputThrows) {
  REQUIRE_GPU();
  Buffer x(DType::kBFloat16, 4 * 64), q(DType::kInt8, 4 * 64), y(DType::kBFloat16, 4 * 64), scales(DType::kFloat32, 4);
  const ConstMatrix xd = const_matrix(x.device(), DType::kBFloat16, 4, 64);
  QuantScale dynamic;
  dynamic.row_scales = static_cast<float*>(scales.device());
  EXPECT_THROW(rms_norm_quant(kGpu, xd, {}, matrix(y.device(), DType::kBFloat16, 4, 64), dynamic), Error);  // q dtype
  QuantScale both = dynamic;
  both.static_scale = static_cast<const float*>(scales.device());
  EXPECT_THROW(rms_norm_quant(kGpu, xd, {}, matrix(q.device(), DType::kInt8, 4, 64), both), Error);
  EXPECT_THROW(rms_norm_quant(kGpu, xd, {}, matrix(q.device(), DType::kInt8, 4, 32), dynamic), Error);  // shape
}

// The static scale is a device pointer read by the kernel: a captured graph replayed after
// the scale changed quantizes with the new value.
TEST(CudaQuant, GraphReplayReadsTheCurrentStaticScale) {
  REQUIRE_GPU();
  const std::int64_t rows = 4, cols = 4096;
  std::mt19937 rng(3);
  Buffer x(DType::kBFloat16, rows * cols), q(DType::kInt8, rows * cols), scale(DType::kFloat32, 1);
  x.fill_random(rng);
  scale.fill(0.02f);
  x.upload();
  scale.upload();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Context ctx{Device::kCuda, 0, stream};
  QuantScale qs;
  qs.static_scale = static_cast<const float*>(scale.device());
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  rms_norm_quant(ctx, const_matrix(x.device(), DType::kBFloat16, rows, cols), {},
                 matrix(q.device(), DType::kInt8, rows, cols), qs);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  scale.fill(0.05f);
  scale.upload();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  q.download();
  const float replay_scale = 0.05f;
  const auto ref = reference::rms_norm_quant(const_matrix(x.host(), DType::kBFloat16, rows, cols),
                                             {}, {}, DType::kInt8, &replay_scale, nullptr);
  const auto* qb = static_cast<const std::uint8_t*>(q.host());
  expect_q_matches(ref, std::vector<std::uint8_t>(qb, qb + rows * cols), DType::kInt8, rows, cols,
                   cols);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- float64 (norm_f64.cu): the verification dtype, against the fp64 reference at fp64
// tolerance, with strides, D = 1 and odd D, a zero row, in-place dx, the dx addend, and dw /
// db repeated bit for bit. The backward is handed a wrong fp32 rstd: float64 recomputes it.

struct F64Case {
  std::int64_t rows, cols, pad;
};

std::vector<F64Case> f64_cases() {
  return {{1, 1, 0}, {5, 1, 3}, {7, 33, 0}, {3, 129, 5}, {130, 257, 2}, {2, 4099, 1}};
}

// |got - ref| <= 1e-12 * max|ref| per output (fp64 arithmetic, tree-ordered sums).
void expect_f64_close(const std::vector<double>& ref, const double* got, std::int64_t rows,
                      std::int64_t cols, std::int64_t stride, const std::string& what) {
  double scale = 1e-300;
  for (double r : ref) scale = std::max(scale, std::abs(r));
  std::int64_t bad = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = got[r * stride + j], e = ref[static_cast<std::size_t>(r * cols + j)];
      if (!(std::abs(g - e) <= 1e-12 * scale) && bad++ < 5) {
        ADD_FAILURE() << what << "[" << r << ", " << j << "]: got " << g << ", reference " << e;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(CudaFloat64, ForwardMatchesReference) {
  REQUIRE_GPU();
  std::mt19937 rng(64);
  for (const F64Case& c : f64_cases()) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols << " pad " << c.pad);
    const std::int64_t stride = c.cols + c.pad, n = c.rows * stride;
    Buffer x(DType::kFloat64, n), res(DType::kFloat64, n), y(DType::kFloat64, n);
    Buffer w(DType::kFloat64, c.cols), b(DType::kFloat64, c.cols), rstd(DType::kFloat32, c.rows),
        mean(DType::kFloat32, c.rows);
    x.fill_random(rng);
    res.fill_random(rng);
    w.fill_random(rng, 0.5f, 1.5f);
    b.fill_random(rng);
    for (std::int64_t j = 0; j < c.cols; ++j)
      detail::store_from_float(x.host(), DType::kFloat64, j, 0.0f);  // row 0: zeros
    for (Buffer* buf : {&x, &res, &w, &b}) buf->upload();
    const ConstMatrix xh = const_matrix(x.host(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix xd = const_matrix(x.device(), DType::kFloat64, c.rows, c.cols, stride);
    const Matrix yd = matrix(y.device(), DType::kFloat64, c.rows, c.cols, stride);
    const double* yh = static_cast<const double*>(y.host());
    for (const bool weighted : {false, true}) {
      for (const float offset : {0.0f, 1.0f}) {
        const ConstVector wv =
            weighted ? ConstVector{w.device(), DType::kFloat64, c.cols} : ConstVector{};
        const ConstVector wh =
            weighted ? ConstVector{w.host(), DType::kFloat64, c.cols} : ConstVector{};
        RmsNormOptions options;
        options.weight_offset = offset;
        rms_norm(kGpu, xd, wv, yd, static_cast<float*>(rstd.device()), options);
        CUDA_OK(cudaDeviceSynchronize());
        y.download();
        rstd.download();
        const auto ref = reference::rms_norm(xh, wh, options);
        expect_f64_close(ref.y, yh, c.rows, c.cols, stride, "rms_norm y");
        for (std::int64_t r = 0; r < c.rows; ++r)
          EXPECT_NEAR(rstd.get(r), ref.rstd[r], ref.rstd[r] * 0x1p-24) << r;
      }
    }
    const ConstVector wv{w.device(), DType::kFloat64, c.cols},
        bv{b.device(), DType::kFloat64, c.cols};
    const ConstVector wh{w.host(), DType::kFloat64, c.cols}, bh{b.host(), DType::kFloat64, c.cols};
    layer_norm(kGpu, xd, wv, bv, yd, static_cast<float*>(mean.device()),
               static_cast<float*>(rstd.device()));
    CUDA_OK(cudaDeviceSynchronize());
    y.download();
    expect_f64_close(reference::layer_norm(xh, wh, bh).y, yh, c.rows, c.cols, stride,
                     "layer_norm y");

    const auto fused = reference::fused_add_rms_norm(
        xh, const_matrix(res.host(), DType::kFloat64, c.rows, c.cols, stride), wh);
    fused_add_rms_norm(kGpu, xd, matrix(res.device(), DType::kFloat64, c.rows, c.cols, stride), wv,
                       yd, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    y.download();
    res.download();
    expect_f64_close(fused.y, yh, c.rows, c.cols, stride, "fused_add y");
    expect_f64_close(fused.residual, static_cast<const double*>(res.host()), c.rows, c.cols, stride,
                     "fused_add residual");
  }
}

TEST(CudaFloat64, BackwardMatchesReference) {
  REQUIRE_GPU();
  std::mt19937 rng(65);
  for (const F64Case& c : f64_cases()) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols << " pad " << c.pad);
    const std::int64_t stride = c.cols + c.pad, n = c.rows * stride;
    Buffer x(DType::kFloat64, n), dy(DType::kFloat64, n), dx(DType::kFloat64, n),
        addend(DType::kFloat64, n);
    Buffer w(DType::kFloat64, c.cols), dw(DType::kFloat64, c.cols), db(DType::kFloat64, c.cols);
    Buffer wrong(DType::kFloat32, 2 * c.rows);
    x.fill_random(rng);
    dy.fill_random(rng);
    addend.fill_random(rng);
    w.fill_random(rng, 0.5f, 1.5f);
    wrong.fill(0.25f);
    for (Buffer* buf : {&x, &dy, &addend, &w, &wrong}) buf->upload();
    const std::size_t ws_bytes = backward_workspace_bytes(kGpu, c.rows, c.cols);
    void* ws = nullptr;
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
    const ConstMatrix xh = const_matrix(x.host(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix dyh = const_matrix(dy.host(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix addh = const_matrix(addend.host(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix xd = const_matrix(x.device(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix dyd = const_matrix(dy.device(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstMatrix addd = const_matrix(addend.device(), DType::kFloat64, c.rows, c.cols, stride);
    const ConstVector wv{w.device(), DType::kFloat64, c.cols},
        wh{w.host(), DType::kFloat64, c.cols};
    const Vector dwv{dw.device(), DType::kFloat64, c.cols},
        dbv{db.device(), DType::kFloat64, c.cols};
    const Matrix dxd = matrix(dx.device(), DType::kFloat64, c.rows, c.cols, stride);
    const float* wrong_mean = static_cast<const float*>(wrong.device());
    const float* wrong_rstd = wrong_mean + c.rows;
    RmsNormOptions gemma;
    gemma.weight_offset = 1.0f;
    auto dw_bits = [&] {
      dw.download();
      return std::vector<double>(static_cast<const double*>(dw.host()),
                                 static_cast<const double*>(dw.host()) + c.cols);
    };

    const auto rms = reference::rms_norm_backward(dyh, xh, wh, gemma, addh);
    rms_norm_backward(kGpu, dyd, xd, wv, wrong_rstd, dxd, dwv, gemma, {ws, ws_bytes}, addd);
    CUDA_OK(cudaDeviceSynchronize());
    dx.download();
    expect_f64_close(rms.dx, static_cast<const double*>(dx.host()), c.rows, c.cols, stride,
                     "rms dx");
    const std::vector<double> first = dw_bits();
    expect_f64_close(rms.dw, first.data(), 1, c.cols, c.cols, "rms dw");
    rms_norm_backward(kGpu, dyd, xd, wv, nullptr, {}, dwv, gemma, {ws, ws_bytes});
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(dw_bits() == first) << "dw differs between runs";

    const auto ln = reference::layer_norm_backward(dyh, xh, wh, true);
    layer_norm_backward(kGpu, dyd, xd, wv, wrong_mean, wrong_rstd, dxd, dwv, dbv, {},
                        {ws, ws_bytes});
    CUDA_OK(cudaDeviceSynchronize());
    dx.download();
    db.download();
    expect_f64_close(ln.dx, static_cast<const double*>(dx.host()), c.rows, c.cols, stride,
                     "layer dx");
    expect_f64_close(ln.dw, dw_bits().data(), 1, c.cols, c.cols, "layer dw");
    expect_f64_close(ln.db, static_cast<const double*>(db.host()), 1, c.cols, c.cols, "layer db");

    // dx written over dy, with dw: dw must still see the original dy.
    const auto plain = reference::rms_norm_backward(dyh, xh, wh);
    rms_norm_backward(kGpu, dyd, xd, wv, nullptr,
                      matrix(dy.device(), DType::kFloat64, c.rows, c.cols, stride), dwv, {},
                      {ws, ws_bytes});
    CUDA_OK(cudaDeviceSynchronize());
    dy.download();
    expect_f64_close(plain.dx, static_cast<const double*>(dy.host()), c.rows, c.cols, stride,
                     "in-place dx");
    expect_f64_close(plain.dw, dw_bits().data(), 1, c.cols, c.cols, "in-place dw");
    cudaFree(ws);
  }
}

TEST(CudaFloat64, PhasedAndQuantizedRefuseIt) {
  REQUIRE_GPU();
  Buffer x(DType::kFloat64, 8), sums(DType::kFloat32, 2);
  EXPECT_THROW(rms_norm_partial_sum_squares(kGpu, const_matrix(x.device(), DType::kFloat64, 2, 4),
                                            static_cast<float*>(sums.device())),
               Error);
}

}  // namespace
}  // namespace fusednorm
