// Shared harness of the fusednorm C++ tests: guarded and poisoned buffers, seeded random
// problems, per-dtype tolerances and comparisons against the fp64 reference.
//
// Every buffer a test hands to the library lives inside a larger allocation: a guard region
// before and after the view, and (for row_stride > D) the gaps between rows. All of it
// starts out as a signalling-NaN sentinel that no arithmetic can produce. After a call, an
// output must have every in-view element overwritten and every guard / gap element still
// the sentinel; an input must be byte-for-byte unchanged. Input gaps stay poisoned too, so
// a kernel that reads past a row's end turns its output into NaN.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/scalar_convert.h"
#include "fusednorm/fusednorm.h"
#include "fusednorm/reference.h"

namespace fusednorm::test {

using Rng = std::mt19937_64;

inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Sentinels: signalling NaNs with a payload. Arithmetic only ever produces quiet NaNs and
// every conversion in the library quiets a NaN, so an element holding one was not written.
inline constexpr std::uint32_t kSentinel32 = 0x7fa5a5a5u;
inline constexpr std::uint16_t kSentinel16 = 0x7d5au;   // fp16 sNaN
inline constexpr std::uint16_t kSentinelBf = 0x7f85u;   // bf16 sNaN
inline constexpr std::uint64_t kSentinel64 = 0x7ff5a5a5a5a5a5a5u;  // fp64 sNaN
// Elements of guard before and after each buffer; odd so that views start unaligned.
inline constexpr std::int64_t kGuard = 37;

// Heavy tests shrink when FUSEDNORM_TEST_QUICK=1 or in sanitizer builds.
bool quick_mode();
// Number of random cases: `full` normally, `quick` in quick mode.
int case_count(int full, int quick);

std::string dtype_str(DType dtype);
// Test-name suffix of a test parameterized over DType.
inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& param) {
  return dtype_str(param.param);
}

// ---- Guarded buffers ---------------------------------------------------------------------

// A rows x cols view with row_stride inside a guarded, poisoned allocation. Also used for
// vectors (rows = 1) and fp32 per-row statistics (rows = 1, cols = number of rows; cols may
// be 0 there).
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t row_stride = -1,
         std::int64_t guard = kGuard);

  static Buffer vector_of(DType dtype, std::int64_t size) { return Buffer(dtype, 1, size); }
  static Buffer floats(std::int64_t count) { return Buffer(DType::kFloat32, 1, count); }

  DType dtype() const { return dtype_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t row_stride() const { return stride_; }
  std::size_t element_size() const { return dtype_size(dtype_); }

  void* data() { return bytes() + guard_ * static_cast<std::int64_t>(element_size()); }
  const void* data() const {
    return bytes() + guard_ * static_cast<std::int64_t>(element_size());
  }
  float* float_data() { return static_cast<float*>(data()); }

  Matrix matrix() { return {data(), dtype_, rows_, cols_, stride_}; }
  ConstMatrix cmatrix() const { return {data(), dtype_, rows_, cols_, stride_}; }
  Vector vector() { return {data(), dtype_, cols_}; }
  ConstVector cvector() const { return {data(), dtype_, cols_}; }

  double at(std::int64_t r, std::int64_t j) const;
  double at(std::int64_t j) const { return at(0, j); }
  // Stores v rounded (once, from double to the dtype via fp32; float64 stores v itself).
  void set(std::int64_t r, std::int64_t j, double v);
  // The element's bit pattern (float64: its low 32 bits; compare values() for those).
  std::uint32_t bits(std::int64_t r, std::int64_t j) const;
  bool is_sentinel(std::int64_t r, std::int64_t j) const;

  // Every element (guards and gaps included) back to the sentinel.
  void poison();
  // In-view elements from gen(r, j); guards and gaps keep the sentinel.
  template <typename Gen>
  void fill(Gen&& gen) {
    poison();
    for (std::int64_t r = 0; r < rows_; ++r) {
      for (std::int64_t j = 0; j < cols_; ++j) set(r, j, gen(r, j));
    }
  }
  // Contiguous copy of the view as doubles.
  std::vector<double> values() const;

  // Output check: every in-view element written (not the sentinel), every guard and gap
  // element still the sentinel.
  ::testing::AssertionResult check_written(const std::string& name) const;
  // Only the guards and gaps are checked (for outputs that may legitimately hold anything).
  ::testing::AssertionResult check_guards(const std::string& name) const;
  // Nothing at all was written: identical bytes to `before`.
  std::vector<std::uint64_t> snapshot() const { return storage_; }
  void restore(const std::vector<std::uint64_t>& saved) { storage_ = saved; }
  bool empty() const { return storage_.empty(); }
  ::testing::AssertionResult check_unchanged(const std::string& name,
                                             const std::vector<std::uint64_t>& before) const;

 private:
  unsigned char* bytes() { return reinterpret_cast<unsigned char*>(storage_.data()); }
  const unsigned char* bytes() const {
    return reinterpret_cast<const unsigned char*>(storage_.data());
  }
  std::int64_t view_elements() const { return rows_ == 0 ? 0 : (rows_ - 1) * stride_ + cols_; }
  std::int64_t total_elements() const { return 2 * guard_ + view_elements(); }
  std::uint32_t raw_bits(std::int64_t storage_index) const;
  bool raw_is_sentinel(std::int64_t storage_index) const;
  // Which view element a storage index is, or false for a guard / gap element.
  bool in_view(std::int64_t storage_index, std::int64_t* r, std::int64_t* j) const;

  DType dtype_ = DType::kFloat32;
  std::int64_t rows_ = 0, cols_ = 0, stride_ = 0, guard_ = 0;
  std::vector<std::uint64_t> storage_;
};

// ---- Random problems ---------------------------------------------------------------------

