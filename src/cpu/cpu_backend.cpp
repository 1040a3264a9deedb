#include "cpu/cpu_backend.h"

#include <omp.h>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#define FUSEDNORM_HAVE_MINCORE 1
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/quantize.h"
#include "core/scalar_convert.h"
#include "cpu/f64_kernels.h"
#include "cpu/quant_kernels.h"
#include "cpu/row_kernels.h"

namespace fusednorm::cpu {
namespace {

using detail::BackwardProblem;
using detail::ForwardProblem;
using detail::kernel_weight_offset;
using detail::NormKind;
using detail::Phase;

// Below this many bytes per thread, waking another thread costs more than it saves.
constexpr std::size_t kMinBytesPerThread = 256 * 1024;
constexpr std::int64_t kMaxRowBlocks = 64;
constexpr std::int64_t kMinRowsPerBlock = 16;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Orders this thread's non-temporal stores before its later stores (and before the barrier
// that ends a parallel region), so every thread then sees the streamed output.
void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// body(i) for i in [0, count), statically scheduled over `threads` threads. Each thread
// ends with a store fence, since the row kernels may have streamed their output. One thread
// runs the loop in place: entering even a one-thread OpenMP region is a call into the
// runtime that a one-row call (1 x 4096, about 1 us) would notice.
template <typename Body>
void parallel_for(int threads, std::int64_t count, Body body) {
  if (threads <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    store_fence();
    return;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static) nowait
    for (std::int64_t i = 0; i < count; ++i) body(i);
    store_fence();
  }
}

template <typename Ptr>
Ptr advance(Ptr base, std::int64_t elements, std::size_t element_size) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
  return static_cast<Ptr>(static_cast<Byte*>(base) +
                          elements * static_cast<std::int64_t>(element_size));
}

// The rows a thread reads next are fetched into L2 while it writes the rows it has read
// (forward_rows, forward_quantized) only when both fit in kFetchAheadBytes together: the
// fetched lines must still be cached when the next sum pass reads them, or the rows are read
// twice. `bytes`: the rows worked on now, as many as are fetched. Fetching against not, by
// the bytes R of a row (or batch), 2 threads, AVX3, Intel VM with 2 MB of L2 per core
// (docs/PERFORMANCE.md, seventeenth session): R <= 128 KiB mostly pays; at 256 KiB bf16
// pays, fp32 costs (1.05-1.19); from 1 MiB every dtype and mode costs (1.1-1.4). 256 KiB is
// also half the smallest L2 seen (512 KiB, Zen 2 / 3).
constexpr std::size_t kFetchAheadBytes = 256 * 1024;
bool fetches_ahead(std::size_t bytes) { return 2 * bytes <= kFetchAheadBytes; }
// ahead (nullptr: no next row) at element `begin`.
const void* ahead_at(const void* ahead, std::int64_t begin, std::size_t esize) {
  return ahead == nullptr ? nullptr : advance(ahead, begin, esize);
}

// A weight (or bias) as fp32 with the weight offset folded in (w + offset, one fp32 add, as
// the forward kernels add it), for the backward, the quantized forward and the fp16 forward
// of more than one row (ForwardCall); borrows the caller's buffer when no conversion is
// needed. (The other forward calls' kernels read weights in their own dtype.) The
// conversion is the SIMD kernels' (exact); the copy lives in one of the calling thread's
// buffers, kept between calls, so that a call allocates nothing once the buffer has grown
// to D (each keeps D * 4 bytes per calling thread); a third PreparedVector alive on the same
// thread gets its own storage.
// narrow_nans: every NaN of the result becomes the default NaN (whose low 16 payload bits
// are zero), as the backward kernels of bf16 rows require (row_kernels.h); an fp32 weight
// is then always copied. (Only NaN payloads change; a NaN stays a NaN.)
class PreparedVector {
 public:
  PreparedVector(ConstVector v, float offset, bool narrow_nans = false) {
    if (v.data == nullptr) return;
    if (v.dtype == DType::kFloat32 && offset == 0.0f && !narrow_nans) {
      data_ = static_cast<const float*>(v.data);
      return;
    }
    const auto n = static_cast<std::size_t>(v.size);
    std::vector<float>* storage = &own_storage_;
    for (int slot = 0; slot < kThreadBuffers; ++slot) {
      if (!thread_buffer_in_use_[slot]) {
        thread_buffer_in_use_[slot] = true;
        thread_slot_ = slot;
        storage = &thread_buffer_[slot];
        break;
      }
    }
    if (storage->size() < n) storage->resize(n);
    float* out = storage->data();
    // x * 1 with no weight: the kernels' exact widening.
    quant_kernels().normalize_amax[static_cast<int>(v.dtype)][kNoParam](
        v.data, nullptr, out, v.size, 1.0f, 0.0f, nullptr);
    if (offset != 0.0f) {
      for (std::size_t j = 0; j < n; ++j) out[j] += offset;
    }
    if (narrow_nans) {
      for (std::size_t j = 0; j < n; ++j) out[j] = NarrowNaN(out[j]);
    }
    data_ = out;
  }
  ~PreparedVector() {
    if (thread_slot_ >= 0) thread_buffer_in_use_[thread_slot_] = false;
  }
  PreparedVector(const PreparedVector&) = delete;
  PreparedVector& operator=(const PreparedVector&) = delete;
  const float* data() const { return data_; }
  bool present() const { return data_ != nullptr; }

 private:
  // Two per thread: a LayerNorm's weight and bias are alive together (ForwardCall).
  static constexpr int kThreadBuffers = 2;
  static thread_local std::vector<float> thread_buffer_[kThreadBuffers];
  static thread_local bool thread_buffer_in_use_[kThreadBuffers];
  std::vector<float> own_storage_;
  int thread_slot_ = -1;  // the thread buffer held, or -1
  const float* data_ = nullptr;
};
thread_local std::vector<float> PreparedVector::thread_buffer_[PreparedVector::kThreadBuffers];
thread_local bool PreparedVector::thread_buffer_in_use_[PreparedVector::kThreadBuffers] = {};

// Outputs at least this large are written with non-temporal stores; smaller ones with
// ordinary stores, so that they stay in cache for the next layer. Measured on a 2-core
// EPYC (32 MB L3), fp16 forward, 2 threads: 4096 rows x 4096 streamed 2x faster, 2048 rows
// 10% faster, 1024 rows 1.3-1.8x slower (see docs/PERFORMANCE.md). The L3 size the OS
// reports is not a usable guide (this VM reports 320 MB), so the threshold is fixed;
// FUSEDNORM_STREAM_MIN_BYTES overrides it for measurements and tests.
constexpr std::size_t kDefaultStreamMinBytes = std::size_t{16} << 20;

// Rows shorter than this are not streamed row by row: with 256 B to 2 KiB rows (bf16,
// D = 128 to 1024, 32 MiB outputs, 2 threads) streaming each row was 5-60% slower in every
// measurement, aligned or not; the partial lines at both ends of each row go through
// ordinary stores and little is left to stream. (Short RMSNorm rows are streamed a block
// of rows at a time instead: forward_short_rows.)
constexpr std::size_t kMinStreamRowBytes = 4096;

// FUSEDNORM_STREAM_MIN_BYTES, when set, replaces the size threshold and is the only
// criterion (tests force streaming on every shape with it).
const char* stream_override() {
  static const char* const override_bytes = std::getenv("FUSEDNORM_STREAM_MIN_BYTES");
  return override_bytes;
}
// Transparent huge pages: the kernel's setting (/sys/kernel/mm/transparent_hugepage/enabled).
// With "always" any large mapping may get them; with "madvise" only the regions that ask.
enum class Thp { kAlways, kMadvise, kNever };
Thp thp_mode() {
  static const Thp mode = [] {
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    std::getline(file, line);  // e.g. "always [madvise] never"
    if (line.find("[never]") != std::string::npos) return Thp::kNever;
    if (line.find("[madvise]") != std::string::npos) return Thp::kMadvise;
    return Thp::kAlways;  // also when unreadable: streaming, as before this check
  }();
  return mode;
}

// Huge pages are zeroed 2 MiB at a time, mostly out of the cache, so a fresh output on them
// is streamed like any other (measured: ordinary stores there were up to 20 % slower).
// Which regions asked for them with "madvise" cannot be asked cheaply; the allocators seen
// give them page-aligned data (torch with THP_MEM_ALLOC_ENABLE=1: 0x...4000), while glibc's
// malloc, posix_memalign and torch's default allocator put large blocks just past a
// header inside the first page (0x...010, 0x...040). So with "madvise" a page-aligned
// output counts as possibly huge.
bool may_get_huge_pages(const void* data) {
  constexpr std::uintptr_t kSmallPage = 4096;
  const Thp mode = thp_mode();
  return mode == Thp::kAlways ||
         (mode == Thp::kMadvise && reinterpret_cast<std::uintptr_t>(data) % kSmallPage == 0);
}

