// Every argument check of every public entry: each throws fusednorm::Error naming the
// operator and the argument, and a rejected call writes nothing.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/problem.h"
#include "test_util.h"

namespace fusednorm::test {
namespace {

constexpr std::int64_t kRows = 4, kCols = 8;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
const DType kBadDType = static_cast<DType>(7);

// A valid fp32 problem of every operator; each test breaks one argument. The fixture's
// TearDown checks that no output was touched by a rejected call.
class ErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Rng rng(1);
    for (Buffer* b : {&x, &dy}) fill_activations(*b, rng, true);
    for (Buffer* b : {&w, &bias}) fill_normal(*b, rng, 1.0, 0.5);
    for (const Buffer* b : {&y, &residual, &dx, &dw, &db, &stats, &workspace}) {
      before.push_back(b->snapshot());
    }
    fill_activations(residual, rng, false);
    before[1] = residual.snapshot();
  }
  void TearDown() override {
    const Buffer* outputs[] = {&y, &residual, &dx, &dw, &db, &stats, &workspace};
    const char* names[] = {"y", "residual", "dx", "dw", "db", "mean/rstd", "workspace"};
    for (std::size_t i = 0; i < std::size(outputs); ++i) {
      EXPECT_TRUE(outputs[i]->check_unchanged(names[i], before[i]));
    }
  }

  float* rstd() { return stats.float_data(); }
  float* mean() { return stats.float_data() + kRows; }

  Buffer x{DType::kFloat32, kRows, kCols, kCols + 2};
  Buffer y{DType::kFloat32, kRows, kCols};
  Buffer residual{DType::kFloat32, kRows, kCols};
  Buffer dy{DType::kFloat32, kRows, kCols};
  Buffer dx{DType::kFloat32, kRows, kCols};
  Buffer w = Buffer::vector_of(DType::kFloat32, kCols);
  Buffer bias = Buffer::vector_of(DType::kFloat32, kCols);
  Buffer dw = Buffer::vector_of(DType::kFloat32, kCols);
  Buffer db = Buffer::vector_of(DType::kFloat32, kCols);
  Buffer stats = Buffer::floats(2 * kRows);
  Buffer workspace = Buffer::floats(4);
  std::vector<std::vector<std::uint64_t>> before;
  Context ctx;
};

// ---- Matrix arguments -----------------------------------------------------------------------

TEST_F(ErrorTest, NullMatrixDataWithRows) {
  ConstMatrix null_x = x.cmatrix();
  null_x.data = nullptr;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, null_x, w.cvector(), y.matrix(), rstd()),
                         "fusednorm::rms_norm", "argument 'x'", "data is null");
  Matrix null_y = y.matrix();
  null_y.data = nullptr;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), w.cvector(), null_y, rstd()),
                         "fusednorm::rms_norm", "argument 'y'", "data is null");
  Matrix null_residual = residual.matrix();
  null_residual.data = nullptr;
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), null_residual, w.cvector(), y.matrix(), rstd()),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "data is null");
  ConstMatrix null_dy = dy.cmatrix();
  null_dy.data = nullptr;
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, null_dy, x.cmatrix(), w.cvector(), rstd(),
                                           dx.matrix(), dw.vector()),
                         "fusednorm::rms_norm_backward", "argument 'dy'", "data is null");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), null_x, w.cvector(), nullptr,
                                             nullptr, dx.matrix(), dw.vector(), db.vector()),
                         "fusednorm::layer_norm_backward", "argument 'x'", "data is null");
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, null_x, w.cvector(), bias.cvector(), y.matrix(),
                                    mean(), rstd()),
                         "fusednorm::layer_norm", "argument 'x'", "data is null");
}

TEST_F(ErrorTest, ZeroOrNegativeD) {
  for (const std::int64_t cols : {std::int64_t{0}, std::int64_t{-3}}) {
    const ConstMatrix bad = const_matrix(x.data(), DType::kFloat32, kRows, cols, kCols);
    EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, bad, {}, y.matrix(), nullptr), "fusednorm::rms_norm",
                           "argument 'x'", "D (cols) must be >= 1");
    EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, bad, {}, {}, y.matrix(), nullptr, nullptr),
                           "fusednorm::layer_norm", "argument 'x'", "D (cols) must be >= 1");
    EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), bad, {}, nullptr, dx.matrix(), {}),
                           "fusednorm::rms_norm_backward", "argument 'x'", "D (cols)");
  }
  // Even with no rows, D = 0 is not a valid shape.
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, const_matrix(nullptr, DType::kFloat32, 0, 0), {},
                                  matrix(nullptr, DType::kFloat32, 0, 0), nullptr),
                         "fusednorm::rms_norm", "argument 'x'", "D (cols)");
}

