// Highway implementation of quant_kernels.h, compiled once per SIMD target through
// foreach_target.h. Few instantiations on purpose (compile time): per target, one
// NormalizeAmax per (rows dtype, weight type) pair (8) and per rows dtype with a prepared
// weight (3), two quantizers (any values / in range) per q dtype and store kind (ordinary /
// streamed) (8), and one static-scale NormalizeQuantize per (store kind, rows dtype, no /
// prepared weight, q dtype) (24).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/quant_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <cmath>
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
// W = PreparedWeight: w holds (w + w_offset) in fp32 (cpu_backend.cpp computes it once per
// call with the same fp32 addition), so y gets the same bits with one load per vector.
struct PreparedWeight {};

template <typename T, typename W, class IsFull>
HWY_INLINE VF NormalizedElements(IsFull full, DF df, const T* x, const void* w, int64_t i,
                                 size_t count, VF vrstd, VF voffset) {
  VF y = hn::Mul(LoadElements(full, df, x + i, count), vrstd);
  if constexpr (std::is_same_v<W, PreparedWeight>) {
    y = hn::Mul(y, LoadElements(full, df, static_cast<const float*>(w) + i, count));
  } else if constexpr (!std::is_void_v<W>) {
    y = hn::Mul(y, hn::Add(LoadElements(full, df, static_cast<const W*>(w) + i, count), voffset));
  }
  return y;
}

// max |y[j]| over the non-NaN y[j] of a staged piece that holds a NaN (NormalizeAmax's
// rare path: a NaN row).
float MaxMagnitudeWithoutNaN(const float* y, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF acc = hn::Zero(df);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const VF v = hn::LoadU(df, y + i);
    acc = hn::Max(acc, hn::IfThenZeroElse(hn::IsNaN(v), hn::Abs(v)));
  }
  float amax = hn::GetLane(hn::MaxOfLanes(df, acc));
  for (; i < n; ++i) {
    if (!std::isnan(y[i])) amax = std::fmax(amax, std::fabs(y[i]));
  }
  return amax;
}

// y = x * rstd [* (w + w_offset)] of n elements into y_out (fp32); returns max |y| over the
// non-NaN values (0 if none) and whether there were NaNs.
template <typename T, typename W>
RowAmax NormalizeAmax(const void* x_ptr, const void* w, float* y_out, int64_t n, float rstd,
                      float w_offset, const void* ahead_ptr) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  const T* ahead = prefetch_row<T>(ahead_ptr, x_ptr);
  const VF vrstd = hn::Set(df, rstd), voffset = hn::Set(df, w_offset);
  // The max is taken over the bits of |y| as integers: non-negative floats order as their
  // bits do, and a NaN's bits exceed Inf's, so a NaN shows in the result and sends the piece
  // to the rare path. One AND and one integer max per vector where excluding NaN lanes as
  // they come took four operations.
  const auto abs_mask = hn::Set(di, 0x7fffffff);
  auto magnitude_bits = [&](VF y) { return hn::And(hn::BitCast(di, y), abs_mask); };
  auto acc0 = hn::Zero(di), acc1 = hn::Zero(di);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    prefetch_line_to_l2(ahead + i);
    prefetch_line_to_l2(ahead + i + N);
    const VF y0 = NormalizedElements<T, W>(Full(), df, x, w, i, N, vrstd, voffset);
    const VF y1 = NormalizedElements<T, W>(Full(), df, x, w, i + N, N, vrstd, voffset);
    hn::StoreU(y0, df, y_out + i);
    hn::StoreU(y1, df, y_out + i + N);
    acc0 = hn::Max(acc0, magnitude_bits(y0));
    acc1 = hn::Max(acc1, magnitude_bits(y1));
  }
  for (; i + N <= n; i += N) {
    const VF y = NormalizedElements<T, W>(Full(), df, x, w, i, N, vrstd, voffset);
    hn::StoreU(y, df, y_out + i);
    acc0 = hn::Max(acc0, magnitude_bits(y));
  }
  if (i < n) {
    // Padding lanes load as 0: y = 0, or NaN when rstd is Inf (then the rare path below
    // looks at the n stored values only).
    const auto rest = static_cast<size_t>(n - i);
    const VF y = NormalizedElements<T, W>(Partial(), df, x, w, i, rest, vrstd, voffset);
    StoreFloats(Partial(), df, y, y_out + i, rest);
    acc1 = hn::Max(acc1, magnitude_bits(y));
  }
  const int32_t amax_bits = hn::GetLane(hn::MaxOfLanes(di, hn::Max(acc0, acc1)));
  if (amax_bits > 0x7f800000) return {MaxMagnitudeWithoutNaN(y_out, n), true};
  return {detail::bits_float(static_cast<uint32_t>(amax_bits)), false};
}

