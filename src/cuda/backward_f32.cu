// Backward kernels for float (one translation unit per dtype and direction keeps builds parallel).
#include "cuda/norm_launch.cuh"

template cudaError_t fusednorm::cuda::launch_backward<float>(const LaunchPlan&, const BackwardArgs&,
                                                          const BackwardOutputs&, cudaStream_t);
template cudaError_t fusednorm::cuda::backward_resident_ctas<float>(const LaunchPlan&,
                                                                    PlannedKernel,
                                                                    const BackwardArgs&, int, int&);