TEST_F(ErrorTest, NegativeRows) {
  const ConstMatrix bad = const_matrix(x.data(), DType::kFloat32, -1, kCols);
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, bad, {}, y.matrix(), nullptr), "fusednorm::rms_norm",
                         "argument 'x'", "rows must be >= 0");
}

TEST_F(ErrorTest, StrideSmallerThanD) {
  ConstMatrix bad_x = x.cmatrix();
  bad_x.row_stride = kCols - 1;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, bad_x, {}, y.matrix(), nullptr), "fusednorm::rms_norm",
                         "argument 'x'", "row_stride 7 is smaller than D = 8");
  Matrix bad_y = y.matrix();
  bad_y.row_stride = 0;
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), {}, {}, bad_y, nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'y'", "row_stride 0");
  Matrix bad_residual = residual.matrix();
  bad_residual.row_stride = -kCols;
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), bad_residual, {}, y.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "row_stride");
  Matrix bad_dx = dx.matrix();
  bad_dx.row_stride = kCols - 1;
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, bad_dx, {}),
      "fusednorm::rms_norm_backward", "argument 'dx'", "row_stride");
  ConstMatrix bad_dy = dy.cmatrix();
  bad_dy.row_stride = 1;
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, bad_dy, x.cmatrix(), {}, nullptr, nullptr,
                                             dx.matrix(), {}, {}),
                         "fusednorm::layer_norm_backward", "argument 'dy'", "row_stride");
}

TEST_F(ErrorTest, UnsupportedDType) {
  ConstMatrix bad_x = x.cmatrix();
  bad_x.dtype = kBadDType;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, bad_x, {}, y.matrix(), nullptr), "fusednorm::rms_norm",
                         "argument 'x'", "unsupported dtype");
  Matrix bad_y = y.matrix();
  bad_y.dtype = kBadDType;
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), {}, {}, bad_y, nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'y'", "unsupported dtype");
  ConstVector bad_w = w.cvector();
  bad_w.dtype = kBadDType;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), bad_w, y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'weight'", "unsupported dtype");
  Vector bad_db = db.vector();
  bad_db.dtype = kBadDType;
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr,
                                             nullptr, dx.matrix(), {}, bad_db),
                         "fusednorm::layer_norm_backward", "argument 'db'", "unsupported dtype");
  EXPECT_FUSEDNORM_ERROR(dtype_size(kBadDType), "unsupported dtype");
  EXPECT_STREQ(dtype_name(kBadDType), "invalid");
}

TEST_F(ErrorTest, ShapeAndDTypeMismatch) {
  Matrix short_y = y.matrix();
  short_y.rows = kRows - 1;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), {}, short_y, nullptr), "fusednorm::rms_norm",
                         "argument 'y'", "shape 3 x 8 does not match x's 4 x 8");
  Matrix narrow_residual = residual.matrix();
  narrow_residual.cols = kCols - 1;
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), narrow_residual, {}, y.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "does not match");
  Matrix half_y = y.matrix();
  half_y.dtype = DType::kFloat16;
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), {}, {}, half_y, nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'y'",
                         "dtype float16 does not match x's float32");
  ConstMatrix wide_dy = dy.cmatrix();
  wide_dy.cols = kCols + 1;
  wide_dy.row_stride = kCols + 1;
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, wide_dy, x.cmatrix(), {}, nullptr, dx.matrix(), {}),
                         "fusednorm::rms_norm_backward", "argument 'dy'", "does not match");
  Matrix bf16_dx = dx.matrix();
  bf16_dx.dtype = DType::kBFloat16;
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr,
                                             nullptr, bf16_dx, {}, {}),
                         "fusednorm::layer_norm_backward", "argument 'dx'", "dtype bfloat16");
}

// ---- Vector arguments -----------------------------------------------------------------------

TEST_F(ErrorTest, WeightSizeDTypeAndNull) {
  ConstVector short_w = w.cvector();
  short_w.size = kCols - 1;
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), short_w, y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'weight'",
                         "size 7 does not match D = 8");
  // A half-precision weight must match x; fp32 is the only other choice.
  Buffer half_x(DType::kBFloat16, kRows, kCols), half_y(DType::kBFloat16, kRows, kCols);
  Rng rng(2);
  fill_activations(half_x, rng, false);
  const Buffer fp16_w = Buffer::vector_of(DType::kFloat16, kCols);
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, half_x.cmatrix(), fp16_w.cvector(), half_y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'weight'",
                         "dtype float16 must be x's dtype (bfloat16) or float32");
  // A half-precision weight with fp32 x is not allowed either.
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), fp16_w.cvector(), y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'weight'", "must be x's dtype");
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), ConstVector{nullptr, DType::kFloat32, kCols},
                                  y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'weight'", "data is null but size is 8");
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), w.cvector(),
                                    ConstVector{nullptr, DType::kFloat32, -1}, y.matrix(),
                                    nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'bias'", "data is null but size is -1");
  ConstVector long_bias = bias.cvector();
  long_bias.size = kCols + 1;
  EXPECT_FUSEDNORM_ERROR(
      layer_norm(ctx, x.cmatrix(), w.cvector(), long_bias, y.matrix(), nullptr, nullptr),
      "fusednorm::layer_norm", "argument 'bias'", "size 9 does not match D = 8");
  ConstVector short_weight = w.cvector();
  short_weight.size = 1;
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), short_weight, y.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'weight'", "size 1");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), short_weight,
                                             nullptr, nullptr, dx.matrix(), dw.vector(), {}),
                         "fusednorm::layer_norm_backward", "argument 'weight'", "size 1");
}

