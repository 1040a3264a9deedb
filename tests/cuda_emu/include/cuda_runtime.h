// CPU emulation of the part of the CUDA runtime and device language that fusednorm's CUDA
// backend and its tests use, so that the real kernel sources (src/cuda/*.cu, *.cuh) run
// as plain C++ on machines without a GPU: every GPU thread is a fiber, a CTA is a set of
// fibers scheduled cooperatively on one OS thread (barriers and warp shuffles are the
// switch points), the CTAs of a thread-block cluster run on OS threads of their own and
// take turns, and shared memory is thread_local storage of that OS thread. Device memory is host
// memory.
//
// What it checks: indexing and coverage (a row element left unwritten or written twice
// shows as a wrong result; cudaMalloc'd memory and shared memory start as 0xff bytes, so
// reading what nothing wrote gives NaN), barrier discipline (a barrier some threads never reach is
// a reported deadlock, not a hang), full-warp shuffles, launch limits (threads, dynamic shared
// memory with and without the opt-in, cluster size and grid divisibility, registers per SM at
// the modeled registers per thread), writes past the launch's
// dynamic shared memory, and, in sanitizer builds, out-of-bounds device memory accesses (ASan sees
// cudaMalloc'd buffers as heap blocks). What it cannot check: timing, memory-model subtleties of
// real hardware, nvcc's code generation. Fibers run one at a time and switch only at barriers,
// shuffles and atomics, so a missing barrier between one thread's write and another's read is seen
// only when the schedule runs the reader first: FUSEDNORM_EMU_SCHEDULE picks the order (forward,
// reverse, warp-greedy, random:SEED; see emu_runtime.cpp), and ctest runs the suite under
// several. Code between two switch points runs as one step of one thread, so a race
// between two accesses with no switch point between them (e.g. within a warp, without a
// __syncwarp) is not seen. It is not a substitute for the GPU run (bench/gpu/run.sh); it
// makes that run start from kernels whose logic has run.
#pragma once

#include <math.h>  // sqrtf in the global namespace, as in device code

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>

// ---- The device language as plain C++ --------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __maxnreg__(...)
// Static and dynamic (extern) shared memory: storage of the OS thread that runs the CTA.
#define __shared__ thread_local
// Cluster code in the kernels is compiled for sm_90.
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

// cvt.rni.s32.f32: round to nearest even, saturate to the int range, NaN -> 0 (PTX ISA,
// cvt: float-to-integer conversions saturate; NaN converts to 0).
inline int __float2int_rn(float f) {
  if (f != f) return 0;
  if (f >= 2147483647.0f) return 2147483647;
  if (f <= -2147483648.0f) return -2147483647 - 1;
  return static_cast<int>(nearbyintf(f));  // the default rounding mode: to nearest even
}

// The running GPU thread's indices: thread_local to the OS thread that runs the CTA, and
// set by the fiber scheduler each time it switches to a thread (see emu_runtime.cpp).
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

namespace cuda_emu {
void syncthreads();
float shfl_xor(unsigned mask, float value, int lane_mask);
float atomic_add(float* address, float value);
[[noreturn]] void trap();
// FUSEDNORM_EMU_SCHEDULE's value ("forward" when unset), for messages about a failure.
const char* schedule_name();
}  // namespace cuda_emu

inline void __syncthreads() { cuda_emu::syncthreads(); }
inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  return cuda_emu::shfl_xor(mask, value, lane_mask);
}
inline float atomicAdd(float* address, float value) { return cuda_emu::atomic_add(address, value); }
[[noreturn]] inline void __trap() { cuda_emu::trap(); }

// ---- Runtime API -----------------------------------------------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;

struct CUstream_st;  // emu_runtime.cpp
using cudaStream_t = CUstream_st*;
struct CUgraph_st;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraph_st*;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrClusterLaunch = 120,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0 };
constexpr unsigned cudaStreamNonBlocking = 1;

enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension = 4 };
struct cudaLaunchAttributeValue {
  struct {
    unsigned x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  std::size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMalloc(void** ptr, std::size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t err);
const char* cudaGetErrorString(cudaError_t err);

namespace cuda_emu {
// The opt-in dynamic shared memory limit of one kernel (cudaFuncSetAttribute).
cudaError_t set_max_dynamic_smem(const void* kernel, int bytes);
// CTAs of one kernel resident per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor's model:
// see emu_runtime.cpp; FUSEDNORM_EMU_REGISTERS sets the registers per thread it assumes).
cudaError_t resident_ctas(const void* kernel, int threads, std::size_t smem, int* count);
// Checks the launch, then runs (or, on a capturing stream, records) body on every thread
// of the grid. body is called once per GPU thread with that thread's indices set.
cudaError_t launch(const void* kernel, const cudaLaunchConfig_t& config, std::function<void()> body);
}  // namespace cuda_emu

template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return cuda_emu::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), value);
}

template <typename T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* count, T* kernel, int threads,
                                                          std::size_t smem) {
  return cuda_emu::resident_ctas(reinterpret_cast<const void*>(kernel), threads, smem, count);
}

template <typename... ExpTypes, typename... ActTypes>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(ExpTypes...),
                               ActTypes&&... args) {
  // Arguments are converted to the kernel's parameter types once, at launch, as CUDA does.
  auto params = std::make_shared<std::tuple<std::decay_t<ExpTypes>...>>(std::forward<ActTypes>(args)...);
  return cuda_emu::launch(reinterpret_cast<const void*>(kernel), *config,
                          [kernel, params] { std::apply(kernel, *params); });
}
