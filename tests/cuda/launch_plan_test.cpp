// The CUDA launch planner's choices, checked on the CPU over D, dtype and alignment.
#include "cuda/launch_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fusednorm::cuda {
namespace {

ProblemShape shape(std::int64_t rows, std::int64_t cols, int elem_bytes, bool aligned = true,
                   int accumulators = 0) {
  ProblemShape s;
  s.rows = rows;
  s.cols = cols;
  s.elem_bytes = elem_bytes;
  s.vector_aligned = aligned && cols % full_vector(elem_bytes) == 0;
  s.accumulators = accumulators;
  return s;
}

const DeviceInfo kH200 = DeviceInfo::h200();
const DeviceInfo kA100 = DeviceInfo::a100();

TEST(LaunchPlan, SmallRowsShareACta) {
  const LaunchPlan p = plan_forward(shape(65536, 128, 2), kH200);
  EXPECT_EQ(p.kind, KernelKind::kRowsPerCta);
  EXPECT_EQ(p.vec, 8);
  EXPECT_EQ(p.team_threads, 16);
  EXPECT_GT(p.rows_per_cta, 1);
  EXPECT_EQ(p.threads_per_cta, p.team_threads * p.rows_per_cta);
  EXPECT_EQ(p.smem_bytes, 0);
}

TEST(LaunchPlan, MediumRowInRegisters) {
  const LaunchPlan p = plan_forward(shape(4096, 4096, 2), kH200);
  EXPECT_EQ(p.kind, KernelKind::kRegisterRow);
  EXPECT_EQ(p.vec, 8);
  EXPECT_GE(std::int64_t{p.team_threads} * p.vecs_per_thread * p.vec, 4096);
  EXPECT_EQ(p.rows_per_cta, 1);
  EXPECT_EQ(p.smem_bytes, 0);
  const LaunchPlan f32 = plan_forward(shape(4096, 4096, 4), kH200);
  EXPECT_EQ(f32.kind, KernelKind::kRegisterRow);
  EXPECT_EQ(f32.vec, 4);
}

TEST(LaunchPlan, LargeRowInSharedMemory) {
  const LaunchPlan bf16 = plan_forward(shape(1024, 65536, 2), kH200);
  EXPECT_EQ(bf16.kind, KernelKind::kSmemRow);
  EXPECT_EQ(bf16.smem_bytes, 65536 * 2);
  EXPECT_EQ(bf16.cluster_size, 1);
  const LaunchPlan f32 = plan_forward(shape(1024, 32768, 4), kH200);
  EXPECT_EQ(f32.kind, KernelKind::kSmemRow);
  EXPECT_EQ(f32.smem_bytes, 32768 * 4);
}

TEST(LaunchPlan, BeyondOneSmUsesClusterOnHopperAndTwoPassOnAmpere) {
  const LaunchPlan f32 = plan_forward(shape(256, 262144, 4), kH200);
  EXPECT_EQ(f32.kind, KernelKind::kClusterRow);
  EXPECT_EQ(f32.cluster_size, 8);
  EXPECT_LE(f32.smem_bytes, kH200.max_smem_per_block - kStaticSmemReserve);
  EXPECT_GE(f32.slice_vecs * f32.cluster_size * f32.vec, 262144);
  EXPECT_EQ(f32.grid % f32.cluster_size, 0);

  EXPECT_EQ(plan_forward(shape(256, 262144, 2), kH200).cluster_size, 4);
  EXPECT_EQ(plan_forward(shape(1024, 65536, 4), kH200).kind, KernelKind::kClusterRow);
  EXPECT_EQ(plan_forward(shape(1024, 65536, 4), kH200).cluster_size, 2);

  EXPECT_EQ(plan_forward(shape(256, 262144, 4), kA100).kind, KernelKind::kTwoPass);
  EXPECT_EQ(plan_forward(shape(1024, 65536, 4), kA100).kind, KernelKind::kTwoPass);
  // Past what a portable cluster of 8 can stage, Hopper falls back too.
  EXPECT_EQ(plan_forward(shape(4, 1 << 21, 4), kH200).kind, KernelKind::kTwoPass);
}

// The quantized output (1 byte per element) is stored with x's vector width: 8 bytes per
// access for 16-bit x, 4 for fp32; its pointer and row stride (bytes) must allow that.
TEST(LaunchPlan, QuantizedOutputAlignment) {
  alignas(16) static std::uint8_t q[64];
  EXPECT_TRUE(quantized_output_aligned(2, q, 4096));
  EXPECT_TRUE(quantized_output_aligned(2, q + 8, 4104));
  EXPECT_FALSE(quantized_output_aligned(2, q + 4, 4096));  // pointer: 4 of 8 bytes
  EXPECT_FALSE(quantized_output_aligned(2, q, 4100));      // row stride
  EXPECT_TRUE(quantized_output_aligned(4, q + 4, 4100));   // fp32 x: 4-byte stores
  EXPECT_FALSE(quantized_output_aligned(4, q + 2, 4096));
}

TEST(LaunchPlan, MisalignedDataTakesTheScalarPath) {
  alignas(16) static std::uint16_t buffer[64];
  EXPECT_TRUE(can_vectorize(2, 4096, {buffer, nullptr}, {4096}));
  EXPECT_FALSE(can_vectorize(2, 4096, {buffer + 1}, {4096}));      // pointer
  EXPECT_FALSE(can_vectorize(2, 4096, {buffer}, {4100}));          // row stride
  EXPECT_FALSE(can_vectorize(2, 4095, {buffer}, {4095}));          // D
  EXPECT_TRUE(can_vectorize(4, 4096, {buffer + 8}, {4096}));       // 16 bytes in
  const LaunchPlan p = plan_forward(shape(512, 4096, 2, false), kH200);
  EXPECT_EQ(p.vec, 1);
  // 4096 scalars are more than 512 threads x 4 registers: staged in shared memory.
  EXPECT_EQ(p.kind, KernelKind::kSmemRow);
  EXPECT_EQ(p.smem_bytes, 4096 * 2);
  EXPECT_EQ(plan_forward(shape(512, 1000, 2, false), kH200).kind, KernelKind::kRegisterRow);
  EXPECT_EQ(plan_backward(shape(512, 4096, 2, false, 1), kH200).vec, 1);
}

TEST(LaunchPlan, SingleElementRows) {
  const LaunchPlan p = plan_forward(shape(1000, 1, 2), kH200);
  EXPECT_EQ(p.vec, 1);
  EXPECT_EQ(p.kind, KernelKind::kRowsPerCta);
  EXPECT_EQ(p.team_threads, 1);
  EXPECT_EQ(p.vecs_per_thread, 1);
  // A single short row still gets a whole warp.
  EXPECT_EQ(plan_forward(shape(1, 64, 2), kH200).threads_per_cta, 32);
  const LaunchPlan b = plan_backward(shape(1000, 1, 4, true, 1), kH200);
  EXPECT_EQ(b.team_threads, 1);
  EXPECT_GE(b.partial_slots, 1);
}

TEST(LaunchPlan, SixtyFourBitRowCounts) {
  const std::int64_t rows = std::int64_t{1} << 40;
  for (const auto& p : {plan_forward(shape(rows, 4096, 2), kH200), plan_forward(shape(rows, 64, 2), kH200),
                        plan_forward(shape(rows, 65536, 2), kH200), plan_backward(shape(rows, 4096, 2, true, 1), kH200)}) {
    EXPECT_GE(p.grid, 1);
    EXPECT_LE(p.grid, kH200.sm_count * 64);  // persistent: kernels loop over rows
  }
  EXPECT_LE(plan_backward(shape(rows, 4096, 2, true, 2), kH200).partial_slots, max_partial_slots(rows, 4096));
}

TEST(LaunchPlan, BackwardAccumulatorsBoundVectorsPerThread) {
  // LayerNorm bf16 with dw and db: 2 x 8 x 4 accumulators would spill; at most 2 vectors.
  const LaunchPlan ln = plan_backward(shape(4096, 8192, 2, true, 2), kH200);
  EXPECT_EQ(ln.kind, KernelKind::kRegisterRow);
  EXPECT_LE(ln.vecs_per_thread, 2);
  const LaunchPlan rms = plan_backward(shape(4096, 16384, 2, true, 1), kH200);
  EXPECT_EQ(rms.kind, KernelKind::kRegisterRow);
  EXPECT_EQ(rms.vecs_per_thread, 4);
  // Past register capacity the row is staged in shared memory instead.
  EXPECT_EQ(plan_backward(shape(4096, 16384, 2, true, 2), kH200).kind, KernelKind::kSmemRow);
}

TEST(LaunchPlan, BackwardBeyondRegistersStagesDyAndXInSharedMemory) {
  // fp32 D = 16384 with dw: dy, x and the fp32 dw sums, 64 KB each, in one CTA.
  const LaunchPlan f32 = plan_backward(shape(4096, 16384, 4, true, 1), kH200);
  EXPECT_EQ(f32.kind, KernelKind::kSmemRow);
  EXPECT_EQ(f32.cluster_size, 1);
  EXPECT_EQ(f32.slice_vecs, 16384 / 4);
  EXPECT_EQ(f32.smem_bytes, 3 * 65536);
  EXPECT_EQ(f32.threads_per_cta, kMaxThreadsPerCta);
  EXPECT_EQ(f32.grid, kH200.sm_count);  // one 192 KB CTA per SM
  EXPECT_EQ(f32.partial_slots, f32.grid);

  // bf16 D = 65536 with dw: 512 KB of staging and sums, a cluster of 4 x 128 KB; one
  // partial slot per cluster.
  const LaunchPlan bf16 = plan_backward(shape(1024, 65536, 2, true, 1), kH200);
  EXPECT_EQ(bf16.kind, KernelKind::kClusterRow);
  EXPECT_EQ(bf16.cluster_size, 4);
  EXPECT_EQ(bf16.smem_bytes, 2 * 2048 * 16 + 2048 * 8 * 4);
  EXPECT_EQ(bf16.grid, kH200.sm_count / 4 * 4);
  EXPECT_EQ(bf16.partial_slots, bf16.grid / 4);

  // LayerNorm fp32 with dw and db: 64 bytes per vector of 4, a cluster of 8.
  EXPECT_EQ(plan_backward(shape(1024, 65536, 4, true, 2), kH200).cluster_size, 8);
  // dx only needs no sums: bf16 D = 262144 fits a cluster of 8 x 128 KB.
  const LaunchPlan dx_only = plan_backward(shape(256, 262144, 2, true, 0), kH200);
  EXPECT_EQ(dx_only.kind, KernelKind::kClusterRow);
  EXPECT_EQ(dx_only.cluster_size, 8);
  // Fewer rows than clusters: one cluster, and one slot, per row.
  const LaunchPlan few = plan_backward(shape(3, 65536, 2, true, 1), kH200);
  EXPECT_EQ(few.grid, 3 * few.cluster_size);
  EXPECT_EQ(few.partial_slots, 3);

  // With dw, bf16 D = 262144 needs 2 MB, more than a portable cluster of 8 holds: only the
  // dw sums (128 KB per CTA) are in shared memory, dy and x are read again.
  const LaunchPlan huge = plan_backward(shape(256, 262144, 2, true, 1), kH200);
  EXPECT_EQ(huge.kind, KernelKind::kClusterRow);
  EXPECT_FALSE(huge.staged_inputs);
  EXPECT_EQ(huge.cluster_size, 8);
  EXPECT_EQ(huge.smem_bytes, 262144 / 8 * 4);
  EXPECT_EQ(huge.partial_slots, huge.grid / 8);
  EXPECT_TRUE(bf16.staged_inputs);
  // LayerNorm fp32 with dw and db: 2 x 128 KB of sums per CTA do not fit either: two kernels.
  const LaunchPlan two = plan_backward(shape(256, 262144, 4, true, 2), kH200);
  EXPECT_EQ(two.kind, KernelKind::kTwoPass);
  EXPECT_GE(two.col_tiles * kTileThreads * two.vec, 262144);
  EXPECT_GE(two.row_blocks * two.rows_per_block, 256);
  EXPECT_EQ(two.partial_slots, two.row_blocks);
  // The A/B switch: the same shapes on the two-pass kernels.
  EXPECT_EQ(plan_backward(shape(1024, 65536, 2, true, 1), kH200, PlanOptions{false}).kind, KernelKind::kTwoPass);
  EXPECT_EQ(plan_forward(shape(1024, 65536, 2), kH200, PlanOptions{false}).kind, KernelKind::kTwoPass);
  EXPECT_EQ(plan_forward(shape(1024, 4096, 2), kH200, PlanOptions{false}).kind, KernelKind::kRegisterRow);
  // No clusters on sm_80, and 192 KB exceeds its 163 KB per CTA.
  EXPECT_EQ(plan_backward(shape(4096, 16384, 4, true, 1), kA100).kind, KernelKind::kTwoPass);
  EXPECT_EQ(plan_backward(shape(4096, 12288, 4, true, 1), kA100).kind, KernelKind::kSmemRow);  // 144 KB
}

// Invariants over a sweep of shapes, dtypes, alignments and devices.
TEST(LaunchPlan, InvariantsOverSweep) {
  std::vector<std::int64_t> cols_list;
  for (std::int64_t d = 1; d <= (1 << 19); d = d * 2) {
    for (std::int64_t delta : {-1, 0, 1}) {
      if (d + delta >= 1) cols_list.push_back(d + delta);
    }
  }
  cols_list.push_back(5120);
  cols_list.push_back(262144);
  for (const DeviceInfo& dev : {kH200, kA100}) {
    for (int esize : {2, 4}) {
      for (bool aligned : {true, false}) {
        for (std::int64_t rows : {std::int64_t{1}, std::int64_t{3}, std::int64_t{4096}, std::int64_t{1} << 33}) {
          for (std::int64_t cols : cols_list) {
            SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " esize " << esize
                                            << " aligned " << aligned << " cc " << dev.cc_major);
            const ProblemShape s = shape(rows, cols, esize, aligned);
            const LaunchPlan f = plan_forward(s, dev);
            const std::int64_t nvec = (cols + f.vec - 1) / f.vec;
            EXPECT_EQ(f.vec, s.vector_aligned ? 16 / esize : 1);
            EXPECT_GE(f.grid, 1);
            EXPECT_LE(f.grid, kMaxGrid);
            EXPECT_EQ(f.grid % f.cluster_size, 0);
            EXPECT_LE(f.threads_per_cta, kMaxThreadsPerCta);
            EXPECT_LE(f.smem_bytes, dev.max_smem_per_block - kStaticSmemReserve);
            EXPECT_LE(f.cluster_size, kMaxClusterSize);
            switch (f.kind) {
              case KernelKind::kRowsPerCta:
              case KernelKind::kRegisterRow:
                EXPECT_GE(std::int64_t{f.team_threads} * f.vecs_per_thread, nvec);
                EXPECT_TRUE(f.team_threads > 32 ? f.team_threads % 32 == 0 : 32 % f.team_threads == 0);
                EXPECT_EQ(f.threads_per_cta, f.team_threads * f.rows_per_cta);
                EXPECT_EQ(f.threads_per_cta % 32, 0);  // whole warps: full-mask shuffles
                break;
              case KernelKind::kSmemRow:
              case KernelKind::kClusterRow:
                EXPECT_GE(f.slice_vecs * f.cluster_size, nvec);
                EXPECT_EQ(f.smem_bytes, f.slice_vecs * f.vec * esize);
                break;
              case KernelKind::kTwoPass:
                break;
            }
            if (f.kind == KernelKind::kClusterRow) {
              EXPECT_GE(dev.cc_major, 9);
              EXPECT_TRUE(dev.cluster_launch);
            }
            for (int acc : {0, 1, 2}) {
              const LaunchPlan b = plan_backward(shape(rows, cols, esize, aligned, acc), dev);
              EXPECT_GE(b.grid, 1);
              EXPECT_LE(b.grid, kMaxGrid);
              EXPECT_LE(b.threads_per_cta, 512);
              EXPECT_GE(b.partial_slots, 1);
              EXPECT_LE(b.partial_slots, max_partial_slots(rows, cols));
              EXPECT_LE(b.smem_bytes, dev.max_smem_per_block - kStaticSmemReserve);
              EXPECT_GE(b.finish_lanes, 1);
              EXPECT_LE(b.finish_lanes, 32);
              EXPECT_EQ(b.grid % b.cluster_size, 0);
              switch (b.kind) {
                case KernelKind::kTwoPass:
                  EXPECT_GE(b.col_tiles * kTileThreads, nvec);
                  EXPECT_LE(b.row_blocks, 65535);
                  EXPECT_GE(b.row_blocks * b.rows_per_block, rows);
                  break;
                case KernelKind::kSmemRow:
                case KernelKind::kClusterRow:
                  EXPECT_GE(b.slice_vecs * b.cluster_size, nvec);
                  if (b.staged_inputs) {
                    EXPECT_EQ(b.smem_bytes, staged_backward_smem(b.slice_vecs, b.vec, esize).total(acc));
                  } else {
                    EXPECT_EQ(b.kind, KernelKind::kClusterRow);
                    EXPECT_EQ(b.cluster_size, kMaxClusterSize);
                    EXPECT_EQ(b.smem_bytes,
                              std::max<std::int64_t>(16, acc * staged_backward_smem(b.slice_vecs, b.vec, esize).acc_bytes));
                  }
                  EXPECT_EQ(b.partial_slots, b.grid / b.cluster_size);
                  EXPECT_EQ(b.threads_per_cta, kMaxThreadsPerCta);
                  if (b.kind == KernelKind::kClusterRow) {
                    EXPECT_GE(dev.cc_major, 9);
                  }
                  break;
                case KernelKind::kRowsPerCta:
                case KernelKind::kRegisterRow:
                  EXPECT_LE(b.smem_bytes, 48 * 1024);  // the dw / db combine buffer
                  EXPECT_GE(std::int64_t{b.team_threads} * b.vecs_per_thread, nvec);
                  EXPECT_LE(b.vecs_per_thread, backward_max_vecs_per_thread(acc, b.vec));
                  EXPECT_EQ(b.partial_slots, b.grid);
                  EXPECT_EQ(b.threads_per_cta % 32, 0);
                  EXPECT_EQ(b.threads_per_cta, b.team_threads * b.rows_per_cta);
                  break;
              }
            }
          }
        }
      }
    }
  }
}

