// The per-row kernel templates and the table of one dtype's kernels (FillDType), included by
// the three per-dtype translation units (row_kernels_f32.cc, _f16.cc, _bf16.cc), so that a
// parallel build compiles them at once. Highway's per-target header pattern: included once
// per target by each TU's foreach_target.h pass, inside no namespace.
#if defined(FUSEDNORM_CPU_ROW_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FUSEDNORM_CPU_ROW_KERNELS_INL_H_
#undef FUSEDNORM_CPU_ROW_KERNELS_INL_H_
#else
#define FUSEDNORM_CPU_ROW_KERNELS_INL_H_
#endif

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "core/scalar_convert.h"
#include "cpu/element_io-inl.h"
#include "cpu/row_kernels.h"
#include "hwy/highway.h"

// A lambda whose call operator is always inlined (GCC and Clang spell it as an attribute
// after the parameter list).
#ifndef FUSEDNORM_INLINE_LAMBDA
#if defined(__GNUC__)
#define FUSEDNORM_INLINE_LAMBDA __attribute__((always_inline))
#else
#define FUSEDNORM_INLINE_LAMBDA
#endif
#endif

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace FUSEDNORM_KERNEL_NAMESPACE {

// The pair of vectors holding the 2 * lanes elements at i, taken apart as kLayout says
// (element_io-inl.h), and its store / non-temporal store at p: one combined store where
// the type provides it (bf16), else two.
template <PairLayout kLayout, class MakeFn>
HWY_INLINE auto MakePair(const MakeFn& make, int64_t i, int64_t lanes) {
  if constexpr (kLayout == PairLayout::kParity) {
    return std::make_pair(make(EvenOfPair(), i, lanes), make(OddOfPair(), i, lanes));
  } else {
    return std::make_pair(make(Full(), i, lanes), make(Full(), i + lanes, lanes));
  }
}
template <typename T, NaNPayloads kNaNs, PairLayout kLayout>
void StorePair(DF df, VF first, VF second, T* p) {
  using IO = ElementIO<T, kNaNs>;
  if constexpr (kLayout == PairLayout::kParity) {
    IO::StoreParity(df, first, second, p);
  } else if constexpr (std::is_same_v<T, hwy::bfloat16_t> && HWY_TARGET != HWY_SCALAR) {
    IO::StorePair(df, first, second, p);
  } else {
    IO::Store(df, first, p);
    IO::Store(df, second, p + hn::Lanes(df));
  }
}
// StorePair, returning the two vectors as stored (RoundTrip's values). With AVX512_BF16's
// conversions a bf16 pair in the parity layout gets them from the stored words, one shift
// or mask each, as RoundTrip would recompute the rounding of the integer path.
template <typename T, NaNPayloads kNaNs, PairLayout kLayout>
HWY_INLINE std::pair<VF, VF> StorePairRounded(DF df, VF first, VF second, T* p) {
  using IO = ElementIO<T, kNaNs>;
#if FUSEDNORM_BF16_CONVERSIONS
  if constexpr (kLayout == PairLayout::kParity) {
    const auto words = IO::DemoteParity(df, first, second);
    hn::StoreU(words, typename IO::DW(), reinterpret_cast<uint16_t*>(p));
    const hn::RebindToUnsigned<DF> du;
    const auto lanes = hn::BitCast(du, words);  // odd element << 16 | even element
    return {hn::BitCast(df, hn::ShiftLeft<16>(lanes)),
            hn::BitCast(df, hn::And(lanes, hn::Set(du, 0xffff0000u)))};
  }
#endif
  StorePair<T, kNaNs, kLayout>(df, first, second, p);
  return {IO::RoundTrip(df, first), IO::RoundTrip(df, second)};
}
template <typename T, NaNPayloads kNaNs, PairLayout kLayout>
void StreamPair(DF df, VF first, VF second, T* aligned) {
  using IO = ElementIO<T, kNaNs>;
  if constexpr (kLayout == PairLayout::kParity) {
    IO::StreamParity(df, first, second, aligned);
  } else if constexpr (std::is_same_v<T, hwy::bfloat16_t> && HWY_TARGET != HWY_SCALAR) {
    IO::StreamPair(df, first, second, aligned);
  } else {
    IO::Stream(df, first, aligned);
    IO::Stream(df, second, aligned + hn::Lanes(df));
  }
}

// Whether a weight / bias of type P (void: none) next to rows of type T has the rows' type:
// it then brings no fp32 NaN payload (kOutputNaNs) and follows the rows' pair layout.
template <typename T, typename P>
constexpr bool kNarrowParam = std::is_void_v<P> || std::is_same_v<P, T>;

// The layout of an output loop whose rows are T and whose other inputs are W and B (void:
// none): parity where all of them are bf16 (and the target has more than one lane).
template <typename T, typename W = void, typename B = void>
constexpr PairLayout kPairLayout = (std::is_same_v<T, hwy::bfloat16_t> &&
                                    HWY_TARGET != HWY_SCALAR && kNarrowParam<T, W> &&
                                    kNarrowParam<T, B>)
                                       ? PairLayout::kParity
                                       : PairLayout::kHalves;

// Ordinary stores of [begin, end) of each row: whole vectors, then one staged partial
// vector. Inlined, so that make's members stay in registers where the caller's copy is a
// local whose address does not escape.
template <typename T, NaNPayloads kNaNs, size_t kRows, PairLayout kLayout, class MakeFn>
HWY_INLINE void StoreRows(DF df, const std::array<T*, kRows>& out, const MakeFn& make,
                          int64_t begin, int64_t end) {
  using IO = ElementIO<T, kNaNs>;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = begin;
  for (; i + 2 * lanes <= end; i += 2 * lanes) {
    const auto [first, second] = MakePair<kLayout>(make, i, lanes);
    for (size_t k = 0; k < kRows; ++k) {
      StorePair<T, kNaNs, kLayout>(df, first[k], second[k], out[k] + i);
    }
  }
  for (; i + lanes <= end; i += lanes) {
    const auto v = make(Full(), i, lanes);
    for (size_t k = 0; k < kRows; ++k) IO::Store(df, v[k], out[k] + i);
  }
  if (i < end) {
    const size_t rest = static_cast<size_t>(end - i);
    const auto v = make(Partial(), i, rest);
    for (size_t k = 0; k < kRows; ++k) {
      Tail<T, kNaNs>(nullptr, rest).Store(df, v[k], out[k] + i);
    }
  }
}

// Writes n elements of each of kRows output rows, one vector at a time: row k's
// [i, i + count) = make(full, i, count)[k]; kNaNs: what is known of their NaNs. Whole pairs
// of vectors are made in kLayout (full = EvenOfPair / OddOfPair for kParity: make must then
// read every tensor through LoadElements, whose element order follows the tag). All rows must share
// their address modulo 64 (consecutive rows of a matrix whose row pitch is a multiple of 64 bytes
// do). kStream: outputs too large for the caches go out with non-temporal stores, which skip
// reading each line before overwriting it (as memcpy does); the first elements go through
// the staging path until `out` reaches vector alignment; `descending` writes those whole
// lines from the row's end down (StreamDescending, below, says when). The caller must issue
// a store fence before the output is read (cpu_backend.cpp's parallel_for does).
// make is taken and captured by value: Highway's stores go through vector types that may
// alias anything, so captured references would be reloaded from memory after every store
// (the streamed fp16 forward write pass, 16384 x 4096 on one thread, took 10.0 ms instead
// of 6.9 ms). make must not capture the empty tag DF (it declares its own, `const DF d;`):
// GCC 12 zero-fills a closure holding an empty member (rep stos) before filling it, and the
// wide loads that copy the closure into this parameter then wait for those small stores
// (no store forwarding): about 8 % of perf's samples of the four-row short-row group
// (fp16, D = 128, AVX3; docs/PERFORMANCE.md, fourteenth session).
// Always inlined: each instantiation has one caller, since every caller's closure type is its
// own, so inlining adds no code, and the by-value make is not copied into a parameter (out of
// line, the caller built it with narrow stores and the copy read it with wide loads); only
// store_range, below, still copies it (docs/PERFORMANCE.md, thirty-first session).
template <typename T, bool kStream, NaNPayloads kNaNs, size_t kRows, class MakeFn,
          PairLayout kLayout = PairLayout::kHalves>
HWY_INLINE void WriteRows(DF df, const std::array<T*, kRows>& out, int64_t n, MakeFn make,
                          bool descending = false) {
  using IO = ElementIO<T, kNaNs>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  if constexpr (kStream) {
    // Only whole 64-byte lines are streamed: a line written partly by ordinary stores and
    // partly by non-temporal ones is flushed half-empty, which cost more than streaming
    // saved. The lines at the row's ends (shared with the neighbouring rows) stay ordinary.
    constexpr uintptr_t kLine = 64;
    const auto address = reinterpret_cast<uintptr_t>(out[0]);
    const uintptr_t vector_bytes = static_cast<uintptr_t>(N) * sizeof(T);
    if (address % sizeof(T) == 0 && kLine % vector_bytes == 0) {
      // Element offsets of the first and the last 64-byte boundary inside the row.
      const auto first_line = static_cast<int64_t>((kLine - address % kLine) % kLine / sizeof(T));
      const uintptr_t end_address = address + static_cast<uintptr_t>(n) * sizeof(T);
      const uintptr_t last_boundary = end_address - end_address % kLine;
      const int64_t last_line =
          last_boundary > address ? static_cast<int64_t>((last_boundary - address) / sizeof(T)) : 0;
      if (first_line + N <= last_line) {
        // The partial lines at both ends: local copies of make and out, as a lambda called
        // twice and not inlined would otherwise reload its captures after every store.
        auto store_range = [=](int64_t begin, int64_t end) {
          const MakeFn make_here = make;
          const std::array<T*, kRows> out_here = out;
          StoreRows<T, kNaNs, kRows, kLayout>(DF(), out_here, make_here, begin, end);
        };
        store_range(0, first_line);
        if (descending) {
          int64_t top = last_line;
          for (; top - 2 * N >= first_line; top -= 2 * N) {
            const auto [first, second] = MakePair<kLayout>(make, top - 2 * N, N);
            for (size_t k = 0; k < kRows; ++k) {
              StreamPair<T, kNaNs, kLayout>(df, first[k], second[k], out[k] + top - 2 * N);
            }
          }
          for (; top - N >= first_line; top -= N) {
            const auto v = make(Full(), top - N, N);
            for (size_t k = 0; k < kRows; ++k) IO::Stream(df, v[k], out[k] + top - N);
          }
          store_range(last_line, n);
          return;
        }
        int64_t i = first_line;
        for (; i + 2 * N <= last_line; i += 2 * N) {
          const auto [first, second] = MakePair<kLayout>(make, i, N);
          for (size_t k = 0; k < kRows; ++k) {
            StreamPair<T, kNaNs, kLayout>(df, first[k], second[k], out[k] + i);
          }
        }
        for (; i < last_line; i += N) {
          const auto v = make(Full(), i, N);
          for (size_t k = 0; k < kRows; ++k) IO::Stream(df, v[k], out[k] + i);
        }
        store_range(last_line, n);
        return;
      }
    }
  }
  // Called once here and inlined: make, a parameter, needs no copy (three copies of a
  // four-row closure, about 100 bytes each, had cost more than 100 instructions per group of
  // short rows); out's pointers are copied so that the stores cannot be taken to change them.
  const std::array<T*, kRows> out_here = out;
  StoreRows<T, kNaNs, kRows, kLayout>(df, out_here, make, 0, n);
  // No fence here: a store fence per row stalls until the write-combining buffers drain,
  // which made D = 128 rows 20x slower. The backend fences once per thread instead.
}

// One output row: out[i, i + count) = make(full, i, count).
template <typename T, bool kStream, NaNPayloads kNaNs, PairLayout kLayout, class MakeFn>
void WriteRow(DF df, T* out, int64_t n, MakeFn make, bool descending = false) {
  auto make_one = [=](auto full, int64_t i, size_t count) {
    return std::array<VF, 1>{make(full, i, count)};
  };
  WriteRows<T, kStream, kNaNs, 1, decltype(make_one), kLayout>(df, {out}, n, make_one, descending);
}

// Sums over kRows rows of n elements read side by side, each row with its own accumulators
// in the one-row order, so every row gets the bits of a one-row call. Two rows at once read
// memory faster than one after the other: the sum of squares of 16384 x 4096 fp32 rows, two
// threads, ran at 38-41 GB/s against 29-32 (Zen 2, AVX2; docs/PERFORMANCE.md, thirteenth
// session): two streams per core keep more lines in flight than one.
// Sum of x; inlined into the one-row kernel and the multi-row LayerRows, so both sum in the
// same order and give the same bits.
template <typename T, size_t kRows>
HWY_INLINE std::array<float, kRows> SumOfRows(DF df, const std::array<const T*, kRows>& x,
                                              int64_t n) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  std::array<VF, kRows> acc0, acc1;
  for (size_t k = 0; k < kRows; ++k) acc0[k] = acc1[k] = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    for (size_t k = 0; k < kRows; ++k) {
      acc0[k] = hn::Add(acc0[k], ElementIO<T>::Load(df, x[k] + i));
      acc1[k] = hn::Add(acc1[k], ElementIO<T>::Load(df, x[k] + i + N));
    }
  }
  for (; i + N <= n; i += N) {
    for (size_t k = 0; k < kRows; ++k) acc0[k] = hn::Add(acc0[k], ElementIO<T>::Load(df, x[k] + i));
  }
  if (i < n) {
    for (size_t k = 0; k < kRows; ++k) {
      acc1[k] = hn::Add(acc1[k], Tail<T>(x[k] + i, static_cast<size_t>(n - i)).Load(df));
    }
  }
  std::array<float, kRows> sums;
  for (size_t k = 0; k < kRows; ++k) {
    sums[k] = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0[k], acc1[k])));
  }
  return sums;
}
template <typename T>
HWY_INLINE float SumOfRow(DF df, const T* x, int64_t n) {
  return SumOfRows<T, 1>(df, {x}, n)[0];
}

