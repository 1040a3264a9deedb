// Highway implementation of quant_kernels.h, compiled once per SIMD target through
// foreach_target.h. Few instantiations on purpose (compile time): per target, one
// NormalizeAmax per (rows dtype, weight type) pair (8) and one quantizer per q dtype (2).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/quant_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <cstring>
#include <type_traits>

#include "cpu/element_io-inl.h"
#include "cpu/quant_kernels.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace HWY_NAMESPACE {

// y = x * rstd [* (w + w_offset)]: the operations of row_kernels-inl.h's Normalize (RMSNorm),
// in the same order, so y has rms_norm's fp32 bits before its rounding to x's dtype.
template <typename T, typename W, class IsFull>
HWY_INLINE VF NormalizedElements(IsFull full, DF df, const T* x, const void* w, int64_t i,
                                 size_t count, VF vrstd, VF voffset) {
  VF y = hn::Mul(LoadElements(full, df, x + i, count), vrstd);
  if constexpr (!std::is_void_v<W>) {
    y = hn::Mul(y, hn::Add(LoadElements(full, df, static_cast<const W*>(w) + i, count), voffset));
  }
  return y;
}

// y = x * rstd [* (w + w_offset)] of n elements into y_out (fp32); returns max |y| over the
// non-NaN values (0 if none).
template <typename T, typename W>
float NormalizeAmax(const void* x_ptr, const void* w, float* y_out, int64_t n, float rstd,
                    float w_offset) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  const VF vrstd = hn::Set(df, rstd), voffset = hn::Set(df, w_offset);
  // NaN lanes count as 0: x86's max would otherwise keep or drop them by operand order.
  auto magnitude = [](VF y) { return hn::IfThenZeroElse(hn::IsNaN(y), hn::Abs(y)); };
  VF acc0 = hn::Zero(df), acc1 = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const VF y0 = NormalizedElements<T, W>(Full(), df, x, w, i, N, vrstd, voffset);
    const VF y1 = NormalizedElements<T, W>(Full(), df, x, w, i + N, N, vrstd, voffset);
    hn::StoreU(y0, df, y_out + i);
    hn::StoreU(y1, df, y_out + i + N);
    acc0 = hn::Max(acc0, magnitude(y0));
    acc1 = hn::Max(acc1, magnitude(y1));
  }
  for (; i + N <= n; i += N) {
    const VF y = NormalizedElements<T, W>(Full(), df, x, w, i, N, vrstd, voffset);
    hn::StoreU(y, df, y_out + i);
    acc0 = hn::Max(acc0, magnitude(y));
  }
  if (i < n) {
    // Padding lanes load as 0 (y = 0, or NaN when rstd is Inf): they never raise the max.
    const auto rest = static_cast<size_t>(n - i);
    const VF y = NormalizedElements<T, W>(Partial(), df, x, w, i, rest, vrstd, voffset);
    StoreFloats(Partial(), df, y, y_out + i, rest);
    acc1 = hn::Max(acc1, magnitude(y));
  }
  return hn::GetLane(hn::MaxOfLanes(df, hn::Max(acc0, acc1)));
}

// One vector of fp32 values to quantized bytes (Lanes(DF) of them at p): the bits of
// quantize.h's float_to_int8_saturate / float_to_e4m3_saturate, lane by lane.
using D8 = hn::Rebind<uint8_t, DF>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;

HWY_INLINE hn::Vec<D8> QuantizeInt8(DF df, VF v) {
  const DI di;
  v = hn::IfThenZeroElse(hn::IsNaN(v), v);
  v = hn::Min(hn::Max(v, hn::Set(df, -128.0f)), hn::Set(df, 127.0f));
  // Adding 1.5 * 2^23 rounds |v| <= 128 to an integer, to nearest even, and leaves the sum in
  // [2^23, 2^24), where the fp32 ulp is 1: the sum's bits minus the constant's are that
  // integer. (Subtracting the constant in fp32 and converting cost five more instructions
  // per vector on AVX2: Highway's ConvertTo guards against out-of-range values.)
  const VF magic = hn::Set(df, 12582912.0f);
  const auto integer = hn::Sub(hn::BitCast(di, hn::Add(v, magic)), hn::Set(di, 0x4b400000));
  const hn::Rebind<int8_t, DF> d8;
  return hn::BitCast(D8(), hn::DemoteTo(d8, integer));
}

HWY_INLINE hn::Vec<D8> QuantizeE4M3(DF df, VF v) {
  const DI di;
  const DU du;
  const auto bits = hn::BitCast(du, v);
  const auto sign = hn::And(hn::ShiftRight<24>(bits), hn::Set(du, 0x80u));
  const auto abs_bits = hn::And(bits, hn::Set(du, 0x7fffffffu));
  // abs_bits < 2^31: signed comparisons are exact (and native on every target).
  const auto abs_signed = hn::BitCast(di, abs_bits);
  const auto is_nan = hn::RebindMask(du, hn::Gt(abs_signed, hn::Set(di, 0x7f800000)));
  const auto saturates = hn::RebindMask(du, hn::Gt(abs_signed, hn::Set(di, 0x43dfffff)));
  const auto subnormal = hn::RebindMask(du, hn::Lt(abs_signed, hn::Set(di, 0x3c800000)));
  // Below 2^-6: m * 2^-9, rounded by the fp32 adder (2^14's ulp is 2^-9).
  const VF magic = hn::Set(df, 16384.0f);
  const auto small =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, abs_bits), magic)), hn::BitCast(du, magic));
  // Normal: round the 20 dropped mantissa bits to nearest even, rebias the exponent.
  const auto rounded = hn::Add(
      abs_bits,
      hn::Add(hn::Set(du, 0x7ffffu), hn::And(hn::ShiftRight<20>(abs_bits), hn::Set(du, 1u))));
  const auto normal = hn::Sub(hn::ShiftRight<20>(rounded), hn::Set(du, 120u << 3));
  auto magnitude = hn::IfThenElse(subnormal, small, normal);
  magnitude = hn::IfThenElse(saturates, hn::Set(du, 0x7eu), magnitude);
  // NaN: the canonical 0x7f, sign dropped (quantize.h, as CUDA's conversions).
  const auto code = hn::IfThenElse(is_nan, hn::Set(du, 0x7fu), hn::Or(sign, magnitude));
  return hn::DemoteTo(D8(), hn::BitCast(di, code));
}