// The quantizers turn fp32 values into one byte per i32 lane (int8 values as -128..127,
// E4M3 codes as 0..255), the bits of quantize.h's float_to_int8_saturate /
// float_to_e4m3_saturate; StoreBytes narrows the lanes to bytes.
using D8 = hn::Rebind<uint8_t, DF>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VI = hn::Vec<DI>;

// What a quantizer may assume of its values v (quant_kernels.h): kAny: nothing; kNoNaN: no
// NaN (Inf and out-of-range values saturate); kInRange: finite with
// |v| <= qmax * (1 + 2^-20). Each assumption drops the work that could not change a result.
enum class QuantRange { kAny, kNoNaN, kInRange };

// Rounding to nearest even: x86's cvtps2dq rounds as MXCSR says (nearest even unless a caller
// changed it, which the fp32 arithmetic before it obeys too), and its out-of-range result,
// INT32_MIN, saturates to -128 in the narrowing packs, right for v < -2^31, so only
// v > 127 needs a clamp. Two instructions per vector (min, convert) where the clamp to
// [-128, 127] and the 1.5 * 2^23 addition below took four: static i8, fp32 rows, AVX2
// (docs/PERFORMANCE.md, "tenth session"). Other targets add 1.5 * 2^23, which rounds
// |v| <= 128 to an integer, to nearest even, and leaves the sum in [2^23, 2^24), where the
// fp32 ulp is 1: the sum's bits minus the constant's are that integer.
#undef FUSEDNORM_QUANT_CVT
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
#define FUSEDNORM_QUANT_CVT 1
#else
#define FUSEDNORM_QUANT_CVT 0
#endif

template <QuantRange kRange>
HWY_INLINE VI QuantizeInt8(DF df, VF v) {
  if constexpr (kRange == QuantRange::kAny) v = hn::IfThenZeroElse(hn::IsNaN(v), v);
#if FUSEDNORM_QUANT_CVT
  if constexpr (kRange != QuantRange::kInRange) v = hn::Min(v, hn::Set(df, 127.0f));
#if HWY_TARGET <= HWY_AVX3
  return VI{_mm512_cvtps_epi32(v.raw)};
#elif HWY_TARGET == HWY_AVX2
  return VI{_mm256_cvtps_epi32(v.raw)};
#else
  return VI{_mm_cvtps_epi32(v.raw)};
#endif
#else
  const DI di;
  if constexpr (kRange != QuantRange::kInRange) {
    v = hn::Min(hn::Max(v, hn::Set(df, -128.0f)), hn::Set(df, 127.0f));
  }
  const VF magic = hn::Set(df, 12582912.0f);
  return hn::Sub(hn::BitCast(di, hn::Add(v, magic)), hn::Set(di, 0x4b400000));
#endif
}