// A fresh output (untouched_memory) would otherwise be faulted in 4 KiB at a time by the
// kernel's first stores, at a cost above the kernel's own: fp32 16384 x 4096 from PyTorch,
// 2 threads, AVX2: 54 ms with a fresh output against 28.5 ms after asking for huge pages
// over it (docs/PERFORMANCE.md, "eleventh session"), which is what torch's allocator does
// with THP_MEM_ALLOC_ENABLE=1. Only the whole huge pages inside [data, data + bytes) are
// advised, so no memory outside the caller's buffer changes its policy, and none is used
// beyond it; the advice changes no byte. FUSEDNORM_HUGE_PAGES=0 turns it off (with THP's
// "defrag" at its default, "madvise", a fault in an advised region may compact memory
// first when no huge page is free).
bool huge_page_advice_enabled() {
  static const bool enabled = [] {
    const char* setting = std::getenv("FUSEDNORM_HUGE_PAGES");
    return setting == nullptr || std::strcmp(setting, "0") != 0;
  }();
  return enabled;
}

}  // namespace

bool advise_huge_pages(void* data, std::size_t bytes) {
#if defined(FUSEDNORM_HAVE_MINCORE) && defined(MADV_HUGEPAGE)
  if (data == nullptr || thp_mode() != Thp::kMadvise || !huge_page_advice_enabled()) return false;
  static const std::uintptr_t huge_page = [] {
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    std::uintptr_t size = 0;
    file >> size;
    return size != 0 ? size : std::uintptr_t{2} << 20;
  }();
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + huge_page - 1) / huge_page * huge_page;
  const std::uintptr_t last = (begin + bytes) / huge_page * huge_page;
  if (last <= first) return false;
  return madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE) == 0;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

namespace {

// Prepares a large output's pages and says whether it gets non-temporal stores: outputs of
// at least the threshold's bytes, in memory already touched or on huge pages. A fresh
// output's small pages come zeroed through the cache, where ordinary stores finish them and
// non-temporal ones write every line twice (fp32 forward from PyTorch, fresh outputs, 2
// threads: 8-19 % faster; docs/PERFORMANCE.md, "ninth session"); so a fresh output is first
// asked onto huge pages (advise_huge_pages), and streamed if that was granted.
bool prepare_large_output(const Matrix& out) {
  static const std::size_t min_bytes =
      stream_override() ? static_cast<std::size_t>(std::strtoull(stream_override(), nullptr, 10))
                        : kDefaultStreamMinBytes;
  const std::size_t esize = dtype_size(out.dtype);
  if (static_cast<std::size_t>(out.rows * out.cols) * esize < min_bytes) return false;
  if (stream_override() != nullptr) return true;
  if (may_get_huge_pages(out.data)) return true;
  const std::size_t bytes = detail::byte_range(out).bytes();
  if (!untouched_memory(out.data, bytes)) return true;
  return advise_huge_pages(const_cast<void*>(out.data), bytes);
}
bool stream_output(const Matrix& out) {
  const bool large = prepare_large_output(out);
  const std::size_t row_bytes = static_cast<std::size_t>(out.cols) * dtype_size(out.dtype);
  if (stream_override() == nullptr && row_bytes < kMinStreamRowBytes) return false;
  return large;
}

// Rows that are whole 64-byte lines starting on a line (as PyTorch's allocator aligns
// tensors): every line of every row can be streamed, with no partial line at a row's ends.
bool whole_line_rows(const Matrix& out) {
  const std::size_t esize = dtype_size(out.dtype);
  return out.data != nullptr && reinterpret_cast<std::uintptr_t>(out.data) % 64 == 0 &&
         (static_cast<std::size_t>(out.cols) * esize) % 64 == 0 &&
         (static_cast<std::size_t>(out.row_stride) * esize) % 64 == 0;
}

// The backward's short dx rows (under kMinStreamRowBytes) are streamed when they are whole
// lines of at least kMinStreamShortDxBytes and the kernels stream whole lines at a time (a
// store pair, WriteRows, of at least 64 bytes): ordinary stores read each line before writing
// it, a third more memory traffic for the backward (dy and x read, dx written). 2 threads,
// Zen 5, rms_norm_backward streamed / ordinary, repeated runs: AVX3 fp32 D = 128 0.68-0.82,
// D = 256 0.78-0.80, fp16 / bf16 D = 256 0.56-1.13 (most 0.82-0.94), D = 512 0.68-0.79; AVX2
// fp32 D = 128 0.94-1.04, D = 256 0.83. Not streamed: AVX2's 32-byte half-precision pairs
// (D = 256 1.11-1.22), 128-byte rows (fp16 / bf16 D = 64 on AVX3, 1.07-1.77), and 256-byte half
// rows (D = 128: 0.65 to 1.44; docs/PERFORMANCE.md, thirty-fourth session).
constexpr std::size_t kMinStreamShortDxBytes = 512;
bool stream_dx(const Matrix& dx) {
  const bool large = prepare_large_output(dx);
  const std::size_t esize = dtype_size(dx.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(dx.cols) * esize;
  if (stream_override() != nullptr || row_bytes >= kMinStreamRowBytes) return large;
  const std::size_t pair_bytes = 2 * static_cast<std::size_t>(row_kernels().float_lanes) * esize;
  return large && row_bytes >= kMinStreamShortDxBytes && pair_bytes >= 64 && whole_line_rows(dx);
}

// Chunked reduction over columns [0, cols) of one row, in the fixed order shared with the
// split-row path: sum over chunks of chunk_fn(chunk begin, chunk length).
template <typename ChunkFn>
float chunked_sum(std::int64_t cols, ChunkFn chunk_fn) {
  float total = 0.0f;
  for (std::int64_t begin = 0; begin < cols; begin += kReduceChunk) {
    total += chunk_fn(begin, std::min(kReduceChunk, cols - begin));
  }
  return total;
}

// The same sums for rows r0 and r1, whose chunks are read side by side (first_stat_pair):
// each row's total has chunked_sum's bits.
template <typename PairFn>
std::array<float, 2> chunked_sum_pair(std::int64_t cols, PairFn pair_fn) {
  std::array<float, 2> total{0.0f, 0.0f};
  for (std::int64_t begin = 0; begin < cols; begin += kReduceChunk) {
    float sums[2];
    pair_fn(begin, std::min(kReduceChunk, cols - begin), sums);
    total[0] += sums[0];
    total[1] += sums[1];
  }
  return total;
}

// Rows per forward batch when the output is streamed: about kBatchBytes of input, so that a
// batch's rows are still in the caches when they are normalized. Measured at 16384 x 4096,
// one thread, against one-row batches: fp16 and bf16 -12 %, fp32 (two-row batches)
// unchanged; 128 KiB batches were no better. Without streaming, batches cost time instead
// (bf16, 8M elements, one thread: D = 512 1.9 -> 3.0-3.6 ms, D = 1024 1.6 -> 2.2-2.5 ms),
// so cached outputs are written row by row. Rows up to kPairBatchBytes / 2 come at least
// two to a batch, so that forward_rows reads them in pairs.
constexpr std::int64_t kMaxBatchRows = 64;
constexpr std::size_t kBatchBytes = 32 * 1024;
constexpr std::size_t kPairBatchBytes = 128 * 1024;
std::int64_t rows_per_batch(std::int64_t cols, std::size_t esize, bool stream) {
  if (!stream) return 1;
  const auto row_bytes = static_cast<std::int64_t>(static_cast<std::size_t>(cols) * esize);
  const std::int64_t fewest = 2 * row_bytes <= static_cast<std::int64_t>(kPairBatchBytes) ? 2 : 1;
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(kBatchBytes) / row_bytes, fewest,
                                  kMaxBatchRows);
}

struct RowStats {
  float mean;  // 0 for RMSNorm
  float rstd;
};

// mean and rstd of one row, the one definition the forward and the backward's recomputation
// share. first(begin, n): a chunk's sum of squares (RMSNorm) or sum (LayerNorm);
// centered(begin, n, mean): a chunk's sum of squared deviations (LayerNorm only).
// row_stats_from_first_total: the same, given chunked_sum(cols, first).
template <typename CenteredFn>
RowStats row_stats_from_first_total(std::int64_t cols, bool is_centered, float eps,
                                    float first_total, CenteredFn centered) {
  const auto count = static_cast<float>(cols);
  if (!is_centered) return {0.0f, rstd_from_mean_square(first_total / count, eps)};
  const float mean = first_total / count;
  const float mean_square =
      chunked_sum(cols, [&](std::int64_t b, std::int64_t n) { return centered(b, n, mean); }) /
      count;
  return {mean, rstd_from_mean_square(mean_square, eps)};
}
template <typename FirstFn, typename CenteredFn>
RowStats compute_row_stats(std::int64_t cols, bool is_centered, float eps, FirstFn first,
                           CenteredFn centered) {
  return row_stats_from_first_total(cols, is_centered, eps, chunked_sum(cols, first), centered);
}

// A forward call's rows and their first reductions, which every forward path (y or q)
// reads the same way.
struct ForwardRows {
  const ForwardProblem& p;
  const DTypeKernels& k;
  std::size_t esize;
  bool centered;

