// rms_norm_quant / fused_add_rms_norm_quant (fusednorm.h, "Quantized RMSNorm") against the
// fp64 reference, bit-exactly against rms_norm's fp32 y where that is observable (fp32
// rows), the SIMD quantizers against quantize.h's scalar ones on every compiled target, and
// the argument checks.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/quantize.h"
#include "cpu/quant_kernels.h"
#include "test_util.h"

namespace fusednorm::test {
namespace {

constexpr DType kQDTypes[] = {DType::kInt8, DType::kFloat8E4M3};

std::uint8_t quantize_scalar(float v, DType q_dtype) {
  return q_dtype == DType::kInt8 ? static_cast<std::uint8_t>(detail::float_to_int8_saturate(v))
                                 : detail::float_to_e4m3_saturate(v);
}

double decode(std::uint8_t bits, DType q_dtype) {
  return q_dtype == DType::kInt8 ? static_cast<double>(static_cast<std::int8_t>(bits))
                                 : static_cast<double>(detail::e4m3_to_float(bits));
}

// A guarded rows x cols byte matrix for q. Every byte starts as `fill`; the bytes outside
// the view (guards, gaps between rows) must keep it. Any byte value is a valid q, so
// "every element written" is checked by running a call twice over different fills.
class QBuffer {
 public:
  QBuffer(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t stride)
      : dtype_(dtype), rows_(rows), cols_(cols), stride_(stride) {
    const std::int64_t view = rows == 0 ? 0 : (rows - 1) * stride + cols;
    bytes_.assign(static_cast<std::size_t>(view + 2 * kGuard), 0);
  }
  void fill(std::uint8_t value) {
    fill_ = value;
    std::fill(bytes_.begin(), bytes_.end(), value);
  }
  Matrix matrix() { return {bytes_.data() + kGuard, dtype_, rows_, cols_, stride_}; }
  std::uint8_t at(std::int64_t r, std::int64_t j) const {
    return bytes_[static_cast<std::size_t>(kGuard + r * stride_ + j)];
  }
  ::testing::AssertionResult check_guards() const {
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      const auto offset = static_cast<std::int64_t>(i) - kGuard;
      const bool inside = offset >= 0 &&
                          offset < (rows_ == 0 ? 0 : (rows_ - 1) * stride_ + cols_) &&
                          offset % stride_ < cols_;
      if (!inside && bytes_[i] != fill_) {
        return ::testing::AssertionFailure() << "q: byte " << offset << " outside the view written";
      }
    }
    return ::testing::AssertionSuccess();
  }
  bool same_view_bytes(const QBuffer& other) const {
    for (std::int64_t r = 0; r < rows_; ++r) {
      for (std::int64_t j = 0; j < cols_; ++j) {
        if (at(r, j) != other.at(r, j)) return false;
      }
    }
    return true;
  }

