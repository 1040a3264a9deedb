// rms_norm_backward and layer_norm_backward against the fp64 reference: dx with a
// scale-aware tolerance, dw / db against their accumulation scale; rstd (and mean) given or
// recomputed; dx absent, separate, or written over dy; caller workspace or none.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "test_util.h"

namespace fusednorm::test {
namespace {

enum class DxMode { kSeparate, kInPlace, kAbsent };
// rms_norm_backward's dx_addend: none, its own buffer, dx's view (prefilled with the addend:
// accumulate in place), or dy's view.
enum class AddendMode { kNone, kSeparate, kIntoDx, kFromDy };

struct BackwardCase {
  std::int64_t rows = 0, cols = 0;
  std::int64_t x_stride = 0, dy_stride = 0, dx_stride = 0;
  DxMode dx_mode = DxMode::kSeparate;
  AddendMode addend = AddendMode::kNone;
  std::int64_t addend_stride = 0;
  bool given_stats = true;  // rstd (and mean) from the library's forward, else recomputed
  bool want_dw = true;
  bool want_db = true;
  bool workspace = false;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  int threads = 0;
};

::testing::Message describe(const BackwardCase& c) {
  return ::testing::Message() << "rows " << c.rows << ", D " << c.cols << ", strides x/dy/dx "
                              << c.x_stride << "/" << c.dy_stride << "/" << c.dx_stride
                              << ", dx mode " << static_cast<int>(c.dx_mode) << ", addend "
                              << static_cast<int>(c.addend) << " (stride " << c.addend_stride
                              << "), given stats " << c.given_stats << ", dw " << c.want_dw
                              << ", db " << c.want_db << ", workspace " << c.workspace << ", eps "
                              << c.eps << ", threads " << c.threads;
}

// Runs one backward case for either operator and checks every output.
void run_backward(Rng& rng, bool centered, DType dtype, WeightKind weight_kind,
                  const BackwardCase& c) {
  SCOPED_TRACE(describe(c));
  const std::int64_t rows = c.rows, cols = c.cols;
  Buffer x(dtype, rows, cols, c.x_stride);
  fill_activations(x, rng, centered);
  Buffer dy(dtype, rows, cols, c.dx_mode == DxMode::kInPlace ? c.dx_stride : c.dy_stride);
  fill_activations(dy, rng, false);
  const Buffer w =
      make_weight(weight_kind, dtype, cols, rng, c.weight_offset != 0.0f ? 0.0 : 1.0);
  const bool want_dw = c.want_dw && weight_kind != WeightKind::kNone;
  const bool want_db = centered && c.want_db;
  // dw / db in the weight's dtype (or the x dtype when there is no weight).
  const DType grad_dtype = weight_dtype(weight_kind, dtype);
  Buffer dw = want_dw ? Buffer::vector_of(grad_dtype, cols) : Buffer();
  Buffer db = want_db ? Buffer::vector_of(grad_dtype, cols) : Buffer();
  Buffer dx(dtype, rows, cols, c.dx_stride);
  Buffer mean = Buffer::floats(rows), rstd = Buffer::floats(rows);

  Context ctx;
  ctx.num_threads = c.threads;
  if (c.given_stats) {
    // The statistics the forward saved, as autograd would pass them.
    Buffer y(dtype, rows, cols);
    if (centered) {
      LayerNormOptions options;
      options.eps = c.eps;
      layer_norm(ctx, x.cmatrix(), view_of(w), {}, y.matrix(), mean.float_data(),
                 rstd.float_data(), options);
    } else {
      RmsNormOptions options;
      options.eps = c.eps;
      options.weight_offset = c.weight_offset;
      rms_norm(ctx, x.cmatrix(), view_of(w), y.matrix(), rstd.float_data(), options);
    }
  }
  const auto x_before = x.snapshot(), dy_before = dy.snapshot(), w_before = w.snapshot();
  const auto stats_before = rstd.snapshot(), mean_before = mean.snapshot();
  // The dx addend (RMSNorm): its own buffer, or dx's / dy's view with the addend in it.
  Buffer addend;
  ConstMatrix addend_view{};
  if (c.addend == AddendMode::kSeparate) {
    addend = Buffer(dtype, rows, cols, c.addend_stride);
    fill_activations(addend, rng, false);
    addend_view = addend.cmatrix();
  } else if (c.addend == AddendMode::kIntoDx) {
    Buffer& target = c.dx_mode == DxMode::kInPlace ? dy : dx;
    if (c.dx_mode != DxMode::kInPlace) fill_activations(dx, rng, false);
    addend_view = target.cmatrix();
  } else if (c.addend == AddendMode::kFromDy) {
    addend_view = dy.cmatrix();
  }
  const auto addend_before = addend.snapshot();
  const auto dx_before = dx.snapshot();

  // Reference, and the scales the tolerances are relative to.
  reference::BackwardResult ref;
  std::vector<double> xhat;
  if (centered) {
    LayerNormOptions options;
    options.eps = c.eps;
    ref = reference::layer_norm_backward(dy.cmatrix(), x.cmatrix(), view_of(w), want_db, options);
    xhat = reference::layer_norm(x.cmatrix(), {}, {}, options).y;
  } else {
    RmsNormOptions options;
    options.eps = c.eps;
    options.weight_offset = c.weight_offset;
    ref = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), view_of(w), options, addend_view);
    xhat = reference::rms_norm(x.cmatrix(), {}, options).y;
  }
  // dx's error scales with rstd * max|g| even where its terms cancel (ref.dx_scale).
  std::vector<double> dx_scale = row_max_abs(ref.dx, rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) dx_scale[r] = std::max(dx_scale[r], ref.dx_scale[r]);
  std::vector<double> dw_abs_sum(static_cast<std::size_t>(cols), 0.0), db_abs_sum(dw_abs_sum);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      dw_abs_sum[j] += std::fabs(dy.at(r, j) * xhat[r * cols + j]);
      db_abs_sum[j] += std::fabs(dy.at(r, j));
    }
  }

  Buffer workspace;
  if (c.workspace) {
    const std::size_t bytes = backward_workspace_bytes(ctx, rows, cols);
    workspace = Buffer::floats(static_cast<std::int64_t>((bytes + 3) / 4));
  }
  const Workspace ws = c.workspace ? Workspace{workspace.data(), static_cast<std::size_t>(
                                                                    workspace.cols() * 4)}
                                   : Workspace{};
  Matrix dx_view{};
  if (c.dx_mode == DxMode::kSeparate) dx_view = dx.matrix();
  if (c.dx_mode == DxMode::kInPlace) dx_view = dy.matrix();
  const float* rstd_in = c.given_stats ? rstd.float_data() : nullptr;
  if (centered) {
    LayerNormOptions options;
    options.eps = c.eps;
    layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), view_of(w),
                        c.given_stats ? mean.float_data() : nullptr, rstd_in, dx_view,
                        mutable_view_of(dw), mutable_view_of(db), options, ws);
  } else {
    RmsNormOptions options;
    options.eps = c.eps;
    options.weight_offset = c.weight_offset;
    rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), view_of(w), rstd_in, dx_view,
                      mutable_view_of(dw), options, ws, addend_view);
  }

  const std::string op = centered ? "layer_norm_backward " : "rms_norm_backward ";
  // The cross-row sums of dw / db: fp32 accumulation, fp64 for float64 calls.
  const double accumulation = tolerance(dtype == DType::kFloat64 ? dtype : DType::kFloat32);
  if (c.dx_mode != DxMode::kAbsent) {
    const Buffer& got = c.dx_mode == DxMode::kInPlace ? dy : dx;
    EXPECT_TRUE(got.check_written("dx"));
    EXPECT_TRUE(compare(op + "dx " + dtype_str(dtype), got, ref.dx, dx_scale, tolerance(dtype),
                        absolute_floor(dtype)));
  }
  if (c.dx_mode != DxMode::kInPlace) {
    EXPECT_TRUE(dy.check_unchanged("dy", dy_before));
  }
  if (c.dx_mode != DxMode::kSeparate) {
    EXPECT_TRUE(dx.check_unchanged("dx buffer not passed", dx_before));
  }
  EXPECT_TRUE(addend.check_unchanged("dx_addend", addend_before));
  if (want_dw) {
    EXPECT_TRUE(dw.check_written("dw"));
    EXPECT_TRUE(compare_vector(op + "dw " + dtype_str(grad_dtype), dw, ref.dw, dw_abs_sum,
                               tolerance(grad_dtype), accumulation));
  }
  if (want_db) {
    EXPECT_TRUE(db.check_written("db"));
    EXPECT_TRUE(compare_vector(op + "db " + dtype_str(grad_dtype), db, ref.db, db_abs_sum,
                               tolerance(grad_dtype), accumulation));
  }
  if (c.workspace) {
    EXPECT_TRUE(workspace.check_guards("workspace"));
  }
  EXPECT_TRUE(x.check_unchanged("x", x_before));
  EXPECT_TRUE(w.check_unchanged("weight", w_before));
  EXPECT_TRUE(rstd.check_unchanged("rstd (an input)", stats_before));
  EXPECT_TRUE(mean.check_unchanged("mean (an input)", mean_before));
}

