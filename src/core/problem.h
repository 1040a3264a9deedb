// The validated, backend-neutral description of one operator call. The public entry points
// (api.cpp) build one of these, validate it once (validate.cpp), and hand it to a backend.
#pragma once

#include "fusednorm/fusednorm.h"

namespace fusednorm::detail {

enum class NormKind { kRms, kLayer };

struct ForwardProblem {
  NormKind kind = NormKind::kRms;
  ConstMatrix x;
  Matrix residual;  // fused add only: residual <- x + residual, then normalize residual
  ConstVector weight;
  ConstVector bias;  // LayerNorm only
  Matrix y;
  float* mean = nullptr;  // LayerNorm only
  float* rstd = nullptr;
  float eps = 0.0f;
  float weight_offset = 0.0f;  // RMSNorm only

  bool has_residual() const { return residual.data != nullptr; }
  std::int64_t rows() const { return x.rows; }
  std::int64_t cols() const { return x.cols; }
};

struct BackwardProblem {
  NormKind kind = NormKind::kRms;
  ConstMatrix dy;
  ConstMatrix x;
  ConstVector weight;
  const float* mean = nullptr;  // LayerNorm only
  const float* rstd = nullptr;
  Matrix dx;
  Vector dw;
  Vector db;  // LayerNorm only
  float eps = 0.0f;
  float weight_offset = 0.0f;
  Workspace workspace;

  std::int64_t rows() const { return x.rows; }
  std::int64_t cols() const { return x.cols; }
};

// Throw fusednorm::Error naming `op` and the offending argument if the problem is invalid.
void validate(const char* op, const ForwardProblem& problem);
void validate(const char* op, const BackwardProblem& problem);

[[noreturn]] void fail(const char* op, const char* argument, const std::string& message);

}  // namespace fusednorm::detail