TEST_F(ErrorTest, GradientVectors) {
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(), dw.vector()),
      "fusednorm::rms_norm_backward", "argument 'dw'",
      "given, but there is no weight to differentiate");
  Vector short_dw = dw.vector();
  short_dw.size = 2;
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                           dx.matrix(), short_dw),
                         "fusednorm::rms_norm_backward", "argument 'dw'", "size 2");
  Vector half_dw = dw.vector();
  half_dw.dtype = DType::kFloat16;
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                           dx.matrix(), half_dw),
                         "fusednorm::rms_norm_backward", "argument 'dw'", "must be x's dtype");
  Vector short_db = db.vector();
  short_db.size = kCols - 1;
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                             nullptr, dx.matrix(), dw.vector(), short_db),
                         "fusednorm::layer_norm_backward", "argument 'db'", "size 7");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                             nullptr, dx.matrix(),
                                             Vector{nullptr, DType::kFloat32, kCols}, {}),
                         "fusednorm::layer_norm_backward", "argument 'dw'", "data is null");
}

TEST_F(ErrorTest, MeanAndRstdTogether) {
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, mean(), nullptr,
                                             dx.matrix(), {}, {}),
                         "fusednorm::layer_norm_backward", "argument 'rstd'",
                         "mean and rstd must be given together");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, rstd(),
                                             dx.matrix(), {}, {}),
                         "fusednorm::layer_norm_backward", "argument 'mean'",
                         "mean and rstd must be given together");
}

// ---- Scalars and context --------------------------------------------------------------------

TEST_F(ErrorTest, EpsMustBeFiniteAndNonNegative) {
  for (const float eps : {-1e-6f, -0.0f - 1e-30f, kNaN, kInf, -kInf}) {
    SCOPED_TRACE(eps);
    RmsNormOptions rms;
    rms.eps = eps;
    LayerNormOptions ln;
    ln.eps = eps;
    EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), {}, y.matrix(), nullptr, rms),
                           "fusednorm::rms_norm", "argument 'eps'", "must be finite and >= 0");
    EXPECT_FUSEDNORM_ERROR(
        fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), {}, y.matrix(), nullptr, rms),
        "fusednorm::fused_add_rms_norm", "argument 'eps'");
    EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), {}, {}, y.matrix(), nullptr, nullptr, ln),
                           "fusednorm::layer_norm", "argument 'eps'");
    EXPECT_FUSEDNORM_ERROR(
        rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(), {}, rms),
        "fusednorm::rms_norm_backward", "argument 'eps'");
    EXPECT_FUSEDNORM_ERROR(layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr,
                                               nullptr, dx.matrix(), {}, {}, ln),
                           "fusednorm::layer_norm_backward", "argument 'eps'");
  }
}

TEST_F(ErrorTest, WeightOffsetMustBeFinite) {
  for (const float offset : {kNaN, kInf, -kInf}) {
    RmsNormOptions rms;
    rms.weight_offset = offset;
    EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), w.cvector(), y.matrix(), nullptr, rms),
                           "fusednorm::rms_norm", "argument 'weight_offset'", "must be finite");
    EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                             dx.matrix(), dw.vector(), rms),
                           "fusednorm::rms_norm_backward", "argument 'weight_offset'");
  }
}

