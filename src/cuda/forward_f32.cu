// Forward kernels for float (one translation unit per dtype and direction keeps builds parallel).
#include "cuda/norm_launch.cuh"

template cudaError_t fusednorm::cuda::launch_forward<float>(const LaunchPlan&, const ForwardArgs&, cudaStream_t);
template cudaError_t fusednorm::cuda::forward_resident_ctas<float>(const LaunchPlan&,
                                                                   const ForwardArgs&, int, int&);
