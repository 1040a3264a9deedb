// Highway implementation of the per-row kernels declared in row_kernels.h. This file is
// compiled once per SIMD target through foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/row_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"

#include <cstring>

#include "cpu/row_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// ---- Element I/O: T in memory, fp32 in registers --------------------------------------
// Half-precision types travel as half-width vectors and are widened in registers, so a
// row is read from memory exactly as many bytes as it holds.

template <typename T>
struct ElementIO;

template <>
struct ElementIO<float> {
  static VF Load(DF df, const float* p) { return hn::LoadU(df, p); }
  static void Store(DF df, VF v, float* p) { hn::StoreU(v, df, p); }
  static VF RoundTrip(DF, VF v) { return v; }
};

template <>
struct ElementIO<hwy::float16_t> {
  using DH = hn::Rebind<hwy::float16_t, DF>;
  static VF Load(DF df, const hwy::float16_t* p) { return hn::PromoteTo(df, hn::LoadU(DH(), p)); }
  static void Store(DF, VF v, hwy::float16_t* p) {
    const DH dh;
    hn::StoreU(hn::DemoteTo(dh, v), dh, p);  // hardware conversion rounds to nearest even
  }
  static VF RoundTrip(DF df, VF v) { return hn::PromoteTo(df, hn::DemoteTo(DH(), v)); }
};

template <>
struct ElementIO<hwy::bfloat16_t> {
  using DB = hn::Rebind<hwy::bfloat16_t, DF>;
  static VF Load(DF df, const hwy::bfloat16_t* p) {
    return hn::PromoteTo(df, hn::LoadU(DB(), p));
  }
  // Highway 1.0's DemoteTo(bf16) truncates; round to nearest even here so that the vector
  // path and the scalar reference produce the same bits.
  static hn::Vec<DB> Demote(DF, VF v) {
    const hn::RebindToUnsigned<DF> du;
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<uint16_t, DF> du16;
    const auto bits = hn::BitCast(du, v);
    const auto upper = hn::ShiftRight<16>(bits);
    const auto lsb = hn::And(upper, hn::Set(du, 1u));
    auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du, 0x7fffu), lsb)));
    const auto quiet_nan = hn::Or(upper, hn::Set(du, 0x40u));
    rounded = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
    return hn::BitCast(DB(), hn::DemoteTo(du16, hn::BitCast(di, rounded)));
  }
  static void Store(DF df, VF v, hwy::bfloat16_t* p) { hn::StoreU(Demote(df, v), DB(), p); }
  static VF RoundTrip(DF df, VF v) { return hn::PromoteTo(df, Demote(df, v)); }
};

// The last (n % lanes) elements of a row go through a one-vector staging buffer, so no
// load or store ever touches memory past the row's end, and the tail runs the same
// arithmetic (and rounding) as the body.
template <typename T>
class Tail {
 public:
  Tail(const T* src, size_t count) : count_(count) {
    std::memset(buffer_, 0, sizeof buffer_);
    if (src != nullptr) std::memcpy(buffer_, src, count * sizeof(T));
  }
  VF Load(DF df) const { return ElementIO<T>::Load(df, buffer_); }
  void Store(DF df, VF v, T* dst) {
    ElementIO<T>::Store(df, v, buffer_);
    std::memcpy(dst, buffer_, count_ * sizeof(T));
  }

 private:
  HWY_ALIGN T buffer_[HWY_MAX_BYTES / sizeof(float)];
  size_t count_;
};

// The tail of an fp32 buffer (weights, accumulators): same staging, fixed type.
using FloatTail = Tail<float>;

template <typename T>
float Sum(const void* x_ptr, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  VF acc0 = hn::Zero(df), acc1 = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 = hn::Add(acc0, ElementIO<T>::Load(df, x + i));
    acc1 = hn::Add(acc1, ElementIO<T>::Load(df, x + i + N));
  }
  for (; i + N <= n; i += N) acc0 = hn::Add(acc0, ElementIO<T>::Load(df, x + i));
  if (i < n) acc1 = hn::Add(acc1, Tail<T>(x + i, static_cast<size_t>(n - i)).Load(df));
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0, acc1)));
}