BackwardCase random_case(Rng& rng, int c) {
  BackwardCase bc;
  bc.cols = random_cols(rng);
  bc.rows = random_rows(rng) * (c % 4 == 3 ? 7 : 1);  // some with many row blocks
  while (bc.rows > 1 && bc.rows * bc.cols > 150000) bc.rows /= 2;
  bc.x_stride = random_stride(rng, bc.cols);
  bc.dy_stride = random_stride(rng, bc.cols);
  bc.dx_stride = random_stride(rng, bc.cols);
  const DxMode modes[] = {DxMode::kSeparate, DxMode::kInPlace, DxMode::kSeparate,
                          DxMode::kAbsent};
  bc.dx_mode = modes[c % 4];
  bc.given_stats = (c / 2) % 2 == 0;
  bc.want_dw = c % 5 != 4;
  bc.want_db = c % 3 != 1;
  bc.workspace = c % 3 == 0;
  const float eps_choices[] = {1e-6f, 1e-5f, 1e-12f};
  bc.eps = eps_choices[c % 3];
  const int thread_choices[] = {0, 1, 2, 3, 7};
  bc.threads = thread_choices[c % 5];
  return bc;
}

// An RMSNorm case with a dx addend in one of its forms (dx present).
BackwardCase with_addend(Rng& rng, BackwardCase bc, int c) {
  const AddendMode modes[] = {AddendMode::kSeparate, AddendMode::kIntoDx, AddendMode::kFromDy};
  bc.addend = modes[c % 3];
  if (bc.dx_mode == DxMode::kAbsent) bc.dx_mode = DxMode::kSeparate;
  bc.addend_stride = random_stride(rng, bc.cols);
  return bc;
}