// One formula for normal and subnormal E4M3 values: with a = min(|v|, 448) and
// B = 2^(max(e, -6) + 20) (e: a's fp32 exponent), B's fp32 ulp is a's E4M3 step (2^(e-3),
// 2^-9 below 2^-6), so the fp32 adder rounds a to nearest even on that step and
// bits(B + a) = bits(B) + k with a ~ k steps, k <= 16. The code is then
// ((max(e, -6) + 6) << 3) + k: the exponent field of B + a, rebiased, plus k (k = 16 carries
// into the next exponent, as the rounding of the scalar version does). No result is an fp32
// subnormal (B + a >= 2^14), so FTZ / DAZ modes cannot change it (DAZ only zeroes inputs
// below 2^-126, which quantize to 0 anyway). 15 vector operations on AVX2: with StoreBytes4,
// QuantizeFloats went from 3.45 (three selects, one vector per store) to 2.39 instructions
// per element (callgrind; docs/PERFORMANCE.md, sixth session).
// kInRange: |v| <= 448 * (1 + 2^-20) < 464 rounds to at most 448's code by the formula
// itself, so the clamp is skipped; kNoNaN and kInRange skip the NaN select.
template <QuantRange kRange>
HWY_INLINE VI QuantizeE4M3(DF df, VF v) {
  constexpr bool kInRange = kRange == QuantRange::kInRange;
  const DI di;
  const DU du;
  const auto bits = hn::BitCast(di, v);
  const auto abs_bits = hn::And(bits, hn::Set(di, 0x7fffffff));
  // abs_bits < 2^31: signed comparisons and min / max are exact.
  const auto a = kInRange ? abs_bits : hn::Min(abs_bits, hn::Set(di, 0x43e00000));  // >= 448: 448
  const auto b = hn::Add(hn::Max(hn::And(a, hn::Set(di, 0x7f800000)), hn::Set(di, 0x3c800000)),
                         hn::Set(di, 20 << 23));
  const auto sum = hn::BitCast(di, hn::Add(hn::BitCast(df, a), hn::BitCast(df, b)));
  // (sum - bits(2^14)) >> 20 is (exponent - 141) << 3 (k < 2^20 shifts out); 2^14 is B below 2^-6.
  const auto magnitude = hn::Add(hn::ShiftRight<20>(hn::Sub(sum, hn::Set(di, 141 << 23))),
                                 hn::And(sum, hn::Set(di, 0x1f)));
  // code = magnitude | (sign bit moved to bit 7): one ternary-logic instruction on AVX-512.
  const auto code = hn::OrAnd(magnitude, hn::BitCast(di, hn::ShiftRight<24>(hn::BitCast(du, bits))),
                              hn::Set(di, 0x80));
  if constexpr (kRange != QuantRange::kAny) return code;
  // NaN: the canonical 0x7f, sign dropped (quantize.h, as CUDA's conversions).
  return hn::IfThenElse(hn::Gt(abs_bits, hn::Set(di, 0x7f800000)), hn::Set(di, 0x7f), code);
}

template <bool kFp8, QuantRange kRange>
HWY_INLINE VI Quantize(DF df, VF v) {
  if constexpr (kFp8) {
    return QuantizeE4M3<kRange>(df, v);
  } else {
    return QuantizeInt8<kRange>(df, v);
  }
}

// One vector's bytes (Lanes(DF) of them) at p: int8 values by signed saturation (a no-op on
// values already in range), E4M3 codes by unsigned saturation.
template <bool kFp8>
HWY_INLINE void StoreBytes(VI v, uint8_t* p) {
  const D8 d8;
  if constexpr (kFp8) {
    hn::StoreU(hn::DemoteTo(d8, v), d8, p);
  } else {
    hn::StoreU(hn::BitCast(d8, hn::DemoteTo(hn::Rebind<int8_t, DF>(), v)), d8, p);
  }
}

// Four vectors' bytes (4 * Lanes(DF)) at p, in order. x86's packs narrow two registers at
// once, which StoreBytes (Highway 1.0's DemoteTo, one vector) cannot use: on AVX2 three packs
// and one permute here against three shuffles per vector there. Within 128-bit registers the
// packs keep lane order; AVX2's work per 128-bit half, so its bytes come out as the 4-byte
// groups a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 and one permute orders them; AVX-512's
// four 128-bit lanes the same way, in one permute. AVX-512 narrows a vector in one instruction
// too (vpmov[u]sdb), but on Zen 4 the four of those cost more than three packs and a permute:
// in L1, quantize int8 2.35 -> 1.75 cycles per 8 elements, e4m3 6.15 -> 5.1
// (fusednorm-kernel-cycles; docs/PERFORMANCE.md, fourteenth session). Other targets store
// vector by vector.
// kStream: a non-temporal store, p aligned to the 4 vectors' bytes (16, 32 or 64; targets
// without packs store ordinarily: kStreamsBytes4).
#undef FUSEDNORM_QUANT_PACKS
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET <= HWY_AVX3 || HWY_TARGET == HWY_SSE4 || \
    HWY_TARGET == HWY_SSSE3