template <typename T>
float Sum(const void* x, int64_t n) {
  return SumOfRow<T>(DF(), static_cast<const T*>(x), n);
}

// Sum of (x - center)^2 (of x^2 when not centered); inlined into the one-row kernel and the
// multi-row RmsRows, so both sum in the same order and give the same bits.
// AddResidualOfRow adds the squares of the stored residual in this same order (the same
// vector pairs and accumulators), so that fused_add_rms_norm's rstd equals rms_norm's on
// the residual it stored. bf16 pairs are loaded in the parity layout: the sum's terms are
// the same, widening them costs fewer instructions than the in-order layout.
template <typename T, bool kCentered, size_t kRows>
HWY_INLINE std::array<float, kRows> SumSquaresOfRows(DF df, const std::array<const T*, kRows>& x,
                                                     int64_t n, float center) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const VF c = hn::Set(df, center);
  auto deviation = [&](VF v) { return kCentered ? hn::Sub(v, c) : v; };
  std::array<VF, kRows> acc0, acc1, acc2, acc3;
  for (size_t k = 0; k < kRows; ++k) acc0[k] = acc1[k] = acc2[k] = acc3[k] = hn::Zero(df);
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    for (size_t k = 0; k < kRows; ++k) {
      auto load = [&](auto full, int64_t j, size_t count) {
        return deviation(LoadElements(full, df, x[k] + j, count));
      };
      const auto [a, b] = MakePair<kPairLayout<T>>(load, i, N);
      const auto [a2, b2] = MakePair<kPairLayout<T>>(load, i + 2 * N, N);
      acc0[k] = hn::MulAdd(a, a, acc0[k]);
      acc1[k] = hn::MulAdd(b, b, acc1[k]);
      acc2[k] = hn::MulAdd(a2, a2, acc2[k]);
      acc3[k] = hn::MulAdd(b2, b2, acc3[k]);
    }
  }
  for (size_t k = 0; k < kRows; ++k) {
    acc0[k] = hn::Add(acc0[k], acc2[k]);
    acc1[k] = hn::Add(acc1[k], acc3[k]);
  }
  for (; i + 2 * N <= n; i += 2 * N) {
    for (size_t k = 0; k < kRows; ++k) {
      auto load = [&](auto full, int64_t j, size_t count) {
        return deviation(LoadElements(full, df, x[k] + j, count));
      };
      const auto [a, b] = MakePair<kPairLayout<T>>(load, i, N);
      acc0[k] = hn::MulAdd(a, a, acc0[k]);
      acc1[k] = hn::MulAdd(b, b, acc1[k]);
    }
  }
  for (; i + N <= n; i += N) {
    for (size_t k = 0; k < kRows; ++k) {
      const VF a = deviation(LoadElements(Full(), df, x[k] + i, N));
      acc0[k] = hn::MulAdd(a, a, acc0[k]);
    }
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    for (size_t k = 0; k < kRows; ++k) {
      // Padding lanes are zero, but (0 - center)^2 is not: mask them out.
      const VF a =
          hn::IfThenElseZero(hn::FirstN(df, rest), deviation(Tail<T>(x[k] + i, rest).Load(df)));
      acc1[k] = hn::MulAdd(a, a, acc1[k]);
    }
  }
  std::array<float, kRows> sums;
  for (size_t k = 0; k < kRows; ++k) {
    sums[k] = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0[k], acc1[k])));
  }
  return sums;
}
template <typename T, bool kCentered>
HWY_INLINE float SumSquaresOfRow(DF df, const T* x, int64_t n, float center) {
  return SumSquaresOfRows<T, kCentered, 1>(df, {x}, n, center)[0];
}

