// The CPU backend: threads, row blocking and the deterministic reductions around the
// per-row SIMD kernels of row_kernels.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.h"

namespace fusednorm::cpu {

void forward(const detail::ForwardProblem& problem, int num_threads);
void backward(const detail::BackwardProblem& problem, int num_threads);
std::size_t backward_workspace_bytes(std::int64_t rows, std::int64_t cols);

// Row sums are accumulated in chunks of this many elements, and the chunk sums are added
// in column order. The chunking is fixed, never derived from the thread count, so a row
// split across threads and a row done by one thread give the same bits.
constexpr std::int64_t kReduceChunk = 4096;

// dw / db are summed over rows in blocks: block b's partial is a sequential sum over its
// rows, and the partials are added in block order. The blocks depend on the row count
// only, so dw is bit-identical for any thread count.
struct RowBlocks {
  std::int64_t count;
  std::int64_t rows_per_block;
};
RowBlocks row_blocks(std::int64_t rows);

// Rows are split across threads only when there are at most this many (the split path keeps
// its per-row state on the stack).
constexpr std::int64_t kMaxSplitRows = 64;

// How a call is spread over threads (exposed for tests and the benchmark's report).
struct ThreadPlan {
  int threads;      // threads actually used
  bool split_rows;  // few long rows: threads share each row's chunks instead of whole rows
};
ThreadPlan plan_threads(std::int64_t rows, std::int64_t cols, std::size_t bytes_moved,
                        int requested_threads);

// Whether no page of [data, data + bytes) is resident yet, judged from a few sampled pages
// (mincore; false off Linux): memory just mapped for an output, as
// glibc's malloc maps large allocations (a fresh torch.empty). Its pages are mapped on the
// first store, zeroed through the cache, so a large output there is written with ordinary
// stores instead of non-temporal ones, unless it may be on huge pages (exposed for tests).
bool untouched_memory(const void* data, std::size_t bytes);

// Asks for transparent huge pages (madvise(MADV_HUGEPAGE)) over the whole huge pages inside
// [data, data + bytes), where THP is in "madvise" mode and FUSEDNORM_HUGE_PAGES is not "0";
// returns whether the advice was given and taken. The backend gives it for a large fresh
// output before writing it (exposed for tests).
bool advise_huge_pages(void* data, std::size_t bytes);

}  // namespace fusednorm::cpu
