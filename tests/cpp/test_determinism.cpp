// Bit-identical results for any thread count and across repeated runs: forward outputs
// (including the split-row path, where threads share each row's chunks), dx, and the
// cross-row reductions dw / db.
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
        return ::testing::AssertionFailure()
               << "output " << o << " first differs at storage word " << i << " of "
               << expected[o].size();
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
    SCOPED_TRACE(::testing::Message() << what << ", " << s.rows << " x " << s.cols << ", "
                                      << dtype_str(dtype()));
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
      fused_add_rms_norm(context(threads), x.cmatrix(), residual.matrix(), w.cvector(),
                         y.matrix(), rstd.float_data());
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
