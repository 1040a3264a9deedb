// Kernel launch with optional large dynamic shared memory and thread-block clusters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>
#include <utility>

#include "cuda/launch_plan.h"

namespace fusednorm::cuda {

inline constexpr std::int64_t kDefaultSmemLimit = 48 * 1024;

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, std::int64_t smem,
                          int cluster_size, cudaStream_t stream, Args&&... args) {
  // The default limit (48 KB) is on static + dynamic shared memory together: a kernel with
  // 144 bytes of static shared memory cannot take 48 KB of dynamic without the opt-in (e.g.
  // fp32 D = 12288 staged in shared memory). kStaticSmemReserve bounds every kernel's static part.
  std::unique_lock<std::mutex> lock;
  if (smem > 0 && smem + kStaticSmemReserve > kDefaultSmemLimit) {
    // The attribute is per kernel, not per launch: held until the launch is enqueued, so that
    // another host thread cannot lower it in between (one mutex per kernel signature).
    static std::mutex attribute_mutex;
    lock = std::unique_lock<std::mutex>(attribute_mutex);
    // A host-side function attribute, not a stream operation: allowed during graph capture.
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  // Every launch goes through cudaLaunchKernelEx (the cluster size is a launch attribute),
  // never <<<>>>: this header is then plain C++ over the runtime API, which
  // tests/cuda_emu's CPU emulation of the runtime also provides.
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<std::size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (cluster_size > 1) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster_size);
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Calls fn with std::integral_constant<int, v> for the run-time value among the choices.
template <int... kChoices, typename Fn>
cudaError_t with_int(int value, Fn&& fn) {
  cudaError_t result = cudaErrorInvalidConfiguration;
  ((value == kChoices ? (result = fn(std::integral_constant<int, kChoices>{}), true) : false) || ...);
  return result;
}

}  // namespace fusednorm::cuda