template <typename T, bool kCentered>
float SumSquares(const void* x, int64_t n, float center) {
  return SumSquaresOfRow<T, kCentered>(DF(), static_cast<const T*>(x), n, center);
}

// RowPairSumFn: the first statistic of two rows read side by side (SumOfRows above).
template <typename T>
void SumPair(const void* x0, const void* x1, int64_t n, float* sums) {
  const auto s = SumOfRows<T, 2>(DF(), {static_cast<const T*>(x0), static_cast<const T*>(x1)}, n);
  sums[0] = s[0];
  sums[1] = s[1];
}
template <typename T>
void SumSquaresPair(const void* x0, const void* x1, int64_t n, float* sums) {
  const auto s = SumSquaresOfRows<T, false, 2>(
      DF(), {static_cast<const T*>(x0), static_cast<const T*>(x1)}, n, 0.0f);
  sums[0] = s[0];
  sums[1] = s[1];
}

// residual <- round(x + residual) over kRows rows side by side (as SumOfRows reads them);
// returns each row's sum of squares of the rounded residual, added as SumSquaresOfRow adds
// them (the same bits). Shared by the one-row kernel and RmsRows, as SumSquaresOfRow is.
// bf16 pairs go in the parity layout: callgrind, AVX2, fused_add_rms_norm 16 x 4096 bf16:
// AddResidual 8.72 M -> 5.90 M instructions.
template <typename T, size_t kRows>
HWY_INLINE std::array<float, kRows> AddResidualOfRows(DF df, const std::array<const T*, kRows>& x,
                                                      const std::array<T*, kRows>& residual,
                                                      int64_t n) {
  using IO = ElementIO<T, NaNPayloads::kNarrow>;  // sums of two T
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  std::array<VF, kRows> acc0, acc1, acc2, acc3;
  for (size_t k = 0; k < kRows; ++k) acc0[k] = acc1[k] = acc2[k] = acc3[k] = hn::Zero(df);
  int64_t i = 0;
  auto add_pair = [&](size_t k, int64_t at, VF& even_acc, VF& odd_acc) {
    auto sum = [&](auto full, int64_t j, size_t count) {
      return hn::Add(LoadElements(full, df, x[k] + j, count),
                     LoadElements(full, df, residual[k] + j, count));
    };
    const auto [first, second] = MakePair<kPairLayout<T>>(sum, at, N);
    // Normalize what was stored.
    const auto [a, b] = StorePairRounded<T, NaNPayloads::kNarrow, kPairLayout<T>>(
        df, first, second, residual[k] + at);
    even_acc = hn::MulAdd(a, a, even_acc);
    odd_acc = hn::MulAdd(b, b, odd_acc);
  };
  for (; i + 4 * N <= n; i += 4 * N) {
    for (size_t k = 0; k < kRows; ++k) {
      add_pair(k, i, acc0[k], acc1[k]);
      add_pair(k, i + 2 * N, acc2[k], acc3[k]);
    }
  }
  for (size_t k = 0; k < kRows; ++k) {
    acc0[k] = hn::Add(acc0[k], acc2[k]);
    acc1[k] = hn::Add(acc1[k], acc3[k]);
  }
  for (; i + 2 * N <= n; i += 2 * N) {
    for (size_t k = 0; k < kRows; ++k) add_pair(k, i, acc0[k], acc1[k]);
  }
  for (; i + N <= n; i += N) {
    for (size_t k = 0; k < kRows; ++k) {
      const VF v = hn::Add(LoadElements(Full(), df, x[k] + i, N),
                           LoadElements(Full(), df, residual[k] + i, N));
      IO::Store(df, v, residual[k] + i);
      const VF a = IO::RoundTrip(df, v);
      acc0[k] = hn::MulAdd(a, a, acc0[k]);
    }
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    for (size_t k = 0; k < kRows; ++k) {
      Tail<T, NaNPayloads::kNarrow> residual_tail(residual[k] + i, rest);
      const VF v = hn::Add(Tail<T>(x[k] + i, rest).Load(df), residual_tail.Load(df));
      residual_tail.Store(df, v, residual[k] + i);
      const VF a = IO::RoundTrip(df, v);
      acc1[k] = hn::MulAdd(a, a, acc1[k]);  // padding lanes are 0 + 0
    }
  }
  std::array<float, kRows> sums;
  for (size_t k = 0; k < kRows; ++k) {
    sums[k] = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0[k], acc1[k])));
  }
  return sums;
}
template <typename T>
HWY_INLINE float AddResidualOfRow(DF df, const T* x, T* residual, int64_t n) {
  return AddResidualOfRows<T, 1>(df, {x}, {residual}, n)[0];
}

