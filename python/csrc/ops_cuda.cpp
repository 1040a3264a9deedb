// CUDA registration of the fusednorm operators; compiled only when the core has its CUDA
// backend. Each call runs under a device guard for x's device, on PyTorch's current stream
// of that device, so it orders correctly with the surrounding torch work and CUDA graphs.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops.h"

namespace fusednorm::torch_ext {
namespace {

struct CudaScope {
  c10::cuda::OptionalCUDAGuard guard;
  Context ctx;
  explicit CudaScope(const at::Tensor& x) {
    // The dispatcher picks CUDA when any argument is on CUDA; x decides the device.
    TORCH_CHECK(x.is_cuda(), "fusednorm: argument 'x' is on ", x.device(),
                " but another argument is on CUDA; all tensors must be on one device");
    guard.set_device(x.device());
    ctx.device = Device::kCuda;
    ctx.cuda_stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  }
};

}  // namespace
}  // namespace fusednorm::torch_ext

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  fusednorm::torch_ext::register_kernels<fusednorm::torch_ext::CudaScope>(m);
}