// A ResidentCtas that answers the same count for every kernel, and records the questions.
class FixedResidentCtas final : public ResidentCtas {
 public:
  explicit FixedResidentCtas(int count) : count_(count) {}
  int per_sm(const LaunchPlan& plan, PlannedKernel kernel) const override {
    asked.push_back({plan.threads_per_cta, plan.smem_bytes, kernel});
    return count_;
  }
  struct Question {
    int threads;
    std::int64_t smem;
    PlannedKernel kernel;
  };
  mutable std::vector<Question> asked;

 private:
  int count_;
};

// The persistent grids hold the CTAs the occupancy answer says are resident, not the count
// threads alone allow: a 256-thread CTA at 118 registers is 2 per SM, not 8.
TEST(LaunchPlan, PersistentGridsAreSizedByTheResidentCtas) {
  const ProblemShape s = shape(1 << 20, 4096, 2);  // bf16 register rows, 256 threads
  const LaunchPlan by_threads = plan_forward(s, kH200);
  ASSERT_EQ(by_threads.kind, KernelKind::kRegisterRow);
  ASSERT_EQ(by_threads.threads_per_cta, 256);
  EXPECT_EQ(by_threads.grid, kH200.sm_count * 8);
  const LaunchPlan at_118 = plan_forward(s, kH200, ModeledResidentCtas(kH200, 118));
  EXPECT_EQ(at_118.grid, kH200.sm_count * 2);
  // The query is about the planned kernel's shape.
  const FixedResidentCtas three(3);
  EXPECT_EQ(plan_forward(s, kH200, three).grid, kH200.sm_count * 3);
  ASSERT_FALSE(three.asked.empty());
  EXPECT_EQ(three.asked.back().threads, 256);
  EXPECT_EQ(three.asked.back().kernel, PlannedKernel::kRows);
  // 0 (the kernel does not fit): still a grid the launch can report the failure for.
  EXPECT_EQ(plan_forward(s, kH200, FixedResidentCtas(0)).grid, kH200.sm_count);

  // Backward register rows: min(1024 threads per SM, the resident CTAs), one slot per CTA.
  const ProblemShape b = shape(1 << 20, 4096, 2, true, 1);
  const LaunchPlan b_threads = plan_backward(b, kH200);
  ASSERT_EQ(b_threads.threads_per_cta, 512);  // 2 rows of 256 threads
  EXPECT_EQ(b_threads.grid, kH200.sm_count * 2);
  const LaunchPlan b1 = plan_backward(b, kH200, FixedResidentCtas(1));
  EXPECT_EQ(b1.grid, kH200.sm_count);
  EXPECT_EQ(b1.partial_slots, b1.grid);
  EXPECT_EQ(b1.finish_lanes, 32);  // 132 slots / 8 per lane, rounded up to a power of two

  // Staged rows: one 192 KB CTA per SM by shared memory; the answer decides.
  const FixedResidentCtas one(1);
  const LaunchPlan staged = plan_backward(shape(4096, 16384, 4, true, 1), kH200, one);
  EXPECT_EQ(staged.kind, KernelKind::kSmemRow);
  EXPECT_EQ(one.asked.back().smem, staged.smem_bytes);
  EXPECT_EQ(staged.grid, kH200.sm_count);

  // Two-pass backward: the coefficient kernel's grid and the tile kernel's row blocks.
  PlanOptions two_pass;
  two_pass.two_pass_only = true;
  const FixedResidentCtas two(2);
  const LaunchPlan tp = plan_backward(shape(1 << 16, 4096, 2, true, 1), kH200, two, two_pass);
  EXPECT_EQ(tp.grid, kH200.sm_count * 2);
  ASSERT_EQ(two.asked.size(), 2u);
  EXPECT_EQ(two.asked[0].kernel, PlannedKernel::kRows);
  EXPECT_EQ(two.asked[1].kernel, PlannedKernel::kTile);
  EXPECT_EQ(tp.row_blocks, (kH200.sm_count * 2 + tp.col_tiles - 1) / tp.col_tiles);
}

