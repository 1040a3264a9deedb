#include <cmath>
#include <cstdio>
#include <vector>

#include "fusednorm/fusednorm.h"

int main() {
  const std::int64_t rows = 2, dim = 5;
  std::vector<float> x = {1, 2, 3, 4, 5, 0, 0, 0, 0, 0}, y(x.size());
  fusednorm::rms_norm({}, fusednorm::const_matrix(x.data(), fusednorm::DType::kFloat32, rows, dim),
                      {}, fusednorm::matrix(y.data(), fusednorm::DType::kFloat32, rows, dim),
                      nullptr);
  const double expected = 1.0 / std::sqrt((1 + 4 + 9 + 16 + 25) / 5.0 + 1e-6);
  const bool ok = std::fabs(y[0] - expected) < 1e-6 && y[5] == 0.0f;
  std::printf("installed fusednorm: y[0] = %.7f (expected %.7f): %s\n", y[0], expected,
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
