// fusednorm on the GPU: median time of every operator x dtype x shape, CUDA events around
// each call, L2 flushed (a 256 MB memset) before each timed call, as triton's do_bench
// does; plus a device-to-device copy and an empty kernel measured the same way in the same
// run. Prints CSV: impl,op,dtype,rows,cols,us,gbps,plan (copy and empty kernel as extra rows).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/scalar_convert.h"
#include "cuda/launch_plan.h"
#include "fusednorm/fusednorm.h"

namespace {

using namespace fusednorm;

#define CHECK(expr)                                                                        \
  do {                                                                                     \
    const cudaError_t err_ = (expr);                                                       \
    if (err_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__global__ void empty_kernel() {}

struct Timer {
  void* flush = nullptr;
  std::size_t flush_bytes = std::size_t{256} << 20;
  int warmup = 3;
  int reps = 15;
  Timer() { CHECK(cudaMalloc(&flush, flush_bytes)); }
  ~Timer() { cudaFree(flush); }

  // Median microseconds of fn, each timed call preceded by an L2 flush.
  double median_us(const std::function<void()>& fn) {
    for (int i = 0; i < warmup; ++i) fn();
    std::vector<cudaEvent_t> start(reps), stop(reps);
    for (int i = 0; i < reps; ++i) {
      CHECK(cudaEventCreate(&start[i]));
      CHECK(cudaEventCreate(&stop[i]));
    }
    for (int i = 0; i < reps; ++i) {
      CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
      CHECK(cudaEventRecord(start[i]));
      fn();
      CHECK(cudaEventRecord(stop[i]));
    }
    CHECK(cudaDeviceSynchronize());
    std::vector<double> us(reps);
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start[i], stop[i]));
      us[i] = 1000.0 * ms;
      cudaEventDestroy(start[i]);
      cudaEventDestroy(stop[i]);
    }
    std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
    return us[reps / 2];
  }
};

cuda::DeviceInfo device_info() {
  int dev = 0, v = 0;
  CHECK(cudaGetDevice(&dev));
  cuda::DeviceInfo d;
  cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev); d.sm_count = v;
  cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev); d.cc_major = v;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerMultiProcessor, dev); d.max_threads_per_sm = v;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); d.max_smem_per_block = v;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev); d.max_smem_per_sm = v;
  cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, dev); d.cluster_launch = v != 0;
  return d;
}

void fill_random(void* dev, DType dtype, std::int64_t n, unsigned seed) {
  // Random data on a small host block, tiled over the buffer (never zeros: see METHOD.md).
  const std::int64_t block = std::min<std::int64_t>(n, 1 << 20);
  std::vector<unsigned char> host(static_cast<std::size_t>(block) * dtype_size(dtype));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (std::int64_t i = 0; i < block; ++i) detail::store_from_float(host.data(), dtype, i, dist(rng));
  const std::size_t esize = dtype_size(dtype);
  for (std::int64_t off = 0; off < n; off += block) {
    const std::int64_t count = std::min(block, n - off);
    CHECK(cudaMemcpy(static_cast<char*>(dev) + off * esize, host.data(), count * esize, cudaMemcpyHostToDevice));
  }
}

// A plan's kernel shape for the CSV: kind/v<vec>k<vectors per thread>t<team>x<rows per
// CTA>c<cluster>. The kernel shape only: the backend sizes the grid with the runtime's
// occupancy answer for the kernel it launches (ResidentCtas), which this planner call does
// not ask for (FUSEDNORM_CUDA_LOG_PLANS=1 prints the launched plans with it).
std::string plan_label(const cuda::LaunchPlan& p) {
  return std::string(cuda::kernel_kind_name(p.kind)) + "/v" + std::to_string(p.vec) + "k" +
         std::to_string(p.vecs_per_thread) + "t" + std::to_string(p.team_threads) + "x" +
         std::to_string(p.rows_per_cta) + "c" + std::to_string(p.cluster_size);
}

