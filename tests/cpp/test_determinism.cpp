// Bit-identical results for any thread count and across repeated runs: forward outputs
// (including the split-row path, where threads share each row's chunks), dx, and the
// cross-row reductions dw / db.
#include <cstring>
#include <functional>
#include <tuple>

#include "cpu/cpu_backend.h"
#include "test_util.h"

namespace fusednorm::test {
namespace {

constexpr int kThreadCounts[] = {1, 2, 3, 7};

struct Shape {
  std::int64_t rows, cols;
};

std::vector<Shape> shapes() {
  std::vector<Shape> s = {{1, 1 << 18}, {2, (1 << 17) + 5}, {3, 100003}, {5, 4099},
                          {37, 1000},   {300, 513},         {1000, 64},  {4099, 3}};
  if (!quick_mode()) s.push_back({1, 1 << 20});
  return s;
}

// Every output of one call, as raw bytes (guards included: they must match too).
using Bits = std::vector<std::vector<std::uint64_t>>;

// Where two runs first differ (output index, 64-bit word), for a readable failure.
::testing::AssertionResult same_bits(const Bits& got, const Bits& expected) {
  for (std::size_t o = 0; o < expected.size(); ++o) {
    for (std::size_t i = 0; i < expected[o].size(); ++i) {
      if (got[o][i] != expected[o][i]) {
        return ::testing::AssertionFailure() << "output " << o << " first differs at storage word "
                                             << i << " of " << expected[o].size();
      }
    }
  }
  return ::testing::AssertionSuccess();
}

class DeterminismTest : public ::testing::TestWithParam<DType> {
 protected:
  DType dtype() const { return GetParam(); }

