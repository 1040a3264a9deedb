// Forward kernels for __half (one translation unit per dtype and direction keeps builds parallel).
#include "cuda/norm_launch.cuh"

template cudaError_t fusednorm::cuda::launch_forward<__half>(const LaunchPlan&, const ForwardArgs&, cudaStream_t);
template cudaError_t fusednorm::cuda::forward_resident_ctas<__half>(const LaunchPlan&,
                                                                    const ForwardArgs&, int, int&);
