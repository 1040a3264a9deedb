// Element I/O of the CPU kernels (T in memory, fp32 in registers) and the staged tails of
// rows, shared by every Highway translation unit (the row kernels, quant_kernels.cc).
// Highway's per-target header pattern: included once per target by each TU's
// foreach_target.h pass, inside no namespace.
#if defined(FUSEDNORM_CPU_ELEMENT_IO_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FUSEDNORM_CPU_ELEMENT_IO_INL_H_
#undef FUSEDNORM_CPU_ELEMENT_IO_INL_H_
#else
#define FUSEDNORM_CPU_ELEMENT_IO_INL_H_
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/scalar_convert.h"
#include "hwy/highway.h"

// The namespace of the kernels: Highway's per-target one, except in
// row_kernels_bf16_avx512bf16.cc, which compiles Highway's AVX3 target a second time with
// AVX512_BF16 enabled and keeps those kernels apart from the ordinary AVX3 ones.
#ifndef FUSEDNORM_KERNEL_NAMESPACE
#define FUSEDNORM_KERNEL_NAMESPACE HWY_NAMESPACE
#endif

// fp32 -> bf16 by the AVX512_BF16 conversions (vcvtneps2bf16, vcvtne2ps2bf16): round to
// nearest even and NaNs quieted, the bits of RoundedBits below, except that fp32
// subnormals become signed zeros; vectors holding one take RoundedBits instead.
#undef FUSEDNORM_BF16_CONVERSIONS
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3 && defined(__AVX512BF16__)
#define FUSEDNORM_BF16_CONVERSIONS 1
#else
#define FUSEDNORM_BF16_CONVERSIONS 0
#endif

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace FUSEDNORM_KERNEL_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// ---- Element I/O: T in memory, fp32 in registers --------------------------------------
// Half-precision types travel as half-width vectors and are widened in registers, so a
// row is read from memory exactly as many bytes as it holds.

// What a kernel knows about the NaNs it stores; only bf16's rounding makes use of it.
//   kAny:    a NaN may carry any fp32 payload (an fp32 weight or bias, the caller's row sums).
//   kNarrow: every NaN's payload has its low 16 bits zero. So is every NaN computed from bf16
//            data, finite fp32 scalars and the row's own statistics: IEEE arithmetic returns
//            an operand's NaN (quieted) or the default NaN (0x7fc00000), never new low bits.
enum class NaNPayloads { kAny, kNarrow };

template <typename T, NaNPayloads kNaNs = NaNPayloads::kAny>
struct ElementIO;

template <NaNPayloads kNaNs>
struct ElementIO<float, kNaNs> {
  static VF Load(DF df, const float* p) { return hn::LoadU(df, p); }
  static void Store(DF df, VF v, float* p) { hn::StoreU(v, df, p); }
  static void Stream(DF df, VF v, float* aligned) { hn::Stream(v, df, aligned); }
  static VF RoundTrip(DF, VF v) { return v; }
};

// Non-temporal store of a half-width (demoted) vector. Highway 1.0's x86 Stream writes a
// whole 128-bit register with 16-byte alignment even for a 64-bit vector (half-precision
// rows on SSSE3 / SSE4): 8 bytes past the elements. Narrow vectors take an ordinary store.
template <class D>
void StreamDemoted(D d, hn::Vec<D> v, hn::TFromD<D>* aligned) {
  if constexpr (hn::MaxLanes(D()) * sizeof(hn::TFromD<D>) >= 16) {
    hn::Stream(v, d, aligned);
  } else {
    hn::StoreU(v, d, aligned);
  }
}

