// The two-phase RMSNorm (column-sliced rows, the tensor-parallel layout): with one slice,
// phase 1 then phase 2 give the bits of the one-call operators; with a row cut into uneven
// slices, and the phase-1 sums added in slice order as an all-reduce would, the results
// match the fp64 reference of the whole row. Slices are sub-views of one buffer, so the
// guards show that no slice writes outside its columns.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "test_util.h"

namespace fusednorm::test {
namespace {

// Column c of a view or vector as the slice's start.
ConstMatrix columns(const Buffer& b, std::int64_t begin, std::int64_t n) {
  ConstMatrix m = b.cmatrix();
  m.data = static_cast<const char*>(m.data) + begin * static_cast<std::int64_t>(b.element_size());
  m.cols = n;
  return m;
}
Matrix columns(Buffer& b, std::int64_t begin, std::int64_t n) {
  Matrix m = b.matrix();
  m.data = static_cast<char*>(m.data) + begin * static_cast<std::int64_t>(b.element_size());
  m.cols = n;
  return m;
}
ConstVector elements(const Buffer& b, std::int64_t begin, std::int64_t n) {
  if (b.empty()) return {};
  return {static_cast<const char*>(b.data()) + begin * static_cast<std::int64_t>(b.element_size()),
          b.dtype(), n};
}
Vector elements(Buffer& b, std::int64_t begin, std::int64_t n) {
  if (b.empty()) return {};
  return {static_cast<char*>(b.data()) + begin * static_cast<std::int64_t>(b.element_size()),
          b.dtype(), n};
}

// Where `slices` column slices of a row of `cols` columns begin, plus cols at the end: cut
// at random columns, at least one column each.
std::vector<std::int64_t> random_cuts(Rng& rng, std::int64_t cols, std::int64_t slices) {
  std::vector<std::int64_t> cuts = {0};
  for (std::int64_t k = 1; k < slices; ++k) {
    std::uniform_int_distribution<std::int64_t> at(cuts.back() + 1, cols - (slices - k));
    cuts.push_back(at(rng));
  }
  cuts.push_back(cols);
  return cuts;
}

std::vector<std::uint32_t> all_bits(const Buffer& b) {
  std::vector<std::uint32_t> bits;
  for (std::int64_t r = 0; r < b.rows(); ++r) {
    for (std::int64_t j = 0; j < b.cols(); ++j) bits.push_back(b.bits(r, j));
  }
  return bits;
}

struct Problem {
  std::int64_t rows, cols;
  Buffer x, residual, dy, addend;
  Buffer w;
};

class TwoPhaseTest : public RmsVariantTest {
 protected:
  RmsNormOptions options() const {
    RmsNormOptions o;
    o.weight_offset = offset();
    return o;
  }

  Problem make_problem(Rng& rng, std::int64_t rows, std::int64_t cols) const {
    Problem p{rows,
              cols,
              Buffer(dtype(), rows, cols, random_stride(rng, cols)),
              Buffer(dtype(), rows, cols, random_stride(rng, cols)),
              Buffer(dtype(), rows, cols, random_stride(rng, cols)),
              Buffer(dtype(), rows, cols, random_stride(rng, cols)),
              Buffer()};
    fill_activations(p.x, rng, false);
    fill_activations(p.residual, rng, false);
    fill_activations(p.dy, rng, false);
    fill_activations(p.addend, rng, false);
    p.w = make_weight(weight_kind(), dtype(), cols, rng, offset() != 0.0f ? 0.0 : 1.0);
    return p;
  }

