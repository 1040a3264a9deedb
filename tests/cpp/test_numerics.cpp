// Numerical guarantees: fp16 inputs up to +-65504 do not overflow, eps is added in fp32
// (1e-12 works with fp16 data), an all-zero row gives zeros when eps > 0, NaN / Inf stay in
// their row, Gemma's offset, constant rows in LayerNorm.
#include <cmath>
#include <limits>

#include "test_util.h"

namespace fusednorm::test {
namespace {

enum class Op { kRms, kFusedAdd, kLayer };
constexpr Op kAllOps[] = {Op::kRms, Op::kFusedAdd, Op::kLayer};

const char* op_name(Op op) {
  switch (op) {
    case Op::kRms: return "rms_norm";
    case Op::kFusedAdd: return "fused_add_rms_norm";
    case Op::kLayer: return "layer_norm";
  }
  return "";
}

// One forward call of `op` on x (for the fused add: x + residual), checked against the
// reference with the usual tolerance, NaN for NaN and Inf for Inf. Returns y.
Buffer forward_checked(Op op, const Buffer& x, Buffer* residual, const Buffer& w,
                       const Buffer& b, float eps, int threads, Buffer* rstd_out = nullptr) {
  const DType dtype = x.dtype();
  const std::int64_t rows = x.rows(), cols = x.cols();
  Buffer y(dtype, rows, cols);
  Buffer rstd = Buffer::floats(rows), mean = Buffer::floats(rows);
  Context ctx;
  ctx.num_threads = threads;
  reference::ForwardResult ref;
  std::vector<double> scale;
  if (op == Op::kLayer) {
    LayerNormOptions options;
    options.eps = eps;
    ref = reference::layer_norm(x.cmatrix(), view_of(w), view_of(b), options);
    const auto unbiased = reference::layer_norm(x.cmatrix(), view_of(w), {}, options).y;
    scale = row_max_abs(unbiased, rows, cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < cols && !b.empty(); ++j) {
        if (std::isfinite(scale[r])) scale[r] = std::max(scale[r], std::fabs(unbiased[r * cols + j]) + std::fabs(b.at(j)));
      }
    }
    layer_norm(ctx, x.cmatrix(), view_of(w), view_of(b), y.matrix(), mean.float_data(),
               rstd.float_data(), options);
  } else {
    RmsNormOptions options;
    options.eps = eps;
    if (op == Op::kFusedAdd) {
      ref = reference::fused_add_rms_norm(x.cmatrix(), residual->cmatrix(), view_of(w), options);
      fused_add_rms_norm(ctx, x.cmatrix(), residual->matrix(), view_of(w), y.matrix(),
                         rstd.float_data(), options);
      EXPECT_TRUE(compare("numerics residual", *residual, ref.residual,
                          std::vector<double>(static_cast<std::size_t>(rows), 0.0), 0.0));
    } else {
      ref = reference::rms_norm(x.cmatrix(), view_of(w), options);
      rms_norm(ctx, x.cmatrix(), view_of(w), y.matrix(), rstd.float_data(), options);
    }
    scale = row_max_abs(ref.y, rows, cols);
  }
  // A NaN row has a NaN scale: the NaN reference decides those elements anyway.
  for (double& s : scale) {
    if (!std::isfinite(s)) s = 0.0;
  }
  EXPECT_TRUE(y.check_written("y"));
  EXPECT_TRUE(compare(std::string("numerics ") + op_name(op) + " y " + dtype_str(dtype), y, ref.y,
                      scale, tolerance(dtype), absolute_floor(dtype)));
  if (rstd_out != nullptr) *rstd_out = rstd;
  return y;
}

bool row_finite(const Buffer& b, std::int64_t r) {
  for (std::int64_t j = 0; j < b.cols(); ++j) {
    if (!std::isfinite(b.at(r, j))) return false;
  }
  return true;
}

// ---- fp16 range ------------------------------------------------------------------------------

TEST(Numerics, Fp16MaxMagnitudeDoesNotOverflow) {
  constexpr double kMax = 65504.0;
  for (const std::int64_t cols : {std::int64_t{1000}, std::int64_t{65536}}) {
    SCOPED_TRACE(cols);
    Rng rng(seed_for(current_test_name(), static_cast<int>(cols)));
    std::uniform_int_distribution<int> coin(0, 1);
    Buffer x(DType::kFloat16, 4, cols);
    x.fill([&](std::int64_t r, std::int64_t j) {
      switch (r) {
        case 0: return kMax;
        case 1: return -kMax;
        case 2: return j % 2 ? kMax : -kMax;
        default: return coin(rng) ? kMax : std::normal_distribution<double>(0, 1000)(rng);
      }
    });
    Buffer w = Buffer::vector_of(DType::kFloat16, cols);
    fill_normal(w, rng, 1.0, 0.25);
    const Buffer b = make_weight(WeightKind::kSame, DType::kFloat16, cols, rng, 0.0);
    for (const Op op : {Op::kRms, Op::kLayer}) {
      SCOPED_TRACE(op_name(op));
      const Buffer y = forward_checked(op, x, nullptr, w, b, 1e-6f, 0);
      for (std::int64_t r = 0; r < 4; ++r) EXPECT_TRUE(row_finite(y, r)) << "row " << r;
    }
    // Without a weight, a constant +-65504 row normalizes to exactly +-1.
    const Buffer y = forward_checked(Op::kRms, x, nullptr, {}, {}, 1e-6f, 0);
    for (std::int64_t j = 0; j < cols; j += 97) {
      EXPECT_EQ(y.at(0, j), 1.0);
      EXPECT_EQ(y.at(1, j), -1.0);
    }
    // The fused add reaching 65504 exactly: 32752 + 32752.
    Buffer half_x(DType::kFloat16, 2, cols), residual(DType::kFloat16, 2, cols);
    half_x.fill([](std::int64_t r, std::int64_t) { return r == 0 ? 32752.0 : -32752.0; });
    residual.fill([](std::int64_t r, std::int64_t) { return r == 0 ? 32752.0 : -32752.0; });
    const Buffer fused = forward_checked(Op::kFusedAdd, half_x, &residual, w, {}, 1e-6f, 0);
    EXPECT_EQ(residual.at(0, 0), kMax);
    EXPECT_EQ(residual.at(1, cols - 1), -kMax);
    EXPECT_TRUE(row_finite(fused, 0) && row_finite(fused, 1));
  }
}

TEST(Numerics, Fp16MaxMagnitudeBackward) {
  constexpr double kMax = 65504.0;
  const std::int64_t rows = 3, cols = 777;
  Rng rng(seed_for(current_test_name(), 0));
  Buffer x(DType::kFloat16, rows, cols), dy(DType::kFloat16, rows, cols);
  x.fill([](std::int64_t r, std::int64_t j) { return (r + j) % 3 ? kMax : -kMax; });
  fill_normal(dy, rng, 0.0, 1.0);
  const Buffer w = make_weight(WeightKind::kFloat32, DType::kFloat16, cols, rng, 1.0);
  for (const bool centered : {false, true}) {
    Buffer dx(DType::kFloat16, rows, cols);
    Buffer dw = Buffer::vector_of(DType::kFloat32, cols);
    reference::BackwardResult ref;
    if (centered) {
      layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                          dx.matrix(), dw.vector(), {});
      ref = reference::layer_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector(), false);
    } else {
      rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        dw.vector());
      ref = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector());
    }
    // xhat = +-1 here, so dx ~ dy * w / 65504: compare against the row's g-scale.
    std::vector<double> scale(rows, 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < cols; ++j) {
        scale[r] = std::max(scale[r], std::fabs(dy.at(r, j) * w.at(j)) / kMax);
      }
      scale[r] = std::max(scale[r], row_max_abs(ref.dx, rows, cols)[r]);
    }
    EXPECT_TRUE(compare("numerics fp16 max dx", dx, ref.dx, scale, tolerance(DType::kFloat16),
                        absolute_floor(DType::kFloat16)));
    for (std::int64_t j = 0; j < cols; ++j) ASSERT_TRUE(std::isfinite(dw.at(j))) << j;
  }
}