// AddResidualPairFn: two rows' fused adds side by side (AddResidualOfRows).
template <typename T>
void AddResidualPair(const void* x0, const void* x1, void* residual0, void* residual1, int64_t n,
                     float* sums) {
  const auto s =
      AddResidualOfRows<T, 2>(DF(), {static_cast<const T*>(x0), static_cast<const T*>(x1)},
                              {static_cast<T*>(residual0), static_cast<T*>(residual1)}, n);
  sums[0] = s[0];
  sums[1] = s[1];
}

template <typename T>
float AddResidual(const void* x, void* residual, int64_t n) {
  return AddResidualOfRow<T>(DF(), static_cast<const T*>(x), static_cast<T*>(residual), n);
}

// A weight or bias element vector: W is float or the rows' type, void when there is none.
template <typename W, class IsFull>
VF LoadParam(IsFull full, DF df, const void* p, int64_t i, size_t count) {
  return LoadElements(full, df, static_cast<const W*>(p) + i, count);
}

// The NaNs of an output of rows of type T with a weight / bias of type W / B (void: none):
// narrow unless an fp32 parameter can bring an fp32 payload (kNarrowParam, above).
template <typename T, typename W, typename B = void>
constexpr NaNPayloads kOutputNaNs = (kNarrowParam<T, W> && kNarrowParam<T, B>)
                                        ? NaNPayloads::kNarrow
                                        : NaNPayloads::kAny;

// A row statistic as the kernels use it: NarrowNaN (row_kernels.h). (Statistics computed
// from the row already are narrow; the phased calls take the caller's sums, which may carry
// any payload.)

// Whether a streamed loop that reads `from` and writes `to` at the same element indices
// should run from the end down. Non-temporal stores stay in flight long after they issue,
// and a load whose address has the low 12 bits of an in-flight store's waits for it (4 KiB
// aliasing). Ascending, the loads run ahead of the stores, so `to` a little after `from`
// (mod 4096) makes nearly every load wait: with y 16-96 bytes after x, the streamed forward
// of 16384 x 4096 from PyTorch took up to 1.5x (fp32) and 2.9x (bf16) its time at other
// offsets (Zen 2, AVX2; docs/PERFORMANCE.md, twelfth session). Descending, the loads trail
// the stores and only `to` a little *before* `from` would alias, so each direction takes the
// half of the offsets whose bad end is 2 KiB away (more than a store buffer holds).
// Either direction gives the same bits: the arithmetic is per element.
HWY_INLINE bool StreamDescending(const void* to, const void* from) {
  const auto offset = (reinterpret_cast<uintptr_t>(to) - reinterpret_cast<uintptr_t>(from)) % 4096;
  return offset != 0 && offset < 2048;
}

template <typename T, bool kStream, bool kCentered, typename W, typename B, bool kOffset>
void Normalize(const void* x_ptr, const void* w, const void* b, void* y_ptr, int64_t n, float mean,
               float rstd, float w_offset, const void* ahead_ptr) {
  const DF df;
  const T* x = static_cast<const T*>(x_ptr);
  const T* ahead = prefetch_row<T>(ahead_ptr, x_ptr);
  T* y = static_cast<T*>(y_ptr);
  const VF vmean = hn::Set(df, NarrowNaN(mean));
  const VF vrstd = hn::Set(df, NarrowNaN(rstd));
  const VF voffset = hn::Set(df, w_offset);  // finite (validated)
  constexpr NaNPayloads kNaNs = kOutputNaNs<T, W, B>;
  WriteRow<T, kStream, kNaNs, kPairLayout<T, W, B>>(
      df, y, n,
      [=](auto full, int64_t i, size_t count) {
        const DF d;  // not captured: see WriteRows
        // One per vector, even where two vectors share a line: one per line (a branch on
        // i) was 1.24-1.30x slower (fp16 / bf16 16384 x 4096, AVX3; docs/PERFORMANCE.md).
        if constexpr (kStream) prefetch_line_to_l2(ahead + i);
        VF out = LoadElements(full, d, x + i, count);
        if constexpr (kCentered) out = hn::Sub(out, vmean);
        out = hn::Mul(out, vrstd);
        if constexpr (!std::is_void_v<W>) {
          // Without an offset (LayerNorm's weights, most RMSNorm ones) no add, which also lets
          // the compiler fold the weight's load into the multiply.
          VF wv = LoadParam<W>(full, d, w, i, count);
          if constexpr (kOffset) wv = hn::Add(wv, voffset);
          out = hn::Mul(out, wv);
        }
        if constexpr (!std::is_void_v<B>) out = hn::Add(out, LoadParam<B>(full, d, b, i, count));
        return out;
      },
      kStream && StreamDescending(y, x));
}