  // One slice: the two phases against the one-call operators, bit for bit.
  void check_one_slice(const Problem& p, int threads) {
    SCOPED_TRACE(::testing::Message()
                 << "rows " << p.rows << ", D " << p.cols << ", threads " << threads);
    Context ctx;
    ctx.num_threads = threads;
    const std::int64_t rows = p.rows, cols = p.cols;
    const DType grad_dtype = weight_dtype(weight_kind(), dtype());

    // rms_norm
    Buffer y1(dtype(), rows, cols), y2(dtype(), rows, cols);
    Buffer rstd1 = Buffer::floats(rows), rstd2 = Buffer::floats(rows), sums = Buffer::floats(rows);
    rms_norm(ctx, p.x.cmatrix(), view_of(p.w), y1.matrix(), rstd1.float_data(), options());
    rms_norm_partial_sum_squares(ctx, p.x.cmatrix(), sums.float_data());
    EXPECT_TRUE(sums.check_written("row_sum_squares"));
    rms_norm_from_sum_squares(ctx, p.x.cmatrix(), view_of(p.w), y2.matrix(), sums.float_data(),
                              cols, rstd2.float_data(), options());
    EXPECT_EQ(all_bits(y1), all_bits(y2)) << "y";
    EXPECT_EQ(all_bits(rstd1), all_bits(rstd2)) << "rstd";

    // fused add: residual and y
    Buffer res1 = p.residual, res2 = p.residual;
    fused_add_rms_norm(ctx, p.x.cmatrix(), res1.matrix(), view_of(p.w), y1.matrix(),
                       rstd1.float_data(), options());
    fused_add_partial_sum_squares(ctx, p.x.cmatrix(), res2.matrix(), sums.float_data());
    rms_norm_from_sum_squares(ctx, res2.cmatrix(), view_of(p.w), y2.matrix(), sums.float_data(),
                              cols, rstd2.float_data(), options());
    EXPECT_EQ(all_bits(res1), all_bits(res2)) << "residual";
    EXPECT_EQ(all_bits(y1), all_bits(y2)) << "fused add y";
    EXPECT_EQ(all_bits(rstd1), all_bits(rstd2)) << "fused add rstd";

    // backward, with and without the dx addend
    for (const bool with_addend : {false, true}) {
      SCOPED_TRACE(with_addend ? "with dx addend" : "without dx addend");
      const ConstMatrix addend = with_addend ? p.addend.cmatrix() : ConstMatrix{};
      Buffer dx1(dtype(), rows, cols), dx2(dtype(), rows, cols);
      Buffer dw1 = p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols);
      Buffer dw2 = p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols);
      Buffer g = Buffer::floats(rows);
      rms_norm_backward(ctx, p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w), rstd1.float_data(),
                        dx1.matrix(), mutable_view_of(dw1), options(), {}, addend);
      rms_norm_backward_partial_sums(ctx, p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w),
                                     rstd1.float_data(), g.float_data(), options());
      EXPECT_TRUE(g.check_written("row_sum_g_xhat"));
      rms_norm_backward_from_sums(ctx, p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w),
                                  rstd1.float_data(), g.float_data(), cols, dx2.matrix(),
                                  mutable_view_of(dw2), options(), {}, addend);
      EXPECT_EQ(all_bits(dx1), all_bits(dx2)) << "dx";
      if (!p.w.empty()) {
        EXPECT_EQ(all_bits(dw1), all_bits(dw2)) << "dw";
      }
    }
  }

  // The row cut at `cuts` (slice k is [cuts[k], cuts[k + 1])), phase-1 sums added in slice
  // order, against the reference of the whole row.
  void check_slices(const Problem& p, const std::vector<std::int64_t>& cuts, int threads) {
    SCOPED_TRACE(::testing::Message() << "rows " << p.rows << ", D " << p.cols << ", "
                                      << cuts.size() - 1 << " slices, threads " << threads);
    Context ctx;
    ctx.num_threads = threads;
    const std::int64_t rows = p.rows, cols = p.cols;
    const std::size_t slices = cuts.size() - 1;
    const DType grad_dtype = weight_dtype(weight_kind(), dtype());

    // Forward of the fused add: phase 1 per slice, the "all-reduce", phase 2 per slice.
    Buffer residual = p.residual;
    Buffer y(dtype(), rows, cols), rstd = Buffer::floats(rows);
    std::vector<float> total(static_cast<std::size_t>(rows), 0.0f);
    for (std::size_t k = 0; k < slices; ++k) {
      Buffer partial = Buffer::floats(rows);
      fused_add_partial_sum_squares(ctx, columns(p.x, cuts[k], cuts[k + 1] - cuts[k]),
                                    columns(residual, cuts[k], cuts[k + 1] - cuts[k]),
                                    partial.float_data());
      const std::vector<double> ref_partial =
          reference::row_sum_squares(columns(residual, cuts[k], cuts[k + 1] - cuts[k]));
      for (std::int64_t r = 0; r < rows; ++r) {
        // Terms are all >= 0: fp32 accumulation of n of them, any order.
        const double n = static_cast<double>(cuts[k + 1] - cuts[k]);
        EXPECT_NEAR(partial.at(r), ref_partial[r], (n + 4) * 0x1p-24 * ref_partial[r])
            << "row " << r;
        total[r] += partial.float_data()[r];
      }
    }
    const reference::ForwardResult ref =
        reference::fused_add_rms_norm(p.x.cmatrix(), p.residual.cmatrix(), view_of(p.w), options());
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      // Every slice writes the same rstd; the last one's is checked.
      rms_norm_from_sum_squares(ctx, columns(residual, cuts[k], n), elements(p.w, cuts[k], n),
                                columns(y, cuts[k], n), total.data(), cols, rstd.float_data(),
                                options());
    }
    EXPECT_TRUE(compare("two-phase residual " + dtype_str(dtype()), residual, ref.residual,
                        std::vector<double>(static_cast<std::size_t>(rows), 0.0), 0.0));
    EXPECT_TRUE(y.check_written("y"));
    EXPECT_TRUE(compare("two-phase y " + dtype_str(dtype()), y, ref.y,
                        row_max_abs(ref.y, rows, cols), tolerance(dtype()),
                        absolute_floor(dtype())));
    EXPECT_TRUE(compare_stats("two-phase rstd", rstd.float_data(), ref.rstd, ref.rstd,
                              tolerance(DType::kFloat32)));

    // Backward of the fused add on the stored residual: dx carries the addend.
    std::vector<float> total_g(static_cast<std::size_t>(rows), 0.0f);
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      Buffer partial = Buffer::floats(rows);
      rms_norm_backward_partial_sums(ctx, columns(p.dy, cuts[k], n), columns(residual, cuts[k], n),
                                     elements(p.w, cuts[k], n), rstd.float_data(),
                                     partial.float_data(), options());
      const std::vector<double> ref_partial =
          reference::row_sum_g_xhat(columns(p.dy, cuts[k], n), columns(residual, cuts[k], n),
                                    elements(p.w, cuts[k], n), rstd.float_data(), options());
      for (std::int64_t r = 0; r < rows; ++r) {
        double abs_sum = 0.0;
        for (std::int64_t j = cuts[k]; j < cuts[k + 1]; ++j) {
          const double wj = p.w.empty() ? 1.0 : p.w.at(j) + offset();
          abs_sum += std::fabs(p.dy.at(r, j) * wj * residual.at(r, j) * rstd.float_data()[r]);
        }
        EXPECT_NEAR(partial.at(r), ref_partial[r], 4 * (n + 4) * 0x1p-24 * abs_sum) << "row " << r;
        total_g[r] += partial.float_data()[r];
      }
    }
    Buffer dx(dtype(), rows, cols);
    Buffer dw = p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols);
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      rms_norm_backward_from_sums(ctx, columns(p.dy, cuts[k], n), columns(residual, cuts[k], n),
                                  elements(p.w, cuts[k], n), rstd.float_data(), total_g.data(),
                                  cols, columns(dx, cuts[k], n), elements(dw, cuts[k], n),
                                  options(), {}, columns(p.addend, cuts[k], n));
    }
    const reference::BackwardResult ref_grad = reference::rms_norm_backward(
        p.dy.cmatrix(), residual.cmatrix(), view_of(p.w), options(), p.addend.cmatrix());
    std::vector<double> dx_scale = row_max_abs(ref_grad.dx, rows, cols);
    for (std::int64_t r = 0; r < rows; ++r)
      dx_scale[r] = std::max(dx_scale[r], ref_grad.dx_scale[r]);
    EXPECT_TRUE(dx.check_written("dx"));
    EXPECT_TRUE(compare("two-phase dx " + dtype_str(dtype()), dx, ref_grad.dx, dx_scale,
                        tolerance(dtype()), absolute_floor(dtype())));
    if (!p.w.empty()) {
      const std::vector<double> xhat = reference::rms_norm(residual.cmatrix(), {}, options()).y;
      std::vector<double> abs_sum(static_cast<std::size_t>(cols), 0.0);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t j = 0; j < cols; ++j)
          abs_sum[j] += std::fabs(p.dy.at(r, j) * xhat[r * cols + j]);
      }
      EXPECT_TRUE(dw.check_written("dw"));
      EXPECT_TRUE(compare_vector("two-phase dw " + dtype_str(grad_dtype), dw, ref_grad.dw, abs_sum,
                                 tolerance(grad_dtype), tolerance(DType::kFloat32)));
    }
  }
};