#define FUSEDNORM_QUANT_PACKS 1
#else
#define FUSEDNORM_QUANT_PACKS 0
#endif
constexpr bool kStreamsBytes4 = FUSEDNORM_QUANT_PACKS;
template <bool kFp8, bool kStream = false>
HWY_INLINE void StoreBytes4(VI a, VI b, VI c, VI d, uint8_t* p) {
#if HWY_TARGET == HWY_AVX2
  const __m256i ab = _mm256_packs_epi32(a.raw, b.raw);
  const __m256i cd = _mm256_packs_epi32(c.raw, d.raw);
  const __m256i bytes = kFp8 ? _mm256_packus_epi16(ab, cd) : _mm256_packs_epi16(ab, cd);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, order);
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ordered);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ordered);
  }
#elif HWY_TARGET <= HWY_AVX3
  const __m512i ab = _mm512_packs_epi32(a.raw, b.raw);
  const __m512i cd = _mm512_packs_epi32(c.raw, d.raw);
  const __m512i bytes = kFp8 ? _mm512_packus_epi16(ab, cd) : _mm512_packs_epi16(ab, cd);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i ordered = _mm512_permutexvar_epi32(order, bytes);
  if constexpr (kStream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), ordered);
  } else {
    _mm512_storeu_si512(p, ordered);
  }
#elif HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3
  const __m128i ab = _mm_packs_epi32(a.raw, b.raw);
  const __m128i cd = _mm_packs_epi32(c.raw, d.raw);
  const __m128i bytes = kFp8 ? _mm_packus_epi16(ab, cd) : _mm_packs_epi16(ab, cd);
  if constexpr (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), bytes);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
  }
#else
  const size_t N = hn::Lanes(DF());
  StoreBytes<kFp8>(a, p);
  StoreBytes<kFp8>(b, p + N);
  StoreBytes<kFp8>(c, p + 2 * N);
  StoreBytes<kFp8>(d, p + 3 * N);
#endif
}

// The whole 64-byte lines of n bytes at q, as byte offsets [first, last) (empty: first ==
// last). Streamed kernels write those with non-temporal stores and the partial lines at the
// ends (shared with the neighbouring rows) with ordinary ones: a line written partly each
// way is flushed half-empty (row_kernels-inl.h's WriteRows streams whole lines only too).
struct WholeLines {
  int64_t first, last;
};
HWY_INLINE WholeLines WholeLinesOf(const uint8_t* q, int64_t n) {
  constexpr int64_t kLine = 64;
  const auto first = static_cast<int64_t>((kLine - reinterpret_cast<uintptr_t>(q) % kLine) % kLine);
  if (first + kLine > n) return {0, 0};
  return {first, first + (n - first) / kLine * kLine};
}

// kStream: q goes out with non-temporal stores (whole lines), which skip reading each line of
// q before overwriting it, straight from the quantizer: quantizing into an L1 buffer and
// copying that out with non-temporal stores (as the forward's short rows do) made the copy a
// loop of stores that waited on the write-combining buffers with nothing to overlap them.
template <bool kFp8, QuantRange kRange, bool kStream>
void QuantizeFloats(const float* y, void* q_ptr, int64_t n, float inv_scale) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto* q = static_cast<uint8_t*>(q_ptr);
  const VF vinv = hn::Set(df, inv_scale);
  auto quantized = [&](int64_t i) {
    return Quantize<kFp8, kRange>(df, hn::Mul(hn::LoadU(df, y + i), vinv));
  };
  if constexpr (kStream && kStreamsBytes4) {
    const WholeLines lines = WholeLinesOf(q, n);
    if (lines.first < lines.last) {
      QuantizeFloats<kFp8, kRange, false>(y, q, lines.first, inv_scale);
      for (int64_t i = lines.first; i < lines.last; i += 4 * N) {
        StoreBytes4<kFp8, true>(quantized(i), quantized(i + N), quantized(i + 2 * N),
                                quantized(i + 3 * N), q + i);
      }
      QuantizeFloats<kFp8, kRange, false>(y + lines.last, q + lines.last, n - lines.last,
                                          inv_scale);
      return;
    }
  }
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    StoreBytes4<kFp8>(quantized(i), quantized(i + N), quantized(i + 2 * N), quantized(i + 3 * N),
                      q + i);
  }
  for (; i + N <= n; i += N) StoreBytes<kFp8>(quantized(i), q + i);
  if (i < n) {
    const auto rest = static_cast<size_t>(n - i);
    const VF v = hn::Mul(LoadElements(Partial(), df, y + i, rest), vinv);
    HWY_ALIGN uint8_t staged[HWY_MAX_BYTES / sizeof(float)];
    StoreBytes<kFp8>(Quantize<kFp8, kRange>(df, v), staged);
    std::memcpy(q + i, staged, rest);
  }
}