// ---- eps ----------------------------------------------------------------------------------------

// eps = 1e-12 is 0 in fp16 (and far below bf16's resolution at 1): it must be added in
// fp32. Rows of zeros and of the smallest subnormal make the difference visible: with eps
// rounded away, a subnormal row would normalize to 1 instead of ~0.06.
TEST(Numerics, TinyEpsWithHalfPrecisionData) {
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_str(dtype));
    const double smallest = dtype == DType::kFloat16 ? 0x1p-24 : 0x1p-133;
    Rng rng(seed_for(current_test_name(), static_cast<int>(dtype)));
    const std::int64_t rows = 4, cols = 67;
    Buffer x(dtype, rows, cols);
    std::normal_distribution<double> normal(0.0, 1.0);
    x.fill([&](std::int64_t r, std::int64_t) {
      switch (r) {
        case 0: return 0.0;
        case 1: return smallest;
        case 2: return 1e-4 * normal(rng);
        default: return normal(rng);
      }
    });
    const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
    const Buffer b = make_weight(WeightKind::kSame, dtype, cols, rng, 0.0);
    Buffer rstd;
    const Buffer y = forward_checked(Op::kRms, x, nullptr, w, {}, 1e-12f, 1, &rstd);
    EXPECT_FLOAT_EQ(rstd.float_data()[0], 1.0f / std::sqrt(1e-12f));
    for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(y.at(0, j), 0.0) << j;
    if (dtype == DType::kFloat16) {
      // 2^-24 / sqrt(2^-48 + 1e-12) = 0.0596...: eps was not lost.
      EXPECT_NEAR(y.at(1, 0) / w.at(0), 0x1p-24 / std::sqrt(0x1p-48 + double{1e-12f}), 1e-3);
    }
    forward_checked(Op::kLayer, x, nullptr, w, b, 1e-12f, 1);
    Buffer residual(dtype, rows, cols);
    residual.fill([](std::int64_t, std::int64_t) { return 0.0; });
    forward_checked(Op::kFusedAdd, x, &residual, w, {}, 1e-12f, 1);
  }
}