TEST_F(ErrorTest, Context) {
  Context negative;
  negative.num_threads = -1;
  EXPECT_FUSEDNORM_ERROR(rms_norm(negative, x.cmatrix(), {}, y.matrix(), nullptr),
                         "fusednorm::rms_norm", "argument 'ctx.num_threads'", "must be >= 0");
  Context unknown;
  unknown.device = static_cast<Device>(9);
  EXPECT_FUSEDNORM_ERROR(layer_norm(unknown, x.cmatrix(), {}, {}, y.matrix(), nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'ctx.device'", "unknown device");
  EXPECT_FUSEDNORM_ERROR(backward_workspace_bytes(unknown, 1, 1),
                         "fusednorm::backward_workspace_bytes", "argument 'ctx.device'");
  if (!has_backend(Device::kCuda)) {
    Context cuda;
    cuda.device = Device::kCuda;
    EXPECT_FUSEDNORM_ERROR(rms_norm(cuda, x.cmatrix(), {}, y.matrix(), nullptr),
                           "fusednorm::rms_norm", "argument 'ctx.device'", "no CUDA backend");
    EXPECT_FUSEDNORM_ERROR(rms_norm_backward(cuda, dy.cmatrix(), x.cmatrix(), {}, nullptr,
                                             dx.matrix(), {}),
                           "fusednorm::rms_norm_backward", "argument 'ctx.device'");
  }
  EXPECT_TRUE(has_backend(Device::kCpu));
}

TEST_F(ErrorTest, WorkspaceBytes) {
  EXPECT_FUSEDNORM_ERROR(backward_workspace_bytes(ctx, -1, 8),
                         "fusednorm::backward_workspace_bytes", "argument 'rows'");
  EXPECT_FUSEDNORM_ERROR(backward_workspace_bytes(ctx, 4, 0),
                         "fusednorm::backward_workspace_bytes", "argument 'cols'");
  // A workspace smaller than backward_workspace_bytes says is rejected, not overrun.
  const std::size_t needed = backward_workspace_bytes(ctx, kRows, kCols);
  ASSERT_GT(needed, 4u * sizeof(float));
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        dw.vector(), {}, Workspace{workspace.data(), 4 * sizeof(float)}),
      "fusednorm::rms_norm_backward", "argument 'workspace'", "bytes given");
}

// ---- Aliasing ------------------------------------------------------------------------------

TEST_F(ErrorTest, ForwardOutputsMustNotOverlapInputs) {
  // y starting one element into x (same stride): overlaps, and is not the same view.
  Matrix shifted = {static_cast<float*>(x.data()) + 1, DType::kFloat32, kRows, kCols, kCols + 2};
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), {}, shifted, nullptr), "fusednorm::rms_norm",
                         "argument 'y'", "overlaps 'x'");
  // Same pointer but another stride is not in-place either.
  Matrix restrided = {x.data(), DType::kFloat32, kRows, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), {}, {}, restrided, nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'y'", "overlaps 'x'");
  // rstd inside x, y or the weight.
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), w.cvector(), y.matrix(), static_cast<float*>(x.data()) + 3),
                         "fusednorm::rms_norm", "argument 'rstd'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), w.cvector(), y.matrix(), y.float_data() + kCols),
                         "fusednorm::rms_norm", "argument 'rstd'", "overlaps 'y'");
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, x.cmatrix(), w.cvector(), y.matrix(), w.float_data()),
                         "fusednorm::rms_norm", "argument 'rstd'", "overlaps 'weight'");
  // mean and rstd overlapping each other, or the bias.
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), w.cvector(), bias.cvector(), y.matrix(),
                                    mean(), mean() + 1),
                         "fusednorm::layer_norm", "argument 'rstd'", "overlaps 'mean'");
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, x.cmatrix(), w.cvector(), bias.cvector(), y.matrix(),
                                    bias.float_data() + 2, rstd()),
                         "fusednorm::layer_norm", "argument 'mean'", "overlaps 'bias'");
  // y over the weight or the bias.
  Matrix y_on_weight = {w.data(), DType::kFloat32, 1, kCols, kCols};
  ConstMatrix one_row = {x.data(), DType::kFloat32, 1, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, one_row, w.cvector(), y_on_weight, nullptr),
                         "fusednorm::rms_norm", "argument 'y'", "overlaps 'weight'");
  Matrix y_on_bias = {bias.data(), DType::kFloat32, 1, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(layer_norm(ctx, one_row, {}, bias.cvector(), y_on_bias, nullptr, nullptr),
                         "fusednorm::layer_norm", "argument 'y'", "overlaps 'bias'");
}

TEST_F(ErrorTest, FusedAddAliasing) {
  // residual is read and written: it may not alias x, and y may not alias it.
  Matrix residual_on_x = {x.data(), DType::kFloat32, kRows, kCols, kCols + 2};
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), residual_on_x, {}, y.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), {}, residual.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'y'", "overlaps 'residual'");
  Matrix residual_on_weight = {w.data(), DType::kFloat32, 1, kCols, kCols};
  ConstMatrix one_row = {x.data(), DType::kFloat32, 1, kCols, kCols};
  Matrix y_one_row = {y.data(), DType::kFloat32, 1, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm(ctx, one_row, residual_on_weight, w.cvector(), y_one_row, nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "overlaps 'weight'");
  EXPECT_FUSEDNORM_ERROR(fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), {}, y.matrix(),
                                            residual.float_data() + 1),
                         "fusednorm::fused_add_rms_norm", "argument 'rstd'",
                         "overlaps 'residual'");
}