  // Runs `call(threads)` for every thread count, twice for the first, and expects the
  // same bits every time.
  template <typename Call>
  void expect_identical(const char* what, const Shape& s, Call call) {
    SCOPED_TRACE(::testing::Message()
                 << what << ", " << s.rows << " x " << s.cols << ", " << dtype_str(dtype()));
    const Bits first = call(kThreadCounts[0]);
    EXPECT_TRUE(same_bits(call(kThreadCounts[0]), first)) << "repeated run with 1 thread";
    for (const int threads : kThreadCounts) {
      EXPECT_TRUE(same_bits(call(threads), first)) << threads << " threads vs 1 thread";
    }
  }
};

TEST_P(DeterminismTest, ForwardAcrossThreadCounts) {
  for (const Shape s : shapes()) {
    Rng rng(seed_for(current_test_name(), static_cast<int>(s.cols)));
    Buffer x(dtype(), s.rows, s.cols), residual(dtype(), s.rows, s.cols);
    fill_activations(x, rng, true);
    fill_activations(residual, rng, false);
    const auto residual_start = residual.snapshot();
    const Buffer w = make_weight(WeightKind::kSame, dtype(), s.cols, rng, 1.0);
    const Buffer b = make_weight(WeightKind::kFloat32, dtype(), s.cols, rng, 0.0);
    Buffer y(dtype(), s.rows, s.cols);
    Buffer mean = Buffer::floats(s.rows), rstd = Buffer::floats(s.rows);
    auto context = [](int threads) {
      Context ctx;
      ctx.num_threads = threads;
      return ctx;
    };
    expect_identical("rms_norm", s, [&](int threads) {
      rms_norm(context(threads), x.cmatrix(), w.cvector(), y.matrix(), rstd.float_data());
      return Bits{y.snapshot(), rstd.snapshot()};
    });
    expect_identical("fused_add_rms_norm", s, [&](int threads) {
      residual.restore(residual_start);
      fused_add_rms_norm(context(threads), x.cmatrix(), residual.matrix(), w.cvector(), y.matrix(),
                         rstd.float_data());
      return Bits{y.snapshot(), residual.snapshot(), rstd.snapshot()};
    });
    expect_identical("layer_norm", s, [&](int threads) {
      layer_norm(context(threads), x.cmatrix(), w.cvector(), b.cvector(), y.matrix(),
                 mean.float_data(), rstd.float_data());
      return Bits{y.snapshot(), mean.snapshot(), rstd.snapshot()};
    });
  }
}

TEST_P(DeterminismTest, BackwardAcrossThreadCounts) {
  for (const Shape s : shapes()) {
    Rng rng(seed_for(current_test_name(), static_cast<int>(s.cols)));
    Buffer x(dtype(), s.rows, s.cols), dy(dtype(), s.rows, s.cols);
    fill_activations(x, rng, true);
    fill_activations(dy, rng, false);
    const Buffer w = make_weight(WeightKind::kSame, dtype(), s.cols, rng, 1.0);
    Buffer dx(dtype(), s.rows, s.cols);
    Buffer dw = Buffer::vector_of(DType::kFloat32, s.cols);
    Buffer dw_half = Buffer::vector_of(dtype(), s.cols);
    Buffer db = Buffer::vector_of(dtype(), s.cols);
    Buffer mean = Buffer::floats(s.rows), rstd = Buffer::floats(s.rows);
    layer_norm({}, x.cmatrix(), w.cvector(), {}, dx.matrix(), mean.float_data(), rstd.float_data());
    auto context = [](int threads) {
      Context ctx;
      ctx.num_threads = threads;
      return ctx;
    };
    expect_identical("rms_norm_backward (rstd recomputed)", s, [&](int threads) {
      rms_norm_backward(context(threads), dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr,
                        dx.matrix(), dw.vector());
      return Bits{dx.snapshot(), dw.snapshot()};
    });
    expect_identical("rms_norm_backward (dw only, half-precision dw)", s, [&](int threads) {
      rms_norm_backward(context(threads), dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, {},
                        dw_half.vector());
      return Bits{dw_half.snapshot()};
    });
    expect_identical("layer_norm_backward (stats given)", s, [&](int threads) {
      layer_norm_backward(context(threads), dy.cmatrix(), x.cmatrix(), w.cvector(),
                          mean.float_data(), rstd.float_data(), dx.matrix(), dw.vector(),
                          db.vector());
      return Bits{dx.snapshot(), dw.snapshot(), db.snapshot()};
    });
  }
}

// Short rows with their statistics given go through the backward's block kernels
// (backward_block); recomputed, through the row-pair loop. The forward's statistics are the
// recomputed ones, so both must give the same bits: dx, dw, db, with and without a weight, with
// a dx addend, odd and even row counts, D from 1 to kMaxShortRow and one beyond, 1 to 3
// threads.
TEST_P(DeterminismTest, BackwardBlocksHaveTheBitsOfTheRowPairs) {
  for (const Shape s : {Shape{1, 128}, Shape{2, 1}, Shape{5, 3}, Shape{37, 64}, Shape{300, 128},
                        Shape{131, 200}, Shape{9, 1000}, Shape{10, 1024}, Shape{6, 1025}}) {
    Rng rng(seed_for(current_test_name(), static_cast<int>(s.rows * 4099 + s.cols)));
    Buffer x(dtype(), s.rows, s.cols), dy(dtype(), s.rows, s.cols), addend(dtype(), s.rows, s.cols);
    fill_activations(x, rng, true);
    fill_activations(dy, rng, false);
    fill_activations(addend, rng, false);
    const Buffer w = make_weight(WeightKind::kSame, dtype(), s.cols, rng, 1.0);
    Buffer dx(dtype(), s.rows, s.cols), y(dtype(), s.rows, s.cols);
    Buffer dw = Buffer::vector_of(DType::kFloat32, s.cols);
    Buffer db = Buffer::vector_of(dtype(), s.cols);
    Buffer mean = Buffer::floats(s.rows), rstd = Buffer::floats(s.rows);
    for (const int threads : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << s.rows << " x " << s.cols << ", "
                                        << dtype_str(dtype()) << ", " << threads << " threads");
      Context ctx;
      ctx.num_threads = threads;
      for (const bool weighted : {true, false}) {
        const ConstVector weight = weighted ? w.cvector() : ConstVector{};
        rms_norm(ctx, x.cmatrix(), weight, y.matrix(), rstd.float_data());
        auto rms = [&](const float* stats, bool with_addend) {
          rms_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), weight, stats, dx.matrix(),
                            weighted ? dw.vector() : Vector{}, {}, {},
                            with_addend ? addend.cmatrix() : ConstMatrix{});
          return Bits{dx.snapshot(), dw.snapshot()};
        };
        EXPECT_TRUE(same_bits(rms(rstd.float_data(), false), rms(nullptr, false)))
            << "rms_norm_backward, weight " << weighted;
        EXPECT_TRUE(same_bits(rms(rstd.float_data(), true), rms(nullptr, true)))
            << "rms_norm_backward with a dx addend, weight " << weighted;
        layer_norm(ctx, x.cmatrix(), weight, {}, y.matrix(), mean.float_data(), rstd.float_data());
        auto layer = [&](bool given) {
          layer_norm_backward(ctx, dy.cmatrix(), x.cmatrix(), weight,
                              given ? mean.float_data() : nullptr,
                              given ? rstd.float_data() : nullptr, dx.matrix(),
                              weighted ? dw.vector() : Vector{}, db.vector());
          return Bits{dx.snapshot(), dw.snapshot(), db.snapshot()};
        };
        EXPECT_TRUE(same_bits(layer(true), layer(false))) << "layer_norm_backward, weight "
                                                          << weighted;
      }
    }
  }
}