  explicit ForwardRows(const ForwardProblem& problem)
      : p(problem),
        k(row_kernels().by_dtype[static_cast<int>(problem.x.dtype)]),
        esize(dtype_size(problem.x.dtype)),
        centered(problem.kind == NormKind::kLayer) {}

  const void* x_row(std::int64_t r) const { return advance(p.x.data, r * p.x.row_stride, esize); }
  void* residual_row(std::int64_t r) const {
    return advance(p.residual.data, r * p.residual.row_stride, esize);
  }
  // The row that gets normalized: the updated residual for the fused add, else x.
  const void* source_row(std::int64_t r) const {
    return p.has_residual() ? residual_row(r) : x_row(r);
  }

  // First reduction of a chunk: sum of squares (RMS; after the residual add when fused) or
  // sum (LayerNorm's mean).
  float first_stat(std::int64_t r, std::int64_t begin, std::int64_t n) const {
    if (p.has_residual()) {
      return k.add_residual(advance(x_row(r), begin, esize), advance(residual_row(r), begin, esize),
                            n);
    }
    const void* x = advance(x_row(r), begin, esize);
    return centered ? k.sum(x, n) : k.sum_squares[0](x, n, 0.0f);
  }
  // LayerNorm's second reduction: sum of squared deviations from the mean.
  float centered_stat(std::int64_t r, std::int64_t begin, std::int64_t n, float mean) const {
    return k.sum_squares[1](advance(x_row(r), begin, esize), n, mean);
  }
  // first_stat of the same chunk of rows r and r + 1, read side by side: sums[i] has the bits
  // of first_stat(r + i, begin, n).
  void first_stat_pair(std::int64_t r, std::int64_t begin, std::int64_t n, float* sums) const {
    if (p.has_residual()) {
      k.add_residual_pair(advance(x_row(r), begin, esize), advance(x_row(r + 1), begin, esize),
                          advance(residual_row(r), begin, esize),
                          advance(residual_row(r + 1), begin, esize), n, sums);
    } else {
      k.first_stat_pair[centered](advance(x_row(r), begin, esize),
                                  advance(x_row(r + 1), begin, esize), n, sums);
    }
  }
};

// fp16 rows of a call of at least kPreparedParamsMinRows rows whose input fits
// kPreparedParamsMaxBytes read their half-precision weight and bias as fp32 copies made once
// per call (PreparedVector: no allocation once its thread buffer has grown), not converted
// again for every row: in the caches the F16C conversions bound the fp16 write loop, and the
// prepared weight removes one of its three (RMSNorm) or two of its four (LayerNorm). Same
// bits (the conversion is exact and the offset is the same one fp32 add). Measured
// (docs/PERFORMANCE.md, twenty-first and twenty-second sessions), prepared / direct:
//   - in the caches, 16 x 4096, one thread: Zen 1 AVX2 rms_norm 0.77, layer_norm 0.83, fused
//     add 0.89; Zen 4 AVX3 0.88, 0.90, 0.92 (AVX2 on Zen 4: 0.96, 0.96, 1.0);
//   - Zen 4 AVX3, 2 threads, rms_norm by the input's size: 2-4 MiB (512 x 4096, 256 x 8192)
//     0.90-0.97, layer_norm 0.91; 8 MiB (1024 x 4096, 512 x 8192) 1.07-1.24, fused add
//     1.19; from memory (16384 x 4096, 2048 x 8192) 1.05-1.09: there the fp32 copy's
//     doubled cache footprint costs more than the conversions it saves.
// So larger calls keep the direct read, as does one row (decode: the copy would cost a pass
// over the weight for one row's use). bf16 keeps it too: its weight widens with one shift in
// the parity layout, which an fp32 weight would break.
constexpr std::int64_t kPreparedParamsMinRows = 2;
constexpr std::size_t kPreparedParamsMaxBytes = std::size_t{4} << 20;
bool prepares_half_params(const ForwardProblem& p) {
  const bool normalizes = p.phase == Phase::kWhole || p.phase == Phase::kFromSums;
  // (A phased call sees a slice of each row; the whole rows are what stay cached or not.)
  const std::int64_t row_cols = p.phase == Phase::kFromSums ? p.full_cols : p.cols();
  const auto input_bytes = static_cast<std::size_t>(p.rows() * row_cols) * sizeof(std::uint16_t);
  return normalizes && p.x.dtype == DType::kFloat16 && p.rows() >= kPreparedParamsMinRows &&
         input_bytes <= kPreparedParamsMaxBytes;
}
// v, when it is to be prepared as fp32 (present and not fp32 already), else none.
ConstVector prepared_param(const ConstVector& v, bool prepare) {
  return prepare && v.data != nullptr && v.dtype != DType::kFloat32 ? v : ConstVector{};
}

// Everything the forward path needs about one call, resolved once; nothing is allocated
// (but a prepared weight's thread buffer, the first time it is needed at this D).
struct ForwardCall : ForwardRows {
  bool stream;
  bool prepare;
  PreparedVector prepared_weight, prepared_bias;
  ConstVector weight, bias;
  ParamType weight_type, bias_type;
  float weight_offset;  // as the kernels add it

  explicit ForwardCall(const ForwardProblem& problem)
      : ForwardRows(problem),
        stream(stream_output(problem.y)),
        prepare(prepares_half_params(problem)),
        prepared_weight(prepared_param(problem.weight, prepare),
                        centered ? 0.0f : problem.weight_offset),
        prepared_bias(prepared_param(problem.bias, prepare), 0.0f),
        weight(prepared_weight.present()
                   ? ConstVector{prepared_weight.data(), DType::kFloat32, problem.weight.size}
                   : problem.weight),
        bias(prepared_bias.present()
                 ? ConstVector{prepared_bias.data(), DType::kFloat32, problem.bias.size}
                 : problem.bias),
        weight_type(param_type(weight)),
        bias_type(param_type(bias)),
        weight_offset(kernel_weight_offset(
            centered || prepared_weight.present() ? 0.0f : problem.weight_offset)) {}

  void* y_row(std::int64_t r) const { return advance(p.y.data, r * p.y.row_stride, esize); }