template <NaNPayloads kNaNs>
struct ElementIO<hwy::float16_t, kNaNs> {
  using DH = hn::Rebind<hwy::float16_t, DF>;
#if HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SCALAR || \
    HWY_TARGET == HWY_EMU128
  // Without F16C, Highway 1.0 converts fp16 in software, truncating instead of rounding
  // and turning Inf / NaN into finite numbers. These targets use the library's scalar
  // conversions (scalar_convert.h) through a one-vector buffer instead.
  static VF Load(DF df, const hwy::float16_t* p) {
    HWY_ALIGN float f[HWY_MAX_BYTES / sizeof(float)];
    for (size_t i = 0; i < hn::Lanes(df); ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, p + i, sizeof bits);
      f[i] = detail::fp16_to_float(bits);
    }
    return hn::Load(df, f);
  }
  static void Store(DF df, VF v, hwy::float16_t* p) {
    HWY_ALIGN float f[HWY_MAX_BYTES / sizeof(float)];
    hn::Store(v, df, f);
    for (size_t i = 0; i < hn::Lanes(df); ++i) {
      const std::uint16_t bits = detail::float_to_fp16(f[i]);
      std::memcpy(p + i, &bits, sizeof bits);
    }
  }
  static void Stream(DF df, VF v, hwy::float16_t* aligned) { Store(df, v, aligned); }
  static VF RoundTrip(DF df, VF v) {
    HWY_ALIGN hwy::float16_t h[HWY_MAX_BYTES / sizeof(float)];
    Store(df, v, h);
    return Load(df, h);
  }
#else
  static VF Load(DF df, const hwy::float16_t* p) { return hn::PromoteTo(df, hn::LoadU(DH(), p)); }
  static void Store(DF, VF v, hwy::float16_t* p) {
    const DH dh;
    hn::StoreU(hn::DemoteTo(dh, v), dh, p);  // hardware conversion rounds to nearest even
  }
  static void Stream(DF, VF v, hwy::float16_t* aligned) {
    StreamDemoted(DH(), hn::DemoteTo(DH(), v), aligned);
  }
  static VF RoundTrip(DF df, VF v) { return hn::PromoteTo(df, hn::DemoteTo(DH(), v)); }
#endif
};

template <NaNPayloads kNaNs>
struct ElementIO<hwy::bfloat16_t, kNaNs> {
  using DB = hn::Rebind<hwy::bfloat16_t, DF>;
  static VF Load(DF df, const hwy::bfloat16_t* p) { return hn::PromoteTo(df, hn::LoadU(DB(), p)); }
  // Highway 1.0's DemoteTo(bf16) truncates; round to nearest even here so that the vector
  // path and the scalar reference produce the same bits. Returns the fp32 bits with the
  // rounded bf16 in the upper 16 bits of each lane.
  // The rounding bias (0x7fff + lsb) carries out of the low half only when those bits are
  // nonzero, which for a NaN (kAny) could make it -0 or Inf: such NaNs are kept (and
  // quieted) by a test that costs three of the seven integer operations per vector. With
  // kNarrow there is nothing to carry: the bf16 forward of 16 x 4096 in L1 (AVX2, one
  // thread) ran 12.5 % fewer instructions (callgrind: 3.92 M instead of 4.48 M).
  static hn::Vec<hn::RebindToUnsigned<DF>> RoundedBits(DF, VF v) {
    const hn::RebindToUnsigned<DF> du;
    const auto bits = hn::BitCast(du, v);
    const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
    const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7fffu), lsb));
    if constexpr (kNaNs == NaNPayloads::kNarrow) {
      return rounded;
    } else {
      const auto quiet_nan = hn::Or(bits, hn::Set(du, 0x400000u));
      return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
    }
  }
  static hn::Vec<DB> Demote(DF df, VF v) {
#if FUSEDNORM_BF16_CONVERSIONS
    if (HWY_LIKELY(!HasSubnormal(v))) {
      return hn::Vec<DB>{reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v.raw))};
    }
#endif
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<uint16_t, DF> du16;
    const auto upper = hn::ShiftRight<16>(RoundedBits(df, v));
    return hn::BitCast(DB(), hn::DemoteTo(du16, hn::BitCast(di, upper)));
  }
  static void Store(DF df, VF v, hwy::bfloat16_t* p) { hn::StoreU(Demote(df, v), DB(), p); }
  static void Stream(DF df, VF v, hwy::bfloat16_t* aligned) {
    StreamDemoted(DB(), Demote(df, v), aligned);
  }
  // The value a store keeps, as fp32: the rounded upper half (the bits Demote stores).
  static VF RoundTrip(DF df, VF v) {
    const hn::RebindToUnsigned<DF> du;
    return hn::BitCast(df, hn::And(RoundedBits(df, v), hn::Set(du, 0xffff0000u)));
  }

