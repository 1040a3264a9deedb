// The textbook RMSNorm: one pass per step, every intermediate materialized in fp32, as a
// framework without fusion runs it (upcast, square, mean, sqrt, divide, scale, downcast).
// The benchmark's baseline; threads split every pass over rows, like the fused kernels.
#pragma once

#include "fusednorm/fusednorm.h"

namespace fusednorm::bench {

void stepwise_rms_norm(ConstMatrix x, ConstVector weight, Matrix y, float eps, int threads);

// dx and dw, each step its own pass: recompute rstd stepwise, g = dy * w, row sums of g * x,
// dx, then dw as a column sum of dy * x * rstd.
void stepwise_rms_norm_backward(ConstMatrix dy, ConstMatrix x, ConstVector weight, Matrix dx,
                                Vector dw, float eps, int threads);

}  // namespace fusednorm::bench