TEST_P(TwoPhaseTest, OneSliceGivesTheOneCallBits) {
  const int cases = case_count(16, 6);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 150000) rows /= 2;
    const int thread_choices[] = {0, 1, 2, 3, 7};
    check_one_slice(make_problem(rng, rows, cols), thread_choices[c % 5]);
  }
}

// Few long rows and several threads: the split-row paths.
TEST_P(TwoPhaseTest, OneSliceOfLongRowsSplitAcrossThreads) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const std::int64_t rows : {1, 2}) {
    check_one_slice(make_problem(rng, rows, 2 * 65536 + 17), 4);
  }
}

TEST_P(TwoPhaseTest, UnevenSlicesMatchTheReference) {
  const int cases = case_count(12, 4);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = std::max<std::int64_t>(random_cols(rng), 3);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 100000) rows /= 2;
    const std::vector<std::int64_t> cuts = random_cuts(rng, cols, 2 + c % 2);  // 2 or 3 slices
    const int thread_choices[] = {0, 1, 3};
    check_slices(make_problem(rng, rows, cols), cuts, thread_choices[c % 3]);
  }
}

// Phase 1's sums do not depend on the thread count.
TEST_P(TwoPhaseTest, PartialSumsAreBitIdenticalForAnyThreadCount) {
  Rng rng(seed_for(current_test_name(), 0));
  const Problem p = make_problem(rng, 67, 5000);
  Buffer rstd = Buffer::floats(p.rows), y(dtype(), p.rows, p.cols);
  rms_norm({}, p.x.cmatrix(), view_of(p.w), y.matrix(), rstd.float_data(), options());
  std::vector<std::uint32_t> first_squares, first_g;
  for (const int threads : {1, 2, 3, 7}) {
    Context ctx;
    ctx.num_threads = threads;
    Buffer squares = Buffer::floats(p.rows), g = Buffer::floats(p.rows);
    rms_norm_partial_sum_squares(ctx, p.x.cmatrix(), squares.float_data());
    rms_norm_backward_partial_sums(ctx, p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w),
                                   rstd.float_data(), g.float_data(), options());
    if (threads == 1) {
      first_squares = all_bits(squares);
      first_g = all_bits(g);
    } else {
      EXPECT_EQ(all_bits(squares), first_squares) << threads << " threads";
      EXPECT_EQ(all_bits(g), first_g) << threads << " threads";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, TwoPhaseTest, all_rms_variants(), rms_variant_name);

// ---- LayerNorm ------------------------------------------------------------------------------

using LayerPhaseParam = std::tuple<DType, WeightKind>;

class LayerNormPhasesTest : public ::testing::TestWithParam<LayerPhaseParam> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  WeightKind weight_kind() const { return std::get<1>(GetParam()); }

  struct LayerProblem {
    std::int64_t rows, cols;
    Buffer x, dy, w, b;
  };
  LayerProblem make_problem(Rng& rng, std::int64_t rows, std::int64_t cols) const {
    LayerProblem p{rows,
                   cols,
                   Buffer(dtype(), rows, cols, random_stride(rng, cols)),
                   Buffer(dtype(), rows, cols, random_stride(rng, cols)),
                   Buffer(),
                   Buffer()};
    fill_activations(p.x, rng, true);
    fill_activations(p.dy, rng, false);
    p.w = make_weight(weight_kind(), dtype(), cols, rng, 1.0);
    p.b = make_weight(weight_kind(), dtype(), cols, rng, 0.0);
    return p;
  }

  // The row cut at `cuts`; every phase's sums added in slice order. Returns y, mean, rstd,
  // dx, dw, db through the buffers given.
  void run_phases(const Context& ctx, const LayerProblem& p, const std::vector<std::int64_t>& cuts,
                  Buffer& y, Buffer& mean, Buffer& rstd, Buffer& dx, Buffer& dw, Buffer& db) {
    const std::int64_t rows = p.rows, cols = p.cols;
    const std::size_t slices = cuts.size() - 1;
    auto all_reduce = [&](const std::function<void(std::size_t, std::int64_t, float*)>& phase) {
      std::vector<float> total(static_cast<std::size_t>(rows), 0.0f);
      for (std::size_t k = 0; k < slices; ++k) {
        Buffer partial = Buffer::floats(rows);
        phase(k, cuts[k + 1] - cuts[k], partial.float_data());
        EXPECT_TRUE(partial.check_written("partial sums"));
        for (std::int64_t r = 0; r < rows; ++r) total[r] += partial.float_data()[r];
      }
      return total;
    };
    const std::vector<float> sum = all_reduce([&](std::size_t k, std::int64_t n, float* out) {
      layer_norm_partial_sums(ctx, columns(p.x, cuts[k], n), out);
    });
    const std::vector<float> squared = all_reduce([&](std::size_t k, std::int64_t n, float* out) {
      layer_norm_partial_squared_deviations(ctx, columns(p.x, cuts[k], n), sum.data(), cols, out);
    });
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      layer_norm_from_sums(ctx, columns(p.x, cuts[k], n), elements(p.w, cuts[k], n),
                           elements(p.b, cuts[k], n), columns(y, cuts[k], n), sum.data(),
                           squared.data(), cols, mean.float_data(), rstd.float_data());
    }
    std::vector<float> g(static_cast<std::size_t>(rows), 0.0f), g_xhat(g);
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      Buffer part_g = Buffer::floats(rows), part_g_xhat = Buffer::floats(rows);
      layer_norm_backward_partial_sums(
          ctx, columns(p.dy, cuts[k], n), columns(p.x, cuts[k], n), elements(p.w, cuts[k], n),
          mean.float_data(), rstd.float_data(), part_g.float_data(), part_g_xhat.float_data());
      for (std::int64_t r = 0; r < rows; ++r) {
        g[r] += part_g.float_data()[r];
        g_xhat[r] += part_g_xhat.float_data()[r];
      }
    }
    for (std::size_t k = 0; k < slices; ++k) {
      const std::int64_t n = cuts[k + 1] - cuts[k];
      layer_norm_backward_from_sums(ctx, columns(p.dy, cuts[k], n), columns(p.x, cuts[k], n),
                                    elements(p.w, cuts[k], n), mean.float_data(), rstd.float_data(),
                                    g.data(), g_xhat.data(), cols, columns(dx, cuts[k], n),
                                    elements(dw, cuts[k], n), elements(db, cuts[k], n));
    }
  }
};