 private:
  DType dtype_;
  std::int64_t rows_, cols_, stride_;
  std::uint8_t fill_ = 0;
  std::vector<std::uint8_t> bytes_;
};

// y's fp32 relative error (tolerance(kFloat32): the chunked sums and one rounding) twice, for
// y and for a dynamic scale derived from y's amax, plus the reciprocal's and the product's
// roundings. q_exact within this relative distance of a rounding boundary may round either way.
double rounding_distance() { return 2 * tolerance(DType::kFloat32) + 0x1p-22; }

// q against the reference: within one step of round(q_exact), and off round(q_exact) only
// where q_exact is within rounding_distance() of a step boundary. Dynamic scales within the
// same relative distance of the reference's.
::testing::AssertionResult check_quantized(const QBuffer& q, DType q_dtype,
                                           const std::vector<float>& scales,
                                           const reference::QuantResult& ref, std::int64_t rows,
                                           std::int64_t cols, int* ambiguous = nullptr) {
  const double delta = rounding_distance();
  for (std::int64_t r = 0; r < rows; ++r) {
    const double ref_scale = ref.scale[static_cast<std::size_t>(r)];
    if (!scales.empty() && !(std::fabs(scales[r] - ref_scale) <= delta * ref_scale)) {
      return ::testing::AssertionFailure()
             << "row " << r << ": scale " << scales[r] << ", reference " << ref_scale;
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      const double exact = ref.q_exact[static_cast<std::size_t>(r * cols + j)];
      const std::uint8_t got = q.at(r, j);
      if (std::isnan(exact)) {
        const bool ok = q_dtype == DType::kInt8 ? got == 0 : got == 0x7fu;
        if (!ok) {
          return ::testing::AssertionFailure()
                 << "(" << r << ", " << j << "): NaN quantized to 0x" << std::hex << int{got};
        }
        continue;
      }
      const double slack = std::isinf(exact) ? 0.0 : delta * std::fabs(exact);
      const std::uint8_t lo = quantize_scalar(static_cast<float>(exact - slack), q_dtype);
      const std::uint8_t hi = quantize_scalar(static_cast<float>(exact + slack), q_dtype);
      const double v = decode(got, q_dtype);
      const bool ok = lo == hi ? got == lo : (v >= decode(lo, q_dtype) && v <= decode(hi, q_dtype));
      if (!ok) {
        return ::testing::AssertionFailure()
               << "(" << r << ", " << j << "): q " << v << ", q_exact " << exact << " (allowed "
               << decode(lo, q_dtype) << " .. " << decode(hi, q_dtype) << ")";
      }
      if (ambiguous != nullptr && lo != hi) ++*ambiguous;
    }
  }
  return ::testing::AssertionSuccess();
}

enum class Mode { kStatic, kDynamic, kDynamicBounded };
const char* mode_str(Mode m) {
  return m == Mode::kStatic ? "static" : m == Mode::kDynamic ? "dynamic" : "dynamic+ub";
}

// One call of the operator under test and everything it wrote.
struct QuantCall {
  QBuffer q;
  std::vector<float> scales;  // dynamic only
  Buffer residual;            // fused add only: after the call
};

struct Case {
  DType q_dtype = DType::kInt8;
  Mode mode = Mode::kDynamic;
  bool fused = false;
  std::int64_t q_stride = 0;
  float static_scale = 1.0f;
  float upper_bound = 1.0f;
  int threads = 1;
  RmsNormOptions options;
};

QuantCall run_quant(const Case& c, const Buffer& x, const Buffer& residual_in, const Buffer& w,
                    std::uint8_t fill) {
  const std::int64_t rows = x.rows(), cols = x.cols();
  QuantCall out{QBuffer(c.q_dtype, rows, cols, c.q_stride), {}, residual_in};
  out.q.fill(fill);
  Buffer row_scales = Buffer::floats(rows);
  QuantScale scale;
  if (c.mode == Mode::kStatic) {
    scale.static_scale = &c.static_scale;
  } else {
    scale.row_scales = row_scales.float_data();
    if (c.mode == Mode::kDynamicBounded) scale.scale_upper_bound = &c.upper_bound;
  }
  Context ctx;
  ctx.num_threads = c.threads;
  if (c.fused) {
    fused_add_rms_norm_quant(ctx, x.cmatrix(), out.residual.matrix(), view_of(w), out.q.matrix(),
                             scale, c.options);
  } else {
    rms_norm_quant(ctx, x.cmatrix(), view_of(w), out.q.matrix(), scale, c.options);
  }
  if (c.mode != Mode::kStatic) {
    EXPECT_TRUE(row_scales.check_written("row_scales"));
    out.scales.assign(row_scales.float_data(), row_scales.float_data() + rows);
  }
  return out;
}

// Runs the case twice (two q fills: every view byte written, nothing outside it) and checks
// it against the reference; returns the first run.
QuantCall check_case(const Case& c, const Buffer& x, const Buffer& residual, const Buffer& w) {
  const std::int64_t rows = x.rows(), cols = x.cols();
  SCOPED_TRACE(::testing::Message()
               << dtype_str(x.dtype()) << " -> " << dtype_str(c.q_dtype) << ", " << mode_str(c.mode)
               << (c.fused ? ", fused add" : "") << ", rows " << rows << ", D " << cols
               << ", q stride " << c.q_stride << ", threads " << c.threads);
  const auto x_before = x.snapshot();
  QuantCall first = run_quant(c, x, residual, w, 0xa5);
  const QuantCall second = run_quant(c, x, residual, w, 0x5a);
  EXPECT_TRUE(first.q.check_guards());
  EXPECT_TRUE(second.q.check_guards());
  EXPECT_TRUE(first.q.same_view_bytes(second.q)) << "q differs between two identical calls";
  EXPECT_TRUE(x.check_unchanged("x", x_before));
  const reference::QuantResult ref = reference::rms_norm_quant(
      x.cmatrix(), c.fused ? residual.cmatrix() : ConstMatrix{}, view_of(w), c.q_dtype,
      c.mode == Mode::kStatic ? &c.static_scale : nullptr,
      c.mode == Mode::kDynamicBounded ? &c.upper_bound : nullptr, c.options);
  if (c.fused) {
    EXPECT_TRUE(first.residual.check_written("residual"));
    EXPECT_TRUE(compare("quant residual", first.residual, ref.residual,
                        std::vector<double>(static_cast<std::size_t>(rows), 0.0), 0.0));
  }
  EXPECT_TRUE(check_quantized(first.q, c.q_dtype, first.scales, ref, rows, cols));
  return first;
}

// Typical row amax of y (the reference's), to put static scales and upper bounds where they
// both quantize finely and saturate some rows.
double median_row_amax(const Buffer& x, const Buffer& residual, const Buffer& w, bool fused,
                       const RmsNormOptions& options) {
  const reference::QuantResult ref =
      reference::rms_norm_quant(x.cmatrix(), fused ? residual.cmatrix() : ConstMatrix{}, view_of(w),
                                DType::kInt8, nullptr, nullptr, options);
  std::vector<double> amax = row_max_abs(ref.y, x.rows(), x.cols());
  std::sort(amax.begin(), amax.end());
  return std::max(amax[amax.size() / 2], 1e-3);
}

class QuantTest : public RmsVariantTest {};

TEST_P(QuantTest, EveryModeAgainstReference) {
  const int cases = case_count(6, 2);
  for (int c = 0; c < cases; ++c) {
    Rng rng(seed_for(current_test_name(), c));
    const std::int64_t cols = random_cols(rng);
    std::int64_t rows = random_rows(rng);
    while (rows > 1 && rows * cols > 40000) rows /= 2;
    Buffer x(dtype(), rows, cols, random_stride(rng, cols));
    Buffer residual(dtype(), rows, cols, random_stride(rng, cols));
    fill_activations(x, rng, false);
    fill_activations(residual, rng, false);
    const Buffer w = make_weight(weight_kind(), dtype(), cols, rng, offset() != 0.0f ? 0.0 : 1.0);
    for (const bool fused : {false, true}) {
      Case k;
      k.fused = fused;
      k.options.weight_offset = offset();
      k.threads = 1 + c % 3;
      const double amax = median_row_amax(x, residual, w, fused, k.options);
      for (const DType q_dtype : kQDTypes) {
        k.q_dtype = q_dtype;
        const double qmax = detail::quant_max(q_dtype);
        for (const Mode mode : {Mode::kStatic, Mode::kDynamic, Mode::kDynamicBounded}) {
          k.mode = mode;
          k.q_stride = random_stride(rng, cols);
          k.static_scale = static_cast<float>(amax / qmax * std::exp2(c % 3 - 1.0));
          k.upper_bound = static_cast<float>(amax * 0.75);
          check_case(k, x, residual, w);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, QuantTest, all_rms_variants(), rms_variant_name);

// fp32 rows: rms_norm's y is the fp32 y itself, so q and the dynamic scales are checked
// bit-exactly against the definition (the same y, one reciprocal per row, a multiply).
TEST(Quant, Float32BitsOfTheDefinition) {
  Rng rng(seed_for(current_test_name(), 0));
  // 12289: a row staged in pieces (kQuantStagingFloats), dynamic mode recomputing y.
  for (const std::int64_t cols : {7, 64, 1000, 4097, 12289}) {
    const std::int64_t rows = cols > 8192 ? 3 : 9;
    Buffer x(DType::kFloat32, rows, cols);
    Buffer residual(DType::kFloat32, rows, cols);
    fill_activations(x, rng, false);
    fill_activations(residual, rng, false);
    const Buffer w = make_weight(WeightKind::kFloat32, DType::kFloat32, cols, rng, 0.0);
    for (const bool fused : {false, true}) {
      RmsNormOptions options;
      options.weight_offset = 1.0f;
      // y from the unquantized operator.
      Buffer y(DType::kFloat32, rows, cols);
      Buffer stored_residual = residual;
      Context ctx;
      if (fused) {
        fused_add_rms_norm(ctx, x.cmatrix(), stored_residual.matrix(), view_of(w), y.matrix(),
                           nullptr, options);
      } else {
        rms_norm(ctx, x.cmatrix(), view_of(w), y.matrix(), nullptr, options);
      }
      for (const DType q_dtype : kQDTypes) {
        for (const Mode mode : {Mode::kStatic, Mode::kDynamic, Mode::kDynamicBounded}) {
          SCOPED_TRACE(::testing::Message() << "D " << cols << ", fused " << fused << ", "
                                            << dtype_str(q_dtype) << ", " << mode_str(mode));
          Case k;
          k.q_dtype = q_dtype;
          k.mode = mode;
          k.fused = fused;
          k.q_stride = cols;
          k.options = options;
          k.static_scale = 0.013f;
          k.upper_bound = 1.5f;
          const QuantCall got = run_quant(k, x, residual, w, 0);
          if (fused) {
            for (std::int64_t r = 0; r < rows; ++r) {
              for (std::int64_t j = 0; j < cols; ++j) {
                ASSERT_EQ(got.residual.bits(r, j), stored_residual.bits(r, j));
              }
            }
          }
          for (std::int64_t r = 0; r < rows; ++r) {
            float amax = 0.0f;
            for (std::int64_t j = 0; j < cols; ++j) {
              const float v = static_cast<float>(y.at(r, j));
              if (!std::isnan(v)) amax = std::fmax(amax, std::fabs(v));
            }
            float scale = k.static_scale;
            if (mode != Mode::kStatic) {
              scale = detail::dynamic_quant_scale(
                  amax, mode == Mode::kDynamicBounded ? &k.upper_bound : nullptr, q_dtype);
              ASSERT_EQ(detail::float_bits(got.scales[r]), detail::float_bits(scale))
                  << "row " << r;
            }
            const float inv_scale = 1.0f / scale;
            for (std::int64_t j = 0; j < cols; ++j) {
              const float v = static_cast<float>(y.at(r, j)) * inv_scale;
              ASSERT_EQ(int{got.q.at(r, j)}, int{quantize_scalar(v, q_dtype)})
                  << "(" << r << ", " << j << ") y * inv_scale = " << v;
            }
          }
        }
      }
    }
  }
}

// Any thread count gives the same q, scales and residual.
TEST(Quant, BitIdenticalForAnyThreadCount) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const DType dtype : kAllDTypes) {
    const std::int64_t rows = 67, cols = dtype == DType::kBFloat16 ? 8197 : 4097;
    Buffer x(dtype, rows, cols);
    Buffer residual(dtype, rows, cols);
    fill_activations(x, rng, false);
    fill_activations(residual, rng, false);
    const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
    for (const DType q_dtype : kQDTypes) {
      Case k;
      k.q_dtype = q_dtype;
      k.fused = true;
      k.q_stride = cols;
      k.threads = 1;
      const QuantCall one = run_quant(k, x, residual, w, 0);
      for (const int threads : {2, 3, 0}) {
        k.threads = threads;
        const QuantCall many = run_quant(k, x, residual, w, 0);
        EXPECT_TRUE(one.q.same_view_bytes(many.q)) << dtype_str(dtype) << ", threads " << threads;
        EXPECT_EQ(std::memcmp(one.scales.data(), many.scales.data(), rows * sizeof(float)), 0);
        EXPECT_TRUE(many.residual.check_unchanged("residual", one.residual.snapshot()));
      }
    }
  }
}

// Saturation at +-qmax, fp8 subnormals (a large static scale), tiny and huge inputs.
TEST(Quant, SaturationSubnormalsTinyAndHuge) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const DType dtype : kAllDTypes) {
    const std::int64_t rows = 5, cols = 300;
    for (const double magnitude : {1.0, 1e-30, 1e15}) {
      if (dtype != DType::kFloat32 && magnitude != 1.0) continue;  // outside fp16's range
      Buffer x(dtype, rows, cols);
      fill_normal(x, rng, 0.0, magnitude);
      const Buffer w = make_weight(WeightKind::kFloat32, dtype, cols, rng, 1.0);
      for (const DType q_dtype : kQDTypes) {
        Case k;
        k.q_dtype = q_dtype;
        k.q_stride = cols + 3;
        k.mode = Mode::kStatic;
        for (const float static_scale : {1e-4f, 0.01f, 100.0f}) {
          k.static_scale = static_scale;
          const QuantCall got = check_case(k, x, Buffer(), w);
          // |y| * 1e4 is mostly far beyond qmax: saturated. (Not for x ~ 1e-30: its squares
          // vanish in fp32, eps dominates, y ~ 1e-27.)
          if (static_scale == 1e-4f && magnitude != 1e-30) {
            int saturated = 0;
            for (std::int64_t j = 0; j < cols; ++j) {
              const double v = decode(got.q.at(0, j), q_dtype);
              saturated += v == detail::quant_max(q_dtype) || v == -detail::quant_max(q_dtype) ||
                           v == -128.0;
            }
            EXPECT_GT(saturated, cols / 2);
          }
        }
        k.mode = Mode::kDynamic;
        check_case(k, x, Buffer(), w);
      }
    }
  }
}

// An all-zero row: scale = min_scale and q = 0. A row holding a NaN: y is NaN throughout it
// (rstd is NaN), its dynamic scale is min_scale (amax over no non-NaN values is 0), q is 0
// (int8) or NaN (fp8); the rows around it are untouched by it. An Inf in x: rstd = 0, y = 0
// except NaN where x is Inf.
TEST(Quant, ZeroNaNAndInfRows) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const DType dtype : kAllDTypes) {
    const std::int64_t rows = 5, cols = 77;
    Buffer x(dtype, rows, cols);
    fill_activations(x, rng, false);
    for (std::int64_t j = 0; j < cols; ++j) x.set(1, j, 0.0);
    x.set(2, 13, std::numeric_limits<double>::quiet_NaN());
    x.set(3, 5, std::numeric_limits<double>::infinity());
    const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
    for (const DType q_dtype : kQDTypes) {
      for (const Mode mode : {Mode::kDynamic, Mode::kStatic}) {
        Case k;
        k.q_dtype = q_dtype;
        k.mode = mode;
        k.q_stride = cols;
        k.static_scale = 0.02f;
        const QuantCall got = check_case(k, x, Buffer(), w);
        const std::uint8_t nan_q = q_dtype == DType::kInt8 ? 0 : 0x7f;
        for (std::int64_t j = 0; j < cols; ++j) {
          EXPECT_EQ(got.q.at(1, j) & 0x7f, 0) << "zero row";  // fp8: -0 for a negative weight
          EXPECT_EQ(got.q.at(2, j), nan_q) << "NaN row";      // fp8: the canonical NaN, no sign
          EXPECT_EQ(got.q.at(3, j) & 0x7f, j == 5 ? nan_q : 0) << "Inf row";
        }
        if (mode == Mode::kDynamic) {
          EXPECT_EQ(got.scales[1], detail::quant_min_scale(q_dtype));
          EXPECT_EQ(got.scales[2], detail::quant_min_scale(q_dtype));
          EXPECT_EQ(got.scales[3], detail::quant_min_scale(q_dtype));
        }
      }
    }
  }
}