template <bool kFp8>
HWY_INLINE hn::Vec<D8> Quantize(DF df, VF v) {
  if constexpr (kFp8) {
    return QuantizeE4M3(df, v);
  } else {
    return QuantizeInt8(df, v);
  }
}

template <bool kFp8>
void QuantizeFloats(const float* y, void* q_ptr, int64_t n, float inv_scale) {
  const DF df;
  const D8 d8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto* q = static_cast<uint8_t*>(q_ptr);
  const VF vinv = hn::Set(df, inv_scale);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const VF a = hn::Mul(hn::LoadU(df, y + i), vinv);
    const VF b = hn::Mul(hn::LoadU(df, y + i + N), vinv);
    hn::StoreU(Quantize<kFp8>(df, a), d8, q + i);
    hn::StoreU(Quantize<kFp8>(df, b), d8, q + i + N);
  }
  for (; i + N <= n; i += N) {
    hn::StoreU(Quantize<kFp8>(df, hn::Mul(hn::LoadU(df, y + i), vinv)), d8, q + i);
  }
  if (i < n) {
    const auto rest = static_cast<size_t>(n - i);
    const VF v = hn::Mul(LoadElements(Partial(), df, y + i, rest), vinv);
    HWY_ALIGN uint8_t staged[HWY_MAX_BYTES / sizeof(float)];
    hn::Store(Quantize<kFp8>(df, v), d8, staged);
    std::memcpy(q + i, staged, rest);
  }
}

// ---- Table construction ----------------------------------------------------------------

// The kernel of rows T with weight W (void: none) into its ParamType slots; for fp32 rows an
// fp32 weight is also the rows' own dtype.
template <typename T, typename W>
void SetNormalizeAmax(QuantKernels* k, DType dtype) {
  auto& slots = k->normalize_amax[static_cast<int>(dtype)];
  if constexpr (std::is_void_v<W>) {
    slots[kNoParam] = &NormalizeAmax<T, W>;
  } else if constexpr (std::is_same_v<W, float>) {
    slots[kFloat32Param] = &NormalizeAmax<T, W>;
    if constexpr (std::is_same_v<T, float>) slots[kElementParam] = &NormalizeAmax<T, W>;
  } else {
    slots[kElementParam] = &NormalizeAmax<T, W>;
  }
}

template <typename T>
void SetNormalizeAmaxDType(QuantKernels* k, DType dtype) {
  SetNormalizeAmax<T, void>(k, dtype);
  SetNormalizeAmax<T, float>(k, dtype);
  if constexpr (!std::is_same_v<T, float>) SetNormalizeAmax<T, T>(k, dtype);
}

void FillQuantKernels(QuantKernels* k) {
  *k = QuantKernels{};
  SetNormalizeAmaxDType<float>(k, DType::kFloat32);
  SetNormalizeAmaxDType<hwy::float16_t>(k, DType::kFloat16);
  SetNormalizeAmaxDType<hwy::bfloat16_t>(k, DType::kBFloat16);
  k->quantize[0] = &QuantizeFloats<false>;
  k->quantize[1] = &QuantizeFloats<true>;
  k->target_name = hwy::TargetName(HWY_TARGET);
}

}  // namespace HWY_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <mutex>

namespace fusednorm::cpu {

HWY_EXPORT(FillQuantKernels);

namespace {

QuantKernels kernels_for_target(std::int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  QuantKernels k;
  HWY_DYNAMIC_DISPATCH(FillQuantKernels)(&k);
  hwy::SetSupportedTargetsForTest(0);
  return k;
}

// The target row_kernels() chose (the best one, or FUSEDNORM_CPU_TARGET's), so that a call
// never mixes two targets.
QuantKernels choose_kernels() {
  const char* const name = row_kernels().target_name;
  std::lock_guard<std::mutex> lock(target_mock_mutex());
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (std::strcmp(hwy::TargetName(target), name) == 0) return kernels_for_target(target);
  }
  QuantKernels k;
  HWY_DYNAMIC_DISPATCH(FillQuantKernels)(&k);
  return k;
}

}  // namespace

const QuantKernels& quant_kernels() {
  static const QuantKernels kernels = choose_kernels();
  return kernels;
}

std::vector<TargetQuantKernels> quant_kernels_for_all_supported_targets() {
  std::lock_guard<std::mutex> lock(target_mock_mutex());
  std::vector<TargetQuantKernels> result;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    result.push_back({hwy::TargetName(target), kernels_for_target(target)});
  }
  return result;
}

}  // namespace fusednorm::cpu
#endif  // HWY_ONCE
