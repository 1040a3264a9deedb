// The kernels' dynamic shared memory (`extern __shared__` arrays, one name per kernel that
// has one) as thread_local storage of the emulation, each as large as the emulated
// device's opt-in limit. A kernel declaring a new name fails to link here until it is
// added: the list below is the one place that knows them.
#include <cstddef>
#include <vector>

#include "cuda_runtime.h"
#include "emu_internal.h"

namespace fusednorm::cuda {
constexpr std::size_t kEmuDynamicSmemBytes = 227 * 1024;
thread_local uint4 stage_words[kEmuDynamicSmemBytes / sizeof(uint4)];  // norm_forward_row_kernel
thread_local uint4 smem_words[kEmuDynamicSmemBytes / sizeof(uint4)];   // norm_backward_row_kernel
thread_local float combine[kEmuDynamicSmemBytes / sizeof(float)];      // norm_backward_register_kernel
}  // namespace fusednorm::cuda

namespace cuda_emu {

std::vector<DynamicSmemArray> dynamic_smem_arrays() {
  using namespace fusednorm::cuda;
  return {
      {[] { return reinterpret_cast<char*>(stage_words); }, sizeof(stage_words)},
      {[] { return reinterpret_cast<char*>(smem_words); }, sizeof(smem_words)},
      {[] { return reinterpret_cast<char*>(combine); }, sizeof(combine)},
  };
}

}  // namespace cuda_emu