// A seed that depends on the test's name and a case index, so failures reproduce and
// different tests see different data.
std::uint64_t seed_for(const std::string& test_name, int case_index);
std::string current_test_name();

// Row lengths: small odd sizes, vector-width and chunk boundaries, random sizes.
std::int64_t random_cols(Rng& rng);
std::int64_t random_rows(Rng& rng);
// cols, or cols plus a small random gap.
std::int64_t random_stride(Rng& rng, std::int64_t cols);

// Row-scaled normal data: row r is N(center_r, scale_r) with scale_r = 2^U(-4, 4), stored
// in the buffer's dtype (so the reference reads exactly what the library reads).
void fill_activations(Buffer& b, Rng& rng, bool with_center);
void fill_normal(Buffer& b, Rng& rng, double mean, double stddev);

// ---- Tolerances and comparison -------------------------------------------------------------

// Relative tolerance (against the row's scale) of one output element computed with fp32
// arithmetic and rounded once to `dtype`: two half-ulps of the output dtype plus the fp32
// accumulation error of the chunked row sums.
double tolerance(DType dtype);
// Smallest absolute error that can never be avoided: half the dtype's subnormal step.
double absolute_floor(DType dtype);

// Records the largest error / tolerance ratio seen per label; printed at the end of the
// run ("[ max error ratio ] ..."), so tolerance headroom is visible in the test log.
void record_ratio(const std::string& label, double ratio);
const std::map<std::string, double>& recorded_ratios();

// got (a rows x cols view) against ref (contiguous rows x cols), element (r, j) allowed
// tol * scale[r] + floor of error. NaN in ref requires NaN; an infinite ref requires the
// same infinity.
::testing::AssertionResult compare(const std::string& label, const Buffer& got,
                                   const std::vector<double>& ref,
                                   const std::vector<double>& row_scale, double tol,
                                   double floor = 0.0);
// A vector (dw, db): element j allowed tol_out * max|ref| + tol_acc * abs_sum[j].
::testing::AssertionResult compare_vector(const std::string& label, const Buffer& got,
                                          const std::vector<double>& ref,
                                          const std::vector<double>& abs_sum, double tol_out,
                                          double tol_acc);
// fp32 per-row statistics (rstd, mean) against the reference, tolerance relative to scale.
::testing::AssertionResult compare_stats(const std::string& label, const float* got,
                                         const std::vector<double>& ref,
                                         const std::vector<double>& scale, double tol);

// max_j |v[r, j]| per row of a contiguous rows x cols vector.
std::vector<double> row_max_abs(const std::vector<double>& v, std::int64_t rows,
                                std::int64_t cols);

// ---- Parameter names -------------------------------------------------------------------------

enum class WeightKind { kNone, kSame, kFloat32 };
std::string weight_kind_str(WeightKind kind);
inline DType weight_dtype(WeightKind kind, DType x_dtype) {
  return kind == WeightKind::kFloat32 ? DType::kFloat32 : x_dtype;
}

// The parameters of every RMSNorm suite (forward, fused add, backward): dtype x weight
// variant x weight_offset (0: Llama's w, 1: Gemma's 1 + w).
using RmsVariant = std::tuple<DType, WeightKind, float>;
class RmsVariantTest : public ::testing::TestWithParam<RmsVariant> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  WeightKind weight_kind() const { return std::get<1>(GetParam()); }
  float offset() const { return std::get<2>(GetParam()); }
};
// All of them: every dtype; no weight, a weight in x's dtype, an fp32 weight; both offsets.
inline auto all_rms_variants() {
  return ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                            ::testing::Values(WeightKind::kNone, WeightKind::kSame, WeightKind::kFloat32),
                            ::testing::Values(0.0f, 1.0f));
}
// float64 (a verification dtype: no mixing, so no fp32 weight): no weight or a float64
// weight; both offsets.
inline auto float64_rms_variants() {
  return ::testing::Combine(::testing::Values(DType::kFloat64),
                            ::testing::Values(WeightKind::kNone, WeightKind::kSame),
                            ::testing::Values(0.0f, 1.0f));
}
std::string rms_variant_name(const ::testing::TestParamInfo<RmsVariant>& info);

// A weight (or bias) of the given kind, N(mean, 0.5); an empty Buffer for kNone.
Buffer make_weight(WeightKind kind, DType x_dtype, std::int64_t cols, Rng& rng,
                   double mean);
// The view the API takes: absent (data == nullptr) for an empty Buffer.
inline ConstVector view_of(const Buffer& b) { return b.empty() ? ConstVector{} : b.cvector(); }
inline Vector mutable_view_of(Buffer& b) { return b.empty() ? Vector{} : b.vector(); }

// Expects `statement` to throw fusednorm::Error whose message contains every fragment.
#define EXPECT_FUSEDNORM_ERROR(statement, ...)                                              \
  do {                                                                                    \
    bool fusednorm_threw_ = false;                                                        \
    try {                                                                                 \
      statement;                                                                          \
    } catch (const ::fusednorm::Error& e) {                                               \
      fusednorm_threw_ = true;                                                            \
      const std::string fusednorm_what_ = e.what();                                       \
      for (const char* fragment : {__VA_ARGS__}) {                                        \
        EXPECT_NE(fusednorm_what_.find(fragment), std::string::npos)                      \
            << "message \"" << fusednorm_what_ << "\" lacks \"" << fragment << "\"";      \
      }                                                                                   \
    } catch (const std::exception& e) {                                                   \
      ADD_FAILURE() << #statement << " threw a non-fusednorm exception: " << e.what();    \
      fusednorm_threw_ = true;                                                            \
    }                                                                                     \
    EXPECT_TRUE(fusednorm_threw_) << #statement << " did not throw";                      \
  } while (0)

}  // namespace fusednorm::test
