// fused_add_rms_norm: residual <- x + residual in place (compared bit-exactly with the
// reference's rounded residual), y = rms_norm(residual) against the fp64 reference.
#include "test_util.h"

namespace fusednorm::test {
namespace {

class FusedAddTest : public RmsVariantTest {
 protected:
  void run_case(Rng& rng, std::int64_t rows, std::int64_t cols, std::int64_t x_stride,
                std::int64_t residual_stride, std::int64_t y_stride, bool in_place, bool want_rstd,
                float eps, int threads) {
    SCOPED_TRACE(::testing::Message()
                 << "rows " << rows << ", D " << cols << ", strides " << x_stride << "/"
                 << residual_stride << "/" << y_stride << ", y == x " << in_place << ", eps " << eps
                 << ", threads " << threads);
    Buffer x(dtype(), rows, cols, x_stride);
    Buffer residual(dtype(), rows, cols, residual_stride);
    fill_activations(x, rng, false);
    fill_activations(residual, rng, false);
    const Buffer w = make_weight(weight_kind(), dtype(), cols, rng, offset() != 0.0f ? 0.0 : 1.0);
    Buffer y(dtype(), rows, cols, in_place ? x_stride : y_stride);
    Buffer rstd = Buffer::floats(rows);
    const auto x_before = x.snapshot();
    const auto rstd_before = rstd.snapshot();

    RmsNormOptions options;
    options.eps = eps;
    options.weight_offset = offset();
    const reference::ForwardResult ref =
        reference::fused_add_rms_norm(x.cmatrix(), residual.cmatrix(), view_of(w), options);

    Context ctx;
    ctx.num_threads = threads;
    Buffer& out = in_place ? x : y;
    fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), view_of(w), out.matrix(),
                       want_rstd ? rstd.float_data() : nullptr, options);

    EXPECT_TRUE(residual.check_written("residual"));
    // The stored residual is x + residual in fp32, rounded once: exact.
    EXPECT_TRUE(compare("fused_add residual " + dtype_str(dtype()), residual, ref.residual,
                        std::vector<double>(static_cast<std::size_t>(rows), 0.0), 0.0));
    EXPECT_TRUE(out.check_written("y"));
    EXPECT_TRUE(compare("fused_add y " + dtype_str(dtype()), out, ref.y,
                        row_max_abs(ref.y, rows, cols), tolerance(dtype()),
                        absolute_floor(dtype())));
    if (want_rstd) {
      EXPECT_TRUE(rstd.check_written("rstd"));
      EXPECT_TRUE(compare_stats("fused_add rstd", rstd.float_data(), ref.rstd, ref.rstd,
                                tolerance(DType::kFloat32)));
    } else {
      EXPECT_TRUE(rstd.check_unchanged("rstd (not requested)", rstd_before));
    }
    if (!in_place) {
      EXPECT_TRUE(x.check_unchanged("x", x_before));
    }
    // rms_norm of the stored residual gives the same bits: the fused add sums the squares
    // of what it stored in rms_norm's order (a user may norm the residual again).
    Buffer y_again(dtype(), rows, cols, cols);
    Buffer rstd_again = Buffer::floats(rows);
    rms_norm(ctx, residual.cmatrix(), view_of(w), y_again.matrix(), rstd_again.float_data(),
             options);
    for (std::int64_t r = 0; r < rows; ++r) {
      if (want_rstd) {
        ASSERT_EQ(detail::float_bits(rstd.float_data()[r]),
                  detail::float_bits(rstd_again.float_data()[r]))
            << "rstd of row " << r;
      }
      for (std::int64_t j = 0; j < cols; ++j) {
        ASSERT_EQ(out.at(r, j), y_again.at(r, j)) << "y[" << r << ", " << j << "]";
      }
    }
  }
};

TEST_P(FusedAddTest, RandomShapesAndStrides) {
  const int cases = case_count(40, 12);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 150000) rows /= 2;
    const std::int64_t xs = random_stride(rng, cols), rs = random_stride(rng, cols);
    const float eps_choices[] = {1e-6f, 1e-5f, 1e-12f, 0.0f};
    const int thread_choices[] = {0, 1, 2, 3};
    run_case(rng, rows, cols, xs, rs, random_stride(rng, cols), c % 5 == 4, c % 3 != 2,
             eps_choices[c % 4], thread_choices[(c / 4) % 4]);
  }
}

TEST_P(FusedAddTest, EverySmallWidth) {
  Rng rng(seed_for(current_test_name(), 0));
  for (std::int64_t cols = 1; cols <= 80; ++cols) {
    run_case(rng, 3, cols, cols, cols + 5, cols + 2, cols % 2 == 0, true, 1e-6f, 1);
  }
}

TEST_P(FusedAddTest, ChunkBoundaries) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t cols : {4095, 4096, 4097, 8193, 3 * 4096 + 5}) {
    run_case(rng, 2, cols, cols, cols + 1, cols + 3, false, true, 1e-6f, 2);
  }
}

TEST_P(FusedAddTest, ZeroRowsIsANoOp) {
  Buffer x(dtype(), 0, 9), residual(dtype(), 0, 9), y(dtype(), 0, 9);
  const auto residual_before = residual.snapshot();
  const auto y_before = y.snapshot();
  EXPECT_NO_THROW(fused_add_rms_norm({}, x.cmatrix(), residual.matrix(), {}, y.matrix(), nullptr));
  EXPECT_TRUE(residual.check_unchanged("residual", residual_before));
  EXPECT_TRUE(y.check_unchanged("y", y_before));
  EXPECT_NO_THROW(fused_add_rms_norm({}, const_matrix(nullptr, dtype(), 0, 9),
                                     matrix(nullptr, dtype(), 0, 9), {},
                                     matrix(nullptr, dtype(), 0, 9), nullptr));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, FusedAddTest, all_rms_variants(), rms_variant_name);
INSTANTIATE_TEST_SUITE_P(Float64, FusedAddTest, float64_rms_variants(), rms_variant_name);

}  // namespace
}  // namespace fusednorm::test
