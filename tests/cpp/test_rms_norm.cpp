// rms_norm against the fp64 reference: random seeded shapes and strides for every dtype x
// weight variant x weight_offset, with poisoned outputs and guard checks.
#include "test_util.h"

namespace fusednorm::test {
namespace {

class RmsNormTest : public RmsVariantTest {
 protected:
  // One call on a rows x cols problem; in_place writes y over x.
  void run_case(Rng& rng, std::int64_t rows, std::int64_t cols, std::int64_t x_stride,
                std::int64_t y_stride, bool in_place, bool want_rstd, float eps, int threads) {
    SCOPED_TRACE(::testing::Message() << "rows " << rows << ", D " << cols << ", strides "
                                      << x_stride << "/" << y_stride << ", in_place "
                                      << in_place << ", eps " << eps << ", threads " << threads);
    Buffer x(dtype(), rows, cols, x_stride);
    fill_activations(x, rng, false);
    // Gemma's weights are centred on 0 (applied as 1 + w), Llama's on 1.
    const Buffer w = make_weight(weight_kind(), dtype(), cols, rng, offset() != 0.0f ? 0.0 : 1.0);
    Buffer y(dtype(), rows, cols, in_place ? x_stride : y_stride);
    Buffer rstd = Buffer::floats(rows);
    const auto x_before = x.snapshot();
    const auto w_before = w.snapshot();
    const auto rstd_before = rstd.snapshot();

    RmsNormOptions options;
    options.eps = eps;
    options.weight_offset = offset();
    const reference::ForwardResult ref = reference::rms_norm(x.cmatrix(), view_of(w), options);

    Context ctx;
    ctx.num_threads = threads;
    Buffer& out = in_place ? x : y;
    rms_norm(ctx, x.cmatrix(), view_of(w), out.matrix(), want_rstd ? rstd.float_data() : nullptr,
             options);

    const std::string label = "rms_norm y " + dtype_str(dtype());
    EXPECT_TRUE(out.check_written("y"));
    EXPECT_TRUE(compare(label, out, ref.y, row_max_abs(ref.y, rows, cols), tolerance(dtype()),
                        absolute_floor(dtype())));
    if (want_rstd) {
      EXPECT_TRUE(rstd.check_written("rstd"));
      EXPECT_TRUE(compare_stats("rms_norm rstd", rstd.float_data(), ref.rstd, ref.rstd,
                                tolerance(DType::kFloat32)));
    } else {
      EXPECT_TRUE(rstd.check_unchanged("rstd (not requested)", rstd_before));
    }
    if (!in_place) {
      EXPECT_TRUE(x.check_unchanged("x", x_before));
    }
    EXPECT_TRUE(w.check_unchanged("weight", w_before));
  }
};

TEST_P(RmsNormTest, RandomShapesAndStrides) {
  const int cases = case_count(40, 12);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 150000) rows /= 2;
    const std::int64_t x_stride = random_stride(rng, cols);
    const float eps_choices[] = {1e-6f, 1e-5f, 1e-12f, 0.0f};
    const int thread_choices[] = {0, 1, 2, 3};
    run_case(rng, rows, cols, x_stride, random_stride(rng, cols), /*in_place=*/c % 5 == 4,
             /*want_rstd=*/c % 3 != 2, eps_choices[c % 4], thread_choices[(c / 4) % 4]);
  }
}

// Every D from 1 to 80 (all vector-tail lengths of every target), and a few rows each.
TEST_P(RmsNormTest, EverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 80; ++cols) {
    run_case(rng, 3, cols, cols + 3, cols, false, true, 1e-6f, 1);
  }
}

// Around the 4096-element reduction chunk (kReduceChunk) and its multiples.
TEST_P(RmsNormTest, ChunkBoundaries) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t cols : {4095, 4096, 4097, 8191, 8192, 8193, 3 * 4096 + 5}) {
    run_case(rng, 2, cols, cols + 1, cols, false, true, 1e-6f, 2);
  }
}

TEST_P(RmsNormTest, ZeroRowsIsANoOp) {
  Rng rng(seed_for(current_test_name(), 0));
  Buffer x(dtype(), 0, 19);
  const Buffer w = make_weight(weight_kind(), dtype(), 19, rng, 1.0);
  Buffer y(dtype(), 0, 19);
  Buffer rstd = Buffer::floats(1);  // room for one, none may be written
  const auto y_before = y.snapshot();
  const auto rstd_before = rstd.snapshot();
  RmsNormOptions options;
  options.weight_offset = offset();
  EXPECT_NO_THROW(rms_norm({}, x.cmatrix(), view_of(w), y.matrix(), rstd.float_data(), options));
  EXPECT_TRUE(y.check_unchanged("y", y_before));
  EXPECT_TRUE(rstd.check_unchanged("rstd", rstd_before));
  // With no rows, data pointers may be null.
  EXPECT_NO_THROW(rms_norm({}, const_matrix(nullptr, dtype(), 0, 19), view_of(w),
                           matrix(nullptr, dtype(), 0, 19), nullptr, options));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, RmsNormTest, all_rms_variants(), rms_variant_name);
INSTANTIATE_TEST_SUITE_P(Float64, RmsNormTest, float64_rms_variants(), rms_variant_name);

}  // namespace
}  // namespace fusednorm::test