// A row's outputs do not depend on the rows beside it: the forward reads rows two at a time
// (first_stat_pair, add_residual_pair) where it can, and each must get the bits of a call on that
// row alone. Odd row counts leave a last row outside any pair. (Batches of several rows, and so the
// pairs of forward_rows, need streamed outputs: the streaming_stores ctest run gives them.)
TEST_P(DeterminismTest, EachRowHasTheBitsOfItsOwnCall) {
  const float static_scale = 0.03125f;
  // 9 x 128 takes the short-row kernels; the others the one-row ones (and, with more than one
  // row, fp16's weight and bias prepared as fp32 once per call, which a one-row call skips;
  // every shape here is under the 4 MiB up to which the backend prepares them).
  for (const Shape s :
       {Shape{9, 128}, Shape{7, 1000}, Shape{5, 4099}, Shape{4, 8195}, Shape{3, 100003}}) {
    SCOPED_TRACE(::testing::Message() << s.rows << " x " << s.cols << ", " << dtype_str(dtype()));
    Rng rng(seed_for(current_test_name(), static_cast<int>(s.cols)));
    Buffer x(dtype(), s.rows, s.cols);
    fill_activations(x, rng, true);
    const Buffer w = make_weight(WeightKind::kSame, dtype(), s.cols, rng, 1.0);
    const Buffer b = make_weight(WeightKind::kFloat32, dtype(), s.cols, rng, 0.0);
    const Buffer b_same = make_weight(WeightKind::kSame, dtype(), s.cols, rng, 0.0);
    RmsNormOptions gemma;
    gemma.weight_offset = 1.0f;
    // Row r of m as a one-row view.
    auto row_offset = [](const Buffer& m, std::int64_t r) {
      return r * m.row_stride() * static_cast<std::int64_t>(m.element_size());
    };
    auto x_row = [&](std::int64_t r) {
      return ConstMatrix{static_cast<const unsigned char*>(x.data()) + row_offset(x, r), x.dtype(),
                         1, s.cols, x.row_stride()};
    };
    // Outputs as bytes (Buffer holds no 1-byte dtype), rows packed.
    struct Bytes {
      DType dtype;
      std::vector<unsigned char> bytes;
      Bytes(DType d, std::int64_t rows, std::int64_t cols)
          : dtype(d), bytes(static_cast<std::size_t>(rows * cols) * dtype_size(d), 0xab) {}
      Matrix rows_from(std::int64_t r, std::int64_t count, std::int64_t cols) {
        const auto esize = static_cast<std::int64_t>(dtype_size(dtype));
        return Matrix{bytes.data() + r * cols * esize, dtype, count, cols, cols};
      }
    };
    // Each operator writes its outputs for rows [first, first + x_view.rows) of y (and q, the
    // statistics) from x_view.
    struct Op {
      const char* name;
      DType out_dtype;
      std::function<void(ConstMatrix, Matrix, float*, float*)> run;
    };
    const Op ops[] = {
        {"rms_norm", dtype(),
         [&](ConstMatrix xv, Matrix y, float*, float* rstd) {
           rms_norm({}, xv, w.cvector(), y, rstd);
         }},
        {"rms_norm, weight offset 1", dtype(),
         [&](ConstMatrix xv, Matrix y, float*, float* rstd) {
           rms_norm({}, xv, w.cvector(), y, rstd, gemma);
         }},
        {"layer_norm", dtype(),
         [&](ConstMatrix xv, Matrix y, float* mean, float* rstd) {
           layer_norm({}, xv, w.cvector(), b.cvector(), y, mean, rstd);
         }},
        {"layer_norm, bias in x's dtype", dtype(),
         [&](ConstMatrix xv, Matrix y, float* mean, float* rstd) {
           layer_norm({}, xv, w.cvector(), b_same.cvector(), y, mean, rstd);
         }},
        {"rms_norm_quant static int8", DType::kInt8,
         [&](ConstMatrix xv, Matrix q, float*, float*) {
           QuantScale scale;
           scale.static_scale = &static_scale;
           rms_norm_quant({}, xv, w.cvector(), q, scale);
         }},
        {"rms_norm_quant dynamic e4m3", DType::kFloat8E4M3,
         [&](ConstMatrix xv, Matrix q, float*, float* row_scales) {
           QuantScale scale;
           scale.row_scales = row_scales;
           rms_norm_quant({}, xv, w.cvector(), q, scale);
         }},
    };
    for (const Op& op : ops) {
      SCOPED_TRACE(op.name);
      Bytes whole(op.out_dtype, s.rows, s.cols), alone(op.out_dtype, s.rows, s.cols);
      std::vector<float> stats(2 * s.rows, -1.0f), alone_stats(2 * s.rows, -1.0f);
      op.run(x.cmatrix(), whole.rows_from(0, s.rows, s.cols), stats.data(), stats.data() + s.rows);
      for (std::int64_t r = 0; r < s.rows; ++r) {
        op.run(x_row(r), alone.rows_from(r, 1, s.cols), alone_stats.data() + r,
               alone_stats.data() + s.rows + r);
      }
      EXPECT_TRUE(whole.bytes == alone.bytes);
      EXPECT_EQ(0, std::memcmp(stats.data(), alone_stats.data(), stats.size() * sizeof(float)));
    }
    // The fused add (its rows' residual adds read two rows at a time too): y, the updated
    // residual and rstd of the whole call against each row alone.
    Buffer residual_start(dtype(), s.rows, s.cols);
    fill_activations(residual_start, rng, false);
    Buffer whole_residual(dtype(), s.rows, s.cols), alone_residual(dtype(), s.rows, s.cols);
    whole_residual.restore(residual_start.snapshot());
    alone_residual.restore(residual_start.snapshot());
    Buffer whole_y(dtype(), s.rows, s.cols), alone_y(dtype(), s.rows, s.cols);
    std::vector<float> whole_rstd(s.rows, -1.0f), alone_rstd(s.rows, -1.0f);
    fused_add_rms_norm({}, x.cmatrix(), whole_residual.matrix(), w.cvector(), whole_y.matrix(),
                       whole_rstd.data());
    auto row_view = [&](Buffer& m, std::int64_t r) {
      return Matrix{static_cast<unsigned char*>(m.data()) + row_offset(m, r), m.dtype(), 1, s.cols,
                    m.row_stride()};
    };
    for (std::int64_t r = 0; r < s.rows; ++r) {
      fused_add_rms_norm({}, x_row(r), row_view(alone_residual, r), w.cvector(),
                         row_view(alone_y, r), alone_rstd.data() + r);
    }
    EXPECT_TRUE(same_bits({whole_y.snapshot(), whole_residual.snapshot()},
                          {alone_y.snapshot(), alone_residual.snapshot()}))
        << "fused_add_rms_norm";
    EXPECT_EQ(whole_rstd, alone_rstd) << "fused_add_rms_norm rstd";
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, DeterminismTest, ::testing::ValuesIn(kAllDTypes),
                         dtype_param_name);

// The shapes above do reach both thread paths; without this the split-row comparison could
// silently turn into a row-path comparison if the planner changed.
TEST(Determinism, ShapesCoverTheSplitRowPath) {
  const std::size_t forward_bytes = 2 * (std::size_t{1} << 18) * sizeof(float);
  EXPECT_TRUE(cpu::plan_threads(1, 1 << 18, forward_bytes, 2).split_rows);
  EXPECT_TRUE(cpu::plan_threads(1, 1 << 18, forward_bytes, 7).split_rows);
  EXPECT_FALSE(cpu::plan_threads(1, 1 << 18, forward_bytes, 1).split_rows);
  EXPECT_TRUE(cpu::plan_threads(2, (1 << 17) + 5, 2 * 2 * ((1 << 17) + 5) * 2, 3).split_rows);
  EXPECT_TRUE(cpu::plan_threads(1, 1 << 20, 2 * (std::size_t{1} << 20) * 2, 2).split_rows);
  const std::size_t backward_bytes = 3 * std::size_t{3} * 100003 * 2;
  EXPECT_TRUE(cpu::plan_threads(3, 100003, backward_bytes, 7).split_rows);
  // Many short rows: whole rows per thread.
  EXPECT_FALSE(cpu::plan_threads(1000, 64, 2 * 1000 * 64 * 4, 7).split_rows);
  EXPECT_GE(cpu::plan_threads(4099, 3, 1 << 30, 7).threads, 2);
}

// The row blocks of the dw / db reduction depend on the row count only and cover every
// row exactly once.
TEST(Determinism, RowBlocksCoverEveryRowOnce) {
  for (std::int64_t rows = 1; rows <= 5000; rows += (rows < 300 ? 1 : 97)) {
    const cpu::RowBlocks blocks = cpu::row_blocks(rows);
    ASSERT_GE(blocks.count, 1);
    ASSERT_GE(blocks.rows_per_block, 1);
    EXPECT_GE(blocks.count * blocks.rows_per_block, rows) << rows;
    EXPECT_LT((blocks.count - 1) * blocks.rows_per_block, rows) << rows << ": an empty block";
  }
}

}  // namespace
}  // namespace fusednorm::test