  // ahead: the row read next by this thread (NormalizeFn), or nullptr.
  void normalize(std::int64_t r, std::int64_t begin, std::int64_t n, float mean, float rstd,
                 const void* ahead = nullptr) const {
    const auto fn =
        k.normalize[stream][centered][weight_type][bias_type][offset_slot(weight_offset)];
    fn(advance(source_row(r), begin, esize), param_at(weight, begin), param_at(bias, begin),
       advance(y_row(r), begin, esize), n, mean, rstd, weight_offset,
       ahead_at(ahead, begin, esize));
  }
  static const void* param_at(const ConstVector& v, std::int64_t begin) {
    // (dtype_size is an out-of-line call; this runs once per row.)
    return v.data == nullptr ? nullptr : advance(v.data, begin, v.dtype == DType::kFloat32 ? 4 : 2);
  }
  // Row r's statistics: from the whole row's sums (phase 2 of a phased call), else
  // computed from the row; the same arithmetic as compute_row_stats.
  RowStats row_stats(std::int64_t r) const {
    if (p.phase == Phase::kFromSums) {
      const auto count = static_cast<float>(p.full_cols);
      if (!centered) return {0.0f, rstd_from_mean_square(p.row_sum_squares[r] / count, p.eps)};
      return {p.row_sum[r] / count,
              rstd_from_mean_square(p.row_sum_squared_deviations[r] / count, p.eps)};
    }
    return compute_row_stats(
        p.cols(), centered, p.eps,
        [&](std::int64_t b, std::int64_t n) { return first_stat(r, b, n); },
        [&](std::int64_t b, std::int64_t n, float m) { return centered_stat(r, b, n, m); });
  }
  // Rows r and r + 1's statistics (the bits of row_stats), their first sums read side by
  // side (for the fused add, both rows' residual adds); for rows that reads_pairs() allows.
  bool reads_pairs() const { return p.phase == Phase::kWhole; }
  void row_stats_pair(std::int64_t r, RowStats* stats) const {
    const std::array<float, 2> first_total = chunked_sum_pair(
        p.cols(),
        [&](std::int64_t b, std::int64_t n, float* sums) { first_stat_pair(r, b, n, sums); });
    for (std::int64_t i = 0; i < 2; ++i) {
      stats[i] = row_stats_from_first_total(
          p.cols(), centered, p.eps, first_total[i],
          [&](std::int64_t b, std::int64_t n, float m) { return centered_stat(r + i, b, n, m); });
    }
  }
  // Phase 1's sum over row r's slice: the first statistic (kPartialSums), or LayerNorm's
  // squared deviations from the whole row's mean (kPartialDeviations); chunked as always.
  float partial_sum(std::int64_t r) const {
    if (p.phase == Phase::kPartialDeviations) {
      const float mean = p.row_sum[r] / static_cast<float>(p.full_cols);
      return chunked_sum(
          p.cols(), [&](std::int64_t b, std::int64_t n) { return centered_stat(r, b, n, mean); });
    }
    return chunked_sum(p.cols(),
                       [&](std::int64_t b, std::int64_t n) { return first_stat(r, b, n); });
  }
  void store_stats(std::int64_t r, float mean, float rstd) const {
    if (p.rstd != nullptr) p.rstd[r] = rstd;
    if (p.mean != nullptr) p.mean[r] = mean;
  }
};

// Rows [begin, end) (at most kMaxBatchRows): the statistics of every row first (reads from
// memory), then the normalized rows (writes). Alternating the two per row cost more: the
// switch between a read phase and a streamed write phase is not free.
void forward_rows(const ForwardCall& call, std::int64_t begin, std::int64_t end) {
  RowStats stats[kMaxBatchRows];
  std::int64_t r = begin;
  if (call.reads_pairs()) {
    for (; r + 1 < end; r += 2) call.row_stats_pair(r, &stats[r - begin]);
  }
  for (; r < end; ++r) stats[r - begin] = call.row_stats(r);
  // While a row is written, the row of the next batch at the same place is fetched: the
  // write phase would otherwise leave the memory's read side idle (see NormalizeFn).
  // rms_norm 16384 x 4096 and 2048 x 8192, 2 threads, AVX3 on an Intel VM: new / old
  // geomean 0.88, no pair slower; Zen 4 (1 MB L2), against every fetch off, one round: 0.90
  // AVX3, 0.86 AVX2 (docs/PERFORMANCE.md, fifteenth and eighteenth sessions).
  const std::int64_t batch = end - begin;
  const bool fetch = fetches_ahead(static_cast<std::size_t>(batch * call.p.cols()) * call.esize);
  for (r = begin; r < end; ++r) {
    const RowStats& s = stats[r - begin];
    const void* ahead = fetch && r + batch < call.p.rows() ? call.x_row(r + batch) : nullptr;
    call.normalize(r, 0, call.p.cols(), s.mean, s.rstd, ahead);
    call.store_stats(r, s.mean, s.rstd);
  }
}

// Few long rows (at most kMaxSplitRows): every phase runs over (row, chunk) tasks, and
// per-row sums are added in chunk order, exactly as chunked_sum does. The chunk partials
// live in a fixed stack buffer: a row longer than the buffer holds is reduced in windows of
// chunks, each window's partials added to the row totals in order, so nothing is allocated.
void forward_split_rows(const ForwardCall& call, int threads) {
  constexpr std::int64_t kPartials = 4096;  // 16 KiB
  static_assert(kPartials >= kMaxSplitRows, "one chunk of every row must fit");
  const std::int64_t rows = call.p.rows(), cols = call.p.cols();
  const std::int64_t chunks = ceil_div(cols, kReduceChunk);
  const std::int64_t window = std::min(chunks, kPartials / rows);
  float partial[kPartials];
  float total[kMaxSplitRows], mean[kMaxSplitRows], rstd[kMaxSplitRows];

  // total[r] = sum over chunks, in order, of stat(r, begin, n).
  auto reduce = [&](auto stat) {
    std::fill(total, total + rows, 0.0f);
    for (std::int64_t first = 0; first < chunks; first += window) {
      const std::int64_t count = std::min(window, chunks - first);
      parallel_for(threads, rows * count, [&](std::int64_t t) {
        const std::int64_t r = t / count, begin = (first + t % count) * kReduceChunk;
        partial[t] = stat(r, begin, std::min(kReduceChunk, cols - begin));
      });
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < count; ++c) total[r] += partial[r * count + c];
      }
    }
  };

  if (call.p.phase == Phase::kFromSums) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const RowStats s = call.row_stats(r);
      mean[r] = s.mean;
      rstd[r] = s.rstd;
      call.store_stats(r, mean[r], rstd[r]);
    }
    parallel_for(threads, rows * chunks, [&](std::int64_t t) {
      const std::int64_t r = t / chunks, begin = (t % chunks) * kReduceChunk;
      call.normalize(r, begin, std::min(kReduceChunk, cols - begin), mean[r], rstd[r]);
    });
    return;
  }
  reduce([&](std::int64_t r, std::int64_t begin, std::int64_t n) {
    return call.first_stat(r, begin, n);
  });
  std::fill(mean, mean + rows, 0.0f);
  if (call.centered) {
    for (std::int64_t r = 0; r < rows; ++r) mean[r] = total[r] / static_cast<float>(cols);
    reduce([&](std::int64_t r, std::int64_t begin, std::int64_t n) {
      return call.centered_stat(r, begin, n, mean[r]);
    });
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    rstd[r] = rstd_from_mean_square(total[r] / static_cast<float>(cols), call.p.eps);
    call.store_stats(r, mean[r], rstd[r]);
  }
  parallel_for(threads, rows * chunks, [&](std::int64_t t) {
    const std::int64_t r = t / chunks, begin = (t % chunks) * kReduceChunk;
    call.normalize(r, begin, std::min(kReduceChunk, cols - begin), mean[r], rstd[r]);
  });
}

// Many short rows (D <= kMaxShortRow): blocks of rows through the multi-row kernels
// (rms_rows, layer_rows), which give each row the bits of the one-row path. A large output
// is streamed: straight from the kernels (their streamed kind) when its rows are whole
// 64-byte lines on line boundaries, else, for contiguous rows, through a staging buffer in
// L1 that is then copied out with non-temporal stores, so a block of rows streams as one run
// of whole cache lines (rows streamed one by one were slower: kMinStreamRowBytes). Straight
// from the kernels against staged, from PyTorch (64-byte-aligned tensors), `out=`, 65536 x
// 128 and 16384 x 512, forward and fused add, 2 threads, AVX3: geomean 0.76 over 12, half
// precision 0.57-0.85; with rows not on line boundaries (each row's end lines then take
// ordinary stores) it was 1.2-2.3x slower at D = 128 (docs/PERFORMANCE.md, twenty-ninth
// session).
constexpr std::int64_t kShortRowsPerTask = 64;
constexpr std::size_t kStagingBytes = 16 * 1024;
bool use_short_rows(const ForwardCall& call) {
  // The phased calls take the one-row path (the short-row kernels compute their own stats).
  return call.p.cols() <= kMaxShortRow && call.p.phase == Phase::kWhole;
}
void forward_short_rows(const ForwardCall& call, int threads) {
  const ForwardProblem& p = call.p;
  const std::size_t row_bytes = static_cast<std::size_t>(p.cols()) * call.esize;
  const bool large = prepare_large_output(p.y);
  // Rows of whole 64-byte lines, starting on a line (as PyTorch's allocator aligns tensors),
  // are streamed straight from the multi-row kernels; others through the staging buffer,
  // whose copy-out handles the partial lines once per block instead of twice per row.
  const bool direct = large && whole_line_rows(p.y);
  const bool staged = !direct && p.y.row_stride == p.cols() && row_bytes <= kStagingBytes && large;
  const RmsRowsFn rms_fn =
      call.k.rms_rows[direct][p.has_residual()][call.weight_type][offset_slot(call.weight_offset)];
  const LayerRowsFn layer_fn = call.k.layer_rows[direct][call.weight_type][call.bias_type];
  const std::int64_t rows_per_task =
      staged ? static_cast<std::int64_t>(kStagingBytes / row_bytes) : kShortRowsPerTask;
  const StreamCopyFn stream_copy = row_kernels().stream_copy;
  parallel_for(threads, ceil_div(p.rows(), rows_per_task), [&](std::int64_t task) {
    alignas(64) unsigned char staging[kStagingBytes];
    const std::int64_t first = task * rows_per_task;
    const std::int64_t rows = std::min(rows_per_task, p.rows() - first);
    void* y = staged ? static_cast<void*>(staging) : call.y_row(first);
    if (call.centered) {
      LayerRows block;
      block.x = call.x_row(first);
      block.x_stride = p.x.row_stride;
      block.y = y;
      block.y_stride = p.y.row_stride;
      block.w = call.weight.data;
      block.b = call.bias.data;
      block.eps = p.eps;
      block.mean = p.mean != nullptr ? p.mean + first : nullptr;
      block.rstd = p.rstd != nullptr ? p.rstd + first : nullptr;
      block.rows = rows;
      block.n = p.cols();
      layer_fn(block);
    } else {
      RmsRows block;
      block.x = call.x_row(first);
      block.x_stride = p.x.row_stride;
      block.residual = p.has_residual() ? call.residual_row(first) : nullptr;
      block.residual_stride = p.residual.row_stride;
      block.y = y;
      block.y_stride = p.y.row_stride;
      block.w = call.weight.data;
      block.w_offset = call.weight_offset;
      block.eps = p.eps;
      block.rstd = p.rstd != nullptr ? p.rstd + first : nullptr;
      block.rows = rows;
      block.n = p.cols();
      rms_fn(block);
    }
    if (staged) {
      // The next block's x (contiguous rows only) is fetched while this block is written
      // (rms_norm 65536 x 128 and 16384 x 512, AVX3, Intel VM: geomean 0.87, same page).
      const std::int64_t next_rows = std::min(rows_per_task, p.rows() - first - rows);
      const bool ahead = next_rows > 0 && p.x.row_stride == p.cols();
      stream_copy(call.y_row(first), staging, static_cast<std::int64_t>(rows * row_bytes),
                  ahead ? call.x_row(first + rows) : nullptr,
                  ahead ? static_cast<std::int64_t>(next_rows * row_bytes) : 0);
    }
  });
}

