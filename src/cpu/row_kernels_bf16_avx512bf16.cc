// The bf16 row kernels (row_kernels-inl.h) once more for Highway's AVX3 target, with
// AVX512_BF16's fp32 -> bf16 conversions (element_io-inl.h, FUSEDNORM_BF16_CONVERSIONS).
// Highway 1.0 has no target with AVX512_BF16 (Zen 4, Sapphire Rapids and later have it, the
// AVX3 target's Skylake-X baseline does not), so CMake compiles this file with AVX3's flags
// plus -mavx512bf16, without foreach_target.h: Highway's static target is then AVX3, and the
// kernels live in their own namespace, apart from row_kernels_bf16.cc's AVX3 ones (the same
// template names with other code). row_kernels.cc puts this table in place of AVX3's bf16
// table when the CPU has AVX512_BF16 (target name AVX3_BF16).
#include "cpu/row_kernels.h"

#if defined(FUSEDNORM_AVX512BF16_KERNELS)
#define FUSEDNORM_KERNEL_NAMESPACE N_AVX3_BF16
#include "cpu/row_kernels-inl.h"
#include "hwy/highway.h"

#if HWY_TARGET == HWY_AVX3 && FUSEDNORM_BF16_CONVERSIONS
#define FUSEDNORM_AVX512BF16_COMPILED 1
HWY_BEFORE_NAMESPACE();
namespace fusednorm::cpu {
namespace N_AVX3_BF16 {
void FillBFloat16Kernels(DTypeKernels* k) { FillDType<hwy::bfloat16_t>(k); }
}  // namespace N_AVX3_BF16
}  // namespace fusednorm::cpu
HWY_AFTER_NAMESPACE();
#endif
#endif

namespace fusednorm::cpu {

bool fill_avx512bf16_kernels(DTypeKernels* k) {
#if defined(FUSEDNORM_AVX512BF16_COMPILED)
  // The AVX3 target's features (Highway checks them before dispatching AVX3) are implied by
  // the caller; AVX512_BF16 is this file's own.
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  N_AVX3_BF16::FillBFloat16Kernels(k);
  return true;
#else
  (void)k;
  return false;
#endif
}

}  // namespace fusednorm::cpu
