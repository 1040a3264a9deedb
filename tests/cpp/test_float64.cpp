// float64, the verification dtype (fusednorm.h, Numerics), beyond the operator suites'
// Float64 instantiations (which compare every operator with the fp64 reference at fp64
// tolerance): the statistics contract (the backward recomputes rstd / mean in fp64 and does
// not read the fp32 ones it is given), bit-identical results for any thread count, zero
// rows, and the errors for mixed dtypes and for the operators that refuse float64.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "test_util.h"

namespace fusednorm::test {
namespace {

constexpr DType kF64 = DType::kFloat64;

Context threads(int n) {
  Context ctx;
  ctx.num_threads = n;
  return ctx;
}

// Whatever the caller passes as rstd / mean, the float64 backward gives the reference's
// gradients: an fp32 rstd (even a wrong one) would show as errors far above 1e-12.
TEST(Float64, BackwardRecomputesStatisticsInFp64) {
  Rng rng(seed_for(current_test_name(), 0));
  const std::int64_t rows = 9, cols = 300;
  Buffer x(kF64, rows, cols), dy(kF64, rows, cols), dx(kF64, rows, cols);
  fill_activations(x, rng, true);
  fill_activations(dy, rng, false);
  const Buffer w = make_weight(WeightKind::kSame, kF64, cols, rng, 1.0);
  Buffer dw = Buffer::vector_of(kF64, cols), db = Buffer::vector_of(kF64, cols);
  Buffer wrong_mean = Buffer::floats(rows), wrong_rstd = Buffer::floats(rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    wrong_mean.float_data()[r] = 123.0f;
    wrong_rstd.float_data()[r] = 0.5f;
  }
  std::vector<double> scale(static_cast<std::size_t>(rows));

  const auto rms = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector());
  rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), wrong_rstd.float_data(),
                    dx.matrix(), dw.vector());
  EXPECT_TRUE(compare("rms dx", dx, rms.dx, rms.dx_scale, tolerance(kF64)));
  EXPECT_TRUE(compare("rms dw", dw, rms.dw, {row_max_abs(rms.dw, 1, cols)}, tolerance(kF64)));

  const auto ln = reference::layer_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector(), true);
  layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), wrong_mean.float_data(),
                      wrong_rstd.float_data(), dx.matrix(), dw.vector(), db.vector());
  EXPECT_TRUE(compare("layer dx", dx, ln.dx, ln.dx_scale, tolerance(kF64)));
  EXPECT_TRUE(compare("layer dw", dw, ln.dw, {row_max_abs(ln.dw, 1, cols)}, tolerance(kF64)));
  EXPECT_TRUE(compare("layer db", db, ln.db, {row_max_abs(ln.db, 1, cols)}, tolerance(kF64)));
}

// The forward's rstd / mean outputs are the fp64 statistics rounded once to fp32.
TEST(Float64, StatisticsOutputsAreRoundedFp64Values) {
  Rng rng(seed_for(current_test_name(), 0));
  const std::int64_t rows = 5, cols = 77;
  Buffer x(kF64, rows, cols), y(kF64, rows, cols);
  fill_activations(x, rng, true);
  Buffer mean = Buffer::floats(rows), rstd = Buffer::floats(rows);
  const auto ref = reference::layer_norm(x.cmatrix(), {}, {});
  layer_norm({}, x.cmatrix(), {}, {}, y.matrix(), mean.float_data(), rstd.float_data());
  for (std::int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(mean.float_data()[r], ref.mean[r], std::fabs(ref.mean[r]) * 0x1p-24 + 1e-30) << r;
    EXPECT_NEAR(rstd.float_data()[r], ref.rstd[r], ref.rstd[r] * 0x1p-24) << r;
  }
}

// A row of zeros: y = 0 and finite gradients (rstd = 1 / sqrt(eps)).
TEST(Float64, ZeroRow) {
  const std::int64_t rows = 3, cols = 33;
  Rng rng(seed_for(current_test_name(), 0));
  Buffer x(kF64, rows, cols), dy(kF64, rows, cols), y(kF64, rows, cols), dx(kF64, rows, cols);
  fill_activations(x, rng, false);
  fill_activations(dy, rng, false);
  for (std::int64_t j = 0; j < cols; ++j) x.set(1, j, 0.0);
  const Buffer w = make_weight(WeightKind::kSame, kF64, cols, rng, 1.0);
  Buffer dw = Buffer::vector_of(kF64, cols);
  rms_norm({}, x.cmatrix(), w.cvector(), y.matrix(), nullptr);
  const auto ref = reference::rms_norm(x.cmatrix(), w.cvector());
  EXPECT_TRUE(compare("y", y, ref.y, row_max_abs(ref.y, rows, cols), tolerance(kF64)));
  for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(y.at(1, j), 0.0) << j;
  rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(), dw.vector());
  const auto bref = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector());
  EXPECT_TRUE(compare("dx", dx, bref.dx, bref.dx_scale, tolerance(kF64)));
}