TEST_F(ErrorTest, BackwardOutputsMustNotOverlapInputs) {
  // dx may be dy itself, but not x, nor a shifted dy.
  Matrix dx_on_x = {x.data(), DType::kFloat32, kRows, kCols, kCols + 2};
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx_on_x, {}),
      "fusednorm::rms_norm_backward", "argument 'dx'", "overlaps 'x'");
  Matrix dx_shifted = {dy.float_data() + 1, DType::kFloat32, kRows, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx_shifted, {}),
      "fusednorm::rms_norm_backward", "argument 'dx'", "overlaps 'dy'");
  Matrix dx_on_rstd = {stats.data(), DType::kFloat32, 1, kCols, kCols};
  ConstMatrix x_one = {x.data(), DType::kFloat32, 1, kCols, kCols};
  ConstMatrix dy_one = {dy.data(), DType::kFloat32, 1, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy_one, x_one, {}, stats.float_data() + 2, dx_on_rstd, {}),
      "fusednorm::rms_norm_backward", "argument 'dx'", "overlaps 'rstd'");
  // dw over the weight, dy or dx; db over dw.
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        Vector{w.data(), DType::kFloat32, kCols}),
      "fusednorm::rms_norm_backward", "argument 'dw'", "overlaps 'weight'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        Vector{dy.float_data() + kCols, DType::kFloat32, kCols}),
      "fusednorm::rms_norm_backward", "argument 'dw'", "overlaps 'dy'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        Vector{dx.float_data(), DType::kFloat32, kCols}),
      "fusednorm::rms_norm_backward", "argument 'dw'", "overlaps 'dx'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                          dx.matrix(), dw.vector(), Vector{dw.float_data() + 1, DType::kFloat32, kCols}),
      "fusednorm::layer_norm_backward", "argument 'db'", "overlaps 'dw'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), mean(), rstd(),
                          dx.matrix(), dw.vector(), Vector{stats.data(), DType::kFloat32, kCols}),
      "fusednorm::layer_norm_backward", "argument 'db'", "overlaps 'mean'");
  // The workspace is scratch: it may not overlap anything.
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                          dx.matrix(), dw.vector(), db.vector(), {},
                          Workspace{dw.data(), 1 << 20}),
      "fusednorm::layer_norm_backward", "argument 'workspace'", "overlaps");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        dw.vector(), {}, Workspace{x.data(), 64}),
      "fusednorm::rms_norm_backward", "argument 'workspace'", "overlaps 'x'");
}

TEST_F(ErrorTest, DxAddend) {
  Buffer addend(DType::kFloat32, kRows, kCols);
  Rng rng(2);
  fill_activations(addend, rng, false);
  const auto addend_before = addend.snapshot();
  ConstMatrix wrong_shape = {addend.data(), DType::kFloat32, kRows - 1, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(),
                                           {}, {}, {}, wrong_shape),
                         "fusednorm::rms_norm_backward", "argument 'dx_addend'", "shape");
  ConstMatrix wrong_dtype = {addend.data(), DType::kFloat16, kRows, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(),
                                           {}, {}, {}, wrong_dtype),
                         "fusednorm::rms_norm_backward", "argument 'dx_addend'", "dtype");
  ConstMatrix null_data = {nullptr, DType::kFloat32, kRows, kCols, kCols};
  // data == nullptr means "absent": this call is valid and writes dx; undo it.
  rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(), {}, {}, {},
                    null_data);
  dx.restore(before[2]);
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, {}, {}, {},
                                           {}, addend.cmatrix()),
                         "fusednorm::rms_norm_backward", "argument 'dx_addend'", "dx is absent");
  // In place on dx is fine; a shifted view of dx is not.
  ConstMatrix shifted = {dx.float_data() + 1, DType::kFloat32, kRows, kCols, kCols};
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), {}, nullptr, dx.matrix(),
                                           {}, {}, {}, shifted),
                         "fusednorm::rms_norm_backward", "argument 'dx'", "overlaps 'dx_addend'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        Vector{addend.data(), DType::kFloat32, kCols}, {}, {}, addend.cmatrix()),
      "fusednorm::rms_norm_backward", "argument 'dw'", "overlaps 'dx_addend'");
  EXPECT_TRUE(addend.check_unchanged("dx_addend", addend_before));
}