// RMSNorm of rows.rows short rows, kGroup at a time: the sums of squares of a group first
// (independent chains that overlap), then the group's outputs, each weight vector loaded
// once for the group. Rows that do not fill a group run through kGroup = 1, the same code.
template <typename T, bool kStream, bool kResidual, typename W, bool kOffset, size_t kGroup>
void RmsRowGroup(const RmsRows& rows, int64_t first) {
  const DF df;
  const int64_t n = rows.n;
  std::array<const T*, kGroup> source;
  std::array<T*, kGroup> out;
  std::array<VF, kGroup> vrstd;
  for (size_t k = 0; k < kGroup; ++k) {
    const int64_t r = first + static_cast<int64_t>(k);
    const T* x = static_cast<const T*>(rows.x) + r * rows.x_stride;
    float sum;
    if constexpr (kResidual) {
      T* residual = static_cast<T*>(rows.residual) + r * rows.residual_stride;
      sum = AddResidualOfRow<T>(df, x, residual, n);
      source[k] = residual;
    } else {
      sum = SumSquaresOfRow<T, false>(df, x, n, 0.0f);
      source[k] = x;
    }
    const float rstd = rstd_from_mean_square(sum / static_cast<float>(n), rows.eps);
    if (rows.rstd != nullptr) rows.rstd[r] = rstd;
    vrstd[k] = hn::Set(df, rstd);
    out[k] = static_cast<T*>(rows.y) + r * rows.y_stride;
  }
  const VF voffset = hn::Set(df, rows.w_offset);
  const void* w = rows.w;
  constexpr NaNPayloads kNaNs = kOutputNaNs<T, W>;  // rstd is computed from the rows here
  // Captured by reference, unlike the one-row kernels' make (see WriteRows): a four-row
  // closure by value holds the rows' rstd vectors and pointers, and the copy of it that
  // WriteRows takes was made of wide loads of just-stored parts (no store forwarding), once
  // per group. Reloading the captures from L1 after each store costs less here: in L1, D = 128, one
  // thread, cycles per row fp32 55 -> 41, fp16 66 -> 43, bf16 64 -> 46 (AVX3; AVX2 57 -> 52,
  // 66 -> 51, 80 -> 64), and rms_norm 65536 x 128 from memory 0.86-0.88x the time in half
  // precision (docs/PERFORMANCE.md, twenty-eighth session). By value still lost with WriteRows
  // inlined, with the rstd as vectors or as floats (thirty-first session).
  auto make = [&](auto full, int64_t i, size_t count) FUSEDNORM_INLINE_LAMBDA {
    const DF d;  // not captured: see WriteRows
    VF wv = hn::Zero(d);
    if constexpr (!std::is_void_v<W>) wv = LoadParam<W>(full, d, w, i, count);
    if constexpr (kOffset) wv = hn::Add(wv, voffset);
    std::array<VF, kGroup> result;
    for (size_t k = 0; k < kGroup; ++k) {
      result[k] = hn::Mul(LoadElements(full, d, source[k] + i, count), vrstd[k]);
      if constexpr (!std::is_void_v<W>) result[k] = hn::Mul(result[k], wv);
    }
    return result;
  };
  WriteRows<T, kStream, kNaNs, kGroup, decltype(make), kPairLayout<T, W>>(df, out, n, make);
}

template <typename T, bool kStream, bool kResidual, typename W, bool kOffset>
void RmsRowsKernel(const RmsRows& rows) {
  constexpr size_t kGroup = 4;
  int64_t r = 0;
  for (; r + static_cast<int64_t>(kGroup) <= rows.rows; r += kGroup) {
    RmsRowGroup<T, kStream, kResidual, W, kOffset, kGroup>(rows, r);
  }
  for (; r < rows.rows; ++r) RmsRowGroup<T, kStream, kResidual, W, kOffset, 1>(rows, r);
}

// LayerNorm of rows.rows short rows, kGroup at a time: the group's sums first, then its
// sums of squared deviations (independent chains that overlap; the row is in L1 for the
// second pass), then the outputs, each weight and bias vector loaded once for the group.
// Per row the arithmetic is compute_row_stats' (cpu_backend.cpp; a one-chunk chunked_sum,
// 0.0f + the chunk's sum) followed by Normalize's, so a row's bits do not depend on the
// rows grouped with it or on which path the backend takes.
template <typename T, bool kStream, typename W, typename B, size_t kGroup>
void LayerRowGroup(const LayerRows& rows, int64_t first) {
  const DF df;
  const int64_t n = rows.n;
  const auto length = static_cast<float>(n);
  std::array<const T*, kGroup> source;
  std::array<T*, kGroup> out;
  std::array<float, kGroup> mean;
  std::array<VF, kGroup> vmean, vrstd;
  for (size_t k = 0; k < kGroup; ++k) {
    const int64_t r = first + static_cast<int64_t>(k);
    source[k] = static_cast<const T*>(rows.x) + r * rows.x_stride;
    out[k] = static_cast<T*>(rows.y) + r * rows.y_stride;
    mean[k] = (0.0f + SumOfRow<T>(df, source[k], n)) / length;
  }
  for (size_t k = 0; k < kGroup; ++k) {
    const int64_t r = first + static_cast<int64_t>(k);
    const float mean_square = (0.0f + SumSquaresOfRow<T, true>(df, source[k], n, mean[k])) / length;
    const float rstd = rstd_from_mean_square(mean_square, rows.eps);
    if (rows.mean != nullptr) rows.mean[r] = mean[k];
    if (rows.rstd != nullptr) rows.rstd[r] = rstd;
    vmean[k] = hn::Set(df, NarrowNaN(mean[k]));
    vrstd[k] = hn::Set(df, NarrowNaN(rstd));
  }
  const void* w = rows.w;
  const void* b = rows.b;
  // By reference, as RmsRowGroup's (which says why).
  auto make = [&](auto full, int64_t i, size_t count) FUSEDNORM_INLINE_LAMBDA {
    const DF d;  // not captured: see WriteRows
    VF wv = hn::Zero(d), bv = hn::Zero(d);
    if constexpr (!std::is_void_v<W>) wv = LoadParam<W>(full, d, w, i, count);
    if constexpr (!std::is_void_v<B>) bv = LoadParam<B>(full, d, b, i, count);
    std::array<VF, kGroup> result;
    for (size_t k = 0; k < kGroup; ++k) {
      result[k] = hn::Mul(hn::Sub(LoadElements(full, d, source[k] + i, count), vmean[k]), vrstd[k]);
      if constexpr (!std::is_void_v<W>) result[k] = hn::Mul(result[k], wv);
      if constexpr (!std::is_void_v<B>) result[k] = hn::Add(result[k], bv);
    }
    return result;
  };
  WriteRows<T, kStream, kOutputNaNs<T, W, B>, kGroup, decltype(make), kPairLayout<T, W, B>>(
      df, out, n, make);
}

template <typename T, bool kStream, typename W, typename B>
void LayerRowsKernel(const LayerRows& rows) {
  constexpr size_t kGroup = 4;
  int64_t r = 0;
  for (; r + static_cast<int64_t>(kGroup) <= rows.rows; r += kGroup) {
    LayerRowGroup<T, kStream, W, B, kGroup>(rows, r);
  }
  for (; r < rows.rows; ++r) LayerRowGroup<T, kStream, W, B, 1>(rows, r);
}