// Static mode quantizes rows straight from x only when no y * inv_scale can be NaN
// (quant_kernels.h); a NaN or Inf weight element must send the rows through the staged path,
// with the reference's q, and the smallest scales saturate.
TEST(Quant, StaticScaleWithNonFiniteWeightOrReciprocal) {
  Rng rng(seed_for(current_test_name(), 0));
  for (const DType dtype : kAllDTypes) {
    const std::int64_t rows = 6, cols = 70;  // more than two rows: the weight is prepared
    Buffer x(dtype, rows, cols);
    fill_activations(x, rng, false);
    for (std::int64_t j = 0; j < cols; j += 3) x.set(4, j, 0.0);  // zeros meet the Inf below
    for (const WeightKind kind : {WeightKind::kNone, WeightKind::kSame, WeightKind::kFloat32}) {
      for (const double bad : {std::numeric_limits<double>::quiet_NaN(),
                               std::numeric_limits<double>::infinity(), 1.0}) {
        if (kind == WeightKind::kNone && bad != 1.0) continue;
        Buffer w = make_weight(kind, dtype, cols, rng, 1.0);
        if (bad != 1.0) w.set(0, 9, bad);
        for (const DType q_dtype : kQDTypes) {
          // 3e-39: 1 / scale near FLT_MAX, so y * (1 / scale) overflows to Inf and saturates.
          for (const float static_scale : {0.02f, 3e-39f}) {
            if (bad != 1.0 && static_scale != 0.02f) continue;
            Case k;
            k.q_dtype = q_dtype;
            k.mode = Mode::kStatic;
            k.q_stride = cols;
            k.static_scale = static_scale;
            SCOPED_TRACE(::testing::Message() << weight_kind_str(kind) << ", w[9] = " << bad
                                              << ", scale " << static_scale);
            const QuantCall got = check_case(k, x, Buffer(), w);
            if (bad != 1.0) {
              const std::uint8_t nan_q = q_dtype == DType::kInt8 ? 0 : 0x7f;
              // A NaN weight makes y[9] NaN in every row; an Inf one, where x[9] is 0.
              EXPECT_EQ(got.q.at(4, 9), nan_q);
            }
          }
        }
      }
    }
  }
}

