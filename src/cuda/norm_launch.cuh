// Definitions of the host launchers declared in launchers.h: from the plan and the call's
// variant to one kernel instantiation. Included by the per-dtype instantiation files only.
#pragma once

#include <cstdint>

#include "cuda/launch_util.cuh"
#include "cuda/launchers.h"
#include "cuda/norm_backward.cuh"
#include "cuda/norm_forward.cuh"

namespace fusednorm::cuda {

inline std::int64_t ceil_div64(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---- Forward ---------------------------------------------------------------------------

template <typename T, typename V>
cudaError_t launch_forward_variant(const LaunchPlan& plan, const ForwardArgs& a, cudaStream_t stream) {
  constexpr int kFull = full_vector(sizeof(T));
  const dim3 grid(static_cast<unsigned>(plan.grid));
  return with_int<1, kFull>(plan.vec, [&](auto vec) -> cudaError_t {
    constexpr int kVec = decltype(vec)::value;
    switch (plan.kind) {
      case KernelKind::kRowsPerCta:
      case KernelKind::kRegisterRow: {
        const std::int64_t groups = ceil_div64(a.rows, plan.rows_per_cta);
        const dim3 block(plan.team_threads, plan.rows_per_cta);
        return with_int<1, 2, 4>(plan.vecs_per_thread, [&](auto k) {
          return launch_kernel(norm_forward_register_kernel<T, kVec, decltype(k)::value, V>, grid, block,
                               0, 1, stream, a, groups);
        });
      }
      case KernelKind::kSmemRow:
      case KernelKind::kClusterRow:  // cluster_size is 1 for kSmemRow
        return launch_kernel(plan.kind == KernelKind::kSmemRow
                                 ? norm_forward_row_kernel<T, kVec, V, RowStorage::kSmem>
                                 : norm_forward_row_kernel<T, kVec, V, RowStorage::kCluster>,
                             grid, dim3(plan.team_threads), plan.smem_bytes, plan.cluster_size, stream, a,
                             plan.slice_vecs);
      case KernelKind::kTwoPass:
        return launch_kernel(norm_forward_row_kernel<T, kVec, V, RowStorage::kGlobal>, grid,
                             dim3(plan.team_threads), 0, 1, stream, a, a.cols / kVec);
    }
    return cudaErrorInvalidConfiguration;
  });
}

template <typename T>
cudaError_t launch_forward(const LaunchPlan& plan, const ForwardArgs& a, cudaStream_t stream) {
  const bool w = a.weight != nullptr, b = a.bias != nullptr;
  if (a.centered) {
    if (w && b) return launch_forward_variant<T, ForwardVariant<true, false, true, true>>(plan, a, stream);
    if (w) return launch_forward_variant<T, ForwardVariant<true, false, true, false>>(plan, a, stream);
    if (b) return launch_forward_variant<T, ForwardVariant<true, false, false, true>>(plan, a, stream);
    return launch_forward_variant<T, ForwardVariant<true, false, false, false>>(plan, a, stream);
  }
  if (a.residual != nullptr) {
    if (w) return launch_forward_variant<T, ForwardVariant<false, true, true, false>>(plan, a, stream);
    return launch_forward_variant<T, ForwardVariant<false, true, false, false>>(plan, a, stream);
  }
  if (w) return launch_forward_variant<T, ForwardVariant<false, false, true, false>>(plan, a, stream);
  return launch_forward_variant<T, ForwardVariant<false, false, false, false>>(plan, a, stream);
}

// The quantized RMSNorm forward (a.quant.q set): its own launcher, instantiated in
// forward_quant_<dtype>.cu, so that the y-storing forward's build is unchanged.
template <typename T>
cudaError_t launch_forward_quant(const LaunchPlan& plan, const ForwardArgs& a, cudaStream_t stream) {
  const bool w = a.weight != nullptr;
  if (a.residual != nullptr) {
    if (w) return launch_forward_variant<T, ForwardVariant<false, true, true, false, true>>(plan, a, stream);
    return launch_forward_variant<T, ForwardVariant<false, true, false, false, true>>(plan, a, stream);
  }
  if (w) return launch_forward_variant<T, ForwardVariant<false, false, true, false, true>>(plan, a, stream);
  return launch_forward_variant<T, ForwardVariant<false, false, false, false, true>>(plan, a, stream);
}

// ---- Backward --------------------------------------------------------------------------

template <typename T, typename V>
cudaError_t launch_backward_variant(const LaunchPlan& plan, const BackwardArgs& a,
                                    const BackwardOutputs& out, cudaStream_t stream) {
  constexpr int kFull = full_vector(sizeof(T));
  const cudaError_t err = with_int<1, kFull>(plan.vec, [&](auto vec) -> cudaError_t {
    constexpr int kVec = decltype(vec)::value;
    if (plan.kind == KernelKind::kTwoPass) {
      const dim3 coef_grid(static_cast<unsigned>(plan.grid));
      if constexpr (!V::kAccumulate) {
        // dx only: three passes over each row in one kernel, no workspace.
        return launch_kernel(norm_backward_coef_kernel<T, kVec, V, true>, coef_grid, dim3(kCoefThreads),
                             0, 1, stream, a);
      } else {
        const cudaError_t e = launch_kernel(norm_backward_coef_kernel<T, kVec, V, false>, coef_grid,
                                            dim3(kCoefThreads), 0, 1, stream, a);
        if (e != cudaSuccess) return e;
        const dim3 tiles(static_cast<unsigned>(plan.col_tiles), static_cast<unsigned>(plan.row_blocks));
        return launch_kernel(norm_backward_tile_kernel<T, kVec, V>, tiles, dim3(kTileThreads), 0, 1,
                             stream, a, plan.rows_per_block);
      }
    }
    if (plan.kind == KernelKind::kSmemRow || plan.kind == KernelKind::kClusterRow) {
      const auto kernel = plan.kind == KernelKind::kSmemRow
                              ? norm_backward_row_kernel<T, kVec, V, RowStorage::kSmem, true>
                          : plan.staged_inputs ? norm_backward_row_kernel<T, kVec, V, RowStorage::kCluster, true>
                                               : norm_backward_row_kernel<T, kVec, V, RowStorage::kCluster, false>;
      return launch_kernel(kernel, dim3(static_cast<unsigned>(plan.grid)), dim3(plan.team_threads), plan.smem_bytes,
                           plan.cluster_size, stream, a, plan.slice_vecs);
    }
    const std::int64_t groups = ceil_div64(a.rows, plan.rows_per_cta);
    const dim3 block(plan.team_threads, plan.rows_per_cta);
    return with_int<1, 2, 4>(plan.vecs_per_thread, [&](auto k) -> cudaError_t {
      constexpr int kK = decltype(k)::value;
      constexpr int kAccumulators = int{V::kDw} + int{V::kDb};
      if constexpr (kK <= backward_max_vecs_per_thread(kAccumulators, kVec)) {
        return launch_kernel(norm_backward_register_kernel<T, kVec, kK, V>,
                             dim3(static_cast<unsigned>(plan.grid)), block, plan.smem_bytes, 1, stream,
                             a, groups);
      } else {
        return cudaErrorInvalidConfiguration;  // never planned (too many registers)
      }
    });
  });
  if (err != cudaSuccess || !V::kAccumulate) return err;
  if (out.dw != nullptr) {
    const cudaError_t e = launch_finish(plan, a.dw_partial, a.cols, out.dw, out.dw_dtype, stream);
    if (e != cudaSuccess) return e;
  }
  if (out.db != nullptr) return launch_finish(plan, a.db_partial, a.cols, out.db, out.db_dtype, stream);
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_backward(const LaunchPlan& plan, const BackwardArgs& a, const BackwardOutputs& out,
                            cudaStream_t stream) {
  const bool w = a.weight != nullptr;
  const bool acc = a.dw_partial != nullptr || a.db_partial != nullptr;
  if (a.centered) {
    if (w) {
      return acc ? launch_backward_variant<T, BackwardVariant<true, true, true>>(plan, a, out, stream)
                 : launch_backward_variant<T, BackwardVariant<true, true, false>>(plan, a, out, stream);
    }
    return acc ? launch_backward_variant<T, BackwardVariant<true, false, true>>(plan, a, out, stream)
               : launch_backward_variant<T, BackwardVariant<true, false, false>>(plan, a, out, stream);
  }
  if (a.dx_addend != nullptr) {
    if (w) {
      return acc ? launch_backward_variant<T, BackwardVariant<false, true, true, true>>(plan, a, out, stream)
                 : launch_backward_variant<T, BackwardVariant<false, true, false, true>>(plan, a, out, stream);
    }
    return launch_backward_variant<T, BackwardVariant<false, false, false, true>>(plan, a, out, stream);
  }
  if (w) {
    return acc ? launch_backward_variant<T, BackwardVariant<false, true, true>>(plan, a, out, stream)
               : launch_backward_variant<T, BackwardVariant<false, true, false>>(plan, a, out, stream);
  }
  return launch_backward_variant<T, BackwardVariant<false, false, false>>(plan, a, out, stream);
}

}  // namespace fusednorm::cuda