std::size_t forward_bytes(const ForwardProblem& p) {
  const std::size_t streams = p.has_residual() ? 4 : 2;
  return streams * static_cast<std::size_t>(p.rows() * p.cols()) * dtype_size(p.x.dtype);
}

// ---- Quantized RMSNorm --------------------------------------------------------------------

// One row at a time (the fused add with a large q: two rows' step 1 side by side, then each
// row's steps 2 and 3), whole rows per thread (so any thread count gives the same bits):
//  1. the sum of squares (and the fused add's residual update) by row_kernels' kernels in
//     chunked_sum's order, so rstd, and with it y, has rms_norm's bits;
//  2. y (fp32) into an L1/L2 staging buffer, with its amax;
//  3. the dynamic scale from the amax; q from the staged y.
// x is read from memory once (step 1; step 2 finds the row in the caches). A row longer than
// the staging buffer (kQuantStagingFloats) goes through it in pieces: in dynamic mode step
// 2 then only finds the amax and step 3 recomputes each piece of y (the row is read a
// second time, from L2 / L3 or memory). Static mode needs no amax: q comes straight from x
// (normalize_quantize; with a weight, when it is prepared as fp32, else steps 2 and 3 piece
// by piece). Staging y instead of recomputing it for step 3 cost fewer instructions
// (callgrind, bf16 64 x 4096, bf16 weight, the benchmark's 4 modes: 22.8 M -> 20.9 M).
// A large q (prepare_large_output's threshold) goes out with non-temporal stores straight from
// the quantizing kernels (their streamed kind), which skip reading each line of q before
// overwriting it: ordinary stores would add q's size again to the memory traffic. (Quantized
// into an L1 buffer and copied out by stream_copy instead, the copy's stores waited on the
// write-combining buffers with no work beside them: docs/PERFORMANCE.md, twenty-ninth
// session.)
constexpr std::int64_t kQuantStagingFloats = 8192;  // 32 KiB: D = 8192 in one piece

void forward_quantized(const ForwardProblem& p, int num_threads) {
  const DType dtype = p.x.dtype;
  const std::size_t esize = dtype_size(dtype);
  const QuantKernels& qk = quant_kernels();
  const bool stream = prepare_large_output(p.q);
  const QuantizeFn quantize_any = qk.quantize[stream][quant_index(p.q.dtype)];
  const QuantizeFn quantize_in_range = qk.quantize_in_range[stream][quant_index(p.q.dtype)];
  const std::int64_t cols = p.cols();
  const float w_offset = kernel_weight_offset(p.weight_offset);
  // The weight as fp32 (w + w_offset), once per call (free for an fp32 weight without
  // offset): each row's normalize then loads it instead of converting and adding. Not for
  // a few rows, where the conversion costs about as much as it saves. Added in fp32 as the
  // kernels add it (-0.0f without an offset), so y keeps its bits.
  const bool prepare = p.weight.data != nullptr &&
                       (p.rows() > 2 || (p.weight.dtype == DType::kFloat32 && w_offset == 0.0f));
  const PreparedVector prepared(prepare ? p.weight : ConstVector{}, w_offset);
  const void* weight = prepare ? prepared.data() : p.weight.data;
  const NormalizeAmaxFn normalize_amax =
      prepare ? qk.normalize_amax_prepared[static_cast<int>(dtype)]
              : qk.normalize_amax[static_cast<int>(dtype)][param_type(p.weight)];
  const std::size_t w_esize = prepare || p.weight.dtype == DType::kFloat32 ? 4 : esize;
  const QuantScale& scale = p.quant_scale;
  const bool dynamic = scale.static_scale == nullptr;
  const float static_inv_scale = dynamic ? 0.0f : 1.0f / *scale.static_scale;
  // Static mode needs no amax: y goes straight to q, without the staging buffer (step 2),
  // for the rows whose y cannot be NaN (quant_kernels.h): a finite weight, inv_scale and
  // rstd, and a finite sum of squares. Other rows take steps 2 and 3.
  const NormalizeQuantizeFn normalize_quantize =
      !dynamic && (weight == nullptr || prepare) && std::isfinite(static_inv_scale) &&
              (weight == nullptr || qk.all_finite(static_cast<const float*>(weight), cols))
          ? qk.normalize_quantize[stream][static_cast<int>(dtype)][weight != nullptr]
                                 [quant_index(p.q.dtype)]
          : nullptr;
  const auto elements = static_cast<std::size_t>(p.rows() * cols);
  const std::size_t bytes = elements * (esize * (p.has_residual() ? 3 : 1) + 1);
  const ThreadPlan plan = plan_threads(p.rows(), cols, bytes, num_threads);
  // The fused add reads its rows in pairs (ForwardRows::first_stat_pair), for a large q: its
  // step 1 is two streams (x and residual) read and one written, with nothing fetched ahead.
  // Pairs against one row, 16384 x 4096 and 2048 x 8192, 2 threads, AVX3, Intel VM, 4 rounds:
  // fp16 0.75-0.92 (one 1.37), bf16 0.83-0.98, fp32 0.97-1.14; fused add geomean 0.94 over
  // 24, the unchanged ops 0.97-1.09 as controls. The plain quantized norm read in pairs was
  // no faster (geomean 1.00-1.03 over 12 per mode; it fetches its next row instead), so it
  // reads one row at a time (docs/PERFORMANCE.md, twentieth session).
  const ForwardRows reader(p);  // the rows and step 1's sums, as the forward reads them
  const std::int64_t group = stream && p.has_residual() ? 2 : 1;
  // Steps 2 and 3 read the row from the caches; meanwhile the thread's next row at the same
  // place (`ahead`) is fetched. 16384 x 4096 and 2048 x 8192, 2 threads, AVX3, 3 rounds,
  // new / old geomean: fp16 0.78, bf16 0.84, fp32 1.01; AVX2 0.88. Not for the fused add:
  // prefetching its next x gave 0.97-1.16 (docs/PERFORMANCE.md, sixteenth session).
  const bool fetch =
      stream && !p.has_residual() && fetches_ahead(static_cast<std::size_t>(group * cols) * esize);
  auto finish_row = [&](std::int64_t r, float sum_squares) {
    alignas(64) float y[kQuantStagingFloats];
    const float rstd = rstd_from_mean_square(sum_squares / static_cast<float>(cols), p.eps);
    const void* source = reader.source_row(r);
    // Rows are this thread's in order (parallel_for's static schedule), `group` per task.
    const void* ahead = fetch && r + group < p.rows() ? reader.x_row(r + group) : nullptr;
    auto normalize_piece = [&](std::int64_t begin, std::int64_t n) {
      const void* w = weight == nullptr ? nullptr : advance(weight, begin, w_esize);
      return normalize_amax(advance(source, begin, esize), w, y, n, rstd, w_offset,
                            ahead_at(ahead, begin, esize));
    };
    unsigned char* q_row = static_cast<unsigned char*>(p.q.data) + r * p.q.row_stride;
    QuantizeFn quantize = quantize_any;
    auto quantize_piece = [&](std::int64_t begin, std::int64_t n, float inv_scale) {
      quantize(y, q_row + begin, n, inv_scale);
    };
    if (normalize_quantize != nullptr && std::isfinite(sum_squares) && std::isfinite(rstd)) {
      // Static scale, no weight or a prepared one, no NaN: q straight from the row.
      normalize_quantize(source, weight, q_row, cols, rstd, static_inv_scale, ahead);
      return;
    }
    const bool one_piece = cols <= kQuantStagingFloats;
    float inv_scale = static_inv_scale;
    if (dynamic) {
      RowAmax row{0.0f, false};
      for (std::int64_t begin = 0; begin < cols; begin += kQuantStagingFloats) {
        const RowAmax piece = normalize_piece(begin, std::min(kQuantStagingFloats, cols - begin));
        row.amax = std::max(row.amax, piece.amax);
        row.has_nan = row.has_nan || piece.has_nan;
      }
      const float row_scale =
          detail::dynamic_quant_scale(row.amax, scale.scale_upper_bound, p.q.dtype);
      scale.row_scales[r] = row_scale;
      inv_scale = 1.0f / row_scale;
      if (quant_in_range(row, scale.scale_upper_bound)) quantize = quantize_in_range;
      if (one_piece) {
        quantize_piece(0, cols, inv_scale);
        return;
      }
    }
    for (std::int64_t begin = 0; begin < cols; begin += kQuantStagingFloats) {
      const std::int64_t n = std::min(kQuantStagingFloats, cols - begin);
      normalize_piece(begin, n);
      quantize_piece(begin, n, inv_scale);
    }
  };
  // Step 1 (the sum of squares after the fused add's residual update) in chunked_sum's
  // order, so rstd has rms_norm's bits; a pair's sums have the one-row bits.
  parallel_for(plan.threads, ceil_div(p.rows(), group), [&](std::int64_t task) {
    const std::int64_t r = task * group;
    if (group == 2 && r + 1 < p.rows()) {
      const std::array<float, 2> sums =
          chunked_sum_pair(cols, [&](std::int64_t b, std::int64_t n, float* pair_sums) {
            reader.first_stat_pair(r, b, n, pair_sums);
          });
      finish_row(r, sums[0]);
      finish_row(r + 1, sums[1]);
    } else {
      finish_row(r, chunked_sum(cols, [&](std::int64_t b, std::int64_t n) {
                   return reader.first_stat(r, b, n);
                 }));
    }
  });
}