// BackwardDots of kRows rows at once, each row with its own accumulators, so every row's
// sums are added in the one-row order and have its bits. Each row's sums run as two chains
// of fused multiply-adds (even and odd vectors), as the forward's sums of squares do: one
// chain was bound by the multiply-add latency (4 cycles on Zen 3, 5 on Zen 2, for 8
// elements); two rows run four chains side by side.
template <typename T, bool kCentered, bool kWeight, size_t kRows>
void BackwardDotsRows(const BackwardDotRows<kRows>& rows, const float* w, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  std::array<const T*, kRows> dy, x;
  std::array<VF, kRows> vmean, vrstd;
  // [chain][row]
  std::array<std::array<VF, kRows>, 2> acc_g_xhat, acc_g;
  for (size_t k = 0; k < kRows; ++k) {
    dy[k] = static_cast<const T*>(rows.dy[k]);
    x[k] = static_cast<const T*>(rows.x[k]);
    vmean[k] = hn::Set(df, rows.mean[k]);
    vrstd[k] = hn::Set(df, rows.rstd[k]);
    for (size_t c = 0; c < 2; ++c) {
      acc_g_xhat[c][k] = hn::Zero(df);
      acc_g[c][k] = hn::Zero(df);
    }
  }
  auto accumulate = [&](size_t c, size_t k, VF dyv, VF xv, VF wv) {
    const VF g = kWeight ? hn::Mul(dyv, wv) : dyv;
    const VF xhat = hn::Mul(kCentered ? hn::Sub(xv, vmean[k]) : xv, vrstd[k]);
    acc_g_xhat[c][k] = hn::MulAdd(g, xhat, acc_g_xhat[c][k]);
    if (kCentered) acc_g[c][k] = hn::Add(acc_g[c][k], g);
  };
  auto vector_at = [&](size_t c, int64_t at) {
    const VF wv = kWeight ? hn::LoadU(df, w + at) : hn::Zero(df);
    for (size_t k = 0; k < kRows; ++k) {
      accumulate(c, k, ElementIO<T>::Load(df, dy[k] + at), ElementIO<T>::Load(df, x[k] + at), wv);
    }
  };
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    vector_at(0, i);
    vector_at(1, i + N);
  }
  for (; i + N <= n; i += N) vector_at(0, i);
  if (i < n) {
    // dy's padding lanes are zero, so g and g * x_hat vanish there.
    const size_t rest = static_cast<size_t>(n - i);
    const VF wv = kWeight ? FloatTail(w + i, rest).Load(df) : hn::Zero(df);
    for (size_t k = 0; k < kRows; ++k) {
      accumulate(1, k, Tail<T>(dy[k] + i, rest).Load(df), Tail<T>(x[k] + i, rest).Load(df), wv);
    }
  }
  for (size_t k = 0; k < kRows; ++k) {
    rows.sum_g_xhat[k] =
        hn::GetLane(hn::SumOfLanes(df, hn::Add(acc_g_xhat[0][k], acc_g_xhat[1][k])));
    rows.sum_g[k] =
        kCentered ? hn::GetLane(hn::SumOfLanes(df, hn::Add(acc_g[0][k], acc_g[1][k]))) : 0.0f;
  }
}

template <typename T, bool kCentered, bool kWeight>
void BackwardDots(const void* dy, const void* x, const float* w, int64_t n, float mean, float rstd,
                  float* sum_g_xhat, float* sum_g) {
  float g_xhat[1], g[1];
  const BackwardDotRows<1> row{{dy}, {x}, {mean}, {rstd}, g_xhat, g};
  BackwardDotsRows<T, kCentered, kWeight, 1>(row, w, n);
  *sum_g_xhat = g_xhat[0];
  *sum_g = g[0];
}

template <typename T, bool kCentered, bool kWeight>
void BackwardDotsPair(const BackwardDotRows<2>& rows, const float* w, int64_t n) {
  BackwardDotsRows<T, kCentered, kWeight, 2>(rows, w, n);
}

// BackwardApply of kRows rows at once: dw / db take row 0's term, then row 1's, exactly as
// consecutive one-row calls add them, but are loaded and stored once per pair.
// kAddend: dx_addend is added to each row's dx before it is rounded.
template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend,
          size_t kRows>
void BackwardApplyRows(const BackwardRows<kRows>& rows, const float* w, float* dw_acc,
                       float* db_acc, int64_t n) {
  const DF df;
  std::array<const T*, kRows> dy, x, addend;
  std::array<T*, kRows> dx;
  // The row statistics are captured as floats and broadcast inside make: captured as
  // vectors they made the closure ~600 bytes for a pair of AVX-512 rows, and WriteRows'
  // copies of it (wide loads of just-made narrow stores, no store forwarding) were about a
  // third of the short-row apply kernel's samples (docs/PERFORMANCE.md, thirtieth session).
  // As floats: rms_norm_backward 2048 x 128 in the caches, one thread, AVX3, 0.80-0.84x the
  // time in every dtype; long rows unchanged (the loops broadcast them once, before the loop;
  // thirty-first session).
  std::array<float, kRows> mean, rstd, mean_g, mean_g_xhat;
  for (size_t k = 0; k < kRows; ++k) {
    dy[k] = static_cast<const T*>(rows.dy[k]);
    x[k] = static_cast<const T*>(rows.x[k]);
    addend[k] = static_cast<const T*>(rows.dx_addend[k]);
    dx[k] = static_cast<T*>(rows.dx[k]);
    mean[k] = NarrowNaN(rows.mean[k]);
    rstd[k] = NarrowNaN(rows.rstd[k]);
    mean_g[k] = NarrowNaN(rows.mean_g[k]);
    mean_g_xhat[k] = NarrowNaN(rows.mean_g_xhat[k]);
  }
  // Every NaN that can reach dx is narrow: dy, x and the addend are T, w's NaNs are narrow by
  // contract (row_kernels.h), the row's statistics are made so above. So bf16's dx rounding
  // skips the NaN test: callgrind, rms_norm_backward 16 x 4096 bf16, 1 thread:
  // BackwardApplyRows 9.13 M -> 7.72 M instructions.
  constexpr NaNPayloads kNaNs = NaNPayloads::kNarrow;
  // Always inlined: GCC 12 left this closure out of line in the streamed fp16 kernels (every
  // vector a call returning the rows' vectors through memory), which made streaming fp16 dx
  // look slower than ordinary stores (docs/PERFORMANCE.md, twenty-ninth session).
  auto make = [=](auto full, int64_t i, size_t count) FUSEDNORM_INLINE_LAMBDA {
    const DF d;  // not captured: see WriteRows
    const VF wv = kWeight ? LoadElements(full, d, w + i, count) : hn::Zero(d);
    VF dw_sum = kDw ? LoadElements(full, d, dw_acc + i, count) : hn::Zero(d);
    VF db_sum = kDb ? LoadElements(full, d, db_acc + i, count) : hn::Zero(d);
    std::array<VF, kRows> out;
    for (size_t k = 0; k < kRows; ++k) {
      const VF dyv = LoadElements(full, d, dy[k] + i, count);
      const VF xv = LoadElements(full, d, x[k] + i, count);
      const VF vrstd = hn::Set(d, rstd[k]);
      const VF g = kWeight ? hn::Mul(dyv, wv) : dyv;
      const VF xhat = hn::Mul(kCentered ? hn::Sub(xv, hn::Set(d, mean[k])) : xv, vrstd);
      if (kDw) dw_sum = hn::MulAdd(dyv, xhat, dw_sum);
      if (kDb) db_sum = hn::Add(dyv, db_sum);
      const VF centered_g = kCentered ? hn::Sub(g, hn::Set(d, mean_g[k])) : g;
      out[k] = hn::Mul(vrstd, hn::NegMulAdd(xhat, hn::Set(d, mean_g_xhat[k]), centered_g));
      if constexpr (kAddend) out[k] = hn::Add(out[k], LoadElements(full, d, addend[k] + i, count));
    }
    if (kDw) StoreFloats(full, d, dw_sum, dw_acc + i, count);
    if (kDb) StoreFloats(full, d, db_sum, db_acc + i, count);
    return out;
  };
  WriteRows<T, kStream, kNaNs, kRows>(df, dx, n, make);
}

