// Quantized RMSNorm forward kernels for __half (their own translation unit: builds in parallel with
// the rest).
#include "cuda/norm_launch.cuh"

template cudaError_t fusednorm::cuda::launch_forward_quant<__half>(const LaunchPlan&,
                                                                   const ForwardArgs&,
                                                                   cudaStream_t);
template cudaError_t fusednorm::cuda::forward_quant_resident_ctas<__half>(const LaunchPlan&,
                                                                          const ForwardArgs&, int,
                                                                          int&);