TEST(Quant, ZeroRowsIsANoOp) {
  float scales[1] = {-1.0f};
  const float one = 1.0f;
  EXPECT_NO_THROW(rms_norm_quant({}, const_matrix(nullptr, DType::kFloat16, 0, 9), {},
                                 matrix(nullptr, DType::kInt8, 0, 9), {nullptr, scales, nullptr}));
  EXPECT_NO_THROW(fused_add_rms_norm_quant(
      {}, const_matrix(nullptr, DType::kFloat16, 0, 9), matrix(nullptr, DType::kFloat16, 0, 9), {},
      matrix(nullptr, DType::kFloat8E4M3, 0, 9), {&one, nullptr, nullptr}));
  EXPECT_EQ(scales[0], -1.0f);
}

// The SIMD quantizers give the scalar ones' bits on every target: every 97th fp32 bit
// pattern (every 9973rd in quick mode) and every value near a rounding boundary.
TEST(Quant, SimdQuantizersMatchScalarOnEveryTarget) {
  std::vector<float> boundaries;
  auto around = [&](float v) {
    for (const float s : {v, -v}) {
      boundaries.push_back(s);
      boundaries.push_back(std::nextafter(s, 0.0f));
      boundaries.push_back(std::nextafter(s, 2 * s + 1.0f));
    }
  };
  for (int k = -130; k <= 130; ++k) around(static_cast<float>(k) + 0.5f);
  // The top of quantize_in_range's domain: qmax * (1 + 2^-20) and the values below it.
  for (const float qmax : {detail::kInt8Max, detail::kFloat8E4M3Max}) {
    for (float v = qmax; v <= qmax * (1.0 + 0x1p-20); v = std::nextafter(v, 2 * qmax)) around(v);
  }
  for (int b = 0; b < 0x7f; ++b) {  // every E4M3 value and the midpoints above them
    const float v = detail::e4m3_to_float(static_cast<std::uint8_t>(b));
    const float next = detail::e4m3_to_float(static_cast<std::uint8_t>(b + 1));
    around(v);
    around(b + 1 < 0x7f ? (v + next) / 2 : 464.0f);
  }
  for (const float v : {FLT_MAX, std::numeric_limits<float>::infinity(), FLT_MIN, 0x1p-149f}) {
    around(v);
  }
  boundaries.push_back(std::numeric_limits<float>::quiet_NaN());
  boundaries.push_back(-std::numeric_limits<float>::quiet_NaN());

  // Blocks of values: the boundaries first, then every 97th fp32 bit pattern of magnitude
  // below 1024 (every 9973rd in quick mode), and every 9973rd (99991st) beyond, where every
  // value saturates. Odd block lengths, so the staged tails are covered too.
  const std::uint64_t step = quick_mode() ? 9973u : 97u;
  const std::uint64_t saturated_step = quick_mode() ? 99991u : 9973u;
  constexpr std::size_t kBlock = 65539;
  std::vector<float> values;
  std::vector<std::uint8_t> got(kBlock);
  const auto targets = cpu::quant_kernels_for_all_supported_targets();
  ASSERT_FALSE(targets.empty());
  std::size_t mismatches = 0;
  auto check_block = [&](const cpu::QuantKernels& kernels, DType q_dtype) {
    // q = quantize(v * inv_scale (1)): exactly quantize(v). quantize_in_range is checked on
    // the values of its domain (quant_kernels.h): finite, |v| <= qmax * (1 + 2^-20).
    const double in_range_limit = detail::quant_max(q_dtype) * (1.0 + 0x1p-20);
    for (const bool in_range : {false, true}) {
      const cpu::QuantizeFn quantize = in_range
                                           ? kernels.quantize_in_range[0][cpu::quant_index(q_dtype)]
                                           : kernels.quantize[0][cpu::quant_index(q_dtype)];
      quantize(values.data(), got.data(), static_cast<std::int64_t>(values.size()), 1.0f);
      for (std::size_t i = 0; i < values.size(); ++i) {
        if (in_range && !(std::fabs(values[i]) <= in_range_limit)) continue;
        const std::uint8_t want = quantize_scalar(values[i], q_dtype);
        if (got[i] != want && ++mismatches <= 5) {
          ADD_FAILURE() << kernels.target_name << (in_range ? " (in range)" : "") << ", "
                        << dtype_str(q_dtype) << ": value " << values[i] << " (bits 0x" << std::hex
                        << detail::float_bits(values[i]) << "): got 0x" << int{got[i]}
                        << ", scalar 0x" << int{want};
        }
      }
    }
  };
  std::uint64_t next = 0;
  bool first = true;
  while (first || next <= 0xffffffffu) {
    values.clear();
    if (first) values = boundaries;
    first = false;
    for (; values.size() < kBlock && next <= 0xffffffffu;
         next += (next & 0x7fffffffu) < 0x44800000u ? step : saturated_step) {
      values.push_back(detail::bits_float(static_cast<std::uint32_t>(next)));
    }
    for (const auto& target : targets) {
      for (const DType q_dtype : kQDTypes) check_block(target.kernels, q_dtype);
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

// normalize_amax gives the same y and amax on every target (the backend runs one of them;
// the quantizers are checked on every target above).
TEST(Quant, NormalizeAmaxSameBitsOnEveryTarget) {
  Rng rng(seed_for(current_test_name(), 0));
  const auto targets = cpu::quant_kernels_for_all_supported_targets();
  ASSERT_FALSE(targets.empty());
  for (const DType dtype : kAllDTypes) {
    for (const WeightKind kind : {WeightKind::kNone, WeightKind::kSame, WeightKind::kFloat32}) {
      const std::int64_t cols = 1031;
      Buffer x(dtype, 1, cols);
      fill_activations(x, rng, false);
      x.set(0, 17, std::numeric_limits<double>::quiet_NaN());
      const Buffer w = make_weight(kind, dtype, cols, rng, 1.0);
      const int slot = kind == WeightKind::kNone      ? cpu::kNoParam
                       : kind == WeightKind::kFloat32 ? cpu::kFloat32Param
                                                      : cpu::kElementParam;
      std::vector<float> first(cols), y(cols);
      float first_amax = 0.0f;
      for (std::size_t t = 0; t < targets.size(); ++t) {
        const cpu::RowAmax amax = targets[t].kernels.normalize_amax[static_cast<int>(dtype)][slot](
            x.data(), w.empty() ? nullptr : w.data(), (t == 0 ? first : y).data(), cols, 0.37f,
            1.0f, nullptr);
        SCOPED_TRACE(::testing::Message() << targets[t].name << ", " << dtype_str(dtype) << ", "
                                          << weight_kind_str(kind));
        EXPECT_TRUE(amax.has_nan);  // x[17] is NaN
        if (t == 0) {
          first_amax = amax.amax;
          EXPECT_GT(amax.amax, 0.0f);
          continue;
        }
        EXPECT_EQ(detail::float_bits(amax.amax), detail::float_bits(first_amax));
        EXPECT_EQ(std::memcmp(y.data(), first.data(), cols * sizeof(float)), 0);
      }
    }
  }
}

// The streamed kernels (non-temporal stores for q's whole 64-byte lines, ordinary ones for the
// partial lines at both ends) write the bytes the ordinary kernels write, and only the n bytes
// asked for, at every start offset within a line and lengths around the line and vector
// boundaries, on every target.
TEST(Quant, StreamedKernelsMatchOrdinaryStores) {
  Rng rng(seed_for(current_test_name(), 0));
  const auto targets = cpu::quant_kernels_for_all_supported_targets();
  ASSERT_FALSE(targets.empty());
  constexpr std::int64_t kMaxN = 400, kGuard = 64;
  // Values within both q dtypes' ranges after the scaling below, and a few that saturate.
  std::uniform_real_distribution<float> values(-1.2f, 1.2f), weights(0.5f, 1.5f);
  std::vector<float> y(kMaxN);
  for (float& v : y) v = values(rng);
  Buffer x(DType::kBFloat16, 1, kMaxN);
  fill_activations(x, rng, false);
  std::vector<float> w(kMaxN);
  for (float& v : w) v = weights(rng);
  // 64-byte aligned storage with room for a line of offset and the guards on both sides.
  std::vector<std::uint8_t> storage(kMaxN + 4 * kGuard + 64);
  std::uint8_t* const aligned =
      storage.data() + (64 - reinterpret_cast<std::uintptr_t>(storage.data()) % 64) % 64 + kGuard;
  std::vector<std::uint8_t> want(kMaxN);
  for (const auto& target : targets) {
    const cpu::QuantKernels& k = target.kernels;
    for (const DType q_dtype : kQDTypes) {
      const int qi = cpu::quant_index(q_dtype);
      const float inv_scale = static_cast<float>(detail::quant_max(q_dtype));
      using Kernel = std::function<void(int streamed, std::uint8_t* q, std::int64_t n)>;
      const std::pair<const char*, Kernel> kernels[] = {
          {"quantize", [&](int s, std::uint8_t* q,
                           std::int64_t n) { k.quantize[s][qi](y.data(), q, n, inv_scale); }},
          {"quantize_in_range",
           [&](int s, std::uint8_t* q, std::int64_t n) {
             k.quantize_in_range[s][qi](y.data(), q, n, inv_scale / 1.25f);
           }},
          {"normalize_quantize",
           [&](int s, std::uint8_t* q, std::int64_t n) {
             k.normalize_quantize[s][static_cast<int>(DType::kBFloat16)][1][qi](
                 x.data(), w.data(), q, n, 0.37f, inv_scale, nullptr);
           }},
      };
      for (const auto& [name, kernel] : kernels) {
        for (std::int64_t offset = 0; offset < 64; offset += (offset < 4 || offset > 58) ? 1 : 7) {
          for (const std::int64_t n : {1, 15, 63, 64, 65, 127, 128, 129, 191, 255, 256, 333, 400}) {
            if (offset + n > kMaxN + 64) continue;
            SCOPED_TRACE(::testing::Message()
                         << target.name << ", " << name << ", " << dtype_str(q_dtype) << ", offset "
                         << offset << ", n " << n);
            kernel(0, want.data(), n);
            std::memset(aligned - kGuard, 0xa5, kMaxN + 64 + 2 * kGuard);
            std::uint8_t* const q = aligned + offset;
            kernel(1, q, n);
#if defined(__SSE2__)
            _mm_sfence();
#endif
            ASSERT_EQ(std::memcmp(q, want.data(), static_cast<std::size_t>(n)), 0);
            for (std::uint8_t* g = aligned - kGuard; g < q; ++g) ASSERT_EQ(*g, 0xa5);
            for (std::uint8_t* g = q + n; g < aligned + kMaxN + 64 + kGuard; ++g) {
              ASSERT_EQ(*g, 0xa5);
            }
          }
        }
      }
    }
  }
}

// ---- Argument checks -------------------------------------------------------------------------

class QuantErrors : public ::testing::Test {
 protected:
  static constexpr std::int64_t kRows = 4, kCols = 16;
  std::vector<std::uint16_t> x = std::vector<std::uint16_t>(kRows * kCols, 0x3c00);
  std::vector<std::uint16_t> residual = std::vector<std::uint16_t>(kRows * kCols, 0x3c00);
  std::vector<std::int8_t> q = std::vector<std::int8_t>(kRows * kCols);
  std::vector<float> scales = std::vector<float>(kRows);
  float static_scale = 0.5f, upper_bound = 2.0f;

  ConstMatrix xm() const { return const_matrix(x.data(), DType::kFloat16, kRows, kCols); }
  Matrix qm(DType dtype = DType::kInt8) { return matrix(q.data(), dtype, kRows, kCols); }
  QuantScale dynamic() { return {nullptr, scales.data(), nullptr}; }
  QuantScale fixed() { return {&static_scale, nullptr, nullptr}; }
};

TEST_F(QuantErrors, DTypes) {
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(DType::kFloat16), dynamic()),
                         "fusednorm::rms_norm_quant", "argument 'q'", "int8 or float8_e4m3fn");
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, const_matrix(q.data(), DType::kInt8, kRows, kCols), {},
                                        matrix(x.data(), DType::kInt8, kRows, kCols), dynamic()),
                         "argument 'x'", "output dtype of the quantized operators only");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), ConstVector{q.data(), DType::kFloat8E4M3, kCols}, qm(), dynamic()),
      "argument 'weight'", "float8_e4m3fn");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, xm(), matrix(residual.data(), DType::kBFloat16, kRows, kCols),
                               {}, qm(), dynamic()),
      "fusednorm::fused_add_rms_norm_quant", "argument 'residual'", "dtype");
  // The quantized dtypes are refused by the unquantized operators too.
  EXPECT_FUSEDNORM_ERROR(rms_norm({}, xm(), {}, qm(), nullptr), "fusednorm::rms_norm",
                         "argument 'y'", "output dtype of the quantized operators only");
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(static_cast<DType>(9)), dynamic()),
                         "argument 'q'", "not a quantized dtype");
}

