// The CUDA backend's entry points: problem -> kernel arguments, the launch plan, and the
// one place where the runtime dtype becomes a template argument (dispatch_dtype).
#include "cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cuda/kernel_args.h"
#include "cuda/launch_plan.h"
#include "cuda/launchers.h"

namespace fusednorm::cuda {
namespace {

using detail::BackwardProblem;
using detail::ForwardProblem;
using detail::NormKind;

[[noreturn]] void throw_cuda(const char* op, const char* what, cudaError_t err) {
  throw Error(std::string("fusednorm::") + op + ": " + what + ": " + cudaGetErrorName(err) + ": " +
              cudaGetErrorString(err));
}

void check(const char* op, const char* what, cudaError_t err) {
  if (err != cudaSuccess) throw_cuda(op, what, err);
}

int current_device(const char* op) {
  int device = 0;
  check(op, "cudaGetDevice", cudaGetDevice(&device));
  return device;
}

// Device attributes, read once per device (cudaDeviceGetAttribute does not synchronise).
DeviceInfo device_info(const char* op, int device) {
  static std::mutex mutex;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find(device); it != cache.end()) return it->second;
  auto attribute = [&](cudaDeviceAttr attr) {
    int value = 0;
    check(op, "cudaDeviceGetAttribute", cudaDeviceGetAttribute(&value, attr, device));
    return value;
  };
  DeviceInfo info;
  info.sm_count = attribute(cudaDevAttrMultiProcessorCount);
  info.cc_major = attribute(cudaDevAttrComputeCapabilityMajor);
  info.max_threads_per_sm = attribute(cudaDevAttrMaxThreadsPerMultiProcessor);
  info.max_smem_per_block = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  info.max_smem_per_sm = attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  info.cluster_launch = attribute(cudaDevAttrClusterLaunch) != 0;
  cache.emplace(device, info);
  return info;
}

// The planner's occupancy question (ResidentCtas) answered by the runtime for the kernel the
// launcher picks: query(plan, kernel, count) is a launchers.h *_resident_ctas call for the
// call's dtype and variant (cached there per kernel, block size, shared memory and device).
template <typename Query>
class RuntimeResidentCtas final : public ResidentCtas {
 public:
  RuntimeResidentCtas(const char* op, Query query) : op_(op), query_(std::move(query)) {}
  int per_sm(const LaunchPlan& plan, PlannedKernel kernel) const override {
    int count = 0;
    check(op_, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", query_(plan, kernel, count));
    return count;
  }

 private:
  const char* op_;
  Query query_;
};

template <typename T>
struct TypeTag {
  using type = T;
};

// The one runtime-dtype -> template-argument dispatch of the backend.
template <typename Fn>
cudaError_t dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(TypeTag<float>{});
    case DType::kFloat16: return fn(TypeTag<__half>{});
    case DType::kBFloat16: return fn(TypeTag<__nv_bfloat16>{});
    case DType::kInt8:
    case DType::kFloat8E4M3: break;  // output-only dtypes: validation refuses them as inputs
    case DType::kFloat64: break;     // its own kernels (norm_f64.cu), launched before this
  }
  return cudaErrorInvalidValue;
}

// The planner's view of a call: x's shape and dtype, and whether every pointer and row
// stride the kernels touch allows 16-byte vector accesses.
ProblemShape problem_shape(const ConstMatrix& x, std::initializer_list<const void*> pointers,
                           std::initializer_list<std::int64_t> row_strides) {
  ProblemShape shape;
  shape.rows = x.rows;
  shape.cols = x.cols;
  shape.elem_bytes = static_cast<int>(dtype_size(x.dtype));
  shape.vector_aligned = can_vectorize(shape.elem_bytes, x.cols, pointers, row_strides);
  return shape;
}

// FUSEDNORM_CUDA_LOG_PLANS=1: each distinct launch (op, dtype, shape, plan) once on stderr,
// with the grid the backend sized from the runtime's occupancy answer (resident CTAs per SM
// of the kernel it launches): what gpu_bench's plan column cannot show, since its planner
// call has no compiled kernel to ask about (src/cuda/NOTES.md, the quantized forward on the
// H200). Off, one cached getenv per call.
void log_plan(const char* op, DType dtype, const ProblemShape& shape, const LaunchPlan& plan,
              const ResidentCtas& resident) {
  static const bool enabled = [] {
    const char* v = std::getenv("FUSEDNORM_CUDA_LOG_PLANS");
    return v != nullptr && std::strcmp(v, "0") != 0;
  }();
  if (!enabled) return;
  char line[320];
  std::snprintf(line, sizeof line,
                "fusednorm: cuda plan: op=%s dtype=%s rows=%lld cols=%lld aligned=%d kind=%s "
                "vec=%d k=%d t=%d x=%d c=%d grid=%lld smem=%lld resident_per_sm=%d%s",
                op, dtype_name(dtype), static_cast<long long>(shape.rows),
                static_cast<long long>(shape.cols), shape.vector_aligned ? 1 : 0,
                kernel_kind_name(plan.kind), plan.vec, plan.vecs_per_thread, plan.team_threads,
                plan.rows_per_cta, plan.cluster_size, static_cast<long long>(plan.grid),
                static_cast<long long>(plan.smem_bytes), resident.per_sm(plan, PlannedKernel::kRows),
                plan.quant_register_cap ? " register_cap=1" : "");
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) std::fprintf(stderr, "%s\n", line);
}