// The modeled count: threads, shared memory, registers (rounded up to 8 per thread) and 32
// CTAs per SM, whichever binds first.
TEST(LaunchPlan, ModeledResidentCtas) {
  LaunchPlan p;
  p.threads_per_cta = 256;
  EXPECT_EQ(ModeledResidentCtas(kH200).per_sm(p, PlannedKernel::kRows), 8);
  EXPECT_EQ(ModeledResidentCtas(kH200, 118).per_sm(p, PlannedKernel::kRows),
            2);  // 120 x 256 x 2 <= 65536
  EXPECT_EQ(ModeledResidentCtas(kH200, 128).per_sm(p, PlannedKernel::kRows), 2);
  p.threads_per_cta = 512;
  EXPECT_EQ(ModeledResidentCtas(kH200, 128).per_sm(p, PlannedKernel::kRows), 1);
  EXPECT_EQ(ModeledResidentCtas(kH200, 129).per_sm(p, PlannedKernel::kRows), 0);
  p.threads_per_cta = 32;
  EXPECT_EQ(ModeledResidentCtas(kH200).per_sm(p, PlannedKernel::kRows), kMaxCtasPerSm);
  p.threads_per_cta = 512;
  p.smem_bytes = 100 * 1024;
  EXPECT_EQ(ModeledResidentCtas(kH200).per_sm(p, PlannedKernel::kRows), 2);
  EXPECT_EQ(ModeledResidentCtas(kA100).per_sm(p, PlannedKernel::kRows), 1);
  // kTwoPass backward: the row kernel is the coefficient kernel.
  p.smem_bytes = 0;
  p.coef_threads = 512;
  p.threads_per_cta = 256;
  EXPECT_EQ(ModeledResidentCtas(kH200, 128).per_sm(p, PlannedKernel::kRows), 1);
  EXPECT_EQ(ModeledResidentCtas(kH200, 128).per_sm(p, PlannedKernel::kTile), 2);
}