template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend>
void BackwardApply(const void* dy, const void* x, const float* w, const void* dx_addend, void* dx,
                   float* dw_acc, float* db_acc, int64_t n, float mean, float rstd, float mean_g,
                   float mean_g_xhat) {
  const BackwardRows<1> row{{dy}, {x}, {dx_addend}, {dx}, {mean}, {rstd}, {mean_g}, {mean_g_xhat}};
  BackwardApplyRows<T, kStream, kCentered, kWeight, kDw, kDb, kAddend, 1>(row, w, dw_acc, db_acc,
                                                                          n);
}

template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend>
void BackwardApplyPair(const BackwardRows<2>& rows, const float* w, float* dw_acc, float* db_acc,
                       int64_t n) {
  BackwardApplyRows<T, kStream, kCentered, kWeight, kDw, kDb, kAddend, 2>(rows, w, dw_acc, db_acc,
                                                                          n);
}

// kRows (1 or 2) rows of a BackwardBlock from row r: their dots, the row means of g and
// g * x_hat as the backend forms them from one chunk's sums (0.0f + sum, over n), then their
// dx. Inlined into the block loop, so the rows' pointers and coefficients stay in registers
// instead of going through the pair kernels' structs and calls: rms_norm_backward D = 128,
// half precision, spent about a third of its instructions outside the kernels' loops
// (callgrind, AVX2, thirty-fourth session).
template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend,
          size_t kRows>
HWY_INLINE void BackwardBlockRows(const BackwardBlock& b, int64_t r, const float* w, float* dw_acc,
                                  float* db_acc) {
  float sum_g_xhat[kRows], sum_g[kRows];
  BackwardDotRows<kRows> dots;
  BackwardRows<kRows> rows;
  for (size_t k = 0; k < kRows; ++k) {
    const int64_t row = r + static_cast<int64_t>(k);
    const T* dy = static_cast<const T*>(b.dy) + row * b.dy_stride;
    const T* x = static_cast<const T*>(b.x) + row * b.x_stride;
    dots.dy[k] = rows.dy[k] = dy;
    dots.x[k] = rows.x[k] = x;
    rows.dx_addend[k] =
        kAddend ? static_cast<const T*>(b.dx_addend) + row * b.addend_stride : nullptr;
    rows.dx[k] = static_cast<T*>(b.dx) + row * b.dx_stride;
    dots.mean[k] = rows.mean[k] = kCentered ? b.mean[row] : 0.0f;
    dots.rstd[k] = rows.rstd[k] = b.rstd[row];
  }
  dots.sum_g_xhat = sum_g_xhat;
  dots.sum_g = sum_g;
  BackwardDotsRows<T, kCentered, kWeight, kRows>(dots, w, b.n);
  const float count = static_cast<float>(b.n);
  for (size_t k = 0; k < kRows; ++k) {
    rows.mean_g[k] = (0.0f + sum_g[k]) / count;
    rows.mean_g_xhat[k] = (0.0f + sum_g_xhat[k]) / count;
  }
  BackwardApplyRows<T, kStream, kCentered, kWeight, kDw, kDb, kAddend, kRows>(rows, w, dw_acc,
                                                                              db_acc, b.n);
}

template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend>
void BackwardBlockKernel(const BackwardBlock& b, const float* w, float* dw_acc, float* db_acc) {
  int64_t r = 0;
  for (; r + 2 <= b.rows; r += 2) {
    BackwardBlockRows<T, kStream, kCentered, kWeight, kDw, kDb, kAddend, 2>(b, r, w, dw_acc,
                                                                            db_acc);
  }
  if (r < b.rows) {
    BackwardBlockRows<T, kStream, kCentered, kWeight, kDw, kDb, kAddend, 1>(b, r, w, dw_acc,
                                                                            db_acc);
  }
}

// ColumnSumsFn: the backward's dw / db from its per-row-block fp32 partials. Four vectors
// of columns at a time, each with its own register accumulator walking the blocks in order,
// so no running total goes through memory; every column's terms are added in the scalar
// loop's order. It replaced a loop that summed into a heap buffer and converted element by
// element (detail::store_from_float): callgrind, rms_norm_backward 16 x 4096, one thread,
// AVX2, per call: fp16 122 K -> 4.0 K instructions, bf16 69 K -> 9.5 K.
template <typename T>
void ColumnSums(const float* partials, int64_t blocks, int64_t stride, int64_t n, void* dst_ptr) {
  using IO = ElementIO<T, NaNPayloads::kAny>;  // the partials' NaNs are not known narrow
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  T* dst = static_cast<T*>(dst_ptr);
  int64_t j = 0;
  for (; j + 4 * N <= n; j += 4 * N) {
    VF acc0 = hn::Zero(df), acc1 = hn::Zero(df), acc2 = hn::Zero(df), acc3 = hn::Zero(df);
    const float* p = partials + j;
    for (int64_t b = 0; b < blocks; ++b, p += stride) {
      acc0 = hn::Add(acc0, hn::LoadU(df, p));
      acc1 = hn::Add(acc1, hn::LoadU(df, p + N));
      acc2 = hn::Add(acc2, hn::LoadU(df, p + 2 * N));
      acc3 = hn::Add(acc3, hn::LoadU(df, p + 3 * N));
    }
    IO::Store(df, acc0, dst + j);
    IO::Store(df, acc1, dst + j + N);
    IO::Store(df, acc2, dst + j + 2 * N);
    IO::Store(df, acc3, dst + j + 3 * N);
  }
  for (; j + N <= n; j += N) {
    VF acc = hn::Zero(df);
    const float* p = partials + j;
    for (int64_t b = 0; b < blocks; ++b, p += stride) acc = hn::Add(acc, hn::LoadU(df, p));
    IO::Store(df, acc, dst + j);
  }
  if (j < n) {
    const size_t rest = static_cast<size_t>(n - j);
    VF acc = hn::Zero(df);
    const float* p = partials + j;
    for (int64_t b = 0; b < blocks; ++b, p += stride)
      acc = hn::Add(acc, FloatTail(p, rest).Load(df));
    Tail<T, NaNPayloads::kAny>(nullptr, rest).Store(df, acc, dst + j);
  }
}

// ---- Table construction ----------------------------------------------------------------

// One backward-apply variant into the three tables (one row, two rows, a block of rows).
template <typename T, bool kStream, bool kCentered, bool kWeight, bool kDw, bool kDb, bool kAddend,
          class ApplyTable, class PairTable, class BlockTable>
void FillApply(ApplyTable& apply, PairTable& pair, BlockTable& block) {
  apply[kCentered][kWeight][kDw][kDb][kAddend] =
      &BackwardApply<T, kStream, kCentered, kWeight, kDw, kDb, kAddend>;
  pair[kCentered][kWeight][kDw][kDb][kAddend] =
      &BackwardApplyPair<T, kStream, kCentered, kWeight, kDw, kDb, kAddend>;
  block[kCentered][kWeight][kDw][kDb][kAddend] =
      &BackwardBlockKernel<T, kStream, kCentered, kWeight, kDw, kDb, kAddend>;
}

