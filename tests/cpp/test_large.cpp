// Large problems: D = 1,048,576 against the reference, and 64-bit indexing through views
// whose row offsets exceed 2^32 elements. The latter live in sparse anonymous mappings:
// only the pages around each row are ever touched, so a view spanning 16 GB of address
// space costs a few pages of memory.
#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "test_util.h"

namespace fusednorm::test {
namespace {

constexpr std::int64_t kMegaD = 1 << 20;

TEST(Large, MillionWideRows) {
  const DType dtypes_full[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const std::size_t dtype_count = quick_mode() ? 1 : 3;
  for (std::size_t d = 0; d < dtype_count; ++d) {
    const DType dtype = dtypes_full[d];
    for (const std::int64_t rows : {std::int64_t{1}, std::int64_t{2}}) {
      SCOPED_TRACE(::testing::Message() << dtype_str(dtype) << ", rows " << rows);
      Rng rng(seed_for(current_test_name(), static_cast<int>(rows) * 3 + static_cast<int>(d)));
      Buffer x(dtype, rows, kMegaD), dy(dtype, rows, kMegaD), residual(dtype, rows, kMegaD);
      fill_activations(x, rng, true);
      fill_activations(dy, rng, false);
      fill_activations(residual, rng, false);
      const Buffer w = make_weight(WeightKind::kSame, dtype, kMegaD, rng, 1.0);
      const Buffer b = make_weight(WeightKind::kFloat32, dtype, kMegaD, rng, 0.0);
      Buffer y(dtype, rows, kMegaD);
      Buffer rstd = Buffer::floats(rows), mean = Buffer::floats(rows);
      const double tol = tolerance(dtype), floor = absolute_floor(dtype);

      rms_norm({}, x.cmatrix(), w.cvector(), y.matrix(), rstd.float_data());
      auto ref = reference::rms_norm(x.cmatrix(), w.cvector());
      EXPECT_TRUE(y.check_written("y"));
      EXPECT_TRUE(compare("large rms_norm y", y, ref.y, row_max_abs(ref.y, rows, kMegaD), tol, floor));
      EXPECT_TRUE(compare_stats("large rstd", rstd.float_data(), ref.rstd, ref.rstd,
                                tolerance(DType::kFloat32)));

      ref = reference::fused_add_rms_norm(x.cmatrix(), residual.cmatrix(), w.cvector());
      fused_add_rms_norm({}, x.cmatrix(), residual.matrix(), w.cvector(), y.matrix(), nullptr);
      EXPECT_TRUE(compare("large fused residual", residual, ref.residual,
                          std::vector<double>(static_cast<std::size_t>(rows), 0.0), 0.0));
      EXPECT_TRUE(compare("large fused y", y, ref.y, row_max_abs(ref.y, rows, kMegaD), tol, floor));

      layer_norm({}, x.cmatrix(), w.cvector(), b.cvector(), y.matrix(), mean.float_data(),
                 rstd.float_data());
      ref = reference::layer_norm(x.cmatrix(), w.cvector(), b.cvector());
      const auto unbiased = reference::layer_norm(x.cmatrix(), w.cvector(), {}).y;
      std::vector<double> scale = row_max_abs(unbiased, rows, kMegaD);
      for (double& s : scale) s += 5.0;  // |b| <= ~5 sigma
      EXPECT_TRUE(compare("large layer_norm y", y, ref.y, scale, tol, floor));

      // Backward, dx written over dy (the gradients are compared against a copy).
      const Buffer dy_copy = dy;
      Buffer dw = Buffer::vector_of(DType::kFloat32, kMegaD);
      Buffer db = Buffer::vector_of(DType::kFloat32, kMegaD);
      layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), mean.float_data(),
                          rstd.float_data(), dy.matrix(), dw.vector(), db.vector());
      const auto bref = reference::layer_norm_backward(dy_copy.cmatrix(), x.cmatrix(),
                                                       w.cvector(), true);
      EXPECT_TRUE(dy.check_written("dx"));
      // Scale-aware: dx ~ rstd * |dy * w|; compare against the largest reference value and
      // that bound (dx error does not shrink where g - mean_g cancels).
      std::vector<double> dx_scale = row_max_abs(bref.dx, rows, kMegaD);
      for (std::int64_t r = 0; r < rows; ++r) {
        double g = 0.0;
        for (std::int64_t j = 0; j < kMegaD; ++j) g = std::max(g, std::fabs(dy_copy.at(r, j) * w.at(j)));
        dx_scale[r] = std::max(dx_scale[r], rstd.float_data()[r] * g);
      }
      EXPECT_TRUE(compare("large layer_norm dx", dy, bref.dx, dx_scale, tol, floor));
      std::vector<double> abs_db(static_cast<std::size_t>(kMegaD), 0.0), abs_dw(abs_db);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t j = 0; j < kMegaD; ++j) {
          const double g = std::fabs(dy_copy.at(r, j));
          abs_db[j] += g;
          abs_dw[j] += g * 10.0;  // |xhat| stays below ~6 for normal data
        }
      }
      EXPECT_TRUE(compare_vector("large dw", dw, bref.dw, abs_dw, tolerance(DType::kFloat32),
                                 tolerance(DType::kFloat32)));
      EXPECT_TRUE(compare_vector("large db", db, bref.db, abs_db, tolerance(DType::kFloat32),
                                 tolerance(DType::kFloat32)));
    }
  }
}

