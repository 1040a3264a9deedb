#include "cuda/launch_plan.h"

#include <algorithm>
#include <cstdint>

namespace fusednorm::cuda {
namespace {

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

std::int64_t next_pow2(std::int64_t v) {
  std::int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

// A team of <= 32 threads must tile a warp (a power of two); a larger one is whole warps.
int round_team(std::int64_t threads) {
  return static_cast<int>(threads <= 32 ? next_pow2(threads) : ceil_div(threads, 32) * 32);
}

// Preferred team size: up to 256 threads per row keeps several CTAs per SM, so the fewest
// vectors per thread that fit 256 threads wins (fewest registers). Rows too long for
// that take the maximum of kMaxVecsPerThread vectors per thread and up to max_team threads.
struct RegisterFit {
  bool ok;
  int vecs_per_thread;
  int team;
};
RegisterFit fit_in_registers(std::int64_t nvec, int max_team, int max_k = kMaxVecsPerThread) {
  for (int k = 1; k <= max_k; k *= 2) {
    if (ceil_div(nvec, k) <= 256) return {true, k, round_team(ceil_div(nvec, k))};
  }
  const std::int64_t threads = ceil_div(nvec, max_k);
  if (threads <= max_team) return {true, max_k, round_team(threads)};
  return {false, 0, 0};
}

std::int64_t clamp_grid(std::int64_t grid) { return std::max<std::int64_t>(1, std::min(grid, kMaxGrid)); }

// Rows per CTA, rounded up so that a CTA is whole warps: team reductions shuffle with a
// full warp mask, which is undefined for a partial warp (e.g. 3 rows of D = 128 in bf16).
int whole_warps(int team, std::int64_t rows_per_cta) {
  const std::int64_t per_warp = team < 32 ? 32 / team : 1;
  return static_cast<int>(ceil_div(std::max<std::int64_t>(rows_per_cta, 1), per_warp) * per_warp);
}

int finish_lanes_for(std::int64_t slots) {
  // Each thread of the finishing kernel sums about 8 slots; at most 32 lanes per column.
  return static_cast<int>(std::min<std::int64_t>(32, next_pow2(ceil_div(slots, 8))));
}

// The smallest staging of a row of nvec vectors: the whole row in one CTA's shared memory
// (kSmemRow), else a thread-block cluster of 2, 4 or 8 CTAs each staging a slice
// (kClusterRow, sm_90); bytes_for(slice_vecs) is a CTA's dynamic shared memory. Fills the
// plan's kind, cluster_size, slice_vecs, smem_bytes, team and grid (whole clusters, at most
// max_clusters, at most the CTAs resident on the device at once); false when even a cluster
// of 8 cannot hold the row. Clusters start at min_cluster CTAs.
template <typename BytesFor>
bool plan_staged(std::int64_t nvec, std::int64_t max_clusters, const DeviceInfo& d,
                 const ResidentCtas& resident, BytesFor bytes_for, LaunchPlan& plan,
                 int min_cluster = 1) {
  const std::int64_t budget = d.max_smem_per_block - kStaticSmemReserve;
  const int max_cluster = d.cluster_launch && d.cc_major >= 9 ? kMaxClusterSize : 1;
  for (int cs = min_cluster; cs <= max_cluster; cs *= 2) {
    const std::int64_t slice = ceil_div(nvec, cs);
    const std::int64_t bytes = bytes_for(slice);
    if (bytes > budget) continue;
    plan.kind = cs == 1 ? KernelKind::kSmemRow : KernelKind::kClusterRow;
    plan.cluster_size = cs;
    plan.slice_vecs = slice;
    plan.smem_bytes = bytes;
    plan.team_threads = kMaxThreadsPerCta;
    plan.threads_per_cta = kMaxThreadsPerCta;
    // Whole clusters of the CTAs resident at once (the hardware places a cluster within one
    // GPC, so fewer may fit: cudaOccupancyMaxActiveClusters would say; not asked yet).
    const std::int64_t per_sm = std::max(1, resident.per_sm(plan, PlannedKernel::kRows));
    const std::int64_t clusters = std::min(max_clusters, std::max<std::int64_t>(1, d.sm_count * per_sm / cs));
    plan.grid = clusters * cs;
    return true;
  }
  return false;
}

// Backward register kernels keep dy, x and the dw / db accumulators in registers, so the
// team is capped at 512 threads (128 registers per thread).
constexpr int kBackwardMaxTeam = 512;
// Threads per SM the backward's persistent grid aims for: enough 16-byte loads in flight
// while keeping the dw / db partial slots (each a full fp32 row) few.
constexpr int kBackwardThreadsPerSm = 1024;
constexpr std::int64_t kBackwardCombineSmem = 32 * 1024;

}  // namespace

const char* kernel_kind_name(KernelKind kind) {
  switch (kind) {
    case KernelKind::kRowsPerCta: return "rows_per_cta";
    case KernelKind::kRegisterRow: return "register_row";
    case KernelKind::kSmemRow: return "smem_row";
    case KernelKind::kClusterRow: return "cluster_row";
    case KernelKind::kTwoPass: return "two_pass";
  }
  return "invalid";
}

int ModeledResidentCtas::per_sm(const LaunchPlan& plan, PlannedKernel kernel) const {
  // A kTwoPass backward's row kernel is its coefficient kernel (coef_threads); threads_per_cta
  // is then the tile kernel's.
  const int threads = kernel == PlannedKernel::kTile ? plan.threads_per_cta
                      : plan.coef_threads > 0        ? plan.coef_threads
                                                     : plan.threads_per_cta;
  const std::int64_t smem =
      (kernel == PlannedKernel::kTile ? 0 : plan.smem_bytes) + kStaticSmemReserve;
  const std::int64_t warp_threads = ceil_div(threads, 32) * 32;
  const std::int64_t registers = ceil_div(registers_per_thread_, 8) * 8 * warp_threads;
  return static_cast<int>(
      std::min({std::int64_t{kMaxCtasPerSm}, device_.max_threads_per_sm / warp_threads,
                device_.max_smem_per_sm / smem, kRegistersPerSm / registers}));
}

bool can_vectorize(int elem_bytes, std::int64_t cols, std::initializer_list<const void*> pointers,
                   std::initializer_list<std::int64_t> row_strides) {
  const int vec = full_vector(elem_bytes);
  if (cols % vec != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  for (const std::int64_t stride : row_strides) {
    if (stride % vec != 0) return false;
  }
  return true;
}

bool quantized_output_aligned(int elem_bytes, const void* q, std::int64_t q_row_stride) {
  const int vec_bytes = full_vector(elem_bytes);
  return reinterpret_cast<std::uintptr_t>(q) % vec_bytes == 0 && q_row_stride % vec_bytes == 0;
}

std::int64_t max_partial_slots(std::int64_t rows, std::int64_t cols) {
  const std::int64_t by_size = (std::int64_t{1} << 24) / std::max<std::int64_t>(cols, 1);
  return std::max<std::int64_t>(1, std::min({rows, std::int64_t{1024}, by_size}));
}

WorkspaceLayout workspace_layout(std::int64_t rows, std::int64_t cols) {
  auto align = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  const std::size_t partial =
      align(static_cast<std::size_t>(max_partial_slots(rows, cols) * cols) * sizeof(float));
  const std::size_t coef = align(static_cast<std::size_t>(std::max<std::int64_t>(rows, 0)) * 4 * sizeof(float));
  // + 256: the backend aligns the caller's pointer up to 256 bytes.
  return {0, partial, 2 * partial, 2 * partial + coef + 256};
}

std::size_t backward_workspace_bytes_for(std::int64_t rows, std::int64_t cols) {
  return workspace_layout(rows, cols).total_bytes;
}

LaunchPlan plan_forward(const ProblemShape& s, const DeviceInfo& d, const PlanOptions& options) {
  return plan_forward(s, d, ModeledResidentCtas(d), options);
}

LaunchPlan plan_backward(const ProblemShape& s, const DeviceInfo& d, const PlanOptions& options) {
  return plan_backward(s, d, ModeledResidentCtas(d), options);
}

LaunchPlan plan_forward(const ProblemShape& s, const DeviceInfo& d, const ResidentCtas& resident,
                        const PlanOptions& options) {
  LaunchPlan plan;
  plan.quant_register_cap = options.quant_register_cap;
  plan.vec = s.vector_aligned ? full_vector(s.elem_bytes) : 1;
  const std::int64_t nvec = ceil_div(s.cols, plan.vec);
  const std::int64_t rows = std::max<std::int64_t>(s.rows, 1);

  if (const RegisterFit fit = fit_in_registers(nvec, kMaxThreadsPerCta);
      fit.ok && !options.two_pass_only) {
    plan.kind = fit.team <= 32 ? KernelKind::kRowsPerCta : KernelKind::kRegisterRow;
    plan.vecs_per_thread = fit.vecs_per_thread;
    plan.team_threads = fit.team;
    plan.rows_per_cta = whole_warps(fit.team, std::min<std::int64_t>(rows, fit.team < 256 ? 256 / fit.team : 1));
    plan.threads_per_cta = plan.team_threads * plan.rows_per_cta;
    const std::int64_t groups = ceil_div(rows, plan.rows_per_cta);
    const std::int64_t per_sm = std::max(1, resident.per_sm(plan, PlannedKernel::kRows));
    plan.grid = clamp_grid(std::min(groups, d.sm_count * per_sm));
    return plan;
  }

  // Beyond registers the row is at least 512 x 4 vectors: one 512-thread CTA (or cluster)
  // per row, the row staged in shared memory so that x is read from device memory once.
  const auto row_bytes = [&](std::int64_t slice) { return slice * plan.vec * s.elem_bytes; };
  if (options.staged_rows && !options.two_pass_only &&
      plan_staged(nvec, std::min(rows, kMaxGrid / kMaxClusterSize), d, resident, row_bytes, plan)) {
    return plan;
  }
  plan.kind = KernelKind::kTwoPass;
  plan.team_threads = kTwoPassThreads;
  plan.threads_per_cta = kTwoPassThreads;
  plan.grid = clamp_grid(std::min<std::int64_t>(
      rows, d.sm_count * std::max(1, resident.per_sm(plan, PlannedKernel::kRows))));
  return plan;
}

LaunchPlan plan_backward(const ProblemShape& s, const DeviceInfo& d, const ResidentCtas& resident,
                         const PlanOptions& options) {
  LaunchPlan plan;
  plan.vec = s.vector_aligned ? full_vector(s.elem_bytes) : 1;
  const std::int64_t nvec = ceil_div(s.cols, plan.vec);
  const std::int64_t rows = std::max<std::int64_t>(s.rows, 1);
  const std::int64_t slot_limit = max_partial_slots(rows, s.cols);

  const int max_k = backward_max_vecs_per_thread(s.accumulators, plan.vec);
  if (const RegisterFit fit = fit_in_registers(nvec, kBackwardMaxTeam, max_k);
      fit.ok && !options.two_pass_only) {
    plan.kind = fit.team <= 32 ? KernelKind::kRowsPerCta : KernelKind::kRegisterRow;
    plan.vecs_per_thread = fit.vecs_per_thread;
    plan.team_threads = fit.team;
    // Several rows per CTA, their dw / db sums combined in shared memory before the CTA
    // writes its one partial row; the combine buffer is capped at 32 KB.
    const std::int64_t row_floats = std::int64_t{fit.team} * fit.vecs_per_thread * plan.vec;
    const std::int64_t by_threads = fit.team < kBackwardMaxTeam ? kBackwardMaxTeam / fit.team : 1;
    const std::int64_t by_smem = kBackwardCombineSmem / (row_floats * 4);
    plan.rows_per_cta = whole_warps(fit.team, std::max<std::int64_t>(1, std::min({rows, by_threads, by_smem})));
    plan.threads_per_cta = plan.team_threads * plan.rows_per_cta;
    plan.smem_bytes = plan.rows_per_cta > 1 ? plan.rows_per_cta * row_floats * 4 : 0;
    const std::int64_t groups = ceil_div(rows, plan.rows_per_cta);
    const std::int64_t per_sm = std::max(1, std::min(kBackwardThreadsPerSm / plan.threads_per_cta,
                                                     resident.per_sm(plan, PlannedKernel::kRows)));
    plan.grid = clamp_grid(std::min({groups, d.sm_count * per_sm, slot_limit}));
    plan.partial_slots = plan.grid;
    plan.finish_lanes = finish_lanes_for(plan.partial_slots);
    return plan;
  }

  // Rows too long for registers: dy and x staged in shared memory (one CTA or a cluster
  // per row), dw / db column sums in fp32 shared memory beside them; one partial slot per
  // cluster.
  const auto stage_bytes = [&](std::int64_t slice) {
    return staged_backward_smem(slice, plan.vec, s.elem_bytes).total(s.accumulators);
  };
  // Longer still (sm_90): only the column sums in shared memory, dy and x read again from
  // device memory in each pass. A cluster of 8 shares each row, so the rows in flight are
  // few (sm_count / 8) and a re-read should find the row in L2 (prediction; gpu_bench's
  // fusednorm_two_pass rows measure it against the two-kernel path below).
  const auto sums_bytes = [&](std::int64_t slice) {
    return std::max<std::int64_t>(16, s.accumulators * staged_backward_smem(slice, plan.vec, s.elem_bytes).acc_bytes);
  };
  if (options.staged_rows && !options.two_pass_only) {
    const bool staged = plan_staged(nvec, slot_limit, d, resident, stage_bytes, plan);
    if (staged || plan_staged(nvec, slot_limit, d, resident, sums_bytes, plan, kMaxClusterSize)) {
      plan.staged_inputs = staged;
      plan.partial_slots = plan.grid / plan.cluster_size;
      plan.finish_lanes = finish_lanes_for(plan.partial_slots);
      return plan;
    }
  }

  // Beyond that: a per-row coefficient kernel, then a column-tile kernel that writes dx and
  // accumulates dw / db for its columns over a block of rows. It reads dy and x twice (5/3
  // of the minimum traffic).
  plan.kind = KernelKind::kTwoPass;
  plan.coef_threads = kTwoPassThreads;
  plan.team_threads = kTwoPassThreads;
  plan.threads_per_cta = kTileThreads;
  plan.smem_bytes = 0;
  plan.cluster_size = 1;
  plan.grid = clamp_grid(std::min<std::int64_t>(
      rows, d.sm_count * std::max(1, resident.per_sm(plan, PlannedKernel::kRows))));
  plan.col_tiles = std::min(ceil_div(nvec, kTileThreads), kMaxGrid);
  const std::int64_t tiles_wanted =
      d.sm_count * std::max(1, resident.per_sm(plan, PlannedKernel::kTile));
  plan.row_blocks = std::max<std::int64_t>(
      1, std::min(ceil_div(tiles_wanted, plan.col_tiles), slot_limit));
  plan.rows_per_block = ceil_div(rows, plan.row_blocks);
  plan.row_blocks = ceil_div(rows, plan.rows_per_block);
  plan.partial_slots = plan.row_blocks;
  plan.finish_lanes = finish_lanes_for(plan.partial_slots);
  return plan;
}

}  // namespace fusednorm::cuda