// Whatever the occupancy answer, a backward plan's partial slots fit the workspace that
// backward_workspace_bytes (max_partial_slots) sized without asking: a caller that sizes the
// workspace with the query and then launches is never short.
TEST(LaunchPlan, PartialSlotsFitTheWorkspaceAtAnyOccupancy) {
  for (const int count : {0, 1, 2, 3, 7, 16, 32}) {
    for (const DeviceInfo& dev : {kH200, kA100}) {
      for (const std::int64_t rows :
           {std::int64_t{1}, std::int64_t{37}, std::int64_t{4096}, std::int64_t{1} << 24}) {
        for (const std::int64_t cols :
             {std::int64_t{1}, std::int64_t{1024}, std::int64_t{16384}, std::int64_t{262144}}) {
          for (const int acc : {1, 2}) {
            for (const bool two_pass_only : {false, true}) {
              SCOPED_TRACE(testing::Message()
                           << "count " << count << " rows " << rows << " cols " << cols << " acc "
                           << acc << " two_pass_only " << two_pass_only);
              PlanOptions options;
              options.two_pass_only = two_pass_only;
              const LaunchPlan b = plan_backward(shape(rows, cols, 2, true, acc), dev,
                                                 FixedResidentCtas(count), options);
              EXPECT_GE(b.partial_slots, 1);
              EXPECT_LE(b.partial_slots, max_partial_slots(rows, cols));
              EXPECT_GE(b.grid, 1);
              EXPECT_EQ(b.grid % b.cluster_size, 0);
            }
          }
        }
      }
    }
  }
}

