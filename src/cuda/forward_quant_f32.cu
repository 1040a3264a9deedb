// Quantized RMSNorm forward kernels for float (their own translation unit: builds in parallel with
// the rest).
#include "cuda/norm_launch.cuh"

template cudaError_t fusednorm::cuda::launch_forward_quant<float>(const LaunchPlan&,
                                                                  const ForwardArgs&, cudaStream_t);
template cudaError_t fusednorm::cuda::forward_quant_resident_ctas<float>(const LaunchPlan&,
                                                                         const ForwardArgs&, int,
                                                                         int&);