#if HWY_TARGET != HWY_SCALAR
  // Two vectors at once: the upper halves of both go into one full-width vector with a
  // single ConcatOdd (one vpermt2w on AVX-512) instead of a shift and a saturating pack per
  // vector. The write pass was bound by these integer operations: a 4096-element row
  // normalized in L1 took 443 ns instead of 600 ns (fp16: 274 ns), and the streamed write
  // pass of 16384 x 4096 on one thread 8.3 ms instead of 10.7 ms.
  using DW = hn::Repartition<uint16_t, DF>;  // 2 * Lanes(DF) 16-bit lanes
  static hn::Vec<DW> DemotePair(DF df, VF first, VF second) {
    const DW dw;
#if FUSEDNORM_BF16_CONVERSIONS
    // One instruction for both vectors, in this order, where RoundedBits and ConcatOdd took
    // nine (measured in docs/PERFORMANCE.md, thirty-third session).
    if (HWY_LIKELY(!HasSubnormal(first, second))) {
      return hn::Vec<DW>{reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second.raw, first.raw))};
    }
#endif
    return hn::ConcatOdd(dw, hn::BitCast(dw, RoundedBits(df, second)),
                         hn::BitCast(dw, RoundedBits(df, first)));
  }
  static void StorePair(DF df, VF first, VF second, hwy::bfloat16_t* p) {
    hn::StoreU(DemotePair(df, first, second), DW(), reinterpret_cast<uint16_t*>(p));
  }
  static void StreamPair(DF df, VF first, VF second, hwy::bfloat16_t* aligned) {
    StreamDemoted(DW(), DemotePair(df, first, second), reinterpret_cast<uint16_t*>(aligned));
  }

  // The 2 * Lanes(DF) elements at p as two vectors of their even and odd elements (see
  // PairLayout::kParity): each 32-bit word holds an even element in its low half and the
  // next odd one in its high half, so one shift or one mask widens either (with the load
  // folded in) where the halves layout needs a widening move and a shift per vector.
  static VF LoadEven(DF df, const hwy::bfloat16_t* p) {
    return hn::BitCast(df, hn::ShiftLeft<16>(LoadWords(p)));
  }
  static VF LoadOdd(DF df, const hwy::bfloat16_t* p) {
    const hn::RebindToUnsigned<DF> du;
    return hn::BitCast(df, hn::And(LoadWords(p), hn::Set(du, 0xffff0000u)));
  }
  // The inverse: the rounded odd elements stay in the high halves, the even ones move down
  // into the low halves, one blend joins them (no pack, no cross-lane permute).
  static hn::Vec<DW> DemoteParity(DF df, VF even, VF odd) {
    const DW dw;
#if FUSEDNORM_BF16_CONVERSIONS
    // The conversion yields the even elements, then the odd ones; one permute interleaves them.
    if (HWY_LIKELY(!HasSubnormal(even, odd))) {
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd.raw, even.raw));
      const __m512i interleave =
          _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      return hn::Vec<DW>{_mm512_permutexvar_epi16(interleave, halves)};
    }
#endif
    return hn::OddEven(hn::BitCast(dw, RoundedBits(df, odd)),
                       hn::BitCast(dw, hn::ShiftRight<16>(RoundedBits(df, even))));
  }
  static void StoreParity(DF df, VF even, VF odd, hwy::bfloat16_t* p) {
    hn::StoreU(DemoteParity(df, even, odd), DW(), reinterpret_cast<uint16_t*>(p));
  }
  static void StreamParity(DF df, VF even, VF odd, hwy::bfloat16_t* aligned) {
    StreamDemoted(DW(), DemoteParity(df, even, odd), reinterpret_cast<uint16_t*>(aligned));
  }

 private:
#if FUSEDNORM_BF16_CONVERSIONS
  static constexpr int kSubnormal = 0x20;  // vfpclassps: denormal, either sign
  static bool HasSubnormal(VF v) { return _mm512_fpclass_ps_mask(v.raw, kSubnormal) != 0; }
  static bool HasSubnormal(VF a, VF b) {
    // One kortestw for both masks (an OR of them took two moves out of the mask registers).
    return !_kortestz_mask16_u8(_mm512_fpclass_ps_mask(a.raw, kSubnormal),
                                _mm512_fpclass_ps_mask(b.raw, kSubnormal));
  }
#endif
  static hn::Vec<hn::RebindToUnsigned<DF>> LoadWords(const hwy::bfloat16_t* p) {
    return hn::BitCast(hn::RebindToUnsigned<DF>(),
                       hn::LoadU(DW(), reinterpret_cast<const uint16_t*>(p)));
  }
#endif
};

// The last (n % lanes) elements of a row go through a one-vector staging buffer, so no
// load or store ever touches memory past the row's end, and the tail runs the same
// arithmetic (and rounding) as the body.
template <typename T, NaNPayloads kNaNs = NaNPayloads::kAny>
class Tail {
 public:
  Tail(const T* src, size_t count) : count_(count) {
    std::memset(buffer_, 0, sizeof buffer_);
    if (src != nullptr) std::memcpy(buffer_, src, count * sizeof(T));
  }
  VF Load(DF df) const { return ElementIO<T>::Load(df, buffer_); }
  void Store(DF df, VF v, T* dst) {
    ElementIO<T, kNaNs>::Store(df, v, buffer_);
    std::memcpy(dst, buffer_, count_ * sizeof(T));
  }

 private:
  HWY_ALIGN T buffer_[HWY_MAX_BYTES / sizeof(float)];
  size_t count_;
};

// The tail of an fp32 buffer (weights, accumulators): same staging, fixed type.
using FloatTail = Tail<float>;

using Full = std::true_type;      // a whole vector of elements
using Partial = std::false_type;  // fewer elements than lanes: staged through a Tail

// How a kernel's output loop takes apart the 2 * lanes elements of a pair of vectors.
//   kHalves: the first vector holds elements [0, lanes), the second [lanes, 2 * lanes).
//   kParity: the first holds the even elements, the second the odd ones (bf16 only, and
//            only where every tensor the loop reads is bf16: an fp32 weight would need a
//            shuffle per vector to follow). The arithmetic is per element, so the layout
//            changes no result, only the instructions: the bf16 RMSNorm write loop went from
//            36 to 31 instructions per 16 elements on AVX2 (docs/PERFORMANCE.md).
enum class PairLayout { kHalves, kParity };
struct EvenOfPair {};  // the even elements of the pair starting at the given index
struct OddOfPair {};   // its odd elements

// Loads `count` elements at p as fp32: directly for a whole vector, staged otherwise.
template <typename T, class IsFull>
VF LoadElements(IsFull, DF df, const T* p, size_t count) {
  if constexpr (IsFull::value) {
    return ElementIO<T>::Load(df, p);
  } else {
    return Tail<T>(p, count).Load(df);
  }
}

template <typename T>
VF LoadElements(EvenOfPair, DF df, const T* p, size_t) {
  static_assert(std::is_same_v<T, hwy::bfloat16_t>, "PairLayout::kParity reads bf16 only");
  return ElementIO<T>::LoadEven(df, p);
}
template <typename T>
VF LoadElements(OddOfPair, DF df, const T* p, size_t) {
  static_assert(std::is_same_v<T, hwy::bfloat16_t>, "PairLayout::kParity reads bf16 only");
  return ElementIO<T>::LoadOdd(df, p);
}

template <class IsFull>
void StoreFloats(IsFull, DF df, VF v, float* p, size_t count) {
  if constexpr (IsFull::value) {
    hn::StoreU(v, df, p);
  } else {
    FloatTail(nullptr, count).Store(df, v, p);
  }
}
}  // namespace FUSEDNORM_KERNEL_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();

#endif  // FUSEDNORM_CPU_ELEMENT_IO_INL_H_