// ---- RMSNorm ------------------------------------------------------------------------------

class RmsNormBackwardTest : public RmsVariantTest {
 protected:
  // One row width of the small-width sweeps: 5 rows, a distinct stride per matrix, the
  // statistics given for even widths, one thread.
  BackwardCase small_width_case(std::int64_t cols) const {
    BackwardCase bc;
    bc.rows = 5;
    bc.cols = cols;
    bc.x_stride = cols + 1;
    bc.dy_stride = cols;
    bc.dx_stride = cols + 2;
    bc.given_stats = cols % 2 == 0;
    bc.weight_offset = offset();
    bc.threads = 1;
    return bc;
  }
};

TEST_P(RmsNormBackwardTest, RandomShapesAndStrides) {
  const int cases = case_count(30, 10);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    BackwardCase bc = random_case(rng, c);
    bc.weight_offset = offset();
    run_backward(rng, false, dtype(), weight_kind(), bc);
  }
}

// The fused add's backward: dx = norm's dx + dx_addend, in one pass.
TEST_P(RmsNormBackwardTest, DxAddend) {
  const int cases = case_count(24, 9);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    BackwardCase bc = with_addend(rng, random_case(rng, c), c);
    bc.weight_offset = offset();
    run_backward(rng, false, dtype(), weight_kind(), bc);
  }
}