TEST_F(QuantErrors, Shapes) {
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, matrix(q.data(), DType::kInt8, kRows - 1, kCols), dynamic()),
      "argument 'q'", "does not match x's");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, matrix(q.data(), DType::kInt8, kRows, kCols, kCols - 1),
                     dynamic()),
      "argument 'q'", "row_stride");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), ConstVector{x.data(), DType::kFloat16, kCols - 1}, qm(), dynamic()),
      "argument 'weight'", "size");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, matrix(nullptr, DType::kInt8, kRows, kCols), dynamic()),
      "argument 'q'", "null");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, xm(), matrix(nullptr, DType::kFloat16, kRows, kCols), {}, qm(),
                               dynamic()),
      "argument 'residual'", "null");
}

TEST_F(QuantErrors, ScaleCombinations) {
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(), QuantScale{}), "argument 'scale'",
                         "neither");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, qm(), {&static_scale, scales.data(), nullptr}),
      "argument 'scale'", "both");
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(), {&static_scale, nullptr, &upper_bound}),
                         "argument 'scale.scale_upper_bound'", "only for dynamic");
}

TEST_F(QuantErrors, ScaleValues) {
  for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), -0.0f}) {
    static_scale = bad;
    EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(), fixed()),
                           "argument 'scale.static_scale'", "finite and > 0");
    upper_bound = bad;
    EXPECT_FUSEDNORM_ERROR(
        fused_add_rms_norm_quant({}, xm(), matrix(residual.data(), DType::kFloat16, kRows, kCols),
                                 {}, qm(), {nullptr, scales.data(), &upper_bound}),
        "argument 'scale.scale_upper_bound'", "finite and > 0");
  }
  // Positive and finite, but its reciprocal is Inf (q = y * (1 / scale)).
  static_scale = 1e-39f;
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(), fixed()),
                         "argument 'scale.static_scale'", "1 / scale is finite");
  static_scale = 0x1p-128f;  // 1 / 2^-128 = 2^128 > FLT_MAX
  EXPECT_FUSEDNORM_ERROR(rms_norm_quant({}, xm(), {}, qm(), fixed()),
                         "argument 'scale.static_scale'", "1 / scale is finite");
  static_scale = 3e-39f;  // 1 / scale is about 3.3e38: accepted
  EXPECT_NO_THROW(rms_norm_quant({}, xm(), {}, qm(), fixed()));
}