template <typename T, bool kCentered>
float SumSquares(const void* x_ptr, int64_t n, float center) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  const VF c = hn::Set(df, center);
  auto deviation = [&](VF v) { return kCentered ? hn::Sub(v, c) : v; };
  VF acc0 = hn::Zero(df), acc1 = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const VF a = deviation(ElementIO<T>::Load(df, x + i));
    const VF b = deviation(ElementIO<T>::Load(df, x + i + N));
    acc0 = hn::MulAdd(a, a, acc0);
    acc1 = hn::MulAdd(b, b, acc1);
  }
  for (; i + N <= n; i += N) {
    const VF a = deviation(ElementIO<T>::Load(df, x + i));
    acc0 = hn::MulAdd(a, a, acc0);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    // Padding lanes are zero, but (0 - center)^2 is not: mask them out.
    const VF a = hn::IfThenElseZero(hn::FirstN(df, rest),
                                    deviation(Tail<T>(x + i, rest).Load(df)));
    acc1 = hn::MulAdd(a, a, acc1);
  }
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0, acc1)));
}

template <typename T>
float AddResidual(const void* x_ptr, void* residual_ptr, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  T* residual = static_cast<T*>(residual_ptr);
  VF acc = hn::Zero(df);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const VF sum = hn::Add(ElementIO<T>::Load(df, x + i), ElementIO<T>::Load(df, residual + i));
    ElementIO<T>::Store(df, sum, residual + i);
    const VF stored = ElementIO<T>::RoundTrip(df, sum);  // normalize what was stored
    acc = hn::MulAdd(stored, stored, acc);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    Tail<T> residual_tail(residual + i, rest);
    const VF sum = hn::Add(Tail<T>(x + i, rest).Load(df), residual_tail.Load(df));
    residual_tail.Store(df, sum, residual + i);
    const VF stored = ElementIO<T>::RoundTrip(df, sum);
    acc = hn::MulAdd(stored, stored, acc);  // padding lanes are 0 + 0
  }
  return hn::GetLane(hn::SumOfLanes(df, acc));
}

template <typename T, bool kCentered, bool kWeight, bool kBias>
void Normalize(const void* x_ptr, const float* w, const float* b, void* y_ptr, int64_t n,
               float mean, float rstd) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* x = static_cast<const T*>(x_ptr);
  T* y = static_cast<T*>(y_ptr);
  const VF vmean = hn::Set(df, mean);
  const VF vrstd = hn::Set(df, rstd);
  auto apply = [&](VF v, VF wv, VF bv) {
    VF out = hn::Mul(kCentered ? hn::Sub(v, vmean) : v, vrstd);
    if (kWeight) out = hn::Mul(out, wv);
    if (kBias) out = hn::Add(out, bv);
    return out;
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const VF wv = kWeight ? hn::LoadU(df, w + i) : hn::Zero(df);
    const VF bv = kBias ? hn::LoadU(df, b + i) : hn::Zero(df);
    ElementIO<T>::Store(df, apply(ElementIO<T>::Load(df, x + i), wv, bv), y + i);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    const VF wv = kWeight ? FloatTail(w + i, rest).Load(df) : hn::Zero(df);
    const VF bv = kBias ? FloatTail(b + i, rest).Load(df) : hn::Zero(df);
    Tail<T> y_tail(nullptr, rest);
    y_tail.Store(df, apply(Tail<T>(x + i, rest).Load(df), wv, bv), y + i);
  }
}