TEST_P(RmsNormBackwardTest, DxAddendEverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 40; ++cols) {
    const BackwardCase bc = with_addend(rng, small_width_case(cols), static_cast<int>(cols));
    run_backward(rng, false, dtype(), weight_kind(), bc);
  }
}

TEST_P(RmsNormBackwardTest, EverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 70; ++cols) {
    run_backward(rng, false, dtype(), weight_kind(), small_width_case(cols));
  }
}

// Few long rows with several threads take the split-row path.
TEST_P(RmsNormBackwardTest, LongRowsSplitAcrossThreads) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t rows : {1, 2}) {
    BackwardCase bc;
    bc.rows = rows;
    bc.cols = 3 * 65536 + 17;
    bc.x_stride = bc.dy_stride = bc.dx_stride = bc.cols;
    bc.weight_offset = offset();
    bc.threads = 4;
    bc.given_stats = rows == 1;
    run_backward(rng, false, dtype(), weight_kind(), bc);
    run_backward(rng, false, dtype(), weight_kind(), with_addend(rng, bc, static_cast<int>(rows)));
  }
}

TEST_P(RmsNormBackwardTest, ZeroRowsZeroesDw) {
  Rng rng(seed_for(current_test_name(), 0));
  const Buffer w = make_weight(weight_kind(), dtype(), 13, rng, 1.0);
  Buffer x(dtype(), 0, 13), dy(dtype(), 0, 13), dx(dtype(), 0, 13);
  // No weight: no dw either; the call is a pure no-op.
  Buffer dw = w.empty() ? Buffer() : Buffer::vector_of(w.dtype(), 13);
  const auto dx_before = dx.snapshot();
  RmsNormOptions options;
  options.weight_offset = offset();
  rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), view_of(w), nullptr, dx.matrix(),
                    mutable_view_of(dw), options);
  if (!dw.empty()) {
    EXPECT_TRUE(dw.check_written("dw"));
    for (std::int64_t j = 0; j < 13; ++j) EXPECT_EQ(dw.at(j), 0.0) << j;
  }
  EXPECT_TRUE(dx.check_unchanged("dx", dx_before));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, RmsNormBackwardTest, all_rms_variants(), rms_variant_name);
INSTANTIATE_TEST_SUITE_P(Float64, RmsNormBackwardTest, float64_rms_variants(), rms_variant_name);

// ---- LayerNorm ----------------------------------------------------------------------------

using LayerBackwardParam = std::tuple<DType, WeightKind>;

class LayerNormBackwardTest : public ::testing::TestWithParam<LayerBackwardParam> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  WeightKind weight_kind() const { return std::get<1>(GetParam()); }
};

TEST_P(LayerNormBackwardTest, RandomShapesAndStrides) {
  const int cases = case_count(30, 10);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    BackwardCase bc = random_case(rng, c);
    bc.eps = 1e-5f;
    run_backward(rng, true, dtype(), weight_kind(), bc);
  }
}

TEST_P(LayerNormBackwardTest, EverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 70; ++cols) {
    BackwardCase bc;
    bc.rows = 5;
    bc.cols = cols;
    bc.x_stride = cols;
    bc.dy_stride = cols + 3;
    bc.dx_stride = cols + 1;
    bc.given_stats = cols % 2 == 1;
    bc.eps = 1e-5f;
    bc.threads = 1;
    run_backward(rng, true, dtype(), weight_kind(), bc);
  }
}