// ---- 64-bit indexing --------------------------------------------------------------------------

// A rows x cols view with a huge row stride in a sparse mapping. Around each row, kWindow
// elements before and after are set to the sentinel and checked afterwards.
class SparseMatrix {
 public:
  static constexpr std::int64_t kWindow = 64;

  SparseMatrix(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t stride)
      : dtype_(dtype), rows_(rows), cols_(cols), stride_(stride) {
    bytes_ = static_cast<std::size_t>((rows - 1) * stride + cols + 2 * kWindow) * dtype_size(dtype);
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
    if (base_ == nullptr) return;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = -kWindow; j < cols + kWindow; ++j) poison(r, j);
    }
  }
  ~SparseMatrix() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  SparseMatrix(const SparseMatrix&) = delete;
  SparseMatrix& operator=(const SparseMatrix&) = delete;

  bool ok() const { return base_ != nullptr; }
  void* data() const { return base_ + kWindow * static_cast<std::int64_t>(dtype_size(dtype_)); }
  Matrix matrix() const { return {data(), dtype_, rows_, cols_, stride_}; }
  ConstMatrix cmatrix() const { return matrix(); }

  double at(std::int64_t r, std::int64_t j) const {
    return detail::load_as_float(data(), dtype_, r * stride_ + j);
  }
  void set(std::int64_t r, std::int64_t j, double v) {
    detail::store_from_float(data(), dtype_, r * stride_ + j, static_cast<float>(v));
  }
  std::uint32_t bits(std::int64_t r, std::int64_t j) const {
    std::uint32_t u = 0;
    std::memcpy(&u, static_cast<const unsigned char*>(data()) +
                        (r * stride_ + j) * static_cast<std::int64_t>(dtype_size(dtype_)),
                dtype_size(dtype_));
    return u;
  }
  std::uint32_t sentinel() const { return dtype_ == DType::kFloat32 ? kSentinel32 : kSentinel16; }
  // Guards untouched, every element written (outputs) or never the sentinel (inputs).
  ::testing::AssertionResult check(const char* name) const {
    for (std::int64_t r = 0; r < rows_; ++r) {
      for (std::int64_t j = -kWindow; j < cols_ + kWindow; ++j) {
        const bool inside = j >= 0 && j < cols_;
        if (inside == (bits(r, j) == sentinel())) {
          return ::testing::AssertionFailure()
                 << name << ": row " << r << ", column " << j
                 << (inside ? " not written" : " written outside the view");
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  void poison(std::int64_t r, std::int64_t j) {
    const std::uint32_t s = sentinel();
    std::memcpy(static_cast<unsigned char*>(data()) +
                    (r * stride_ + j) * static_cast<std::int64_t>(dtype_size(dtype_)),
                &s, dtype_size(dtype_));
  }

  DType dtype_;
  std::int64_t rows_, cols_, stride_;
  std::size_t bytes_ = 0;
  unsigned char* base_ = nullptr;
};

// Row r starts at r * (2^31 + 19) elements: beyond int32 for r = 1 and beyond uint32 (and
// 2^32 bytes) for r = 2. Every operator, forward and backward.
TEST(Large, SixtyFourBitRowOffsets) {
  const std::int64_t rows = 3, cols = 77, stride = (std::int64_t{1} << 31) + 19;
  const DType dtype = DType::kFloat16;
  SparseMatrix x(dtype, rows, cols, stride), y(dtype, rows, cols, stride),
      dy(dtype, rows, cols, stride), dx(dtype, rows, cols, stride),
      residual(dtype, rows, cols, stride);
  if (!x.ok() || !y.ok() || !dy.ok() || !dx.ok() || !residual.ok()) {
    GTEST_SKIP() << "cannot reserve 5 x 8.6 GB of address space here";
  }
  ASSERT_GT((rows - 1) * stride, std::int64_t{1} << 32);
  Rng rng(seed_for(current_test_name(), 0));
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      x.set(r, j, (r + 1) * normal(rng) + 0.5);
      dy.set(r, j, normal(rng));
      residual.set(r, j, normal(rng));
    }
  }
  const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
  const Buffer b = make_weight(WeightKind::kSame, dtype, cols, rng, 0.0);
  float rstd[rows], mean[rows];
  const double tol = tolerance(dtype), floor = absolute_floor(dtype);

  // The comparisons read the sparse outputs through a small contiguous copy.
  auto gather = [&](const SparseMatrix& m) {
    Buffer out(dtype, rows, cols);
    out.fill([&](std::int64_t r, std::int64_t j) { return m.at(r, j); });
    return out;
  };

  rms_norm({}, x.cmatrix(), w.cvector(), y.matrix(), rstd);
  auto ref = reference::rms_norm(x.cmatrix(), w.cvector());
  EXPECT_TRUE(y.check("rms_norm y"));
  EXPECT_TRUE(compare("64-bit rms_norm y", gather(y), ref.y, row_max_abs(ref.y, rows, cols), tol, floor));

  layer_norm({}, x.cmatrix(), w.cvector(), b.cvector(), y.matrix(), mean, rstd);
  ref = reference::layer_norm(x.cmatrix(), w.cvector(), b.cvector());
  std::vector<double> scale = row_max_abs(ref.y, rows, cols);
  for (double& s : scale) s += 3.0;
  EXPECT_TRUE(y.check("layer_norm y"));
  EXPECT_TRUE(compare("64-bit layer_norm y", gather(y), ref.y, scale, tol, floor));

  ref = reference::fused_add_rms_norm(x.cmatrix(), residual.cmatrix(), w.cvector());
  fused_add_rms_norm({}, x.cmatrix(), residual.matrix(), w.cvector(), y.matrix(), rstd);
  EXPECT_TRUE(residual.check("residual"));
  EXPECT_TRUE(compare("64-bit fused residual", gather(residual), ref.residual,
                      std::vector<double>(rows, 0.0), 0.0));
  EXPECT_TRUE(compare("64-bit fused y", gather(y), ref.y, row_max_abs(ref.y, rows, cols), tol, floor));

  for (const bool centered : {false, true}) {
    SCOPED_TRACE(centered ? "layer_norm_backward" : "rms_norm_backward");
    Buffer dw = Buffer::vector_of(DType::kFloat32, cols);
    reference::BackwardResult bref;
    if (centered) {
      layer_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, nullptr,
                          dx.matrix(), dw.vector(), {});
      bref = reference::layer_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector(), false);
    } else {
      rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), nullptr, dx.matrix(),
                        dw.vector());
      bref = reference::rms_norm_backward(dy.cmatrix(), x.cmatrix(), w.cvector());
    }
    EXPECT_TRUE(dx.check("dx"));
    std::vector<double> dx_scale = row_max_abs(bref.dx, rows, cols);
    for (double& s : dx_scale) s *= 4.0;  // cancellation headroom for these small rows
    EXPECT_TRUE(compare("64-bit dx", gather(dx), bref.dx, dx_scale, tol, floor));
    std::vector<double> abs_dw(static_cast<std::size_t>(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < cols; ++j) abs_dw[j] += std::fabs(dy.at(r, j)) * 10.0;
    }
    EXPECT_TRUE(compare_vector("64-bit dw", dw, bref.dw, abs_dw, tolerance(DType::kFloat32),
                               tolerance(DType::kFloat32)));
  }
  EXPECT_TRUE(x.check("x (input)"));
  EXPECT_TRUE(dy.check("dy (input)"));
}

