// Between the emulated runtime (emu_runtime.cpp) and the kernels' shared-memory names
// (emu_shared.cpp).
#pragma once

#include <cstddef>
#include <vector>

namespace cuda_emu {

// One `extern __shared__` array of the kernels: its address in the calling OS thread.
struct DynamicSmemArray {
  char* (*address)();
  std::size_t capacity;
};
std::vector<DynamicSmemArray> dynamic_smem_arrays();

}  // namespace cuda_emu