// ---- Backward --------------------------------------------------------------------------

// Per-row coefficients of dx.
struct RowCoefficients {
  float mean, rstd, mean_g, mean_g_xhat;
};

struct BackwardCall {
  const BackwardProblem& p;
  const DTypeKernels& k;
  std::size_t esize;
  PreparedVector weight;
  bool centered;
  bool want_dw;
  bool want_db;
  // dx is streamed as any long-row output is, in every dtype, and short rows where stream_dx
  // says. Long rows, with the apply kernels' closure inlined, streamed / ordinary at
  // 16384 x 4096 and 2048 x 8192, 2 threads: fp16 0.81-0.97 (AVX3), 0.72-0.76 (AVX2); bf16
  // 0.81-0.95 (AVX2) (docs/PERFORMANCE.md, twenty-ninth session). Out of line, the streamed
  // fp16 kernels had been slower.
  bool stream;
  BackwardApplyFn apply;
  BackwardApplyPairFn apply_pair;
  // Short rows with their statistics given run a row block per call (backward_block);
  // nullptr where the row-pair loop of backward_rows must run instead.
  BackwardBlockFn block;
  // Where dx goes when the caller wants none: one row of scratch per thread.
  std::vector<char> discarded_dx;

  BackwardCall(const BackwardProblem& problem, int threads)
      : p(problem),
        k(row_kernels().by_dtype[static_cast<int>(problem.x.dtype)]),
        esize(dtype_size(problem.x.dtype)),
        weight(problem.weight, problem.kind == NormKind::kRms ? problem.weight_offset : 0.0f,
               problem.x.dtype == DType::kBFloat16),
        centered(problem.kind == NormKind::kLayer),
        want_dw(problem.dw.data != nullptr),
        want_db(problem.db.data != nullptr),
        stream(stream_dx(problem.dx)),
        apply(k.backward_apply[stream][centered][weight.present()][want_dw][want_db]
                              [problem.has_addend()]),
        apply_pair(k.backward_apply_pair[stream][centered][weight.present()][want_dw][want_db]
                                        [problem.has_addend()]),
        block(nullptr) {
    // The block kernels form the row means from one column chunk's sums.
    static_assert(kMaxShortRow <= kReduceChunk, "short rows must fit one column chunk");
    if (p.cols() <= kMaxShortRow && p.phase == Phase::kWhole && p.rstd != nullptr &&
        (!centered || p.mean != nullptr) && p.dx.data != nullptr && pairable()) {
      block = k.backward_block[stream][centered][weight.present()][want_dw][want_db]
                              [problem.has_addend()];
    }
    if (p.dx.data == nullptr && p.phase != Phase::kPartialSums) {
      discarded_dx.resize(static_cast<std::size_t>(threads) * p.cols() * esize);
    }
  }

  const void* x_row(std::int64_t r) const { return advance(p.x.data, r * p.x.row_stride, esize); }
  const void* dy_row(std::int64_t r) const {
    return advance(p.dy.data, r * p.dy.row_stride, esize);
  }
  const void* addend_row(std::int64_t r) const {
    return p.has_addend() ? advance(p.dx_addend.data, r * p.dx_addend.row_stride, esize) : nullptr;
  }
  void* dx_row(std::int64_t r) {
    if (p.dx.data != nullptr) return advance(p.dx.data, r * p.dx.row_stride, esize);
    return discarded_dx.data() + omp_get_thread_num() * p.cols() * esize;
  }

  // mean and rstd of row r: given, or recomputed exactly as the forward computes them.
  void row_stats(std::int64_t r, float* mean, float* rstd) const {
    if (p.rstd != nullptr) {
      *rstd = p.rstd[r];
      *mean = (centered && p.mean != nullptr) ? p.mean[r] : 0.0f;
      return;
    }
    const void* x = x_row(r);
    const RowStats stats = compute_row_stats(
        p.cols(), centered, p.eps,
        [&](std::int64_t b, std::int64_t n) {
          return centered ? k.sum(advance(x, b, esize), n)
                          : k.sum_squares[0](advance(x, b, esize), n, 0.0f);
        },
        [&](std::int64_t b, std::int64_t n, float m) {
          return k.sum_squares[1](advance(x, b, esize), n, m);
        });
    *mean = stats.mean;
    *rstd = stats.rstd;
  }

  // The sums of g * x_hat and g of kRows (1 or 2) consecutive rows from r over columns
  // [begin, begin + n), with c[j]'s mean and rstd: each row's have the bits of a one-row
  // call (BackwardDotsPairFn).
  template <std::size_t kRows>
  void chunk_dots(std::int64_t r, std::int64_t begin, std::int64_t n, const RowCoefficients* c,
                  float* g_xhat, float* g) const {
    static_assert(kRows == 1 || kRows == 2, "one-row and pair kernels only");
    const float* w = weight.present() ? weight.data() + begin : nullptr;
    if constexpr (kRows == 1) {
      k.backward_dots[centered][weight.present()](advance(dy_row(r), begin, esize),
                                                  advance(x_row(r), begin, esize), w, n, c[0].mean,
                                                  c[0].rstd, g_xhat, g);
    } else {
      const BackwardDotRows<2> rows{
          {advance(dy_row(r), begin, esize), advance(dy_row(r + 1), begin, esize)},
          {advance(x_row(r), begin, esize), advance(x_row(r + 1), begin, esize)},
          {c[0].mean, c[1].mean},
          {c[0].rstd, c[1].rstd},
          g_xhat,
          g};
      k.backward_dots_pair[centered][weight.present()](rows, w, n);
    }
  }

  // Rows r and r + 1 can go through the pair kernels: their dx rows must share their
  // address modulo 64 when streamed (the discarded-dx scratch row is one row for both).
  bool pairable() const {
    return !stream || p.dx.data == nullptr ||
           (p.dx.row_stride * static_cast<std::int64_t>(esize)) % 64 == 0;
  }

  static std::int64_t row(std::size_t j) { return static_cast<std::int64_t>(j); }