template <typename T, bool kCentered, bool kWeight>
void BackwardDots(const void* dy_ptr, const void* x_ptr, const float* w, int64_t n, float mean,
                  float rstd, float* sum_g_xhat, float* sum_g) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* dy = static_cast<const T*>(dy_ptr);
  const T* x = static_cast<const T*>(x_ptr);
  const VF vmean = hn::Set(df, mean);
  const VF vrstd = hn::Set(df, rstd);
  VF acc_g_xhat = hn::Zero(df), acc_g = hn::Zero(df);
  auto accumulate = [&](VF dyv, VF xv, VF wv) {
    const VF g = kWeight ? hn::Mul(dyv, wv) : dyv;
    const VF xhat = hn::Mul(kCentered ? hn::Sub(xv, vmean) : xv, vrstd);
    acc_g_xhat = hn::MulAdd(g, xhat, acc_g_xhat);
    if (kCentered) acc_g = hn::Add(acc_g, g);
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    accumulate(ElementIO<T>::Load(df, dy + i), ElementIO<T>::Load(df, x + i),
               kWeight ? hn::LoadU(df, w + i) : hn::Zero(df));
  }
  if (i < n) {
    // dy's padding lanes are zero, so g and g * x_hat vanish there.
    const size_t rest = static_cast<size_t>(n - i);
    accumulate(Tail<T>(dy + i, rest).Load(df), Tail<T>(x + i, rest).Load(df),
               kWeight ? FloatTail(w + i, rest).Load(df) : hn::Zero(df));
  }
  *sum_g_xhat = hn::GetLane(hn::SumOfLanes(df, acc_g_xhat));
  *sum_g = kCentered ? hn::GetLane(hn::SumOfLanes(df, acc_g)) : 0.0f;
}

template <typename T, bool kCentered, bool kWeight, bool kDw, bool kDb>
void BackwardApply(const void* dy_ptr, const void* x_ptr, const float* w, void* dx_ptr,
                   float* dw_acc, float* db_acc, int64_t n, float mean, float rstd,
                   float mean_g, float mean_g_xhat) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const T* dy = static_cast<const T*>(dy_ptr);
  const T* x = static_cast<const T*>(x_ptr);
  T* dx = static_cast<T*>(dx_ptr);
  const VF vmean = hn::Set(df, mean);
  const VF vrstd = hn::Set(df, rstd);
  const VF vmean_g = hn::Set(df, mean_g);
  const VF vmean_g_xhat = hn::Set(df, mean_g_xhat);
  // Returns dx; updates the accumulators in place.
  auto step = [&](VF dyv, VF xv, VF wv, VF& dw_v, VF& db_v) {
    const VF g = kWeight ? hn::Mul(dyv, wv) : dyv;
    const VF xhat = hn::Mul(kCentered ? hn::Sub(xv, vmean) : xv, vrstd);
    if (kDw) dw_v = hn::MulAdd(dyv, xhat, dw_v);
    if (kDb) db_v = hn::Add(db_v, dyv);
    const VF centered_g = kCentered ? hn::Sub(g, vmean_g) : g;
    return hn::Mul(vrstd, hn::NegMulAdd(xhat, vmean_g_xhat, centered_g));
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    VF dw_v = kDw ? hn::LoadU(df, dw_acc + i) : hn::Zero(df);
    VF db_v = kDb ? hn::LoadU(df, db_acc + i) : hn::Zero(df);
    const VF dxv = step(ElementIO<T>::Load(df, dy + i), ElementIO<T>::Load(df, x + i),
                        kWeight ? hn::LoadU(df, w + i) : hn::Zero(df), dw_v, db_v);
    ElementIO<T>::Store(df, dxv, dx + i);
    if (kDw) hn::StoreU(dw_v, df, dw_acc + i);
    if (kDb) hn::StoreU(db_v, df, db_acc + i);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    FloatTail dw_tail(kDw ? dw_acc + i : nullptr, rest);
    FloatTail db_tail(kDb ? db_acc + i : nullptr, rest);
    VF dw_v = dw_tail.Load(df);
    VF db_v = db_tail.Load(df);
    const VF dxv = step(Tail<T>(dy + i, rest).Load(df), Tail<T>(x + i, rest).Load(df),
                        kWeight ? FloatTail(w + i, rest).Load(df) : hn::Zero(df), dw_v, db_v);
    Tail<T>(nullptr, rest).Store(df, dxv, dx + i);
    if (kDw) dw_tail.Store(df, dw_v, dw_acc + i);
    if (kDb) db_tail.Store(df, db_v, db_acc + i);
  }
}