// The table slots (ParamType) of a weight or bias of type W (void: none) next to rows of
// type T; -1 for none. For fp32 rows, the rows' dtype is fp32: both slots.
template <typename T, typename W>
constexpr std::array<int, 2> kParamSlots =
    std::is_void_v<W> ? std::array<int, 2>{kNoParam, -1}
    : std::is_same_v<W, float>
        ? std::array<int, 2>{kFloat32Param, std::is_same_v<T, float> ? kElementParam : -1}
        : std::array<int, 2>{kElementParam, -1};

// Offset slot 1 adds the weight offset only where there is one to add to: RMSNorm's weight.
template <typename T, bool kStream, bool kCentered, typename W, typename B>
void SetNormalize(NormalizeFn (&table)[3][3][2]) {
  constexpr bool kOffset = !kCentered && !std::is_void_v<W>;
  for (const int pw : kParamSlots<T, W>) {
    for (const int pb : kParamSlots<T, B>) {
      if (pw < 0 || pb < 0) continue;
      table[pw][pb][0] = &Normalize<T, kStream, kCentered, W, B, false>;
      table[pw][pb][1] = &Normalize<T, kStream, kCentered, W, B, kOffset>;
    }
  }
}

// Every weight type with bias type B.
template <typename T, bool kStream, bool kCentered, typename B>
void SetNormalizeWeights(NormalizeFn (&table)[3][3][2]) {
  SetNormalize<T, kStream, kCentered, void, B>(table);
  SetNormalize<T, kStream, kCentered, float, B>(table);
  if constexpr (!std::is_same_v<T, float>) SetNormalize<T, kStream, kCentered, T, B>(table);
}

template <typename T, bool kStream, bool kResidual, typename W>
void SetRmsRows(RmsRowsFn (&table)[3][2]) {
  for (const int pw : kParamSlots<T, W>) {
    if (pw < 0) continue;
    table[pw][0] = &RmsRowsKernel<T, kStream, kResidual, W, false>;
    table[pw][1] = &RmsRowsKernel<T, kStream, kResidual, W, !std::is_void_v<W>>;
  }
}

template <typename T, bool kStream, bool kResidual>
void SetRmsRowsWeights(RmsRowsFn (&table)[3][2]) {
  SetRmsRows<T, kStream, kResidual, void>(table);
  SetRmsRows<T, kStream, kResidual, float>(table);
  if constexpr (!std::is_same_v<T, float>) SetRmsRows<T, kStream, kResidual, T>(table);
}

template <typename T, bool kStream, typename W, typename B>
void SetLayerRows(LayerRowsFn (&table)[3][3]) {
  for (const int pw : kParamSlots<T, W>) {
    for (const int pb : kParamSlots<T, B>) {
      if (pw >= 0 && pb >= 0) table[pw][pb] = &LayerRowsKernel<T, kStream, W, B>;
    }
  }
}

// Every weight type with bias type B.
template <typename T, bool kStream, typename B>
void SetLayerRowsWeights(LayerRowsFn (&table)[3][3]) {
  SetLayerRows<T, kStream, void, B>(table);
  SetLayerRows<T, kStream, float, B>(table);
  if constexpr (!std::is_same_v<T, float>) SetLayerRows<T, kStream, T, B>(table);
}

template <typename T, bool kStream>
void FillWriters(DTypeKernels* k) {
  SetRmsRowsWeights<T, kStream, false>(k->rms_rows[kStream][0]);
  SetRmsRowsWeights<T, kStream, true>(k->rms_rows[kStream][1]);
  SetLayerRowsWeights<T, kStream, void>(k->layer_rows[kStream]);
  SetLayerRowsWeights<T, kStream, float>(k->layer_rows[kStream]);
  if constexpr (!std::is_same_v<T, float>) {
    SetLayerRowsWeights<T, kStream, T>(k->layer_rows[kStream]);
  }
  // [centered][weight][bias]; RMSNorm has no bias, so [0][*][1 and 2] stay null. For fp32
  // rows the rows' dtype is fp32: both ParamTypes get the same kernels.
  auto& normalize = k->normalize[kStream];
  SetNormalizeWeights<T, kStream, false, void>(normalize[0]);
  SetNormalizeWeights<T, kStream, true, void>(normalize[1]);
  SetNormalizeWeights<T, kStream, true, float>(normalize[1]);
  if constexpr (!std::is_same_v<T, float>) SetNormalizeWeights<T, kStream, true, T>(normalize[1]);
  // Only RMSNorm (not centered, no bias gradient) takes a dx addend.
  auto& apply = k->backward_apply[kStream];
  auto& pair = k->backward_apply_pair[kStream];
  auto& block = k->backward_block[kStream];
  FillApply<T, kStream, false, false, false, false, false>(apply, pair, block);
  FillApply<T, kStream, false, true, false, false, false>(apply, pair, block);
  FillApply<T, kStream, false, true, true, false, false>(apply, pair, block);
  FillApply<T, kStream, false, false, false, false, true>(apply, pair, block);
  FillApply<T, kStream, false, true, false, false, true>(apply, pair, block);
  FillApply<T, kStream, false, true, true, false, true>(apply, pair, block);
  FillApply<T, kStream, true, false, false, false, false>(apply, pair, block);
  FillApply<T, kStream, true, false, false, true, false>(apply, pair, block);
  FillApply<T, kStream, true, true, false, false, false>(apply, pair, block);
  FillApply<T, kStream, true, true, false, true, false>(apply, pair, block);
  FillApply<T, kStream, true, true, true, false, false>(apply, pair, block);
  FillApply<T, kStream, true, true, true, true, false>(apply, pair, block);
}

template <typename T>
void FillDType(DTypeKernels* k) {
  k->sum = &Sum<T>;
  k->sum_squares[0] = &SumSquares<T, false>;
  k->sum_squares[1] = &SumSquares<T, true>;
  k->first_stat_pair[0] = &SumSquaresPair<T>;
  k->first_stat_pair[1] = &SumPair<T>;
  k->add_residual = &AddResidual<T>;
  k->add_residual_pair = &AddResidualPair<T>;
  k->backward_dots[0][0] = &BackwardDots<T, false, false>;
  k->backward_dots[0][1] = &BackwardDots<T, false, true>;
  k->backward_dots[1][0] = &BackwardDots<T, true, false>;
  k->backward_dots[1][1] = &BackwardDots<T, true, true>;
  k->backward_dots_pair[0][0] = &BackwardDotsPair<T, false, false>;
  k->backward_dots_pair[0][1] = &BackwardDotsPair<T, false, true>;
  k->backward_dots_pair[1][0] = &BackwardDotsPair<T, true, false>;
  k->backward_dots_pair[1][1] = &BackwardDotsPair<T, true, true>;
  FillWriters<T, false>(k);
  FillWriters<T, true>(k);
  k->column_sums = &ColumnSums<T>;
}

// One dtype's table, defined by that dtype's translation unit (FillDType<T>) and called by
// row_kernels.cc's FillRowKernels for the same target.
void FillFloat32Kernels(DTypeKernels* k);
void FillFloat16Kernels(DTypeKernels* k);
void FillBFloat16Kernels(DTypeKernels* k);

}  // namespace FUSEDNORM_KERNEL_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();

#endif  // FUSEDNORM_CPU_ROW_KERNELS_INL_H_