// Read at every call (getenv is a scan of a few dozen strings, far below a launch), so a
// benchmark can switch it between calls.
PlanOptions plan_options() {
  PlanOptions options;
  const char* staged = std::getenv("FUSEDNORM_CUDA_STAGED_ROWS");
  options.staged_rows = staged == nullptr || std::strcmp(staged, "0") != 0;
  const char* cap = std::getenv("FUSEDNORM_CUDA_QUANT_REGISTER_CAP");
  options.quant_register_cap = cap != nullptr && std::strcmp(cap, "0") != 0;
  return options;
}

OutDType out_dtype(DType dtype) { return static_cast<OutDType>(static_cast<int>(dtype)); }

}  // namespace

std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols) {
  return backward_workspace_bytes_for(rows, cols);
}

void forward(const char* op, const ForwardProblem& p, void* stream) {
  if (p.rows() == 0) return;
  ForwardArgs a = {};
  a.centered = p.kind == NormKind::kLayer;
  a.x = p.x.data;
  a.x_stride = p.x.row_stride;
  a.residual = p.has_residual() ? p.residual.data : nullptr;
  a.residual_stride = p.residual.row_stride;
  a.y = p.y.data;
  a.y_stride = p.y.row_stride;
  a.weight = p.weight.data;
  a.weight_f32 = p.weight.dtype == DType::kFloat32;
  a.bias = p.bias.data;
  a.bias_f32 = p.bias.dtype == DType::kFloat32;
  a.mean = p.mean;
  a.rstd = p.rstd;
  a.rows = p.rows();
  a.cols = p.cols();
  a.eps = p.eps;
  a.weight_offset = detail::kernel_weight_offset(p.kind == NormKind::kRms ? p.weight_offset : 0.0f);
  // Phase 1 writes partial_sums; LayerNorm's deviations phase takes row_sum (the mean).
  const bool phase1 =
      p.phase == detail::Phase::kPartialSums || p.phase == detail::Phase::kPartialDeviations;
  const bool phase2 = p.phase == detail::Phase::kFromSums;
  a.partial_sums = phase1 ? p.partial_sums : nullptr;
  a.row_sum_squares = phase2 ? p.row_sum_squares : nullptr;
  a.row_sum = p.phase == detail::Phase::kPartialDeviations || phase2 ? p.row_sum : nullptr;
  a.row_sum_squared_deviations = phase2 ? p.row_sum_squared_deviations : nullptr;
  a.full_cols = p.full_cols;
  if (p.is_quantized()) {
    // Scale pointers are device pointers, read by the kernels (never here: a CUDA graph
    // replays with the value the static scale holds at replay time).
    a.quant.q = p.q.data;
    a.quant.q_stride = p.q.row_stride;
    a.quant.fp8 = p.q.dtype == DType::kFloat8E4M3;
    a.quant.static_scale = p.quant_scale.static_scale;
    a.quant.row_scales = p.quant_scale.row_scales;
    a.quant.scale_upper_bound = p.quant_scale.scale_upper_bound;
  }

  const auto s = static_cast<cudaStream_t>(stream);
  if (p.x.dtype == DType::kFloat64) {
    check(op, "kernel launch", launch_forward_f64(a, s));
    return;
  }

  ProblemShape shape =
      problem_shape(p.x, {p.x.data, p.residual.data, p.y.data, p.weight.data, p.bias.data},
                    {p.x.row_stride, p.has_residual() ? p.residual.row_stride : 0,
                     p.y.data != nullptr ? p.y.row_stride : 0});
  // The quantized output is stored kVec bytes at a time (8 for 16-bit x, 4 for fp32).
  if (p.is_quantized()) {
    shape.vector_aligned = shape.vector_aligned &&
                           quantized_output_aligned(shape.elem_bytes, p.q.data, p.q.row_stride);
  }
  PlanOptions options = plan_options();
  options.two_pass_only = p.phase != detail::Phase::kWhole;
  const int device = current_device(op);
  const RuntimeResidentCtas resident(op, [&](const LaunchPlan& plan, PlannedKernel, int& count) {
    return dispatch_dtype(p.x.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      return p.is_quantized() ? forward_quant_resident_ctas<T>(plan, a, device, count)
                              : forward_resident_ctas<T>(plan, a, device, count);
    });
  });
  const LaunchPlan plan = plan_forward(shape, device_info(op, device), resident, options);
  log_plan(op, p.x.dtype, shape, plan, resident);
  check(op, "kernel launch", dispatch_dtype(p.x.dtype, [&](auto tag) {
          using T = typename decltype(tag)::type;
          return p.is_quantized() ? launch_forward_quant<T>(plan, a, s) : launch_forward<T>(plan, a, s);
        }));
}