// Whole rows per thread and dw / db over fixed row blocks: the same bits for any thread
// count, forward and backward (with the addend and in place).
TEST(Float64, BitIdenticalForAnyThreadCount) {
  for (const auto& [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{1, 70001}, {3, 4099}, {301, 257}, {4099, 3}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    Rng rng(seed_for(current_test_name(), static_cast<int>(cols)));
    Buffer x(kF64, rows, cols), dy(kF64, rows, cols), addend(kF64, rows, cols);
    fill_activations(x, rng, true);
    fill_activations(dy, rng, false);
    fill_activations(addend, rng, false);
    const Buffer w = make_weight(WeightKind::kSame, kF64, cols, rng, 1.0);
    const Buffer b = make_weight(WeightKind::kSame, kF64, cols, rng, 0.0);
    auto run = [&](int n) {
      Buffer y(kF64, rows, cols), dx(kF64, rows, cols), dw(Buffer::vector_of(kF64, cols)),
          db(Buffer::vector_of(kF64, cols));
      std::vector<std::vector<double>> out;
      RmsNormOptions gemma;
      gemma.weight_offset = 1.0f;
      rms_norm(threads(n), x.cmatrix(), w.cvector(), y.matrix(), nullptr, gemma);
      out.push_back(y.values());
      layer_norm(threads(n), x.cmatrix(), w.cvector(), b.cvector(), y.matrix(), nullptr, nullptr);
      out.push_back(y.values());
      rms_norm_backward(threads(n), dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        dw.vector(), gemma, {}, addend.cmatrix());
      out.push_back(dx.values());
      out.push_back(dw.values());
      layer_norm_backward(threads(n), dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                          dx.matrix(), dw.vector(), db.vector());
      out.push_back(dx.values());
      out.push_back(dw.values());
      out.push_back(db.values());
      return out;
    };
    const auto first = run(1);
    for (const int n : {1, 2, 3, 7}) {
      const auto got = run(n);
      for (std::size_t o = 0; o < first.size(); ++o) {
        // Exact equality of doubles (no NaN here): bit-identical.
        EXPECT_TRUE(got[o] == first[o]) << "output " << o << ", " << n << " threads";
      }
    }
  }
}

// float64 takes no other dtype: each mixed argument is named.
TEST(Float64, MixedDtypesAreRefusedByName) {
  const std::int64_t rows = 2, cols = 8;
  Buffer x(kF64, rows, cols), x32(DType::kFloat32, rows, cols);
  Buffer y(kF64, rows, cols), y32(DType::kFloat32, rows, cols);
  Buffer w(Buffer::vector_of(kF64, cols)), w32(Buffer::floats(cols)),
      w16(Buffer::vector_of(DType::kFloat16, cols));
  Buffer dw(Buffer::vector_of(kF64, cols)), dw32(Buffer::floats(cols));
  Rng rng(seed_for(current_test_name(), 0));
  for (Buffer* b : {&x, &x32, &w, &w32, &w16}) fill_normal(*b, rng, 1.0, 0.5);
  EXPECT_FUSEDNORM_ERROR(rms_norm({}, x.cmatrix(), w32.cvector(), y.matrix(), nullptr),
                         "fusednorm::rms_norm", "'weight'", "float32", "float64");
  EXPECT_FUSEDNORM_ERROR(rms_norm({}, x.cmatrix(), w.cvector(), y32.matrix(), nullptr),
                         "fusednorm::rms_norm", "'y'", "float32");
  EXPECT_FUSEDNORM_ERROR(rms_norm({}, x32.cmatrix(), w.cvector(), y32.matrix(), nullptr),
                         "fusednorm::rms_norm", "'weight'", "float64");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm({}, x.cmatrix(), x32.matrix(), w.cvector(), y.matrix(), nullptr),
      "fusednorm::fused_add_rms_norm", "'residual'");
  EXPECT_FUSEDNORM_ERROR(
      layer_norm({}, x.cmatrix(), w.cvector(), w16.cvector(), y.matrix(), nullptr, nullptr),
      "fusednorm::layer_norm", "'bias'", "float16");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward({}, x32.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                           y.matrix(), dw.vector()),
                         "fusednorm::rms_norm_backward", "'dy'");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward({}, x.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                           y.matrix(), dw32.vector()),
                         "fusednorm::rms_norm_backward", "'dw'", "float32");
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward({}, x.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                           y.matrix(), dw.vector(), {}, {}, x32.cmatrix()),
                         "fusednorm::rms_norm_backward", "'dx_addend'");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward({}, x.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                             nullptr, y32.matrix(), dw.vector(), {}),
                         "fusednorm::layer_norm_backward", "'dx'");
  EXPECT_FUSEDNORM_ERROR(layer_norm_backward({}, x.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                                             nullptr, y.matrix(), dw.vector(), dw32.vector()),
                         "fusednorm::layer_norm_backward", "'db'");
}

