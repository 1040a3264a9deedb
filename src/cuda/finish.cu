// The second stage of the deterministic dw / db reduction (dtype-independent: partials are
// fp32, the destination dtype is a run-time argument of one small kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/launch_util.cuh"
#include "cuda/launchers.h"

namespace fusednorm::cuda {
namespace {


// Block (32 columns, lanes): lane l sums slots l, l + lanes, ... of its column; the lanes'
// sums are then added in lane order. The order depends only on (slots, lanes).
__global__ void __launch_bounds__(1024)
    finish_column_sums_kernel(const float* partial, std::int64_t slots, std::int64_t cols, void* dst,
                              OutDType dtype) {
  __shared__ float lane_sums[32][33];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (std::int64_t slot = threadIdx.y; slot < slots; slot += blockDim.y) s += partial[slot * cols + col];
  }
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float total = 0.0f;
  for (int lane = 0; lane < static_cast<int>(blockDim.y); ++lane) total += lane_sums[lane][threadIdx.x];
  switch (dtype) {
    case OutDType::kFloat32: static_cast<float*>(dst)[col] = total; break;
    case OutDType::kFloat16: static_cast<__half*>(dst)[col] = __float2half_rn(total); break;
    case OutDType::kBFloat16: static_cast<__nv_bfloat16*>(dst)[col] = __float2bfloat16_rn(total); break;
  }
}

}  // namespace

cudaError_t launch_finish(const LaunchPlan& plan, const float* partial, std::int64_t cols, void* dst,
                          OutDType dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32));
  const dim3 block(32, plan.finish_lanes);
  return launch_kernel(finish_column_sums_kernel, grid, block, 0, 1, stream, partial, plan.partial_slots, cols,
                       dst, dtype);
}

}  // namespace fusednorm::cuda
