#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace fusednorm::test {

bool quick_mode() {
#ifdef FUSEDNORM_TEST_SANITIZED
  return true;
#else
  const char* env = std::getenv("FUSEDNORM_TEST_QUICK");
  return env != nullptr && env[0] != '\0' && std::string(env) != "0";
#endif
}

int case_count(int full, int quick) { return quick_mode() ? quick : full; }

std::string dtype_str(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kInt8: return "i8";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat64: return "f64";
  }
  return "invalid";
}

std::string weight_kind_str(WeightKind kind) {
  switch (kind) {
    case WeightKind::kNone: return "none";
    case WeightKind::kSame: return "same";
    case WeightKind::kFloat32: return "f32";
  }
  return "invalid";
}

std::string rms_variant_name(const ::testing::TestParamInfo<RmsVariant>& info) {
  return dtype_str(std::get<0>(info.param)) + "_w_" + weight_kind_str(std::get<1>(info.param)) +
         (std::get<2>(info.param) != 0.0f ? "_gemma" : "");
}

// ---- Buffer ------------------------------------------------------------------------------

Buffer::Buffer(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
               std::int64_t guard)
    : dtype_(dtype),
      rows_(rows),
      cols_(cols),
      stride_(row_stride < 0 ? cols : row_stride),
      guard_(guard) {
  // poison() and the element accessors know 2-, 4- and 8-byte dtypes only.
  if (element_size() < 2) throw std::invalid_argument("test Buffer: no 1-byte dtypes");
  const std::size_t bytes = static_cast<std::size_t>(total_elements()) * element_size();
  storage_.resize((bytes + 7) / 8 + 1);
  poison();
}

