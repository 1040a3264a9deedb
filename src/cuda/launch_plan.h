// The CUDA launch planner: from a problem's shape, dtype and alignment and from what the
// device offers, the kernel shape a call runs with. Plain host C++ (no CUDA headers), so
// that every choice is unit-tested on machines without a GPU (tests/cuda/).
//
// Kernel kinds, by row length D (the thresholds come from register and shared-memory
// capacity, not from tuning constants; see plan_forward / plan_backward):
//   kRowsPerCta   small D: a team of <= 32 threads per row, several rows per CTA.
//   kRegisterRow  medium D: a team of up to 512 threads holds the row in registers, so x
//                 is read from device memory once.
//   kSmemRow      large D: one CTA per row, the row staged in shared memory.
//   kClusterRow   larger than one SM's shared memory (sm_90): a thread-block cluster splits
//                 the row, each CTA stages its slice, and the row statistics are combined
//                 through distributed shared memory instead of a second global read.
//   kTwoPass      everything else (sm_80 with huge D; rows beyond what a cluster of 8 can
//                 stage): the row is read from device memory again for each pass.
// The backward uses the same kinds; its staged rows hold dy and x plus fp32 dw / db column
// sums in shared memory, so they run out of room at a shorter D than the forward's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace fusednorm::cuda {

enum class KernelKind : std::uint8_t {
  kRowsPerCta,
  kRegisterRow,
  kSmemRow,
  kClusterRow,
  kTwoPass,
};
const char* kernel_kind_name(KernelKind kind);

// What the planner needs to know about the device. The backend fills it from
// cudaDeviceGetAttribute; tests fill it by hand.
struct DeviceInfo {
  int sm_count = 132;
  int cc_major = 9;
  int max_threads_per_sm = 2048;
  std::int64_t max_smem_per_block = 227 * 1024;  // opt-in limit of dynamic shared memory
  std::int64_t max_smem_per_sm = 228 * 1024;
  bool cluster_launch = true;  // thread-block clusters with distributed shared memory

  static DeviceInfo h200() { return {}; }
  static DeviceInfo a100() { return {108, 8, 2048, 163 * 1024, 164 * 1024, false}; }
};

struct ProblemShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  int elem_bytes = 2;           // bytes of one element of x (2 or 4)
  bool vector_aligned = false;  // see can_vectorize()
  int accumulators = 0;  // backward: fp32 column sums each thread keeps (dw: 1, dw and db: 2)
};

struct LaunchPlan {
  KernelKind kind = KernelKind::kTwoPass;
  int vec = 1;                // elements per memory access (16 bytes, or 1 when unaligned)
  int vecs_per_thread = 0;    // register kinds: vectors of a row each thread holds (1, 2, 4)
  int team_threads = 0;       // threads sharing one row (per CTA for kClusterRow)
  int rows_per_cta = 1;
  int threads_per_cta = 0;    // team_threads * rows_per_cta (two-pass backward: tile kernel)
  int cluster_size = 1;
  std::int64_t slice_vecs = 0;  // kSmemRow / kClusterRow: vectors of a row one CTA stages
  // Backward kClusterRow: dy and x staged in shared memory beside the column sums; false:
  // only the sums are, and dy and x are read from device memory (L2) in each pass.
  bool staged_inputs = true;
  // Forward kRegisterRow / kRowsPerCta of the quantized forward: the capped kernel
  // (PlanOptions::quant_register_cap); the other launchers ignore it.
  bool quant_register_cap = false;
  std::int64_t smem_bytes = 0;  // dynamic shared memory per CTA
  std::int64_t grid = 0;        // CTAs (a multiple of cluster_size); kernels loop over rows

  // Backward only. dw / db partial sums: `partial_slots` rows of `cols` fp32 each in the
  // workspace, summed in slot order by the finishing kernel (deterministic, no atomics).
  // One slot per CTA (register kinds), per cluster (staged kinds) or per row block (kTwoPass).
  std::int64_t partial_slots = 0;
  // kTwoPass backward: grid of the column-tile kernel is col_tiles x row_blocks; the
  // per-row coefficient kernel runs `grid` CTAs of coef_threads.
  std::int64_t col_tiles = 0;
  std::int64_t row_blocks = 0;
  std::int64_t rows_per_block = 0;
  int coef_threads = 0;
  // Finishing kernel: CTAs of 32 columns x finish_lanes slot lanes.
  int finish_lanes = 0;
};

