// Kernel launch with optional large dynamic shared memory and thread-block clusters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda/launch_plan.h"

namespace fusednorm::cuda {

inline constexpr std::int64_t kDefaultSmemLimit = 48 * 1024;

// Opts `kernel` in to `smem` bytes of dynamic shared memory where that is needed: the default
// limit (48 KB) is on static + dynamic shared memory together, so a kernel with 144 bytes of
// static shared memory cannot take 48 KB of dynamic without it (e.g. fp32 D = 12288 staged in
// shared memory); kStaticSmemReserve bounds every kernel's static part. The attribute is per
// kernel, not per launch: the returned lock (one mutex per kernel signature) is to be held
// until the launch is enqueued or the occupancy query answered, so that another host thread
// cannot lower it in between. A host-side function attribute, not a stream operation: allowed
// during graph capture.
template <typename... KernelArgs>
std::unique_lock<std::mutex> allow_dynamic_smem(void (*kernel)(KernelArgs...), std::int64_t smem,
                                                cudaError_t& err) {
  err = cudaSuccess;
  if (smem <= 0 || smem + kStaticSmemReserve <= kDefaultSmemLimit) return {};
  static std::mutex attribute_mutex;
  std::unique_lock<std::mutex> lock(attribute_mutex);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  return lock;
}

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, std::int64_t smem,
                          int cluster_size, cudaStream_t stream, Args&&... args) {
  cudaError_t err = cudaSuccess;
  const std::unique_lock<std::mutex> lock = allow_dynamic_smem(kernel, smem, err);
  if (err != cudaSuccess) return err;
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

// The runtime's occupancy answers, kept per (kernel, device, threads per CTA, dynamic shared
// memory): the query is a host computation over the kernel's attributes, but the planner asks
// at every call. One cache for the program (inline functions' statics are shared by every
// translation unit), guarded by a mutex: calls come from any host thread.
class OccupancyCache {
 public:
  struct Key {
    const void* kernel;
    int device;
    int threads;
    std::int64_t smem;
    bool operator<(const Key& o) const {
      return std::tie(kernel, device, threads, smem) <
             std::tie(o.kernel, o.device, o.threads, o.smem);
    }
  };
  static bool find(const Key& key, int& count) {
    const std::lock_guard<std::mutex> lock(mutex());
    const auto it = entries().find(key);
    if (it == entries().end()) return false;
    count = it->second;
    return true;
  }
  static void insert(const Key& key, int count) {
    const std::lock_guard<std::mutex> lock(mutex());
    entries().emplace(key, count);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<Key, int>& entries() {
    static std::map<Key, int> m;
    return m;
  }
};

// CTAs of `kernel` resident per SM on `device` at `threads` per CTA and `smem` bytes of
// dynamic shared memory: cudaOccupancyMaxActiveBlocksPerMultiprocessor (registers, shared
// memory, threads), cached. The kernel is opted in to `smem` first: the calculator counts
// against the kernel's dynamic shared memory limit, not the device's.
template <typename... KernelArgs>
cudaError_t resident_ctas_per_sm(void (*kernel)(KernelArgs...), int device, int threads,
                                 std::int64_t smem, int& count) {
  const OccupancyCache::Key key{reinterpret_cast<const void*>(kernel), device, threads, smem};
  if (OccupancyCache::find(key, count)) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  const std::unique_lock<std::mutex> lock = allow_dynamic_smem(kernel, smem, err);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, threads,
                                                      static_cast<std::size_t>(smem));
  if (err == cudaSuccess) OccupancyCache::insert(key, count);
  return err;
}

// Calls fn with std::integral_constant<int, v> for the run-time value among the choices.
template <int... kChoices, typename Fn>
cudaError_t with_int(int value, Fn&& fn) {
  cudaError_t result = cudaErrorInvalidConfiguration;
  ((value == kChoices ? (result = fn(std::integral_constant<int, kChoices>{}), true) : false) || ...);
  return result;
}

}  // namespace fusednorm::cuda
