// layer_norm against the fp64 reference: every dtype x weight variant x bias variant, with
// mean and rstd outputs, random seeded shapes and strides, poisoned outputs.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "test_util.h"

namespace fusednorm::test {
namespace {

using LayerParam = std::tuple<DType, WeightKind, WeightKind /*bias*/>;

class LayerNormTest : public ::testing::TestWithParam<LayerParam> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  WeightKind weight_kind() const { return std::get<1>(GetParam()); }
  WeightKind bias_kind() const { return std::get<2>(GetParam()); }

  void run_case(Rng& rng, std::int64_t rows, std::int64_t cols, std::int64_t x_stride,
                std::int64_t y_stride, bool in_place, bool want_stats, float eps, int threads) {
    SCOPED_TRACE(::testing::Message() << "rows " << rows << ", D " << cols << ", strides "
                                      << x_stride << "/" << y_stride << ", in_place "
                                      << in_place << ", eps " << eps << ", threads " << threads);
    Buffer x(dtype(), rows, cols, x_stride);
    fill_activations(x, rng, /*with_center=*/true);
    const Buffer w = make_weight(weight_kind(), dtype(), cols, rng, 1.0);
    const Buffer b = make_weight(bias_kind(), dtype(), cols, rng, 0.0);
    Buffer y(dtype(), rows, cols, in_place ? x_stride : y_stride);
    Buffer mean = Buffer::floats(rows), rstd = Buffer::floats(rows);
    const auto x_before = x.snapshot();
    const auto stats_before = mean.snapshot();

    LayerNormOptions options;
    options.eps = eps;
    const reference::ForwardResult ref =
        reference::layer_norm(x.cmatrix(), view_of(w), view_of(b), options);
    // Error scale of a row: the normalized, weighted term and the bias, each rounded.
    const reference::ForwardResult unbiased =
        reference::layer_norm(x.cmatrix(), view_of(w), {}, options);
    std::vector<double> scale(static_cast<std::size_t>(rows), 0.0), x_scale(scale);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const double bias = b.empty() ? 0.0 : b.at(j);
        scale[r] = std::max(scale[r], std::fabs(unbiased.y[r * cols + j]) + std::fabs(bias));
        x_scale[r] = std::max(x_scale[r], std::fabs(x.at(r, j)));
      }
    }

    Context ctx;
    ctx.num_threads = threads;
    Buffer& out = in_place ? x : y;
    layer_norm(ctx, x.cmatrix(), view_of(w), view_of(b), out.matrix(),
               want_stats ? mean.float_data() : nullptr, want_stats ? rstd.float_data() : nullptr,
               options);

    EXPECT_TRUE(out.check_written("y"));
    EXPECT_TRUE(compare("layer_norm y " + dtype_str(dtype()), out, ref.y, scale,
                        tolerance(dtype()), absolute_floor(dtype())));
    if (want_stats) {
      EXPECT_TRUE(mean.check_written("mean"));
      EXPECT_TRUE(rstd.check_written("rstd"));
      EXPECT_TRUE(compare_stats("layer_norm mean", mean.float_data(), ref.mean, x_scale,
                                tolerance(DType::kFloat32)));
      EXPECT_TRUE(compare_stats("layer_norm rstd", rstd.float_data(), ref.rstd, ref.rstd,
                                tolerance(DType::kFloat32)));
    } else {
      EXPECT_TRUE(mean.check_unchanged("mean (not requested)", stats_before));
      EXPECT_TRUE(rstd.check_unchanged("rstd (not requested)", stats_before));
    }
    if (!in_place) {
      EXPECT_TRUE(x.check_unchanged("x", x_before));
    }
  }
};

TEST_P(LayerNormTest, RandomShapesAndStrides) {
  const int cases = case_count(30, 10);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 150000) rows /= 2;
    const std::int64_t x_stride = random_stride(rng, cols);
    const float eps_choices[] = {1e-5f, 1e-6f, 1e-12f, 0.0f};
    const int thread_choices[] = {0, 1, 2, 3};
    run_case(rng, rows, cols, x_stride, random_stride(rng, cols), c % 5 == 4, c % 3 != 2,
             eps_choices[c % 4], thread_choices[(c / 4) % 4]);
  }
}

TEST_P(LayerNormTest, EverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 80; ++cols) {
    run_case(rng, 3, cols, cols + 3, cols, false, true, 1e-5f, 1);
  }
}

TEST_P(LayerNormTest, ChunkBoundaries) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t cols : {4095, 4096, 4097, 8193, 3 * 4096 + 5}) {
    run_case(rng, 2, cols, cols + 1, cols, false, true, 1e-5f, 2);
  }
}

TEST_P(LayerNormTest, ZeroRowsIsANoOp) {
  Rng rng(seed_for(current_test_name(), 0));
  Buffer x(dtype(), 0, 11), y(dtype(), 0, 11);
  const Buffer w = make_weight(weight_kind(), dtype(), 11, rng, 1.0);
  const Buffer b = make_weight(bias_kind(), dtype(), 11, rng, 0.0);
  Buffer stats = Buffer::floats(2);
  const auto y_before = y.snapshot();
  const auto stats_before = stats.snapshot();
  EXPECT_NO_THROW(layer_norm({}, x.cmatrix(), view_of(w), view_of(b), y.matrix(),
                             stats.float_data(), stats.float_data() + 1));
  EXPECT_TRUE(y.check_unchanged("y", y_before));
  EXPECT_TRUE(stats.check_unchanged("mean/rstd", stats_before));
}

std::string layer_param_name(const ::testing::TestParamInfo<LayerParam>& info) {
  return dtype_str(std::get<0>(info.param)) + "_w_" + weight_kind_str(std::get<1>(info.param)) +
         "_b_" + weight_kind_str(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    AllVariants, LayerNormTest,
    ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                       ::testing::Values(WeightKind::kNone, WeightKind::kSame,
                                         WeightKind::kFloat32),
                       ::testing::Values(WeightKind::kNone, WeightKind::kSame,
                                         WeightKind::kFloat32)),
    layer_param_name);
INSTANTIATE_TEST_SUITE_P(Float64, LayerNormTest,
                         ::testing::Combine(::testing::Values(DType::kFloat64),
                                            ::testing::Values(WeightKind::kNone, WeightKind::kSame),
                                            ::testing::Values(WeightKind::kNone,
                                                              WeightKind::kSame)),
                         layer_param_name);

}  // namespace
}  // namespace fusednorm::test
