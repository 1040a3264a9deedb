// The bf16 row kernels (row_kernels-inl.h): one translation unit per dtype, so that a
// parallel build compiles them at once. Compiled once per SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/row_kernels_bf16.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "cpu/row_kernels-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace HWY_NAMESPACE {
void FillBFloat16Kernels(DTypeKernels* k) { FillDType<hwy::bfloat16_t>(k); }
}  // namespace HWY_NAMESPACE
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();