// Static scale: q = quantize(y * inv_scale) straight from x, y never stored (W: void or
// PreparedWeight). The same operations as NormalizeAmax then QuantizeFloats, so the same bits.
// The caller guarantees that no y * inv_scale is NaN (quant_kernels.h), so the quantizer
// skips the NaN select.
// (A function, not a lambda: GCC did not inline the lambda holding the E4M3 quantizer, which
// cost 1.6 times the instructions.)
template <typename T, typename W, bool kFp8>
HWY_INLINE VI QuantizedElements(DF df, const T* x, const void* w, int64_t i, VF vrstd, VF vinv) {
  // (voffset: only read for an unprepared weight)
  const VF y = NormalizedElements<T, W>(Full(), df, x, w, i, hn::Lanes(df), vrstd, vrstd);
  return Quantize<kFp8, QuantRange::kNoNaN>(df, hn::Mul(y, vinv));
}

template <typename T, typename W, bool kFp8, bool kStream>
void NormalizeQuantize(const void* x_ptr, const void* w, void* q_ptr, int64_t n, float rstd,
                       float inv_scale, const void* ahead_ptr) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  const T* ahead = prefetch_row<T>(ahead_ptr, x_ptr);
  auto* q = static_cast<uint8_t*>(q_ptr);
  const VF vrstd = hn::Set(df, rstd), vinv = hn::Set(df, inv_scale);
  if constexpr (kStream && kStreamsBytes4) {
    const WholeLines lines = WholeLinesOf(q, n);
    if (lines.first < lines.last) {
      // (The weight pointer is not advanced: w + i indexes it from the row's start.)
      NormalizeQuantize<T, W, kFp8, false>(x, w, q, lines.first, rstd, inv_scale, ahead);
      for (int64_t i = lines.first; i < lines.last; i += 4 * N) {
        for (int64_t v = 0; v < 4; ++v) prefetch_line_to_l2(ahead + i + v * N);
        StoreBytes4<kFp8, true>(QuantizedElements<T, W, kFp8>(df, x, w, i, vrstd, vinv),
                                QuantizedElements<T, W, kFp8>(df, x, w, i + N, vrstd, vinv),
                                QuantizedElements<T, W, kFp8>(df, x, w, i + 2 * N, vrstd, vinv),
                                QuantizedElements<T, W, kFp8>(df, x, w, i + 3 * N, vrstd, vinv),
                                q + i);
      }
      const void* w_tail = w == nullptr ? nullptr : static_cast<const float*>(w) + lines.last;
      NormalizeQuantize<T, W, kFp8, false>(x + lines.last, w_tail, q + lines.last, n - lines.last,
                                           rstd, inv_scale, ahead + lines.last);
      return;
    }
  }
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    for (int64_t v = 0; v < 4; ++v) prefetch_line_to_l2(ahead + i + v * N);
    StoreBytes4<kFp8>(QuantizedElements<T, W, kFp8>(df, x, w, i, vrstd, vinv),
                      QuantizedElements<T, W, kFp8>(df, x, w, i + N, vrstd, vinv),
                      QuantizedElements<T, W, kFp8>(df, x, w, i + 2 * N, vrstd, vinv),
                      QuantizedElements<T, W, kFp8>(df, x, w, i + 3 * N, vrstd, vinv), q + i);
  }
  for (; i + N <= n; i += N) {
    StoreBytes<kFp8>(QuantizedElements<T, W, kFp8>(df, x, w, i, vrstd, vinv), q + i);
  }
  if (i < n) {
    const auto rest = static_cast<size_t>(n - i);
    const VF y = NormalizedElements<T, W>(Partial(), df, x, w, i, rest, vrstd, vrstd);
    HWY_ALIGN uint8_t staged[HWY_MAX_BYTES / sizeof(float)];
    StoreBytes<kFp8>(Quantize<kFp8, QuantRange::kNoNaN>(df, hn::Mul(y, vinv)), staged);
    std::memcpy(q + i, staged, rest);
  }
}