// The two-phase (column-sliced) calls run the two-pass kernels' passes separately, whatever
// the shape; their partial slots stay within the workspace bound.
TEST(LaunchPlan, TwoPassOnlyForcesTheTwoPassKernels) {
  PlanOptions two_pass;
  two_pass.two_pass_only = true;
  for (const std::int64_t cols : {1, 128, 4096, 65536}) {
    SCOPED_TRACE(cols);
    EXPECT_EQ(plan_forward(shape(1024, cols, 2), kH200, two_pass).kind, KernelKind::kTwoPass);
    const LaunchPlan back = plan_backward(shape(1024, cols, 2, true, 1), kH200, two_pass);
    EXPECT_EQ(back.kind, KernelKind::kTwoPass);
    EXPECT_LE(back.partial_slots, max_partial_slots(1024, cols));
  }
}

TEST(LaunchPlan, WorkspaceCoversEveryBackwardPlan) {
  for (std::int64_t rows : {std::int64_t{0}, std::int64_t{1}, std::int64_t{4096}, std::int64_t{1} << 20}) {
    for (std::int64_t cols : {std::int64_t{1}, std::int64_t{128}, std::int64_t{4096}, std::int64_t{262144}}) {
      const WorkspaceLayout w = workspace_layout(rows, cols);
      const std::size_t partial = static_cast<std::size_t>(max_partial_slots(rows, cols) * cols) * 4;
      EXPECT_GE(w.db_offset - w.dw_offset, partial);
      EXPECT_GE(w.coef_offset - w.db_offset, partial);
      EXPECT_GE(w.total_bytes - w.coef_offset, static_cast<std::size_t>(rows) * 16 + 256);
      EXPECT_EQ(w.db_offset % 256, 0u);
      EXPECT_EQ(w.coef_offset % 256, 0u);
      EXPECT_EQ(backward_workspace_bytes_for(rows, cols), w.total_bytes);
    }
  }
}

}  // namespace
}  // namespace fusednorm::cuda