// A streamed loop runs descending when its output lies a little after its input modulo
// 4096 bytes (row_kernels-inl.h, StreamDescending): at every such offset, and at the
// ascending ones, the outputs must have the same bits and no byte outside them may change.
// Long rows (Normalize's streamed loop, with partial lines at both ends) and short rows and
// a static-scale int8 q (both staged, then StreamCopy). Streamed when run with
// FUSEDNORM_STREAM_MIN_BYTES=1 (the streaming_stores run of this suite); plain stores
// otherwise, which must agree as well.
TEST(Large, StreamedOutputsAtAnyOffsetFromTheirInput) {
  constexpr std::int64_t kPage = 4096, kGuardBytes = 256;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const std::int64_t cols : {std::int64_t{4096 + 37}, std::int64_t{128}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " D=" + std::to_string(cols));
      const std::int64_t rows = cols > 1000 ? 3 : 300;
      const std::size_t esize = dtype_size(dtype);
      const std::int64_t bytes = rows * cols * static_cast<std::int64_t>(esize);
      Rng rng(seed_for(current_test_name(), static_cast<int>(esize) + static_cast<int>(cols)));
      Buffer x(dtype, rows, cols);
      fill_normal(x, rng, 0.3, 2.0);
      const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
      const float static_scale = 0.02f;
      // One arena for every placement; y starts `offset` bytes after x modulo 4096.
      std::vector<unsigned char> arena(
          static_cast<std::size_t>(bytes + 2 * kPage + 2 * kGuardBytes));
      const auto x_address = reinterpret_cast<std::uintptr_t>(x.data());
      std::vector<unsigned char> first_y, first_q;
      for (const std::int64_t offset : {0, 16, 32, 64, 96, 1024, 2046, 2048, 3072, 4032, 4080}) {
        SCOPED_TRACE("y - x = " + std::to_string(offset) + " (mod 4096)");
        std::fill(arena.begin(), arena.end(), static_cast<unsigned char>(0xa5));
        const auto base = reinterpret_cast<std::uintptr_t>(arena.data()) + kGuardBytes;
        const std::uintptr_t skip =
            (x_address + static_cast<std::uintptr_t>(offset) - base) % kPage;
        unsigned char* y = arena.data() + kGuardBytes + skip;
        ASSERT_EQ((reinterpret_cast<std::uintptr_t>(y) - x_address) % kPage,
                  static_cast<std::uintptr_t>(offset));
        const Matrix ym{y, dtype, rows, cols, cols};
        rms_norm({}, x.cmatrix(), w.cvector(), ym, nullptr);
        std::vector<unsigned char> y_bits(y, y + bytes);
        const Matrix qm{y, DType::kInt8, rows, cols, cols};
        QuantScale scale;
        scale.static_scale = &static_scale;
        rms_norm_quant({}, x.cmatrix(), w.cvector(), qm, scale);
        std::vector<unsigned char> q_bits(y, y + rows * cols);
        for (std::size_t i = 0; i < arena.size(); ++i) {
          const auto at =
              static_cast<std::int64_t>(i) - static_cast<std::int64_t>(kGuardBytes + skip);
          if (at < 0 || at >= bytes) {
            ASSERT_EQ(arena[i], 0xa5) << "byte " << at << " from y's start was written";
          }
        }
        if (first_y.empty()) {
          first_y = y_bits;
          first_q = q_bits;
        } else {
          EXPECT_TRUE(y_bits == first_y) << "rms_norm's y differs from its bits at offset 0";
          EXPECT_TRUE(q_bits == first_q) << "rms_norm_quant's q differs from its bits at offset 0";
        }
      }
    }
  }
}

