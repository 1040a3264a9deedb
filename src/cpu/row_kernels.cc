// The table of every dtype's row kernels (row_kernels-inl.h, compiled per dtype in
// row_kernels_f32.cc, _f16.cc and _bf16.cc) and the target dispatch. This file is compiled
// once per SIMD target through foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/row_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/row_kernels-inl.h"
#include "cpu/row_kernels.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace HWY_NAMESPACE {

void StreamCopy(void* dst_ptr, const void* src_ptr, int64_t bytes, const void* ahead_ptr,
                int64_t ahead_bytes) {
  const hn::ScalableTag<uint8_t> d8;
  const auto N = static_cast<int64_t>(hn::Lanes(d8));
  auto* dst = static_cast<uint8_t*>(dst_ptr);
  const auto* src = static_cast<const uint8_t*>(src_ptr);
  constexpr int64_t kLine = 64;
  const auto head =
      static_cast<int64_t>((kLine - reinterpret_cast<uintptr_t>(dst) % kLine) % kLine);
  const auto* ahead = static_cast<const char*>(ahead_ptr);
  const char* const ahead_end = ahead + ahead_bytes;
  if (kLine % N != 0 || N < 16 || head + kLine > bytes) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    prefetch_to_l2(ahead, ahead_bytes);
    return;
  }
  std::memcpy(dst, src, static_cast<size_t>(head));
  const int64_t lines_end = head + (bytes - head) / kLine * kLine;
  // Prefetches per copied line: enough to cover ahead by the end of the copy.
  const int64_t lines = (lines_end - head) / kLine;
  const int64_t ahead_per_line = (ahead_bytes + lines * kLine - 1) / (lines * kLine);
  auto copy_line = [&](int64_t i) {
    const int64_t count = std::min(ahead_per_line * kLine, static_cast<int64_t>(ahead_end - ahead));
    prefetch_to_l2(ahead, count);
    ahead += count;
    for (int64_t k = 0; k < kLine; k += N) hn::Stream(hn::LoadU(d8, src + i + k), d8, dst + i + k);
  };
  if (StreamDescending(dst, src)) {  // 4 KiB aliasing: row_kernels-inl.h
    for (int64_t i = lines_end - kLine; i >= head; i -= kLine) copy_line(i);
  } else {
    for (int64_t i = head; i < lines_end; i += kLine) copy_line(i);
  }
  std::memcpy(dst + lines_end, src + lines_end, static_cast<size_t>(bytes - lines_end));
}

void FillRowKernels(RowKernels* kernels) {
  *kernels = RowKernels{};
  FillFloat32Kernels(&kernels->by_dtype[static_cast<int>(DType::kFloat32)]);
  FillFloat16Kernels(&kernels->by_dtype[static_cast<int>(DType::kFloat16)]);
  FillBFloat16Kernels(&kernels->by_dtype[static_cast<int>(DType::kBFloat16)]);
  kernels->stream_copy = &StreamCopy;
  kernels->target_name = hwy::TargetName(HWY_TARGET);
  kernels->target = HWY_TARGET;
  kernels->float_lanes = static_cast<int64_t>(hn::Lanes(DF()));
}

}  // namespace HWY_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>

namespace fusednorm::cpu {

HWY_EXPORT(FillRowKernels);

std::mutex& target_mock_mutex() {
  static std::mutex mutex;
  return mutex;
}

namespace {

RowKernels kernels_for_target(std::int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  RowKernels k;
  HWY_DYNAMIC_DISPATCH(FillRowKernels)(&k);
  hwy::SetSupportedTargetsForTest(0);
  return k;
}

// AVX3's table with the bf16 kernels of AVX512_BF16, when both are there (k: AVX3's).
bool upgrade_to_avx3_bf16(RowKernels* k) {
  if (k->target != HWY_AVX3) return false;
  if (!fill_avx512bf16_kernels(&k->by_dtype[static_cast<int>(DType::kBFloat16)])) return false;
  k->target_name = kAvx3Bf16TargetName;
  return true;
}

bool same_name(const char* a, const std::string& b) {
  const std::string left(a);
  return left.size() == b.size() &&
         std::equal(left.begin(), left.end(), b.begin(), [](char x, char y) {
           return std::toupper(static_cast<unsigned char>(x)) ==
                  std::toupper(static_cast<unsigned char>(y));
         });
}

RowKernels choose_kernels() {
  const char* const chosen = std::getenv("FUSEDNORM_CPU_TARGET");
  if (chosen == nullptr || *chosen == '\0') {
    RowKernels k;
    HWY_DYNAMIC_DISPATCH(FillRowKernels)(&k);
    upgrade_to_avx3_bf16(&k);
    return k;
  }
  // The same list the tests run (AVX3_BF16 included where it exists), so a name is accepted
  // exactly when its kernels are tested on this CPU.
  std::string available;
  for (const TargetKernels& t : kernels_for_all_supported_targets()) {
    if (same_name(t.name, chosen)) return t.kernels;
    available += std::string(available.empty() ? "" : ", ") + t.name;
  }
  throw Error(
      std::string("fusednorm: environment variable FUSEDNORM_CPU_TARGET: '") + chosen +
      "' is not a SIMD target of this build that this CPU supports (those are: " + available + ")");
}

}  // namespace

const RowKernels& row_kernels() {
  static const RowKernels kernels = choose_kernels();
  return kernels;
}

std::vector<TargetKernels> kernels_for_all_supported_targets() {
  std::lock_guard<std::mutex> lock(target_mock_mutex());
  std::vector<TargetKernels> result;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    result.push_back({hwy::TargetName(target), kernels_for_target(target)});
    RowKernels upgraded = result.back().kernels;
    if (upgrade_to_avx3_bf16(&upgraded)) result.push_back({kAvx3Bf16TargetName, upgraded});
  }
  return result;
}

}  // namespace fusednorm::cpu
#endif  // HWY_ONCE