// ---- zero rows ----------------------------------------------------------------------------------

TEST(Numerics, AllZeroRowGivesZerosWhenEpsPositive) {
  for (const DType dtype : kAllDTypes) {
    for (const float eps : {1e-12f, 1e-6f, 1e-5f}) {
      SCOPED_TRACE(::testing::Message() << dtype_str(dtype) << ", eps " << eps);
      Rng rng(seed_for(current_test_name(), static_cast<int>(dtype)));
      const std::int64_t rows = 3, cols = 4099;
      Buffer x(dtype, rows, cols);
      std::normal_distribution<double> normal(0.0, 1.0);
      x.fill([&](std::int64_t r, std::int64_t) { return r == 1 ? 0.0 : normal(rng); });
      const Buffer w = make_weight(WeightKind::kFloat32, dtype, cols, rng, 1.0);
      const Buffer b = make_weight(WeightKind::kSame, dtype, cols, rng, 0.0);
      for (const Op op : kAllOps) {
        SCOPED_TRACE(op_name(op));
        Buffer residual(dtype, rows, cols);
        residual.fill([&](std::int64_t r, std::int64_t) { return r == 1 ? 0.0 : normal(rng); });
        const Buffer y = forward_checked(op, x, &residual, w, b, eps, 2);
        for (std::int64_t j = 0; j < cols; ++j) {
          // LayerNorm of a zero row is exactly its bias.
          const double expected = op == Op::kLayer ? b.at(j) : 0.0;
          ASSERT_EQ(y.at(1, j), expected) << "column " << j;
        }
      }
      // The backward of a zero row: xhat = 0 there, so dx = rstd * (g - mean_g) with
      // rstd = 1/sqrt(eps), which may exceed the dtype's range (1e6 for eps = 1e-12): then
      // Inf of the right sign, as storing the exact value would give.
      Buffer dy(dtype, rows, cols), dx(dtype, rows, cols);
      fill_normal(dy, rng, 0.0, 1.0);
      for (const bool centered : {false, true}) {
        reference::BackwardResult ref;
        if (centered) {
          LayerNormOptions ln;
          ln.eps = eps;
          layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                              dx.matrix(), {}, {}, ln);
          ref = reference::layer_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector(), false, ln);
        } else {
          RmsNormOptions options;
          options.eps = eps;
          rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(), {},
                            options);
          ref = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector(), options);
        }
        const double scale = row_max_abs(ref.dx, rows, cols)[1];
        for (std::int64_t j = 0; j < cols; ++j) {
          const double expected = ref.dx[cols + j];
          const double stored = detail::round_to_dtype(static_cast<float>(expected), dtype);
          if (std::isinf(stored)) {
            ASSERT_EQ(dx.at(1, j), stored) << "column " << j;
          } else {
            ASSERT_NEAR(dx.at(1, j), expected, tolerance(dtype) * scale) << "column " << j;
          }
        }
      }
    }
  }
}

// ---- NaN / Inf isolation ------------------------------------------------------------------------