// The quantized RMSNorm (issue 9) at vLLM's serving shapes (tokens x hidden): static and
// dynamic scales, int8 and FP8, with and without the fused residual add, beside the
// unquantized rms_norm / fused_add_rms_norm of the same shapes. Bytes: x read, q written (1
// byte per element), the weight, the scales (dynamic: 4 bytes per row written; static: 4
// read); the fused add also reads and writes the residual.
void quantized_ops(Timer& timer, const Context& ctx, const cuda::DeviceInfo& dev) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const std::size_t es = dtype_size(dt);
    for (std::int64_t cols : {4096, 8192}) {
      for (std::int64_t rows : {1, 16, 256, 4096}) {
        const std::int64_t n = rows * cols;
        void *x, *r, *y, *q, *w;
        float *scales, *static_scale;
        CHECK(cudaMalloc(&x, n * es));
        CHECK(cudaMalloc(&r, n * es));
        CHECK(cudaMalloc(&y, n * es));
        CHECK(cudaMalloc(&q, n));
        CHECK(cudaMalloc(&w, cols * es));
        CHECK(cudaMalloc(&scales, rows * 4));
        CHECK(cudaMalloc(&static_scale, 4));
        fill_random(x, dt, n, 1);
        fill_random(r, dt, n, 2);
        fill_random(w, dt, cols, 4);
        const float scale_value = 0.02f;
        CHECK(cudaMemcpy(static_scale, &scale_value, 4, cudaMemcpyHostToDevice));
        const ConstMatrix xm = const_matrix(x, dt, rows, cols);
        const Matrix rm = matrix(r, dt, rows, cols);
        const ConstVector wv{w, dt, cols};
        const double io = static_cast<double>(n) * es, qb = static_cast<double>(n), pv = static_cast<double>(cols) * es;
        const cuda::ProblemShape shape{rows, cols, static_cast<int>(es), true, 0};
        const cuda::LaunchPlan plan = cuda::plan_forward(shape, dev);
        const std::string plan_name = plan_label(plan);
        auto report = [&](const std::string& op, double bytes, const std::function<void()>& fn,
                          const char* impl = "fusednorm") {
          const double us = timer.median_us(fn);
          CHECK(cudaGetLastError());
          std::printf("%s,%s,%s,%lld,%lld,%.3f,%.1f,%s\n", impl, op.c_str(), dtype_name(dt),
                      static_cast<long long>(rows), static_cast<long long>(cols), us, bytes / us / 1e3,
                      plan_name.c_str());
          std::fflush(stdout);
        };
        // The register-row kernels again with kQuantRegisterCap registers per thread
        // (FUSEDNORM_CUDA_QUANT_REGISTER_CAP=1, read by the backend at every call): the A/B of
        // src/cuda/NOTES.md's lead for the quantized forward, in the same run.
        const bool register_rows =
            plan.kind == cuda::KernelKind::kRegisterRow || plan.kind == cuda::KernelKind::kRowsPerCta;
        auto report_quant = [&](const std::string& op, double bytes, const std::function<void()>& fn) {
          report(op, bytes, fn);
          if (!register_rows) return;
          setenv("FUSEDNORM_CUDA_QUANT_REGISTER_CAP", "1", 1);
          report(op, bytes, fn, "fusednorm_regcap");
          unsetenv("FUSEDNORM_CUDA_QUANT_REGISTER_CAP");
        };
        report("rms_norm", 2 * io + pv, [&] { rms_norm(ctx, xm, wv, matrix(y, dt, rows, cols), nullptr); });
        report("fused_add_rms_norm", 4 * io + pv,
               [&] { fused_add_rms_norm(ctx, xm, rm, wv, matrix(y, dt, rows, cols), nullptr); });
        for (DType qdt : {DType::kInt8, DType::kFloat8E4M3}) {
          const Matrix qm = matrix(q, qdt, rows, cols);
          for (bool dynamic : {false, true}) {
            QuantScale qs;
            if (dynamic) qs.row_scales = scales; else qs.static_scale = static_scale;
            const std::string suffix = std::string("_") + (qdt == DType::kInt8 ? "int8" : "fp8") +
                                       (dynamic ? "_dynamic" : "_static");
            const double scale_bytes = dynamic ? 4.0 * rows : 4.0;
            report_quant("rms_norm_quant" + suffix, io + qb + pv + scale_bytes,
                         [&] { rms_norm_quant(ctx, xm, wv, qm, qs); });
            report_quant("fused_add_rms_norm_quant" + suffix, 3 * io + qb + pv + scale_bytes,
                         [&] { fused_add_rms_norm_quant(ctx, xm, rm, wv, qm, qs); });
          }
        }
        for (void* p : {x, r, y, q, w}) cudaFree(p);
        cudaFree(scales);
        cudaFree(static_scale);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess || have == 0) {
    std::fprintf(stderr, "gpu_bench: no CUDA device\n");
    return 1;
  }
  Timer timer;
  if (argc > 1) timer.reps = std::atoi(argv[1]);
  const cuda::DeviceInfo dev = device_info();
  const Context ctx{Device::kCuda, 0, nullptr};
  std::printf("impl,op,dtype,rows,cols,us,gbps,plan\n");

  // Ceilings measured in this run: a 1 GiB device-to-device copy and an empty kernel.
  {
    const std::size_t bytes = std::size_t{1} << 30;
    void *a, *b;
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&b, bytes));
    CHECK(cudaMemset(a, 1, bytes));
    const double us = timer.median_us([&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
    std::printf("copy,copy,-,1,%zu,%.3f,%.1f,-\n", bytes, us, 2.0 * bytes / us / 1e3);
    cudaFree(a);
    cudaFree(b);
    const double empty = timer.median_us([&] { empty_kernel<<<1, 32>>>(); });
    std::printf("empty_kernel,launch,-,1,1,%.3f,0,-\n", empty);
  }

  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {1, 4096}, {512, 4096}, {4096, 4096}, {16384, 4096}, {32768, 8192},
      {65536, 128}, {4096, 16384}, {1024, 65536}, {256, 262144}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const std::size_t es = dtype_size(dt);
    for (const auto& shape : shapes) {
      const std::int64_t rows = shape.first, cols = shape.second;  // captured by lambdas below (C++17)
      const std::int64_t n = rows * cols;
      void *x, *y, *r, *dy, *w, *b, *dw, *db, *ws;
      float *mean, *rstd;
      CHECK(cudaMalloc(&x, n * es));
      CHECK(cudaMalloc(&y, n * es));
      CHECK(cudaMalloc(&r, n * es));
      CHECK(cudaMalloc(&dy, n * es));
      CHECK(cudaMalloc(&w, cols * es));
      CHECK(cudaMalloc(&b, cols * es));
      CHECK(cudaMalloc(&dw, cols * es));
      CHECK(cudaMalloc(&db, cols * es));
      CHECK(cudaMalloc(&mean, rows * 4));
      CHECK(cudaMalloc(&rstd, rows * 4));
      const std::size_t ws_bytes = backward_workspace_bytes(ctx, rows, cols);
      CHECK(cudaMalloc(&ws, ws_bytes));
      fill_random(x, dt, n, 1);
      fill_random(r, dt, n, 2);
      fill_random(dy, dt, n, 3);
      fill_random(w, dt, cols, 4);
      fill_random(b, dt, cols, 5);

      const ConstMatrix xm = const_matrix(x, dt, rows, cols);
      const Matrix ym = matrix(y, dt, rows, cols);
      const ConstVector wv{w, dt, cols}, bv{b, dt, cols};
      const double io = static_cast<double>(n) * es;  // bytes of one rows x cols stream
      const double pv = static_cast<double>(cols) * es;

      struct Op {
        const char* name;
        double bytes;
        int accumulators;  // backward: fp32 column sums per column (dw: 1, dw and db: 2); -1: forward
        std::function<void()> call;
        std::function<void()> prepare = {};  // run once before the timed calls
      };
      // Backward with the forward's statistics (computed just before), as autograd calls it.
      const auto rms_stats = [&] { rms_norm(ctx, xm, wv, ym, rstd); };
      const auto layer_stats = [&] { layer_norm(ctx, xm, wv, bv, ym, mean, rstd); };
      const std::vector<Op> ops = {
          {"rms_norm", 2 * io + pv, -1, [&] { rms_norm(ctx, xm, wv, ym, rstd); }},
          {"fused_add_rms_norm", 4 * io + pv, -1,
           [&] { fused_add_rms_norm(ctx, xm, matrix(r, dt, rows, cols), wv, ym, rstd); }},
          {"layer_norm", 2 * io + 2 * pv, -1, [&] { layer_norm(ctx, xm, wv, bv, ym, mean, rstd); }},
          {"rms_norm_backward", 3 * io + 2 * pv, 1,
           [&] {
             rms_norm_backward(ctx, const_matrix(dy, dt, rows, cols), xm, wv, rstd, ym, {dw, dt, cols}, {},
                               {ws, ws_bytes});
           },
           rms_stats},
          // The fused add's backward: dx = norm's dx + the residual's gradient (r), one pass.
          {"rms_norm_backward_add", 4 * io + 2 * pv, 1,
           [&] {
             rms_norm_backward(ctx, const_matrix(dy, dt, rows, cols), xm, wv, rstd, ym, {dw, dt, cols}, {},
                               {ws, ws_bytes}, const_matrix(r, dt, rows, cols));
           },
           rms_stats},
          {"layer_norm_backward", 3 * io + 3 * pv, 2,
           [&] {
             layer_norm_backward(ctx, const_matrix(dy, dt, rows, cols), xm, wv, mean, rstd, ym, {dw, dt, cols},
                                 {db, dt, cols}, {}, {ws, ws_bytes});
           },
           layer_stats},
      };
      for (const Op& op : ops) {
        if (op.prepare) op.prepare();
        cuda::ProblemShape s{rows, cols, static_cast<int>(es), cols % cuda::full_vector(static_cast<int>(es)) == 0,
                             std::max(op.accumulators, 0)};
        auto plan_for = [&](const cuda::PlanOptions& options) {
          return op.accumulators < 0 ? cuda::plan_forward(s, dev, options) : cuda::plan_backward(s, dev, options);
        };
        auto report = [&](const char* impl, const cuda::LaunchPlan& plan) {
          const double us = timer.median_us(op.call);
          CHECK(cudaGetLastError());
          std::printf("%s,%s,%s,%lld,%lld,%.3f,%.1f,%s\n", impl, op.name, dtype_name(dt),
                      static_cast<long long>(rows), static_cast<long long>(cols), us, op.bytes / us / 1e3,
                      plan_label(plan).c_str());
          std::fflush(stdout);
        };
        const cuda::LaunchPlan plan = plan_for({});
        report("fusednorm", plan);
        // Where rows are staged in shared memory, the same call on the two-pass kernels
        // (FUSEDNORM_CUDA_STAGED_ROWS=0): what staging gains, measured in the same run.
        if (plan.kind == cuda::KernelKind::kSmemRow || plan.kind == cuda::KernelKind::kClusterRow) {
          setenv("FUSEDNORM_CUDA_STAGED_ROWS", "0", 1);
          report("fusednorm_two_pass", plan_for({false}));
          unsetenv("FUSEDNORM_CUDA_STAGED_ROWS");
        }
      }
      for (void* p : {x, y, r, dy, w, b, dw, db, ws}) cudaFree(p);
      cudaFree(mean);
      cudaFree(rstd);
    }
  }
  quantized_ops(timer, ctx, dev);
  return 0;
}
