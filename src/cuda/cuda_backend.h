// The CUDA backend. Every pointer inside the problem is a device pointer (rstd, mean and
// the weights too). Calls only enqueue work on the given stream: no host synchronisation,
// no allocation (the backward's scratch is the caller's workspace), so they can be
// captured in CUDA graphs. Launch failures throw fusednorm::Error with CUDA's message.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.h"

namespace fusednorm::cuda {

// `stream` is a cudaStream_t (nullptr: the legacy default stream).
void forward(const char* op, const detail::ForwardProblem& p, void* stream);
void backward(const char* op, const detail::BackwardProblem& p, void* stream);

// Workspace the backward needs for rows x cols when dw or db is requested (any dtype,
// any device); dx alone needs none.
std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols);

}  // namespace fusednorm::cuda