std::uint32_t Buffer::raw_bits(std::int64_t i) const {
  if (dtype_ == DType::kFloat64) {
    std::uint64_t u;
    std::memcpy(&u, bytes() + i * 8, 8);
    return static_cast<std::uint32_t>(u);
  }
  if (dtype_ == DType::kFloat32) {
    std::uint32_t u;
    std::memcpy(&u, bytes() + i * 4, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, bytes() + i * 2, 2);
  return h;
}

bool Buffer::raw_is_sentinel(std::int64_t i) const {
  switch (dtype_) {
    case DType::kFloat32: return raw_bits(i) == kSentinel32;
    case DType::kFloat16: return raw_bits(i) == kSentinel16;
    case DType::kBFloat16: return raw_bits(i) == kSentinelBf;
    case DType::kFloat64: {
      std::uint64_t u;
      std::memcpy(&u, bytes() + i * 8, 8);
      return u == kSentinel64;
    }
    default: break;
  }
  return false;
}

void Buffer::poison() {
  const std::int64_t n = total_elements();
  for (std::int64_t i = 0; i < n; ++i) {
    if (dtype_ == DType::kFloat64) {
      std::memcpy(bytes() + i * 8, &kSentinel64, 8);
    } else if (dtype_ == DType::kFloat32) {
      std::memcpy(bytes() + i * 4, &kSentinel32, 4);
    } else {
      const std::uint16_t s = dtype_ == DType::kFloat16 ? kSentinel16 : kSentinelBf;
      std::memcpy(bytes() + i * 2, &s, 2);
    }
  }
}

double Buffer::at(std::int64_t r, std::int64_t j) const {
  return detail::load_as_double(data(), dtype_, r * stride_ + j);
}

void Buffer::set(std::int64_t r, std::int64_t j, double v) {
  if (dtype_ == DType::kFloat64) {
    static_cast<double*>(data())[r * stride_ + j] = v;
    return;
  }
  detail::store_from_float(data(), dtype_, r * stride_ + j, static_cast<float>(v));
}

std::uint32_t Buffer::bits(std::int64_t r, std::int64_t j) const {
  return raw_bits(guard_ + r * stride_ + j);
}

bool Buffer::is_sentinel(std::int64_t r, std::int64_t j) const {
  return raw_is_sentinel(guard_ + r * stride_ + j);
}

std::vector<double> Buffer::values() const {
  std::vector<double> v(static_cast<std::size_t>(rows_ * cols_));
  for (std::int64_t r = 0; r < rows_; ++r) {
    for (std::int64_t j = 0; j < cols_; ++j) v[r * cols_ + j] = at(r, j);
  }
  return v;
}

bool Buffer::in_view(std::int64_t i, std::int64_t* r, std::int64_t* j) const {
  const std::int64_t k = i - guard_;
  if (k < 0 || k >= view_elements()) return false;
  *r = k / stride_;
  *j = k % stride_;
  return *j < cols_;
}

::testing::AssertionResult Buffer::check_written(const std::string& name) const {
  std::int64_t unwritten = 0, clobbered = 0;
  std::ostringstream detail;
  for (std::int64_t i = 0; i < total_elements(); ++i) {
    std::int64_t r = 0, j = 0;
    const bool inside = in_view(i, &r, &j);
    const bool sentinel = raw_is_sentinel(i);
    if (inside && sentinel) {
      if (unwritten++ < 3) detail << " unwritten (" << r << ", " << j << ");";
    } else if (!inside && !sentinel) {
      if (clobbered++ < 3) detail << " write outside the view at storage index " << i << ";";
    }
  }
  if (unwritten == 0 && clobbered == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << " (" << rows_ << " x " << cols_ << ", stride " << stride_ << "): "
         << unwritten << " elements not written, " << clobbered
         << " guard/gap elements overwritten:" << detail.str();
}

::testing::AssertionResult Buffer::check_guards(const std::string& name) const {
  std::int64_t clobbered = 0;
  std::ostringstream detail;
  for (std::int64_t i = 0; i < total_elements(); ++i) {
    std::int64_t r = 0, j = 0;
    if (!in_view(i, &r, &j) && !raw_is_sentinel(i)) {
      if (clobbered++ < 3) detail << " storage index " << i << ";";
    }
  }
  if (clobbered == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": " << clobbered
                                       << " guard/gap elements overwritten:" << detail.str();
}

::testing::AssertionResult Buffer::check_unchanged(
    const std::string& name, const std::vector<std::uint64_t>& before) const {
  if (before == storage_) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << " was modified, but it is an input";
}

// ---- Random problems ---------------------------------------------------------------------

std::uint64_t seed_for(const std::string& test_name, int case_index) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across standard libraries
  for (const char c : test_name) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h ^ (static_cast<std::uint64_t>(case_index) * 0x9e3779b97f4a7c15ull);
}

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info == nullptr ? "" : std::string(info->test_suite_name()) + "." + info->name();
}

std::int64_t random_cols(Rng& rng) {
  static constexpr std::int64_t kInteresting[] = {
      1,   2,    3,    4,    5,    7,    8,    9,    15,   16,   17,    31,   32,
      33,  63,   64,   65,   127,  128,  129,  255,  257,  1000, 1023,  1024, 1025,
      4095, 4096, 4097, 5003, 8191, 8192, 8193, 12289};
  std::uniform_int_distribution<int> pick(0, 2);
  if (pick(rng) < 2) {
    std::uniform_int_distribution<std::size_t> i(0, std::size(kInteresting) - 1);
    return kInteresting[i(rng)];
  }
  std::uniform_int_distribution<std::int64_t> any(1, 3000);
  return any(rng);
}

std::int64_t random_rows(Rng& rng) {
  static constexpr std::int64_t kInteresting[] = {1, 1, 2, 3, 4, 5, 7, 8, 13, 17, 33, 65};
  std::uniform_int_distribution<std::size_t> i(0, std::size(kInteresting) - 1);
  return kInteresting[i(rng)];
}

std::int64_t random_stride(Rng& rng, std::int64_t cols) {
  std::uniform_int_distribution<int> kind(0, 3);
  switch (kind(rng)) {
    case 0: return cols + 1;
    case 1: return cols + 1 + std::uniform_int_distribution<std::int64_t>(0, 40)(rng);
    default: return cols;
  }
}

void fill_activations(Buffer& b, Rng& rng, bool with_center) {
  std::uniform_real_distribution<double> log_scale(-4.0, 4.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> scale(static_cast<std::size_t>(b.rows())),
      center(static_cast<std::size_t>(b.rows()));
  for (std::int64_t r = 0; r < b.rows(); ++r) {
    scale[r] = std::exp2(log_scale(rng));
    center[r] = with_center ? 2.0 * scale[r] * normal(rng) : 0.0;
  }
  b.fill([&](std::int64_t r, std::int64_t) { return center[r] + scale[r] * normal(rng); });
}

void fill_normal(Buffer& b, Rng& rng, double mean, double stddev) {
  std::normal_distribution<double> normal(mean, stddev);
  b.fill([&](std::int64_t, std::int64_t) { return normal(rng); });
}

Buffer make_weight(WeightKind kind, DType x_dtype, std::int64_t cols, Rng& rng,
                   double mean) {
  if (kind == WeightKind::kNone) return {};
  Buffer w = Buffer::vector_of(weight_dtype(kind, x_dtype), cols);
  fill_normal(w, rng, mean, 0.5);
  return w;
}

// ---- Tolerances --------------------------------------------------------------------------

double tolerance(DType dtype) {
  // fp32 accumulation: chunks of 4096 elements summed with 2 vector accumulators, chunk
  // sums added in order; the measured relative error of rstd stays below 1e-6 for D up to
  // 2^20, so 8e-6 leaves a wide margin and still catches any fp16/bf16 intermediate.
  constexpr double kAccumulation = 8e-6;
  switch (dtype) {
    case DType::kFloat32: return kAccumulation + 2 * 0x1p-24;
    case DType::kFloat16: return kAccumulation + 2 * 0x1p-11;  // ~2^-10
    case DType::kBFloat16: return kAccumulation + 2 * 0x1p-8;  // ~2^-7
    // fp64 arithmetic throughout: sums of a few thousand terms stay near 1e-13.
    case DType::kFloat64:
      return 1e-12;
    default: break;  // quantized outputs have their own checks
  }
  return 0.0;
}

double absolute_floor(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 0x1p-150;
    case DType::kFloat16: return 0x1p-25;
    case DType::kBFloat16: return 0x1p-134;
    default: break;
  }
  return 0.0;
}

namespace {

std::map<std::string, double>& ratios() {
  static std::map<std::string, double> r;
  return r;
}

class RatioReporter : public ::testing::EmptyTestEventListener {
  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    for (const auto& [label, ratio] : ratios()) {
      std::cout << "[ max error ratio ] " << label << ": " << ratio
                << " of the tolerance\n";
    }
  }
};

const bool reporter_registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new RatioReporter);
  return true;
}();