TEST_P(LayerNormPhasesTest, OneSliceGivesTheOneCallBits) {
  const int cases = case_count(12, 4);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 150000) rows /= 2;
    const LayerProblem p = make_problem(rng, rows, cols);
    Context ctx;
    const int thread_choices[] = {0, 1, 3};
    ctx.num_threads = thread_choices[c % 3];
    SCOPED_TRACE(::testing::Message()
                 << "rows " << rows << ", D " << cols << ", threads " << ctx.num_threads);
    const DType grad_dtype = weight_dtype(weight_kind(), dtype());
    auto grad = [&] { return p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols); };
    Buffer y1(dtype(), rows, cols), y2(dtype(), rows, cols), dx1(dtype(), rows, cols),
        dx2(dtype(), rows, cols);
    Buffer mean1 = Buffer::floats(rows), rstd1 = Buffer::floats(rows), mean2 = Buffer::floats(rows),
           rstd2 = Buffer::floats(rows);
    Buffer dw1 = grad(), dw2 = grad(), db1 = grad(), db2 = grad();
    layer_norm(ctx, p.x.cmatrix(), view_of(p.w), view_of(p.b), y1.matrix(), mean1.float_data(),
               rstd1.float_data());
    layer_norm_backward(ctx, p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w), mean1.float_data(),
                        rstd1.float_data(), dx1.matrix(), mutable_view_of(dw1),
                        mutable_view_of(db1));
    run_phases(ctx, p, {0, cols}, y2, mean2, rstd2, dx2, dw2, db2);
    EXPECT_EQ(all_bits(y1), all_bits(y2)) << "y";
    EXPECT_EQ(all_bits(mean1), all_bits(mean2)) << "mean";
    EXPECT_EQ(all_bits(rstd1), all_bits(rstd2)) << "rstd";
    EXPECT_EQ(all_bits(dx1), all_bits(dx2)) << "dx";
    if (!p.w.empty()) {
      EXPECT_EQ(all_bits(dw1), all_bits(dw2)) << "dw";
      EXPECT_EQ(all_bits(db1), all_bits(db2)) << "db";
    }
  }
}