// A NaN or Inf poisons its own row and nothing else, on the row path and on the split-row
// path (few long rows across threads).
TEST(Numerics, NanAndInfStayInTheirRow) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  struct Shape {
    std::int64_t rows, cols;
    int threads;
  };
  for (const DType dtype : kAllDTypes) {
    for (const Shape s : {Shape{6, 301, 3}, Shape{3, 1 << 17, 4}}) {
      SCOPED_TRACE(::testing::Message() << dtype_str(dtype) << ", " << s.rows << " x " << s.cols
                                        << ", threads " << s.threads);
      Rng rng(seed_for(current_test_name(), static_cast<int>(dtype)));
      const std::int64_t nan_row = 0, inf_row = s.rows - 1;
      Buffer x(dtype, s.rows, s.cols);
      std::normal_distribution<double> normal(0.0, 1.0);
      x.fill([&](std::int64_t r, std::int64_t j) {
        if (r == nan_row && j == 7) return kNaN;
        if (r == inf_row && j == s.cols - 1) return j % 2 ? kInf : -kInf;  // in the vector tail
        return normal(rng);
      });
      const Buffer w = make_weight(WeightKind::kSame, dtype, s.cols, rng, 1.0);
      const Buffer b = make_weight(WeightKind::kFloat32, dtype, s.cols, rng, 0.0);
      for (const Op op : kAllOps) {
        SCOPED_TRACE(op_name(op));
        Buffer residual(dtype, s.rows, s.cols);
        fill_normal(residual, rng, 0.0, 1.0);
        const Buffer y = forward_checked(op, x, &residual, w, b, 1e-6f, s.threads);
        for (std::int64_t r = 0; r < s.rows; ++r) {
          if (r != nan_row && r != inf_row) {
            EXPECT_TRUE(row_finite(y, r)) << "row " << r;
          }
        }
        EXPECT_TRUE(std::isnan(y.at(nan_row, 0)));
      }
      // Backward: dx of the other rows is untouched by the bad rows (dw sums every row, so
      // it is NaN by definition).
      Buffer dy(dtype, s.rows, s.cols), dx(dtype, s.rows, s.cols);
      fill_normal(dy, rng, 0.0, 1.0);
      Context ctx;
      ctx.num_threads = s.threads;
      for (const bool centered : {false, true}) {
        if (centered) {
          layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                              dx.matrix(), {}, {});
        } else {
          rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(), {});
        }
        EXPECT_TRUE(dx.check_written("dx"));
        for (std::int64_t r = 1; r + 1 < s.rows; ++r) EXPECT_TRUE(row_finite(dx, r)) << r;
        EXPECT_TRUE(std::isnan(dx.at(nan_row, 0)));
      }
    }
  }
}

// ---- weight_offset and LayerNorm special rows -----------------------------------------------

// Gemma's (1 + w) with w = 0 multiplies by exactly 1: bit-identical to no weight.
TEST(Numerics, GemmaOffsetWithZeroWeightEqualsNoWeight) {
  for (const DType dtype : kAllDTypes) {
    Rng rng(seed_for(current_test_name(), static_cast<int>(dtype)));
    Buffer x(dtype, 5, 1031);
    fill_activations(x, rng, false);
    Buffer zero = Buffer::vector_of(dtype, 1031);
    zero.fill([](std::int64_t, std::int64_t) { return 0.0; });
    Buffer y_gemma(dtype, 5, 1031), y_plain(dtype, 5, 1031);
    RmsNormOptions gemma;
    gemma.weight_offset = 1.0f;
    rms_norm({}, x.cmatrix(), zero.cvector(), y_gemma.matrix(), nullptr, gemma);
    rms_norm({}, x.cmatrix(), {}, y_plain.matrix(), nullptr);
    EXPECT_EQ(y_gemma.snapshot(), y_plain.snapshot()) << dtype_str(dtype);
    // And no weight ignores weight_offset.
    Buffer y_offset(dtype, 5, 1031);
    rms_norm({}, x.cmatrix(), {}, y_offset.matrix(), nullptr, gemma);
    EXPECT_EQ(y_offset.snapshot(), y_plain.snapshot()) << dtype_str(dtype);
  }
}

// A constant row has zero variance: y is exactly the bias, mean exactly the constant.
TEST(Numerics, LayerNormConstantRowGivesBias) {
  for (const DType dtype : kAllDTypes) {
    for (const std::int64_t cols : {std::int64_t{1}, std::int64_t{7}, std::int64_t{4097}}) {
      SCOPED_TRACE(::testing::Message() << dtype_str(dtype) << ", D " << cols);
      Rng rng(seed_for(current_test_name(), static_cast<int>(cols)));
      Buffer x(dtype, 2, cols);
      x.fill([](std::int64_t r, std::int64_t) { return r == 0 ? 1000.0 : -0.375; });
      const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
      const Buffer b = make_weight(WeightKind::kFloat32, dtype, cols, rng, 0.0);
      Buffer y(dtype, 2, cols);
      Buffer mean = Buffer::floats(2), rstd = Buffer::floats(2);
      layer_norm({}, x.cmatrix(), w.cvector(), b.cvector(), y.matrix(), mean.float_data(),
                 rstd.float_data());
      EXPECT_EQ(mean.float_data()[0], 1000.0f);
      EXPECT_EQ(mean.float_data()[1], -0.375f);
      EXPECT_FLOAT_EQ(rstd.float_data()[0], 1.0f / std::sqrt(1e-5f));
      for (std::int64_t r = 0; r < 2; ++r) {
        for (std::int64_t j = 0; j < cols; ++j) {
          ASSERT_EQ(y.at(r, j), detail::round_to_dtype(static_cast<float>(b.at(j)), dtype))
              << r << ", " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fusednorm::test