  // The coefficients of kRows consecutive rows from r: their statistics, then their dots,
  // each row's chunk sums added in chunk order. Two rows' dots run in one pass, each with the
  // bits of the one-row case: the dots of one row are one chain of fused multiply-adds,
  // bound by their latency (seventh session, docs/PERFORMANCE.md).
  template <std::size_t kRows>
  void coefficients(std::int64_t r, RowCoefficients (&c)[kRows]) const {
    for (std::size_t j = 0; j < kRows; ++j) row_stats(r + row(j), &c[j].mean, &c[j].rstd);
    if (p.phase == Phase::kFromSums) {
      for (std::size_t j = 0; j < kRows; ++j) sums_from_phase1(r + row(j), &c[j]);
      return;
    }
    float sum_g_xhat[kRows], sum_g[kRows];
    rows_dots<kRows>(r, c, sum_g_xhat, sum_g);
    for (std::size_t j = 0; j < kRows; ++j) {
      c[j].mean_g = mean_of_sum(sum_g[j]);
      c[j].mean_g_xhat = mean_of_sum(sum_g_xhat[j]);
    }
  }

  // Phase 2: the row means of g and g * x_hat from the whole row's phase-1 sums.
  void sums_from_phase1(std::int64_t r, RowCoefficients* c) const {
    c->mean_g = centered ? mean_of_sum(p.row_sum_g[r]) : 0.0f;
    c->mean_g_xhat = mean_of_sum(p.row_sum_g_xhat[r]);
  }

  // The sums of g * x_hat and g of kRows consecutive rows from r (c[j]'s mean and rstd):
  // chunk sums added in chunk order.
  template <std::size_t kRows>
  void rows_dots(std::int64_t r, const RowCoefficients* c, float* sum_g_xhat, float* sum_g) const {
    for (std::size_t j = 0; j < kRows; ++j) sum_g_xhat[j] = sum_g[j] = 0.0f;
    for (std::int64_t begin = 0; begin < p.cols(); begin += kReduceChunk) {
      float g_xhat[kRows], g[kRows];
      chunk_dots<kRows>(r, begin, std::min(kReduceChunk, p.cols() - begin), c, g_xhat, g);
      for (std::size_t j = 0; j < kRows; ++j) {
        sum_g_xhat[j] += g_xhat[j];
        sum_g[j] += g[j];
      }
    }
  }

  // A row mean (of g or g * x_hat) from its sum: over this call's columns, or phase 2's
  // full_cols.
  float mean_of_sum(float sum_g_xhat) const {
    const std::int64_t count = p.phase == Phase::kFromSums ? p.full_cols : p.cols();
    return sum_g_xhat / static_cast<float>(count);
  }

  // dx of rows r and r + 1 and their dw / db terms (row r's first), in one pass.
  void apply_pair_rows(std::int64_t r, const RowCoefficients (&c)[2], float* dw_acc,
                       float* db_acc) {
    BackwardRows<2> rows;
    for (int j = 0; j < 2; ++j) {
      rows.dy[j] = dy_row(r + j);
      rows.x[j] = x_row(r + j);
      rows.dx_addend[j] = addend_row(r + j);
      rows.dx[j] = dx_row(r + j);
      rows.mean[j] = c[j].mean;
      rows.rstd[j] = c[j].rstd;
      rows.mean_g[j] = c[j].mean_g;
      rows.mean_g_xhat[j] = c[j].mean_g_xhat;
    }
    apply_pair(rows, weight.present() ? weight.data() : nullptr, dw_acc, db_acc, p.cols());
  }

  void apply_chunk(std::int64_t r, std::int64_t begin, std::int64_t n, float mean, float rstd,
                   float mean_g, float mean_g_xhat, float* dw_acc, float* db_acc) {
    const void* addend = p.has_addend() ? advance(addend_row(r), begin, esize) : nullptr;
    apply(advance(dy_row(r), begin, esize), advance(x_row(r), begin, esize),
          weight.present() ? weight.data() + begin : nullptr, addend,
          advance(dx_row(r), begin, esize), dw_acc, db_acc, n, mean, rstd, mean_g, mean_g_xhat);
  }
};

// dst[offset, offset + n) = sum over b < blocks of partials[b * stride + j], added in block
// order to +0.0f and rounded once to dst's dtype: the SIMD ColumnSums (row_kernels.h) for
// the kernels' dtypes, a scalar loop with the same order otherwise.
void store_column_sums(const float* partials, std::int64_t blocks, std::int64_t stride,
                       std::int64_t n, Vector dst, std::int64_t offset) {
  if (dst.dtype == DType::kFloat32 || dst.dtype == DType::kFloat16 ||
      dst.dtype == DType::kBFloat16) {
    row_kernels().by_dtype[static_cast<int>(dst.dtype)].column_sums(
        partials, blocks, stride, n, advance(dst.data, offset, dtype_size(dst.dtype)));
    return;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    float total = 0.0f;
    for (std::int64_t b = 0; b < blocks; ++b) total += partials[b * stride + j];
    detail::store_from_float(dst.data, dst.dtype, offset + j, total);
  }
}

// dst (in the gradient's dtype) = sum over blocks of partials, added in block order, by
// column chunks across the threads.
void finish_column_sums(const float* partials, std::int64_t blocks, std::int64_t cols, Vector dst,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t begin = 0; begin < cols; begin += kReduceChunk) {
    store_column_sums(partials + begin, blocks, cols, std::min(cols - begin, kReduceChunk), dst,
                      begin);
  }
}

void backward_rows(BackwardCall& call, int threads, float* dw_partials, float* db_partials) {
  const std::int64_t rows = call.p.rows(), cols = call.p.cols();
  const RowBlocks blocks = row_blocks(rows);
  parallel_for(threads, blocks.count, [&](std::int64_t b) {
    float* dw_acc = call.want_dw ? dw_partials + b * cols : nullptr;
    float* db_acc = call.want_db ? db_partials + b * cols : nullptr;
    if (dw_acc) std::fill(dw_acc, dw_acc + cols, 0.0f);
    if (db_acc) std::fill(db_acc, db_acc + cols, 0.0f);
    const std::int64_t end = std::min(rows, (b + 1) * blocks.rows_per_block);
    std::int64_t r = b * blocks.rows_per_block;
    if (call.block != nullptr) {
      const BackwardProblem& p = call.p;
      BackwardBlock block;
      block.dy = call.dy_row(r);
      block.x = call.x_row(r);
      block.dx_addend = call.addend_row(r);
      block.dx = call.dx_row(r);
      block.dy_stride = p.dy.row_stride;
      block.x_stride = p.x.row_stride;
      block.addend_stride = p.has_addend() ? p.dx_addend.row_stride : 0;
      block.dx_stride = p.dx.row_stride;
      block.mean = call.centered ? p.mean + r : nullptr;
      block.rstd = p.rstd + r;
      block.rows = end - r;
      block.n = cols;
      call.block(block, call.weight.present() ? call.weight.data() : nullptr, dw_acc, db_acc);
      return;
    }
    // Two rows at a time: the apply pass loads and stores the dw / db partials and loads
    // the weight once per pair instead of once per row. Measured at 16384 x 4096, one
    // thread: fp32 8 to 12 % faster, fp16 and bf16 1 to 4 %. The dots pass is paired too
    // (coefficients<2>): two latency-bound chains side by side. (An earlier pairing was
    // measured 5 to 13 % slower for fp16 and bf16 while their dx was still streamed.)
    if (call.pairable()) {
      for (; r + 2 <= end; r += 2) {
        RowCoefficients c[2];
        call.coefficients<2>(r, c);
        call.apply_pair_rows(r, c, dw_acc, db_acc);
      }
    }
    for (; r < end; ++r) {
      RowCoefficients c[1];
      call.coefficients<1>(r, c);
      call.apply_chunk(r, 0, cols, c[0].mean, c[0].rstd, c[0].mean_g, c[0].mean_g_xhat, dw_acc,
                       db_acc);
    }
  });
  if (call.want_dw) finish_column_sums(dw_partials, blocks.count, cols, call.p.dw, threads);
  if (call.want_db) finish_column_sums(db_partials, blocks.count, cols, call.p.db, threads);
}