TEST_F(ErrorTest, TwoPhaseArguments) {
  Buffer sums = Buffer::floats(kRows);
  const auto sums_before = sums.snapshot();
  EXPECT_FUSEDNORM_ERROR(rms_norm_partial_sum_squares(ctx, x.cmatrix(), nullptr),
                         "fusednorm::rms_norm_partial_sum_squares", "argument 'row_sum_squares'",
                         "null");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_partial_sum_squares(ctx, x.cmatrix(), static_cast<float*>(x.data())),
      "fusednorm::rms_norm_partial_sum_squares", "argument 'row_sum_squares'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(fused_add_partial_sum_squares(ctx, x.cmatrix(), {}, sums.float_data()),
                         "fusednorm::fused_add_partial_sum_squares", "argument 'residual'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_partial_sum_squares(ctx, x.cmatrix(), residual.matrix(), residual.float_data()),
      "fusednorm::fused_add_partial_sum_squares", "argument 'row_sum_squares'",
      "overlaps 'residual'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_from_sum_squares(ctx, x.cmatrix(), w.cvector(), y.matrix(), nullptr, kCols, rstd()),
      "fusednorm::rms_norm_from_sum_squares", "argument 'row_sum_squares'", "null");
  EXPECT_FUSEDNORM_ERROR(rms_norm_from_sum_squares(ctx, x.cmatrix(), w.cvector(), y.matrix(),
                                                   sums.float_data(), kCols - 1, rstd()),
                         "fusednorm::rms_norm_from_sum_squares", "argument 'full_cols'",
                         "smaller than the slice's D");
  EXPECT_FUSEDNORM_ERROR(rms_norm_from_sum_squares(ctx, x.cmatrix(), w.cvector(), y.matrix(),
                                                   sums.float_data(), kCols, sums.float_data()),
                         "fusednorm::rms_norm_from_sum_squares", "argument 'rstd'",
                         "overlaps 'row_sum_squares'");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(),
                                                        nullptr, sums.float_data()),
                         "fusednorm::rms_norm_backward_partial_sums", "argument 'rstd'",
                         "required");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), rstd(), nullptr),
      "fusednorm::rms_norm_backward_partial_sums", "argument 'row_sum_g_xhat'", "required");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(),
                                                        rstd(), static_cast<float*>(dy.data())),
                         "fusednorm::rms_norm_backward_partial_sums", "argument 'row_sum_g_xhat'",
                         "overlaps 'dy'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                  sums.float_data(), kCols, dx.matrix(), dw.vector()),
      "fusednorm::rms_norm_backward_from_sums", "argument 'rstd'", "required");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), rstd(), nullptr,
                                  kCols, dx.matrix(), dw.vector()),
      "fusednorm::rms_norm_backward_from_sums", "argument 'row_sum_g_xhat'", "required");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), rstd(),
                                  sums.float_data(), 0, dx.matrix(), dw.vector()),
      "fusednorm::rms_norm_backward_from_sums", "argument 'full_cols'");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(),
                                                     rstd(), sums.float_data(), kCols, dx.matrix(),
                                                     Vector{sums.data(), DType::kFloat32, kCols}),
                         "fusednorm::rms_norm_backward_from_sums", "argument 'dw'",
                         "overlaps 'row_sum_g_xhat'");
  EXPECT_TRUE(sums.check_unchanged("row sums", sums_before));
}

TEST_F(ErrorTest, LayerNormPhaseArguments) {
  Buffer sums = Buffer::floats(2 * kRows);
  float* first = sums.float_data();
  float* second = sums.float_data() + kRows;
  const auto sums_before = sums.snapshot();
  EXPECT_FUSEDNORM_ERROR(layer_norm_partial_sums(ctx, x.cmatrix(), nullptr),
                         "fusednorm::layer_norm_partial_sums", "argument 'row_sum'", "null");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_partial_squared_deviations(ctx, x.cmatrix(), nullptr, kCols, second),
      "fusednorm::layer_norm_partial_squared_deviations", "argument 'row_sum'", "required");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_partial_squared_deviations(ctx, x.cmatrix(), first, kCols - 1, second),
      "fusednorm::layer_norm_partial_squared_deviations", "argument 'full_cols'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_partial_squared_deviations(ctx, x.cmatrix(), first, kCols, first),
      "fusednorm::layer_norm_partial_squared_deviations", "argument 'row_sum_squared_deviations'",
      "overlaps 'row_sum'");
  EXPECT_FUSEDNORM_ERROR(layer_norm_from_sums(ctx, x.cmatrix(), w.cvector(), bias.cvector(),
                                              y.matrix(), first, nullptr, kCols, mean(), rstd()),
                         "fusednorm::layer_norm_from_sums", "argument 'row_sum_squared_deviations'",
                         "required");
  EXPECT_FUSEDNORM_ERROR(layer_norm_from_sums(ctx, x.cmatrix(), w.cvector(), bias.cvector(),
                                              y.matrix(), first, second, kCols, first, rstd()),
                         "fusednorm::layer_norm_from_sums", "argument 'mean'",
                         "overlaps 'row_sum'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, rstd(),
                                       first, second),
      "fusednorm::layer_norm_backward_partial_sums", "argument 'mean'", "required");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), mean(), rstd(),
                                       nullptr, second),
      "fusednorm::layer_norm_backward_partial_sums", "argument 'row_sum_g'", "required");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward_partial_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), mean(), rstd(),
                                       first, first),
      "fusednorm::layer_norm_backward_partial_sums", "argument 'row_sum_g'",
      "overlaps 'row_sum_g_xhat'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), mean(), rstd(),
                                    nullptr, second, kCols, dx.matrix(), dw.vector(), db.vector()),
      "fusednorm::layer_norm_backward_from_sums", "argument 'row_sum_g'", "required");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_backward_from_sums(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), mean(), nullptr,
                                    first, second, kCols, dx.matrix(), dw.vector(), db.vector()),
      "fusednorm::layer_norm_backward_from_sums", "argument 'rstd'", "required");
  EXPECT_TRUE(sums.check_unchanged("row sums", sums_before));
}