// The two-phase operators exchange fp32 row sums, the quantized ones are an inference path:
// both refuse float64, naming x.
TEST(Float64, PhasedAndQuantizedOperatorsRefuseIt) {
  const std::int64_t rows = 2, cols = 8;
  Buffer x(kF64, rows, cols), y(kF64, rows, cols), res(kF64, rows, cols);
  Rng rng(seed_for(current_test_name(), 0));
  fill_normal(x, rng, 1.0, 0.5);
  fill_normal(res, rng, 1.0, 0.5);
  Buffer sums = Buffer::floats(rows), sums2 = Buffer::floats(rows), rstd = Buffer::floats(rows);
  for (std::int64_t r = 0; r < rows; ++r)
    sums.float_data()[r] = sums2.float_data()[r] = rstd.float_data()[r] = 1.0f;
  std::vector<std::int8_t> q(static_cast<std::size_t>(rows * cols));  // (Buffer has no int8)
  Buffer scales = Buffer::floats(rows);
  const char* phased = "two-phase";
  EXPECT_FUSEDNORM_ERROR(rms_norm_partial_sum_squares({}, x.cmatrix(), sums.float_data()),
                         "rms_norm_partial_sum_squares", "'x'", "float64", phased);
  EXPECT_FUSEDNORM_ERROR(
      fused_add_partial_sum_squares({}, x.cmatrix(), res.matrix(), sums.float_data()),
      "fused_add_partial_sum_squares", "'x'", phased);
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_from_sum_squares({}, x.cmatrix(), {}, y.matrix(), sums.float_data(), cols, nullptr),
      "rms_norm_from_sum_squares", "'x'", phased);
  EXPECT_FUSEDNORM_ERROR(rms_norm_backward_partial_sums({}, x.cmatrix(), x.cmatrix(), {},
                                                        rstd.float_data(), sums.float_data()),
                         "rms_norm_backward_partial_sums", "'x'", phased);
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_backward_from_sums({}, x.cmatrix(), x.cmatrix(), {}, rstd.float_data(),
                                  sums.float_data(), cols, y.matrix(), {}),
      "rms_norm_backward_from_sums", "'x'", phased);
  EXPECT_FUSEDNORM_ERROR(layer_norm_partial_sums({}, x.cmatrix(), sums.float_data()),
                         "layer_norm_partial_sums", "'x'", phased);
  EXPECT_FUSEDNORM_ERROR(
      layer_norm_from_sums({}, x.cmatrix(), {}, {}, y.matrix(), sums.float_data(),
                           sums2.float_data(), cols, nullptr, nullptr),
      "layer_norm_from_sums", "'x'", phased);
  QuantScale scale;
  scale.row_scales = scales.float_data();
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, x.cmatrix(), {}, matrix(q.data(), DType::kInt8, rows, cols), scale),
      "rms_norm_quant", "'x'", "float64", "quantized");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, x.cmatrix(), res.matrix(), {},
                               matrix(q.data(), DType::kInt8, rows, cols), scale),
      "fused_add_rms_norm_quant", "'x'", "float64");
}

TEST(Float64, DtypeNameAndSize) {
  EXPECT_EQ(dtype_size(kF64), 8u);
  EXPECT_STREQ(dtype_name(kF64), "float64");
}

}  // namespace
}  // namespace fusednorm::test