// A fresh anonymous mapping is untouched until a store reaches one of its sampled pages;
// the first page (where an allocator keeps its header) is not sampled.
TEST(Large, UntouchedMemoryIsMemoryNoStoreHasReached) {
  const std::size_t bytes = std::size_t{8} << 20;
  void* const mapped =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  // Small pages, whatever the THP mode: a huge page would make a store's neighbours resident.
  madvise(mapped, bytes, MADV_NOHUGEPAGE);
  char* const p = static_cast<char*>(mapped);
  EXPECT_TRUE(cpu::untouched_memory(p, bytes));
  p[0] = 1;
  EXPECT_TRUE(cpu::untouched_memory(p, bytes)) << "the first page is the allocator's";
  p[bytes / 2] = 1;
  EXPECT_FALSE(cpu::untouched_memory(p, bytes)) << "the middle page was written";
  EXPECT_TRUE(cpu::untouched_memory(p + bytes / 2 + 4096, bytes / 4)) << "a range past it";
  p[bytes - 1] = 1;
  EXPECT_FALSE(cpu::untouched_memory(p + bytes / 2 + 4096, bytes / 2 - 4096)) << "its last page";
  munmap(mapped, bytes);
  std::vector<char> touched(bytes, 0);
  EXPECT_FALSE(cpu::untouched_memory(touched.data(), bytes));
  EXPECT_FALSE(cpu::untouched_memory(nullptr, bytes));
  EXPECT_FALSE(cpu::untouched_memory(p, 4096)) << "no whole page past the first";
}