void backward(const char* op, const BackwardProblem& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool want_dw = p.dw.data != nullptr;
  const bool want_db = p.db.data != nullptr;
  if (p.rows() == 0) {
    // Sums over no rows: zero bits are 0.0 in every dtype.
    if (want_dw) check(op, "cudaMemsetAsync(dw)", cudaMemsetAsync(p.dw.data, 0, p.dw.size * dtype_size(p.dw.dtype), s));
    if (want_db) check(op, "cudaMemsetAsync(db)", cudaMemsetAsync(p.db.data, 0, p.db.size * dtype_size(p.db.dtype), s));
    return;
  }
  const bool sums_only = p.phase == detail::Phase::kPartialSums;
  if (p.dx.data == nullptr && !want_dw && !want_db && !sums_only) return;

  BackwardArgs a = {};
  a.centered = p.kind == NormKind::kLayer;
  a.dy = p.dy.data;
  a.dy_stride = p.dy.row_stride;
  a.x = p.x.data;
  a.x_stride = p.x.row_stride;
  a.weight = p.weight.data;
  a.weight_f32 = p.weight.dtype == DType::kFloat32;
  a.mean = p.kind == NormKind::kLayer ? p.mean : nullptr;
  a.rstd = p.rstd;
  a.dx = p.dx.data;
  a.dx_stride = p.dx.row_stride;
  a.dx_addend = p.dx_addend.data;
  a.dx_addend_stride = p.dx_addend.row_stride;
  a.partial_sum_g_xhat = sums_only ? p.partial_sum_g_xhat : nullptr;
  a.partial_sum_g = sums_only ? p.partial_sum_g : nullptr;
  a.row_sum_g_xhat = p.phase == detail::Phase::kFromSums ? p.row_sum_g_xhat : nullptr;
  a.row_sum_g = p.phase == detail::Phase::kFromSums ? p.row_sum_g : nullptr;
  a.full_cols = p.full_cols;
  a.rows = p.rows();
  a.cols = p.cols();
  a.eps = p.eps;
  a.weight_offset = detail::kernel_weight_offset(p.kind == NormKind::kRms ? p.weight_offset : 0.0f);

  if (want_dw || want_db) {
    const WorkspaceLayout layout = workspace_layout(p.rows(), p.cols());
    if (p.workspace.data == nullptr || p.workspace.bytes < layout.total_bytes) {
      detail::fail(op, "workspace",
                   std::to_string(p.workspace.data == nullptr ? 0 : p.workspace.bytes) + " bytes given, " +
                       std::to_string(layout.total_bytes) +
                       " bytes needed (see backward_workspace_bytes); CUDA calls never allocate");
    }
    const auto start = reinterpret_cast<std::uintptr_t>(p.workspace.data);
    char* base = reinterpret_cast<char*>((start + 255) / 256 * 256);
    a.dw_partial = want_dw ? reinterpret_cast<float*>(base + layout.dw_offset) : nullptr;
    a.db_partial = want_db ? reinterpret_cast<float*>(base + layout.db_offset) : nullptr;
    a.coef = reinterpret_cast<float*>(base + layout.coef_offset);
  }
  if (p.x.dtype == DType::kFloat64) {
    // The workspace's coefficient region holds the rows' fp64 mean and rstd (launchers.h).
    check(op, "kernel launch",
          launch_backward_f64(a, reinterpret_cast<double*>(a.coef), want_dw ? p.dw.data : nullptr,
                              want_db ? p.db.data : nullptr, s));
    return;
  }

  ProblemShape shape =
      problem_shape(p.x, {p.dy.data, p.x.data, p.dx.data, p.weight.data, p.dx_addend.data},
                    {p.dy.row_stride, p.x.row_stride, p.dx.data != nullptr ? p.dx.row_stride : 0,
                     p.has_addend() ? p.dx_addend.row_stride : 0});
  // Must match the launcher's kernel variant (BackwardVariant::kDw / kDb).
  const bool accumulate = want_dw || want_db;
  shape.accumulators =
      accumulate ? (p.weight.data != nullptr ? 1 : 0) + (p.kind == NormKind::kLayer ? 1 : 0) : 0;
  PlanOptions options = plan_options();
  options.two_pass_only = p.phase != detail::Phase::kWhole;
  const int device = current_device(op);
  const RuntimeResidentCtas resident(op, [&](const LaunchPlan& plan, PlannedKernel kernel,
                                             int& count) {
    return dispatch_dtype(p.x.dtype, [&](auto tag) {
      return backward_resident_ctas<typename decltype(tag)::type>(plan, kernel, a, device, count);
    });
  });
  const LaunchPlan plan = plan_backward(shape, device_info(op, device), resident, options);
  log_plan(op, p.x.dtype, shape, plan, resident);
  const BackwardOutputs out = {p.dw.data, out_dtype(p.dw.dtype), p.db.data, out_dtype(p.db.dtype)};

  check(op, "kernel launch", dispatch_dtype(p.x.dtype, [&](auto tag) {
          return launch_backward<typename decltype(tag)::type>(plan, a, out, s);
        }));
}

}  // namespace fusednorm::cuda
