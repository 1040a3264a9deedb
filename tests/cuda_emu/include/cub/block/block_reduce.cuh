// CPU emulation (see cuda_runtime.h): cub::BlockReduce's Reduce, with CUB's contract that
// only thread 0 receives the total (the others get a NaN here, so a kernel that reads the
// total elsewhere shows wrong results instead of passing by luck).
#pragma once

#include <limits>

#include "cuda_runtime.h"

namespace cub {

template <typename T, int kThreads>
class BlockReduce {
 public:
  struct TempStorage {
    T values[kThreads];
  };
  explicit BlockReduce(TempStorage& storage) : storage_(storage) {}

  template <typename Op>
  T Reduce(T value, Op op) {
    const unsigned tid = threadIdx.x + threadIdx.y * blockDim.x;
    storage_.values[tid] = value;
    __syncthreads();
    if (tid != 0) return poison(value);
    T total = storage_.values[0];
    for (int t = 1; t < kThreads; ++t) total = op(total, storage_.values[t]);
    return total;
  }

 private:
  static T poison(T value) {
    T out = value;
    float* f = reinterpret_cast<float*>(&out);
    for (unsigned i = 0; i < sizeof(T) / sizeof(float); ++i) f[i] = std::numeric_limits<float>::quiet_NaN();
    return out;
  }
  TempStorage& storage_;
};

}  // namespace cub
