// The CPU backend's float64 operators: a verification dtype (fusednorm.h, Numerics), kept
// out of the Highway kernels (row_kernels.cc compiles every SIMD target; fp64 needs none).
#pragma once

#include "core/problem.h"

namespace fusednorm::cpu {

// One-call operators only (validation refuses float64 for the phased and quantized ones).
void forward_f64(const detail::ForwardProblem& problem, int num_threads);
void backward_f64(const detail::BackwardProblem& problem, int num_threads);

}  // namespace fusednorm::cpu