TEST_P(LayerNormPhasesTest, UnevenSlicesMatchTheReference) {
  const int cases = case_count(8, 3);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = std::max<std::int64_t>(random_cols(rng), 3);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 100000) rows /= 2;
    const std::int64_t slices = 2 + c % 2;
    const std::vector<std::int64_t> cuts = random_cuts(rng, cols, slices);
    SCOPED_TRACE(::testing::Message()
                 << "rows " << rows << ", D " << cols << ", " << slices << " slices");
    const LayerProblem p = make_problem(rng, rows, cols);
    const DType grad_dtype = weight_dtype(weight_kind(), dtype());
    Buffer y(dtype(), rows, cols), dx(dtype(), rows, cols);
    Buffer mean = Buffer::floats(rows), rstd = Buffer::floats(rows);
    Buffer dw = p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols);
    Buffer db = p.w.empty() ? Buffer() : Buffer::vector_of(grad_dtype, cols);
    run_phases(Context{}, p, cuts, y, mean, rstd, dx, dw, db);

    const auto ref = reference::layer_norm(p.x.cmatrix(), view_of(p.w), view_of(p.b));
    // Scales as in the LayerNorm suite: y's error relative to |y without bias| + |bias|,
    // mean's to the row's largest |x|.
    const auto unbiased = reference::layer_norm(p.x.cmatrix(), view_of(p.w), {});
    std::vector<double> scale(static_cast<std::size_t>(rows), 0.0), x_scale(scale);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const double bias = p.b.empty() ? 0.0 : p.b.at(j);
        scale[r] = std::max(scale[r], std::fabs(unbiased.y[r * cols + j]) + std::fabs(bias));
        x_scale[r] = std::max(x_scale[r], std::fabs(p.x.at(r, j)));
      }
    }
    EXPECT_TRUE(y.check_written("y"));
    EXPECT_TRUE(compare("layer phases y " + dtype_str(dtype()), y, ref.y, scale, tolerance(dtype()),
                        absolute_floor(dtype())));
    EXPECT_TRUE(compare_stats("layer phases mean", mean.float_data(), ref.mean, x_scale,
                              tolerance(DType::kFloat32)));
    EXPECT_TRUE(compare_stats("layer phases rstd", rstd.float_data(), ref.rstd, ref.rstd,
                              tolerance(DType::kFloat32)));
    const auto grad =
        reference::layer_norm_backward(p.dy.cmatrix(), p.x.cmatrix(), view_of(p.w), !p.w.empty());
    std::vector<double> dx_scale = row_max_abs(grad.dx, rows, cols);
    for (std::int64_t r = 0; r < rows; ++r) dx_scale[r] = std::max(dx_scale[r], grad.dx_scale[r]);
    EXPECT_TRUE(dx.check_written("dx"));
    EXPECT_TRUE(compare("layer phases dx " + dtype_str(dtype()), dx, grad.dx, dx_scale,
                        tolerance(dtype()), absolute_floor(dtype())));
    if (!p.w.empty()) {
      const std::vector<double> xhat = reference::layer_norm(p.x.cmatrix(), {}, {}).y;
      std::vector<double> dw_abs(static_cast<std::size_t>(cols), 0.0), db_abs(dw_abs);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t j = 0; j < cols; ++j) {
          dw_abs[j] += std::fabs(p.dy.at(r, j) * xhat[r * cols + j]);
          db_abs[j] += std::fabs(p.dy.at(r, j));
        }
      }
      EXPECT_TRUE(compare_vector("layer phases dw " + dtype_str(grad_dtype), dw, grad.dw, dw_abs,
                                 tolerance(grad_dtype), tolerance(DType::kFloat32)));
      EXPECT_TRUE(compare_vector("layer phases db " + dtype_str(grad_dtype), db, grad.db, db_abs,
                                 tolerance(grad_dtype), tolerance(DType::kFloat32)));
    }
  }
}

std::string layer_phase_name(const ::testing::TestParamInfo<LayerPhaseParam>& info) {
  return dtype_str(std::get<0>(info.param)) + "_w_" + weight_kind_str(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, LayerNormPhasesTest,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::Values(WeightKind::kNone, WeightKind::kSame,
                                                              WeightKind::kFloat32)),
                         layer_phase_name);

}  // namespace
}  // namespace fusednorm::test