// ---- 64-bit views ----------------------------------------------------------------------------

// Views whose extent does not fit 64-bit element (and byte) arithmetic are rejected before
// anything is touched; these pointers are never dereferenced.
TEST_F(ErrorTest, ViewSpanningMoreThan64BitIndexing) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  struct Shape {
    std::int64_t rows, cols, stride;
  };
  for (const Shape s : {Shape{2, 1, max / 8}, Shape{max, 1, max}, Shape{max, max, max},
                        Shape{9, 16, std::int64_t{1} << 58}, Shape{1, max / 4, max / 4},
                        Shape{1, max, max}}) {
    SCOPED_TRACE(::testing::Message() << s.rows << " x " << s.cols << ", stride " << s.stride);
    const ConstMatrix huge = {x.data(), DType::kFloat32, s.rows, s.cols, s.stride};
    EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, huge, {}, y.matrix(), nullptr), "fusednorm::rms_norm",
                           "argument 'x'", "64-bit indexing");
    const Matrix huge_y = {y.data(), DType::kFloat32, s.rows, s.cols, s.stride};
    const ConstMatrix same_x = {x.data(), DType::kFloat32, s.rows, s.cols, s.cols};
    EXPECT_FUSEDNORM_ERROR(rms_norm(ctx, same_x, {}, huge_y, nullptr), "fusednorm::rms_norm",
                           "64-bit indexing");
  }
}

// Large (but representable) views pass validation without overflow in the extent and
// overlap arithmetic. validate() is called directly: the memory does not exist.
TEST(Validation, AcceptsHugeViewsWithoutOverflow) {
  // Fake, never dereferenced addresses far apart.
  auto fake = [](std::uintptr_t a) { return reinterpret_cast<void*>(a); };
  const std::int64_t stride = std::int64_t{1} << 57;  // 3 rows: 2^58 elements, 2^60 bytes
  detail::ForwardProblem p;
  p.x = {fake(std::uintptr_t{1} << 12), DType::kFloat32, 3, 5, stride};
  p.y = {fake(std::uintptr_t{1} << 62), DType::kFloat32, 3, 5, stride};
  p.eps = 1e-6f;
  EXPECT_NO_THROW(detail::validate("rms_norm", p));
  // In place over a huge view is still in place.
  p.y = {const_cast<void*>(p.x.data), DType::kFloat32, 3, 5, stride};
  EXPECT_NO_THROW(detail::validate("rms_norm", p));
  // 2^20 + 1 rows of stride 2^31 + 3: indexes far beyond both 32-bit ranges.
  p.x = {fake(std::uintptr_t{1} << 12), DType::kFloat16, (std::int64_t{1} << 20) + 1, 7,
         (std::int64_t{1} << 31) + 3};
  p.y = {fake(std::uintptr_t{1} << 62), DType::kFloat16, p.x.rows, 7, p.x.row_stride};
  EXPECT_NO_THROW(detail::validate("rms_norm", p));
  // Overlap is still detected at the far end of a huge view: y starts inside x's last row.
  const std::uintptr_t last_row =
      (std::uintptr_t{1} << 12) + static_cast<std::uintptr_t>(p.x.rows - 1) *
                                      static_cast<std::uintptr_t>(p.x.row_stride) * 2;
  p.y = {fake(last_row + 4), DType::kFloat16, 1, 7, 7};
  p.y.rows = p.x.rows;
  p.y.row_stride = p.x.row_stride;
  EXPECT_FUSEDNORM_ERROR(detail::validate("rms_norm", p), "argument 'y'", "overlaps 'x'");

  detail::BackwardProblem b;
  b.x = {fake(std::uintptr_t{1} << 12), DType::kBFloat16, 5, 3, std::int64_t{1} << 56};
  b.dy = {fake(std::uintptr_t{1} << 60), DType::kBFloat16, 5, 3, std::int64_t{1} << 56};
  b.dx = {fake(std::uintptr_t{3} << 60), DType::kBFloat16, 5, 3, std::int64_t{1} << 56};
  b.eps = 1e-6f;
  EXPECT_NO_THROW(detail::validate("rms_norm_backward", b));
}