std::string describe(double v) {
  std::ostringstream s;
  s.precision(9);
  s << v;
  return s.str();
}

}  // namespace

void record_ratio(const std::string& label, double ratio) {
  double& r = ratios()[label];
  r = std::max(r, ratio);
}

const std::map<std::string, double>& recorded_ratios() { return ratios(); }

namespace {

// One element's verdict; updates the worst ratio.
bool element_ok(double got, double ref, double allowed, double* worst) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  if (!std::isfinite(got)) return false;
  const double err = std::fabs(got - ref);
  if (allowed > 0.0) *worst = std::max(*worst, err / allowed);
  return err <= allowed;
}

}  // namespace

::testing::AssertionResult compare(const std::string& label, const Buffer& got,
                                   const std::vector<double>& ref,
                                   const std::vector<double>& row_scale, double tol,
                                   double floor) {
  const std::int64_t rows = got.rows(), cols = got.cols();
  if (ref.size() != static_cast<std::size_t>(rows * cols)) {
    return ::testing::AssertionFailure() << label << ": reference has " << ref.size()
                                         << " elements, expected " << rows * cols;
  }
  double worst = 0.0;
  std::int64_t bad = 0;
  std::ostringstream detail;
  for (std::int64_t r = 0; r < rows; ++r) {
    const double allowed = tol * row_scale[r] + floor;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = got.at(r, j), e = ref[r * cols + j];
      if (!element_ok(g, e, allowed, &worst) && bad++ < 5) {
        detail << "\n  (" << r << ", " << j << "): got " << describe(g) << ", reference "
               << describe(e) << ", allowed error " << describe(allowed);
      }
    }
  }
  record_ratio(label, worst);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << label << " (" << rows << " x " << cols << "): " << bad
                                       << " elements out of tolerance" << detail.str();
}

::testing::AssertionResult compare_vector(const std::string& label, const Buffer& got,
                                          const std::vector<double>& ref,
                                          const std::vector<double>& abs_sum, double tol_out,
                                          double tol_acc) {
  double max_ref = 0.0;
  for (const double v : ref) max_ref = std::max(max_ref, std::fabs(v));
  double worst = 0.0;
  std::int64_t bad = 0;
  std::ostringstream detail;
  for (std::int64_t j = 0; j < got.cols(); ++j) {
    const double allowed = tol_out * max_ref + tol_acc * abs_sum[j] + absolute_floor(got.dtype());
    const double g = got.at(j), e = ref[j];
    if (!element_ok(g, e, allowed, &worst) && bad++ < 5) {
      detail << "\n  [" << j << "]: got " << describe(g) << ", reference " << describe(e)
             << ", allowed error " << describe(allowed);
    }
  }
  record_ratio(label, worst);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << label << " (" << got.cols() << "): " << bad
                                       << " elements out of tolerance" << detail.str();
}

::testing::AssertionResult compare_stats(const std::string& label, const float* got,
                                         const std::vector<double>& ref,
                                         const std::vector<double>& scale, double tol) {
  double worst = 0.0;
  std::int64_t bad = 0;
  std::ostringstream detail;
  for (std::size_t r = 0; r < ref.size(); ++r) {
    const double allowed = tol * scale[r];
    if (!element_ok(got[r], ref[r], allowed, &worst) && bad++ < 5) {
      detail << "\n  [" << r << "]: got " << describe(got[r]) << ", reference "
             << describe(ref[r]) << ", allowed error " << describe(allowed);
    }
  }
  record_ratio(label, worst);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << label << ": " << bad << " rows out of tolerance"
                                       << detail.str();
}

std::vector<double> row_max_abs(const std::vector<double>& v, std::int64_t rows,
                                std::int64_t cols) {
  std::vector<double> m(static_cast<std::size_t>(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) m[r] = std::max(m[r], std::fabs(v[r * cols + j]));
  }
  return m;
}

}  // namespace fusednorm::test