// Backward register kernels: at most 32 fp32 accumulators per thread (dw / db over the
// thread's columns) beside dy and x, or ptxas spills at 128 registers (measured: LayerNorm
// bf16 with dw and db at 4 vectors of 8 spilled 104 bytes).
constexpr int backward_max_vecs_per_thread(int accumulators, int vec) {
  return accumulators * vec * 4 <= 32 ? 4 : 2;
}

// Shared memory of one CTA of the staged backward (kSmemRow / kClusterRow): its slices of dy
// and x (slice_vecs vectors each), then one fp32 slice per accumulator (dw, db). Every region
// starts 16-byte aligned. The planner sizes launches with it and the kernel finds its
// regions with it, so the two cannot disagree.
struct StagedBackwardSmem {
  std::int64_t stage_bytes;  // one of the dy / x slices
  std::int64_t acc_bytes;    // one fp32 accumulator slice
  constexpr std::int64_t total(int accumulators) const { return 2 * stage_bytes + accumulators * acc_bytes; }
};
constexpr std::int64_t round_up_16(std::int64_t bytes) { return (bytes + 15) / 16 * 16; }
constexpr StagedBackwardSmem staged_backward_smem(std::int64_t slice_vecs, int vec, int elem_bytes) {
  return {round_up_16(slice_vecs * vec * elem_bytes), round_up_16(slice_vecs * vec * 4)};
}

// Elements per 16-byte access for the element size.
constexpr int full_vector(int elem_bytes) { return 16 / elem_bytes; }

// 16-byte accesses are possible when every address is 16-byte aligned, every row stride
// (in elements) keeps rows 16-byte aligned, and D is a whole number of vectors.
bool can_vectorize(int elem_bytes, std::int64_t cols, std::initializer_list<const void*> pointers,
                   std::initializer_list<std::int64_t> row_strides);

// The quantized forward stores q (1 byte per element) with the vector width of x's loads:
// full_vector(elem_bytes) bytes per access (8 for 16-bit x, 4 for fp32). Possible when q's
// address and row stride (in bytes) are multiples of that width; can_vectorize covers the
// rest of the call.
bool quantized_output_aligned(int elem_bytes, const void* q, std::int64_t q_row_stride);

// Choices that are not the problem's or the device's: switches for A/B measurements.
struct PlanOptions {
  // false: rows beyond register capacity take the two-pass kernels instead of being staged
  // in shared memory (the backend reads FUSEDNORM_CUDA_STAGED_ROWS=0; gpu_bench uses it to
  // measure what staging gains on the same shapes in the same run).
  bool staged_rows = true;
  // true: the two-pass kernels whatever the shape. The two-phase (column-sliced) calls run
  // their passes separately: phase 1 is the first pass, phase 2 the rest.
  bool two_pass_only = false;
  // true: the quantized forward's register rows run norm_forward_register_capped_kernel
  // (kQuantRegisterCap registers per thread) instead of the ptxas-chosen count (the backend
  // reads FUSEDNORM_CUDA_QUANT_REGISTER_CAP=1; gpu_bench times both in one run). The
  // planner copies it into the plan, so the occupancy answer is the capped kernel's.
  bool quant_register_cap = false;
};

// The kernel of a plan an occupancy question is about: the row kernel (every kind; for a
// kTwoPass backward, the per-row coefficient kernel) or the kTwoPass backward's column-tile
// kernel (LaunchPlan::threads_per_cta threads, no dynamic shared memory).
enum class PlannedKernel : std::uint8_t { kRows, kTile };

// How many CTAs of a plan's kernel are resident on one SM at once, at the plan's threads per
// CTA and dynamic shared memory (0: not even one fits). Registers per thread decide it as
// much as threads and shared memory do (a 256-thread CTA at 118 registers fits twice per SM,
// not 8 times), and only the compiled kernel knows them: the backend answers with the CUDA
// runtime's occupancy calculator for the kernel its launcher picks for the plan
// (cuda_backend.cu). The planner asks once the plan's kernel shape is fixed, and sizes the
// persistent grids, the dw / db partial-slot counts and the two-pass row blocks with the
// answer. Workspace sizes do not depend on it (max_partial_slots bounds every plan).
class ResidentCtas {
 public:
  virtual int per_sm(const LaunchPlan& plan, PlannedKernel kernel) const = 0;

 protected:
  ~ResidentCtas() = default;
};