// Whether advise_huge_pages gives its advice here: THP in "madvise" mode, and
// FUSEDNORM_HUGE_PAGES not "0" (cpu_backend.cpp).
bool expect_huge_page_advice() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(file, line);
  const char* setting = std::getenv("FUSEDNORM_HUGE_PAGES");
  return line.find("[madvise]") != std::string::npos &&
         (setting == nullptr || std::strcmp(setting, "0") != 0);
}
// Whether the backend gives it for a large fresh output: also not when
// FUSEDNORM_STREAM_MIN_BYTES alone decides how outputs are written.
bool expect_fresh_output_advice() {
  return expect_huge_page_advice() && std::getenv("FUSEDNORM_STREAM_MIN_BYTES") == nullptr;
}

// The VmFlags of the mapping holding address (/proc/self/smaps), e.g. "rd wr mr mw me ac hg";
// "hg" marks a region advised with MADV_HUGEPAGE.
std::string vm_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto where = reinterpret_cast<std::uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long begin = 0, end = 0;
    // A mapping's first line starts "begin-end perms"; its fields follow, VmFlags last.
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2 &&
        line.find(' ') > line.find('-')) {
      inside = begin <= where && where < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8);
    }
  }
  return "";
}

// Large outputs take ordinary stores in untouched memory (asked onto huge pages first where
// THP is "madvise") and non-temporal ones elsewhere: the same bits either way, every element
// written, nothing past the view. Each operator's output kind: y, q (static and dynamic
// scales), and the backward's dx.
TEST(Large, FreshAndTouchedOutputsGetTheSameBits) {
  // y and dx: fp32 64 MiB, bf16 32 MiB; q: 16 MiB, the smallest size the backend prepares.
  const std::int64_t rows = 4096, cols = 4096;
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const bool advice = expect_fresh_output_advice();
  const float static_scale = 0.02f;
  std::vector<float> row_scales(rows);
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Rng rng(seed_for(current_test_name(), static_cast<int>(dtype)));
    Buffer x(dtype, rows, cols), dy(dtype, rows, cols);
    fill_activations(x, rng, true);
    fill_activations(dy, rng, false);
    const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
    std::vector<float> rstd(rows);
    rms_norm({}, x.cmatrix(), w.cvector(), Buffer(dtype, rows, cols).matrix(), rstd.data());
    struct Output {
      const char* name;
      DType dtype;
      std::function<void(void*)> write;
    };
    const Output outputs[] = {
        {"y", dtype,
         [&](void* out) {
           rms_norm({}, x.cmatrix(), w.cvector(), {out, dtype, rows, cols, cols}, nullptr);
         }},
        {"dx", dtype,
         [&](void* out) {
           rms_norm_backward({}, dy.cmatrix(), x.cmatrix(), w.cvector(), rstd.data(),
                             {out, dtype, rows, cols, cols}, {});
         }},
        {"q static", DType::kInt8,
         [&](void* out) {
           QuantScale scale;
           scale.static_scale = &static_scale;
           rms_norm_quant({}, x.cmatrix(), w.cvector(), {out, DType::kInt8, rows, cols, cols},
                          scale);
         }},
        {"q dynamic", DType::kFloat8E4M3,
         [&](void* out) {
           QuantScale scale;
           scale.row_scales = row_scales.data();
           rms_norm_quant({}, x.cmatrix(), w.cvector(),
                          {out, DType::kFloat8E4M3, rows, cols, cols}, scale);
         }},
    };
    for (const Output& output : outputs) {
      SCOPED_TRACE(::testing::Message() << dtype_str(dtype) << " " << output.name);
      const std::size_t bytes = static_cast<std::size_t>(rows * cols) * dtype_size(output.dtype);
      std::vector<char> touched(bytes + 64, 0x5a);
      const std::size_t mapped_bytes = bytes + 2 * 4096;
      void* const mapped =
          mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_NE(mapped, MAP_FAILED);
      char* const fresh = static_cast<char*>(mapped) + 64;  // not page-aligned, as from malloc
      ASSERT_TRUE(cpu::untouched_memory(fresh, bytes));
      output.write(fresh);
      output.write(touched.data());
      EXPECT_EQ(std::memcmp(fresh, touched.data(), bytes), 0);
      EXPECT_EQ(touched[bytes], 0x5a);
      EXPECT_EQ(fresh[bytes], 0) << "written past the view";
      // The advice covers whole huge pages inside the output only.
      const auto first_huge = (reinterpret_cast<std::uintptr_t>(fresh) + kHugePage - 1) /
                              kHugePage * kHugePage;
      const std::string flags = vm_flags(reinterpret_cast<void*>(first_huge));
      EXPECT_EQ(flags.find(" hg") != std::string::npos, advice) << flags;
      EXPECT_EQ(vm_flags(mapped).find(" hg"), std::string::npos)
          << "advised below the first whole huge page: " << vm_flags(mapped);
      munmap(mapped, mapped_bytes);
    }
  }
}