// With no rows, null data is fine everywhere (nothing is read or written).
TEST(ZeroRows, NullPointersAreFine) {
  for (const DType dtype : kAllDTypes) {
    const ConstMatrix x = const_matrix(nullptr, dtype, 0, 5);
    const Matrix out = matrix(nullptr, dtype, 0, 5);
    EXPECT_NO_THROW(rms_norm({}, x, {}, out, nullptr));
    EXPECT_NO_THROW(fused_add_rms_norm({}, x, out, {}, out, nullptr));
    EXPECT_NO_THROW(layer_norm({}, x, {}, {}, out, nullptr, nullptr));
    EXPECT_NO_THROW(rms_norm_backward({}, x, x, {}, nullptr, out, {}));
    EXPECT_NO_THROW(layer_norm_backward({}, x, x, {}, nullptr, nullptr, out, {}, {}));
  }
}

// Two column slices of one matrix do not overlap: x = buf[:, :D] and y = buf[:, D:] (or
// the residual there) are accepted and give the result of separate buffers; a slice that
// shares one column with x is still refused.
TEST(Aliasing, SiblingColumnSlicesAreNotOverlaps) {
  constexpr std::int64_t rows = 5, cols = 24, pitch = 3 * cols;
  Rng rng(7);
  Buffer buf(DType::kFloat32, rows, pitch);
  fill_activations(buf, rng, true);
  auto slice = [&](std::int64_t first_col) {
    return Matrix{buf.float_data() + first_col, DType::kFloat32, rows, cols, pitch};
  };
  auto cslice = [&](std::int64_t first_col) {
    const Matrix m = slice(first_col);
    return ConstMatrix{m.data, m.dtype, m.rows, m.cols, m.row_stride};
  };
  Buffer x_copy(DType::kFloat32, rows, cols), expected(DType::kFloat32, rows, cols);
  x_copy.fill([&](std::int64_t r, std::int64_t j) { return buf.at(r, j); });
  rms_norm({}, x_copy.cmatrix(), {}, expected.matrix(), nullptr);
  rms_norm({}, cslice(0), {}, slice(cols), nullptr);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(buf.at(r, cols + j), expected.at(r, j));
  }
  fused_add_rms_norm({}, cslice(0), slice(cols), {}, slice(2 * cols), nullptr);
  EXPECT_FUSEDNORM_ERROR(rms_norm({}, cslice(0), {}, slice(cols - 1), nullptr),
                         "fusednorm::rms_norm", "argument 'y'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm({}, cslice(0), slice(cols - 1), {}, slice(2 * cols), nullptr),
      "fusednorm::fused_add_rms_norm", "argument 'residual'", "overlaps 'x'");
}

// ByteRange::overlaps against the byte sets themselves, over small views of every layout.
TEST(Aliasing, ByteRangeOverlapIsExactForOnePitch) {
  struct View {
    std::int64_t offset, rows, stride, cols;
  };
  std::vector<View> views;
  for (std::int64_t offset : {0, 1, 3, 5, 8}) {
    for (std::int64_t rows : {1, 2, 3}) {
      for (std::int64_t stride : {4, 6}) {
        for (std::int64_t cols : {1, 2, 4}) views.push_back({offset, rows, stride, cols});
      }
    }
  }
  auto bytes_of = [](const View& v) {
    std::vector<bool> used(64, false);
    for (std::int64_t r = 0; r < v.rows; ++r) {
      for (std::int64_t j = 0; j < v.cols; ++j)
        used[static_cast<std::size_t>(v.offset + r * v.stride + j)] = true;
    }
    return used;
  };
  alignas(8) static unsigned char memory[64];
  for (const View& a : views) {
    for (const View& b : views) {
      const auto ra = detail::byte_range(memory + a.offset, DType::kInt8, a.rows, a.stride, a.cols);
      const auto rb = detail::byte_range(memory + b.offset, DType::kInt8, b.rows, b.stride, b.cols);
      const std::vector<bool> ua = bytes_of(a), ub = bytes_of(b);
      bool shared = false;
      for (std::size_t i = 0; i < ua.size(); ++i) shared = shared || (ua[i] && ub[i]);
      SCOPED_TRACE(::testing::Message()
                   << a.offset << "/" << a.rows << "/" << a.stride << "/" << a.cols << " vs "
                   << b.offset << "/" << b.rows << "/" << b.stride << "/" << b.cols);
      const bool one_pitch = a.rows == 1 || b.rows == 1 || a.stride == b.stride;
      if (one_pitch) {
        EXPECT_EQ(ra.overlaps(rb), shared);
        EXPECT_EQ(rb.overlaps(ra), shared);
      } else if (shared) {
        EXPECT_TRUE(ra.overlaps(rb));  // never missed, where it may over-approximate
      }
    }
  }
}

}  // namespace
}  // namespace fusednorm::test