// A model for unit tests and tools without a device: the device's limits on threads, shared
// memory (dynamic + kStaticSmemReserve) and registers per SM (registers_per_thread rounded
// up to 8, as the hardware allocates them), and at most 32 CTAs per SM. At 32 registers per
// thread it is the thread-and-shared-memory count the planner used before it asked the
// runtime.
class ModeledResidentCtas final : public ResidentCtas {
 public:
  explicit ModeledResidentCtas(const DeviceInfo& device, int registers_per_thread = 32)
      : device_(device), registers_per_thread_(registers_per_thread) {}
  int per_sm(const LaunchPlan& plan, PlannedKernel kernel) const override;

 private:
  DeviceInfo device_;
  int registers_per_thread_;
};

LaunchPlan plan_forward(const ProblemShape& shape, const DeviceInfo& device,
                        const ResidentCtas& resident, const PlanOptions& options = {});
LaunchPlan plan_backward(const ProblemShape& shape, const DeviceInfo& device,
                         const ResidentCtas& resident, const PlanOptions& options = {});
// With ModeledResidentCtas(device) (32 registers per thread): for tests and tools only; the
// backend plans with the runtime's answer.
LaunchPlan plan_forward(const ProblemShape& shape, const DeviceInfo& device, const PlanOptions& options = {});
LaunchPlan plan_backward(const ProblemShape& shape, const DeviceInfo& device, const PlanOptions& options = {});

// The most partial-sum slots any backward plan uses for rows x cols: min(rows, 1024,
// 2^24 / cols), at least 1. Independent of dtype and device so that the workspace size is.
std::int64_t max_partial_slots(std::int64_t rows, std::int64_t cols);

// Workspace layout of the backward (offsets in bytes from the workspace start, each
// 256-byte aligned from the workspace pointer rounded up to 256 bytes): dw partials, db
// partials, per-row coefficients (4 floats per row); total_bytes includes the rounding.
struct WorkspaceLayout {
  std::size_t dw_offset, db_offset, coef_offset, total_bytes;
};
WorkspaceLayout workspace_layout(std::int64_t rows, std::int64_t cols);
std::size_t backward_workspace_bytes_for(std::int64_t rows, std::int64_t cols);

// Limits the planner respects (CUDA's, and the kernels' compiled maxima).
// 512 threads leave ptxas up to 128 registers per thread (1024 would cap it at 64 and
// spill). The kernels say __launch_bounds__(512, 1): with the bare thread bound ptxas
// aimed at 32 registers and spilled (nvcc 13.0).
inline constexpr int kMaxThreadsPerCta = 512;
inline constexpr int kMaxVecsPerThread = 4;
inline constexpr int kMaxClusterSize = 8;  // portable cluster size
inline constexpr std::int64_t kMaxGrid = 2147483647;
inline constexpr std::int64_t kStaticSmemReserve = 1024;  // kernels' static shared memory
inline constexpr int kTwoPassThreads = 512;  // two-pass forward and backward row kernels
inline constexpr int kTileThreads = 256;     // two-pass backward column-tile kernel
inline constexpr int kFinishThreads =
    1024;  // dw / db finishing kernel: 32 columns x up to 32 lanes
// The float64 verification kernels (norm_f64.cu): their shared-memory reduction holds one
// double per thread, kStaticSmemReserve bytes at this size.
inline constexpr int kFloat64Threads = 128;
// Registers per SM (sm_80, sm_90): a CTA of n threads launches only when each thread needs
// at most kRegistersPerSm / n registers. That is the one thing the planner assumes about
// registers: tests/cuda/check_sass.py checks every compiled kernel against the largest CTA the
// planner gives its family (kMaxThreadsPerCta: 128 registers). How many CTAs are resident
// per SM below that bound is the runtime's answer (ResidentCtas), not an assumption.
inline constexpr int kRegistersPerSm = 65536;
// norm_forward_register_capped_kernel's registers per thread (__maxnreg__): 3 CTAs of 256
// threads per SM (3 * 256 * 80 <= kRegistersPerSm).
inline constexpr int kQuantRegisterCap = 80;
static_assert(3 * 256 * kQuantRegisterCap <= kRegistersPerSm, "3 CTAs of 256 threads per SM");
static_assert(kMaxThreadsPerCta * kQuantRegisterCap <= kRegistersPerSm, "a 512-thread CTA fits");
inline constexpr int kMaxCtasPerSm = 32;  // sm_80 and sm_90

}  // namespace fusednorm::cuda