TEST_F(QuantErrors, Overlap) {
  // q over x, row_scales over x / q / residual, residual over x.
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, matrix(x.data(), DType::kInt8, kRows, kCols), dynamic()),
      "argument 'q'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, qm(), {nullptr, reinterpret_cast<float*>(x.data()), nullptr}),
      "argument 'scale.row_scales'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, qm(), {nullptr, reinterpret_cast<float*>(q.data()), nullptr}),
      "argument 'scale.row_scales'", "overlaps 'q'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, qm(), {reinterpret_cast<float*>(q.data()), nullptr, nullptr}),
      "argument 'q'", "overlaps 'scale.static_scale'");
  EXPECT_FUSEDNORM_ERROR(
      rms_norm_quant({}, xm(), {}, qm(), {nullptr, scales.data(), scales.data() + 1}),
      "argument 'scale.row_scales'", "overlaps 'scale.scale_upper_bound'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, xm(), matrix(residual.data(), DType::kFloat16, kRows, kCols), {},
                               qm(), {nullptr, reinterpret_cast<float*>(residual.data()), nullptr}),
      "argument 'scale.row_scales'", "overlaps 'residual'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, xm(), matrix(x.data(), DType::kFloat16, kRows, kCols), {}, qm(),
                               dynamic()),
      "argument 'residual'", "overlaps 'x'");
  EXPECT_FUSEDNORM_ERROR(
      fused_add_rms_norm_quant({}, xm(), matrix(residual.data(), DType::kFloat16, kRows, kCols), {},
                               matrix(residual.data(), DType::kInt8, kRows, kCols), dynamic()),
      "argument 'q'", "overlaps 'residual'");
}

}  // namespace
}  // namespace fusednorm::test