// Few long rows: row coefficients from (row, chunk) tasks, then dx / dw / db by column
// chunk, each chunk walking the same row blocks in the same order as backward_rows.
void backward_split_rows(BackwardCall& call, int threads) {
  const std::int64_t rows = call.p.rows(), cols = call.p.cols();
  const std::int64_t chunks = ceil_div(cols, kReduceChunk);
  std::vector<RowCoefficients> coef(static_cast<std::size_t>(rows));
  // Recomputing rstd here runs on one thread per row; the usual caller (autograd) passes
  // the rstd saved by the forward.
  for (std::int64_t r = 0; r < rows; ++r) call.row_stats(r, &coef[r].mean, &coef[r].rstd);
  if (call.p.phase == Phase::kFromSums) {
    for (std::int64_t r = 0; r < rows; ++r) call.sums_from_phase1(r, &coef[r]);
  } else {
    std::vector<float> g_xhat(static_cast<std::size_t>(rows * chunks)), g(g_xhat.size());
    parallel_for(threads, rows * chunks, [&](std::int64_t t) {
      const std::int64_t r = t / chunks, begin = (t % chunks) * kReduceChunk;
      call.chunk_dots<1>(r, begin, std::min(kReduceChunk, cols - begin), &coef[r], &g_xhat[t],
                         &g[t]);
    });
    for (std::int64_t r = 0; r < rows; ++r) {
      float sum_g_xhat = 0.0f, sum_g = 0.0f;
      for (std::int64_t c = 0; c < chunks; ++c) {
        sum_g_xhat += g_xhat[r * chunks + c];
        sum_g += g[r * chunks + c];
      }
      coef[r].mean_g = call.mean_of_sum(sum_g);
      coef[r].mean_g_xhat = call.mean_of_sum(sum_g_xhat);
    }
  }
  const RowBlocks blocks = row_blocks(rows);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> block_dw(call.want_dw ? kReduceChunk : 0),
        block_db(call.want_db ? kReduceChunk : 0);
    std::vector<float> total_dw(block_dw.size()), total_db(block_db.size());
#pragma omp for schedule(static) nowait
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t begin = c * kReduceChunk, n = std::min(kReduceChunk, cols - begin);
      std::fill(total_dw.begin(), total_dw.end(), 0.0f);
      std::fill(total_db.begin(), total_db.end(), 0.0f);
      for (std::int64_t b = 0; b < blocks.count; ++b) {
        std::fill(block_dw.begin(), block_dw.end(), 0.0f);
        std::fill(block_db.begin(), block_db.end(), 0.0f);
        const std::int64_t end = std::min(rows, (b + 1) * blocks.rows_per_block);
        for (std::int64_t r = b * blocks.rows_per_block; r < end; ++r) {
          call.apply_chunk(r, begin, n, coef[r].mean, coef[r].rstd, coef[r].mean_g,
                           coef[r].mean_g_xhat, call.want_dw ? block_dw.data() : nullptr,
                           call.want_db ? block_db.data() : nullptr);
        }
        for (std::int64_t j = 0; j < static_cast<std::int64_t>(total_dw.size()); ++j)
          total_dw[j] += block_dw[j];
        for (std::int64_t j = 0; j < static_cast<std::int64_t>(total_db.size()); ++j)
          total_db[j] += block_db[j];
      }
      // One block of finished sums: total is never -0.0f (it starts at +0.0f), so adding it
      // to +0.0f changes nothing and this only rounds, as the scalar store did.
      if (call.want_dw) store_column_sums(total_dw.data(), 1, n, n, call.p.dw, begin);
      if (call.want_db) store_column_sums(total_db.data(), 1, n, n, call.p.db, begin);
    }
    store_fence();  // dx may have been streamed
  }
}

void zero_vector(Vector v) {
  for (std::int64_t j = 0; v.data != nullptr && j < v.size; ++j) {
    detail::store_from_float(v.data, v.dtype, j, 0.0f);
  }
}

}  // namespace

bool untouched_memory(const void* data, std::size_t bytes) {
#ifdef FUSEDNORM_HAVE_MINCORE
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  // Whole pages only, and not the first: an allocator keeps its header just before the
  // data, on that page. Three samples: the second page, the middle one, the last whole one.
  const std::uintptr_t first = (begin + page - 1) / page * page + page;
  const std::uintptr_t last = (begin + bytes) / page * page;  // one past the last whole page
  if (data == nullptr || last < first + page) return false;
  const std::uintptr_t pages = (last - first) / page;
  for (const std::uintptr_t index : {std::uintptr_t{0}, pages / 2, pages - 1}) {
    unsigned char resident = 0;
    if (mincore(reinterpret_cast<void*>(first + index * page), page, &resident) != 0 ||
        (resident & 1) != 0) {
      return false;
    }
  }
  return true;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

RowBlocks row_blocks(std::int64_t rows) {
  const std::int64_t count =
      std::max<std::int64_t>(1, std::min(kMaxRowBlocks, ceil_div(rows, kMinRowsPerBlock)));
  const std::int64_t rows_per_block = std::max<std::int64_t>(1, ceil_div(rows, count));
  return {std::max<std::int64_t>(1, ceil_div(rows, rows_per_block)), rows_per_block};
}

ThreadPlan plan_threads(std::int64_t rows, std::int64_t cols, std::size_t bytes_moved,
                        int requested_threads) {
  const int available = requested_threads > 0 ? requested_threads : omp_get_num_procs();
  const auto by_size = static_cast<std::int64_t>(bytes_moved / kMinBytesPerThread);
  const int threads =
      static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(available, by_size)));
  // A row is split across threads only when there are too few rows to go round and each
  // thread still gets at least one whole chunk.
  const bool split =
      threads > 1 && rows < threads && rows <= kMaxSplitRows && cols >= 2 * kReduceChunk;
  return {threads, split};
}

std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols) {
  // dw and db partials, one fp32 row of each per row block.
  return 2 * static_cast<std::size_t>(row_blocks(rows).count * cols) * sizeof(float);
}

void forward(const ForwardProblem& p, int num_threads) {
  if (p.rows() == 0) return;
  if (p.x.dtype == DType::kFloat64) {
    forward_f64(p, num_threads);
    return;
  }
  if (p.is_quantized()) {
    forward_quantized(p, num_threads);
    return;
  }
  const ForwardCall call(p);
  const ThreadPlan plan = plan_threads(p.rows(), p.cols(), forward_bytes(p), num_threads);
  if (p.phase == Phase::kPartialSums || p.phase == Phase::kPartialDeviations) {
    // One thread per row: few long rows are not split (the sums' bits are the same).
    parallel_for(plan.threads, p.rows(),
                 [&](std::int64_t r) { p.partial_sums[r] = call.partial_sum(r); });
    return;
  }
  if (plan.split_rows) {
    forward_split_rows(call, plan.threads);
    return;
  }
  // The multi-row kernel computes each row's statistics itself: whole rows only.
  if (p.phase == Phase::kWhole && use_short_rows(call)) {
    forward_short_rows(call, plan.threads);
    return;
  }
  const std::int64_t batch = rows_per_batch(p.cols(), call.esize, call.stream);
  parallel_for(plan.threads, ceil_div(p.rows(), batch), [&](std::int64_t b) {
    forward_rows(call, b * batch, std::min(p.rows(), (b + 1) * batch));
  });
}

void backward(const BackwardProblem& p, int num_threads) {
  if (p.rows() == 0) {
    zero_vector(p.dw);
    zero_vector(p.db);
    return;
  }
  if (p.x.dtype == DType::kFloat64) {
    backward_f64(p, num_threads);
    return;
  }
  if (p.phase == Phase::kPartialSums) {
    const std::size_t bytes =
        2 * static_cast<std::size_t>(p.rows() * p.cols()) * dtype_size(p.x.dtype);
    const ThreadPlan plan = plan_threads(p.rows(), p.cols(), bytes, num_threads);
    BackwardCall call(p, plan.threads);
    // One thread per row: few long rows are not split (the sums' bits are the same).
    parallel_for(plan.threads, p.rows(), [&](std::int64_t r) {
      RowCoefficients c;
      float sum_g_xhat, sum_g;
      call.row_stats(r, &c.mean, &c.rstd);
      call.rows_dots<1>(r, &c, &sum_g_xhat, &sum_g);
      p.partial_sum_g_xhat[r] = sum_g_xhat;
      if (p.partial_sum_g != nullptr) p.partial_sum_g[r] = sum_g;
    });
    return;
  }
  const std::size_t needed = backward_workspace_bytes(p.rows(), p.cols());
  if (p.workspace.data != nullptr && p.workspace.bytes < needed) {
    detail::fail(p.kind == NormKind::kRms ? "rms_norm_backward" : "layer_norm_backward",
                 "workspace",
                 std::to_string(p.workspace.bytes) + " bytes given, " + std::to_string(needed) +
                     " needed (see backward_workspace_bytes)");
  }
  const std::size_t bytes =
      3 * static_cast<std::size_t>(p.rows() * p.cols()) * dtype_size(p.x.dtype);
  const ThreadPlan plan = plan_threads(p.rows(), p.cols(), bytes, num_threads);
  BackwardCall call(p, plan.threads);
  if (plan.split_rows) {
    backward_split_rows(call, plan.threads);
    return;
  }
  std::unique_ptr<float[]> owned;
  float* partials = static_cast<float*>(p.workspace.data);
  if (partials == nullptr) {
    owned.reset(new float[needed / sizeof(float)]);
    partials = owned.get();
  }
  const std::size_t half = needed / sizeof(float) / 2;
  backward_rows(call, plan.threads, partials, partials + half);
}

}  // namespace fusednorm::cpu
