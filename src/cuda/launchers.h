// Host launchers: one per direction, templated on the element type. Each owns the launch
// shape (from the LaunchPlan), picks the kernel instantiation for the call's variant, and
// returns the launch's cudaError_t. Beside each, the planner's occupancy question for the
// kernel that launcher would pick (*_resident_ctas: CTAs resident per SM on `device`, from
// the runtime's occupancy calculator, cached; see ResidentCtas in launch_plan.h). They are
// instantiated once per dtype in forward_<dtype>.cu / backward_<dtype>.cu; the runtime dtype
// becomes T in cuda_backend.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel_args.h"
#include "cuda/launch_plan.h"

namespace fusednorm::cuda {

template <typename T>
cudaError_t launch_forward(const LaunchPlan& plan, const ForwardArgs& args, cudaStream_t stream);
template <typename T>
cudaError_t forward_resident_ctas(const LaunchPlan& plan, const ForwardArgs& args, int device,
                                  int& count);

// The quantized RMSNorm forward: args.quant.q replaces args.y.
template <typename T>
cudaError_t launch_forward_quant(const LaunchPlan& plan, const ForwardArgs& args,
                                 cudaStream_t stream);
template <typename T>
cudaError_t forward_quant_resident_ctas(const LaunchPlan& plan, const ForwardArgs& args, int device,
                                        int& count);

// Where the finished dw / db go (nullable), in their own dtypes.
struct BackwardOutputs {
  void* dw;
  OutDType dw_dtype;
  void* db;
  OutDType db_dtype;
};

// dst[c] = sum over slots s (in slot order) of partial[s * cols + c], rounded once to dtype.
cudaError_t launch_finish(const LaunchPlan& plan, const float* partial, std::int64_t cols, void* dst,
                          OutDType dtype, cudaStream_t stream);

template <typename T>
cudaError_t launch_backward(const LaunchPlan& plan, const BackwardArgs& args,
                            const BackwardOutputs& out, cudaStream_t stream);
template <typename T>
cudaError_t backward_resident_ctas(const LaunchPlan& plan, PlannedKernel kernel,
                                   const BackwardArgs& args, int device, int& count);

// float64 (norm_f64.cu): the one-call operators only. row_stats: 2 doubles per row of
// device scratch (the workspace's coefficient region), needed when dw or db is wanted.
cudaError_t launch_forward_f64(const ForwardArgs& args, cudaStream_t stream);
cudaError_t launch_backward_f64(const BackwardArgs& args, double* row_stats, void* dw, void* db,
                                cudaStream_t stream);

}  // namespace fusednorm::cuda