// ---- Table construction ----------------------------------------------------------------

template <typename T>
void FillDType(DTypeKernels* k) {
  k->sum = &Sum<T>;
  k->sum_squares[0] = &SumSquares<T, false>;
  k->sum_squares[1] = &SumSquares<T, true>;
  k->add_residual = &AddResidual<T>;
  k->normalize[0][0][0] = &Normalize<T, false, false, false>;
  k->normalize[0][0][1] = &Normalize<T, false, false, true>;
  k->normalize[0][1][0] = &Normalize<T, false, true, false>;
  k->normalize[0][1][1] = &Normalize<T, false, true, true>;
  k->normalize[1][0][0] = &Normalize<T, true, false, false>;
  k->normalize[1][0][1] = &Normalize<T, true, false, true>;
  k->normalize[1][1][0] = &Normalize<T, true, true, false>;
  k->normalize[1][1][1] = &Normalize<T, true, true, true>;
  k->backward_dots[0][0] = &BackwardDots<T, false, false>;
  k->backward_dots[0][1] = &BackwardDots<T, false, true>;
  k->backward_dots[1][0] = &BackwardDots<T, true, false>;
  k->backward_dots[1][1] = &BackwardDots<T, true, true>;
  // RMSNorm has no bias, so [0][*][*][1] stays null.
  k->backward_apply[0][0][0][0] = &BackwardApply<T, false, false, false, false>;
  k->backward_apply[0][1][0][0] = &BackwardApply<T, false, true, false, false>;
  k->backward_apply[0][1][1][0] = &BackwardApply<T, false, true, true, false>;
  k->backward_apply[1][0][0][0] = &BackwardApply<T, true, false, false, false>;
  k->backward_apply[1][0][0][1] = &BackwardApply<T, true, false, false, true>;
  k->backward_apply[1][1][0][0] = &BackwardApply<T, true, true, false, false>;
  k->backward_apply[1][1][0][1] = &BackwardApply<T, true, true, false, true>;
  k->backward_apply[1][1][1][0] = &BackwardApply<T, true, true, true, false>;
  k->backward_apply[1][1][1][1] = &BackwardApply<T, true, true, true, true>;
}

void FillRowKernels(RowKernels* kernels) {
  *kernels = RowKernels{};
  FillDType<float>(&kernels->by_dtype[static_cast<int>(DType::kFloat32)]);
  FillDType<hwy::float16_t>(&kernels->by_dtype[static_cast<int>(DType::kFloat16)]);
  FillDType<hwy::bfloat16_t>(&kernels->by_dtype[static_cast<int>(DType::kBFloat16)]);
  kernels->target_name = hwy::TargetName(HWY_TARGET);
}

}  // namespace HWY_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <mutex>

namespace fusednorm::cpu {

HWY_EXPORT(FillRowKernels);

const RowKernels& row_kernels() {
  static const RowKernels kernels = [] {
    RowKernels k;
    HWY_DYNAMIC_DISPATCH(FillRowKernels)(&k);
    return k;
  }();
  return kernels;
}

std::vector<TargetKernels> kernels_for_all_supported_targets() {
  static std::mutex mutex;  // the target mock below is process-global
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<TargetKernels> result;
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    RowKernels k;
    HWY_DYNAMIC_DISPATCH(FillRowKernels)(&k);
    result.push_back({hwy::TargetName(target), k});
  }
  hwy::SetSupportedTargetsForTest(0);
  return result;
}

}  // namespace fusednorm::cpu
#endif  // HWY_ONCE