TEST_P(LayerNormBackwardTest, LongRowsSplitAcrossThreads) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t rows : {1, 2}) {
    BackwardCase bc;
    bc.rows = rows;
    bc.cols = 3 * 65536 + 17;
    bc.x_stride = bc.dy_stride = bc.dx_stride = bc.cols;
    bc.eps = 1e-5f;
    bc.threads = 4;
    bc.given_stats = rows == 2;
    run_backward(rng, true, dtype(), weight_kind(), bc);
  }
}

TEST_P(LayerNormBackwardTest, ZeroRowsZeroesDwAndDb) {
  Rng rng(seed_for(current_test_name(), 0));
  const Buffer w = make_weight(weight_kind(), dtype(), 21, rng, 1.0);
  Buffer x(dtype(), 0, 21), dy(dtype(), 0, 21);
  const DType grad_dtype = weight_dtype(weight_kind(), dtype());
  Buffer dw = w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, 21);
  Buffer db = Buffer::vector_of(grad_dtype, 21);
  layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), view_of(w), nullptr, nullptr, {},
                      mutable_view_of(dw), db.vector());
  for (Buffer* g : {&dw, &db}) {
    if (g->empty()) continue;
    EXPECT_TRUE(g->check_written("dw/db"));
    for (std::int64_t j = 0; j < 21; ++j) EXPECT_EQ(g->at(j), 0.0) << j;
  }
}

std::string layer_backward_name(const ::testing::TestParamInfo<LayerBackwardParam>& info) {
  return dtype_str(std::get<0>(info.param)) + "_w_" + weight_kind_str(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, LayerNormBackwardTest,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::Values(WeightKind::kNone,
                                                              WeightKind::kSame,
                                                              WeightKind::kFloat32)),
                         layer_backward_name);
INSTANTIATE_TEST_SUITE_P(Float64, LayerNormBackwardTest,
                         ::testing::Combine(::testing::Values(DType::kFloat64),
                                            ::testing::Values(WeightKind::kNone,
                                                              WeightKind::kSame)),
                         layer_backward_name);

// The workspace the caller passes is exactly what backward_workspace_bytes says; the
// results do not depend on whether it is given.
TEST(BackwardWorkspace, GivenOrOwnedGiveIdenticalBits) {
  Rng rng(seed_for(current_test_name(), 0));
  const std::int64_t rows = 301, cols = 517;
  Buffer x(DType::kBFloat16, rows, cols), dy(DType::kBFloat16, rows, cols);
  fill_activations(x, rng, true);
  fill_activations(dy, rng, false);
  const Buffer w = make_weight(WeightKind::kFloat32, DType::kBFloat16, cols, rng, 1.0);
  Context ctx;
  ctx.num_threads = 2;
  const std::size_t bytes = backward_workspace_bytes(ctx, rows, cols);
  ASSERT_GE(bytes, static_cast<std::size_t>(2 * cols * 4));
  Buffer workspace = Buffer::floats(static_cast<std::int64_t>(bytes / 4));
  ASSERT_EQ(bytes % 4, 0u);
  std::vector<std::uint64_t> results[2];
  for (int given = 0; given < 2; ++given) {
    Buffer dx(DType::kBFloat16, rows, cols);
    Buffer dw = Buffer::vector_of(DType::kFloat32, cols), db = Buffer::vector_of(DType::kFloat32, cols);
    layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                        dx.matrix(), dw.vector(), db.vector(), {},
                        given ? Workspace{workspace.data(), bytes} : Workspace{});
    EXPECT_TRUE(workspace.check_guards("workspace"));
    std::vector<std::uint64_t> all = dx.snapshot();
    for (const Buffer* b : {&dw, &db}) {
      const auto s = b->snapshot();
      all.insert(all.end(), s.begin(), s.end());
    }
    results[given] = all;
  }
  EXPECT_EQ(results[0], results[1]);
}

}  // namespace
}  // namespace fusednorm::test