// advise_huge_pages advises whole huge pages inside the range only, changes no byte, and
// declines ranges holding none.
TEST(Large, HugePageAdviceStaysInsideTheRange) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t mapped_bytes = 3 * kHugePage;
  void* const mapped =
      mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  char* const base = static_cast<char*>(mapped);
  EXPECT_FALSE(cpu::advise_huge_pages(nullptr, kHugePage));
  EXPECT_FALSE(cpu::advise_huge_pages(base + 64, kHugePage - 128)) << "no whole huge page inside";
  // A whole huge page inside the mapping, with at least a page of the mapping before it.
  const auto aligned = (reinterpret_cast<std::uintptr_t>(base) + 4096 + kHugePage - 1) /
                       kHugePage * kHugePage;
  char* const huge = reinterpret_cast<char*>(aligned);
  huge[-1] = 7;
  EXPECT_EQ(cpu::advise_huge_pages(huge - 4096, kHugePage + 8192), expect_huge_page_advice());
  EXPECT_EQ(huge[-1], 7) << "the advice changed a byte";
  EXPECT_EQ(huge[0], 0);
  if (expect_huge_page_advice()) {
    EXPECT_NE(vm_flags(huge).find(" hg"), std::string::npos) << vm_flags(huge);
    EXPECT_EQ(vm_flags(huge - 1).find(" hg"), std::string::npos) << "advised outside the range";
    EXPECT_EQ(vm_flags(huge + kHugePage).find(" hg"), std::string::npos)
        << "advised outside the range";
  }
  munmap(mapped, mapped_bytes);
}

}  // namespace
}  // namespace fusednorm::test