// Whether every v[j] is finite: the largest magnitude's bits below Inf's (NaNs' exceed them).
bool AllFinite(const float* v, int64_t n) {
  const DF df;
  const DI di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto abs_mask = hn::Set(di, 0x7fffffff);
  auto acc = hn::Zero(di);
  int64_t i = 0;
  for (; i + N <= n; i += N)
    acc = hn::Max(acc, hn::And(hn::BitCast(di, hn::LoadU(df, v + i)), abs_mask));
  if (i < n) {
    const VF rest = LoadElements(Partial(), df, v + i, static_cast<size_t>(n - i));  // padding: 0
    acc = hn::Max(acc, hn::And(hn::BitCast(di, rest), abs_mask));
  }
  return hn::GetLane(hn::MaxOfLanes(di, acc)) < 0x7f800000;
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

template <typename T, bool kStream>
void SetNormalizeQuantize(NormalizeQuantizeFn (&fused)[2][2]) {
  fused[0][0] = &NormalizeQuantize<T, void, false, kStream>;
  fused[0][1] = &NormalizeQuantize<T, void, true, kStream>;
  fused[1][0] = &NormalizeQuantize<T, PreparedWeight, false, kStream>;
  fused[1][1] = &NormalizeQuantize<T, PreparedWeight, true, kStream>;
}

template <typename T>
void SetNormalizeAmaxDType(QuantKernels* k, DType dtype) {
  SetNormalizeAmax<T, void>(k, dtype);
  SetNormalizeAmax<T, float>(k, dtype);
  if constexpr (!std::is_same_v<T, float>) SetNormalizeAmax<T, T>(k, dtype);
  k->normalize_amax_prepared[static_cast<int>(dtype)] = &NormalizeAmax<T, PreparedWeight>;
  SetNormalizeQuantize<T, false>(k->normalize_quantize[0][static_cast<int>(dtype)]);
  SetNormalizeQuantize<T, true>(k->normalize_quantize[1][static_cast<int>(dtype)]);
}

void FillQuantKernels(QuantKernels* k) {
  *k = QuantKernels{};
  SetNormalizeAmaxDType<float>(k, DType::kFloat32);
  SetNormalizeAmaxDType<hwy::float16_t>(k, DType::kFloat16);
  SetNormalizeAmaxDType<hwy::bfloat16_t>(k, DType::kBFloat16);
  k->quantize[0][0] = &QuantizeFloats<false, QuantRange::kAny, false>;
  k->quantize[0][1] = &QuantizeFloats<true, QuantRange::kAny, false>;
  k->quantize[1][0] = &QuantizeFloats<false, QuantRange::kAny, true>;
  k->quantize[1][1] = &QuantizeFloats<true, QuantRange::kAny, true>;
  k->quantize_in_range[0][0] = &QuantizeFloats<false, QuantRange::kInRange, false>;
  k->quantize_in_range[0][1] = &QuantizeFloats<true, QuantRange::kInRange, false>;
  k->quantize_in_range[1][0] = &QuantizeFloats<false, QuantRange::kInRange, true>;
  k->quantize_in_range[1][1] = &QuantizeFloats<true, QuantRange::kInRange, true>;
  k->all_finite = &AllFinite;
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
// never mixes two targets; AVX3_BF16's is AVX3 (the quantized norm writes no bf16).
QuantKernels choose_kernels() {
  const std::int64_t chosen = row_kernels().target;
  std::lock_guard<std::mutex> lock(target_mock_mutex());
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (target == chosen) return kernels_for_target(target);
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
