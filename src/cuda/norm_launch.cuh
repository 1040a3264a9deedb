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

template <typename V>
struct VariantTag {
  using type = V;
};

// Every launcher and occupancy query below goes through the with_*_kernel functions: the one
// place that maps a plan and a call's variant to a kernel instantiation and its launch shape.
// They call fn(kernel, grid, block, dynamic shared memory, cluster size, the kernel's
// arguments after the BackwardArgs / ForwardArgs...), so the planner's occupancy question
// (ResidentCtas) is answered for the kernel that then runs.

// ---- Forward ---------------------------------------------------------------------------

template <typename T, typename V, typename Fn>
cudaError_t with_forward_kernel(const LaunchPlan& plan, const ForwardArgs& a, Fn&& fn) {
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
          if constexpr (V::kQuant) {
            if (plan.quant_register_cap) {
              return fn(norm_forward_register_capped_kernel<T, kVec, decltype(k)::value, V>, grid,
                        block, std::int64_t{0}, 1, groups);
            }
          }
          return fn(norm_forward_register_kernel<T, kVec, decltype(k)::value, V>, grid, block,
                    std::int64_t{0}, 1, groups);
        });
      }
      case KernelKind::kSmemRow:
      case KernelKind::kClusterRow:  // cluster_size is 1 for kSmemRow
        return fn(plan.kind == KernelKind::kSmemRow
                      ? norm_forward_row_kernel<T, kVec, V, RowStorage::kSmem>
                      : norm_forward_row_kernel<T, kVec, V, RowStorage::kCluster>,
                  grid, dim3(plan.team_threads), plan.smem_bytes, plan.cluster_size,
                  plan.slice_vecs);
      case KernelKind::kTwoPass:
        return fn(norm_forward_row_kernel<T, kVec, V, RowStorage::kGlobal>, grid,
                  dim3(plan.team_threads), std::int64_t{0}, 1, a.cols / kVec);
    }
    return cudaErrorInvalidConfiguration;
  });
}

// Calls fn(VariantTag<ForwardVariant<...>>) for the call's variant of the y-storing forward.
template <typename Fn>
cudaError_t with_forward_variant(const ForwardArgs& a, Fn&& fn) {
  const bool w = a.weight != nullptr, b = a.bias != nullptr;
  if (a.centered) {
    if (w && b) return fn(VariantTag<ForwardVariant<true, false, true, true>>{});
    if (w) return fn(VariantTag<ForwardVariant<true, false, true, false>>{});
    if (b) return fn(VariantTag<ForwardVariant<true, false, false, true>>{});
    return fn(VariantTag<ForwardVariant<true, false, false, false>>{});
  }
  if (a.residual != nullptr) {
    if (w) return fn(VariantTag<ForwardVariant<false, true, true, false>>{});
    return fn(VariantTag<ForwardVariant<false, true, false, false>>{});
  }
  if (w) return fn(VariantTag<ForwardVariant<false, false, true, false>>{});
  return fn(VariantTag<ForwardVariant<false, false, false, false>>{});
}

// The quantized RMSNorm forward's variants (a.quant.q set).
template <typename Fn>
cudaError_t with_forward_quant_variant(const ForwardArgs& a, Fn&& fn) {
  const bool w = a.weight != nullptr;
  if (a.residual != nullptr) {
    if (w) return fn(VariantTag<ForwardVariant<false, true, true, false, true>>{});
    return fn(VariantTag<ForwardVariant<false, true, false, false, true>>{});
  }
  if (w) return fn(VariantTag<ForwardVariant<false, false, true, false, true>>{});
  return fn(VariantTag<ForwardVariant<false, false, false, false, true>>{});
}

// fn for with_*_kernel: launches the kernel on the stream with the call's arguments.
template <typename Args>
auto launch_with(const Args& a, cudaStream_t stream) {
  return [&a, stream](auto kernel, dim3 grid, dim3 block, std::int64_t smem, int cluster_size,
                      auto... extra) {
    return launch_kernel(kernel, grid, block, smem, cluster_size, stream, a, extra...);
  };
}

// fn for with_*_kernel: the kernel's resident CTAs per SM (launch_util.cuh's cached query).
inline auto resident_ctas_of(int device, int& count) {
  return [device, &count](auto kernel, dim3, dim3 block, std::int64_t smem, int, auto...) {
    return resident_ctas_per_sm(kernel, device, static_cast<int>(block.x * block.y * block.z), smem,
                                count);
  };
}

template <typename T>
cudaError_t launch_forward(const LaunchPlan& plan, const ForwardArgs& a, cudaStream_t stream) {
  return with_forward_variant(a, [&](auto v) {
    return with_forward_kernel<T, typename decltype(v)::type>(plan, a, launch_with(a, stream));
  });
}

template <typename T>
cudaError_t forward_resident_ctas(const LaunchPlan& plan, const ForwardArgs& a, int device,
                                  int& count) {
  return with_forward_variant(a, [&](auto v) {
    return with_forward_kernel<T, typename decltype(v)::type>(plan, a,
                                                              resident_ctas_of(device, count));
  });
}

// Instantiated in forward_quant_<dtype>.cu, so that the y-storing forward's build is unchanged.
template <typename T>
cudaError_t launch_forward_quant(const LaunchPlan& plan, const ForwardArgs& a,
                                 cudaStream_t stream) {
  return with_forward_quant_variant(a, [&](auto v) {
    return with_forward_kernel<T, typename decltype(v)::type>(plan, a, launch_with(a, stream));
  });
}

template <typename T>
cudaError_t forward_quant_resident_ctas(const LaunchPlan& plan, const ForwardArgs& a, int device,
                                        int& count) {
  return with_forward_quant_variant(a, [&](auto v) {
    return with_forward_kernel<T, typename decltype(v)::type>(plan, a,
                                                              resident_ctas_of(device, count));
  });
}

// ---- Backward --------------------------------------------------------------------------

// `which`: the plan's row kernel, or the kTwoPass column-tile kernel (launched only when dw or
// db is wanted: for dx alone it is never instantiated, and its question is answered with the
// coefficient kernel, whose grid the plan then sizes alone).
template <typename T, typename V, typename Fn>
cudaError_t with_backward_kernel(const LaunchPlan& plan, PlannedKernel which, const BackwardArgs& a,
                                 Fn&& fn) {
  constexpr int kFull = full_vector(sizeof(T));
  const dim3 grid(static_cast<unsigned>(plan.grid));
  return with_int<1, kFull>(plan.vec, [&](auto vec) -> cudaError_t {
    constexpr int kVec = decltype(vec)::value;
    if (plan.kind == KernelKind::kTwoPass) {
      if constexpr (!V::kAccumulate) {
        // dx only: three passes over each row in one kernel, no workspace.
        return fn(norm_backward_coef_kernel<T, kVec, V, true>, grid, dim3(kCoefThreads),
                  std::int64_t{0}, 1);
      } else {
        if (which == PlannedKernel::kRows) {
          return fn(norm_backward_coef_kernel<T, kVec, V, false>, grid, dim3(kCoefThreads),
                    std::int64_t{0}, 1);
        }
        const dim3 tiles(static_cast<unsigned>(plan.col_tiles), static_cast<unsigned>(plan.row_blocks));
        return fn(norm_backward_tile_kernel<T, kVec, V>, tiles, dim3(kTileThreads), std::int64_t{0},
                  1, plan.rows_per_block);
      }
    }
    if (plan.kind == KernelKind::kSmemRow || plan.kind == KernelKind::kClusterRow) {
      const auto kernel = plan.kind == KernelKind::kSmemRow
                              ? norm_backward_row_kernel<T, kVec, V, RowStorage::kSmem, true>
                          : plan.staged_inputs ? norm_backward_row_kernel<T, kVec, V, RowStorage::kCluster, true>
                                               : norm_backward_row_kernel<T, kVec, V, RowStorage::kCluster, false>;
      return fn(kernel, grid, dim3(plan.team_threads), plan.smem_bytes, plan.cluster_size,
                plan.slice_vecs);
    }
    const std::int64_t groups = ceil_div64(a.rows, plan.rows_per_cta);
    const dim3 block(plan.team_threads, plan.rows_per_cta);
    return with_int<1, 2, 4>(plan.vecs_per_thread, [&](auto k) -> cudaError_t {
      constexpr int kK = decltype(k)::value;
      constexpr int kAccumulators = int{V::kDw} + int{V::kDb};
      if constexpr (kK <= backward_max_vecs_per_thread(kAccumulators, kVec)) {
        return fn(norm_backward_register_kernel<T, kVec, kK, V>, grid, block, plan.smem_bytes, 1,
                  groups);
      } else {
        return cudaErrorInvalidConfiguration;  // never planned (too many registers)
      }
    });
  });
}

// Calls fn(VariantTag<BackwardVariant<...>>) for the call's variant.
template <typename Fn>
cudaError_t with_backward_variant(const BackwardArgs& a, Fn&& fn) {
  const bool w = a.weight != nullptr;
  const bool acc = a.dw_partial != nullptr || a.db_partial != nullptr;
  if (a.centered) {
    if (w) {
      return acc ? fn(VariantTag<BackwardVariant<true, true, true>>{})
                 : fn(VariantTag<BackwardVariant<true, true, false>>{});
    }
    return acc ? fn(VariantTag<BackwardVariant<true, false, true>>{})
               : fn(VariantTag<BackwardVariant<true, false, false>>{});
  }
  if (a.dx_addend != nullptr) {
    if (w) {
      return acc ? fn(VariantTag<BackwardVariant<false, true, true, true>>{})
                 : fn(VariantTag<BackwardVariant<false, true, false, true>>{});
    }
    return fn(VariantTag<BackwardVariant<false, false, false, true>>{});
  }
  if (w) {
    return acc ? fn(VariantTag<BackwardVariant<false, true, true>>{})
               : fn(VariantTag<BackwardVariant<false, true, false>>{});
  }
  return fn(VariantTag<BackwardVariant<false, false, false>>{});
}

template <typename T>
cudaError_t launch_backward(const LaunchPlan& plan, const BackwardArgs& a,
                            const BackwardOutputs& out, cudaStream_t stream) {
  return with_backward_variant(a, [&](auto v) -> cudaError_t {
    using V = typename decltype(v)::type;
    cudaError_t err =
        with_backward_kernel<T, V>(plan, PlannedKernel::kRows, a, launch_with(a, stream));
    if (err != cudaSuccess || !V::kAccumulate) return err;
    if (plan.kind == KernelKind::kTwoPass) {
      err = with_backward_kernel<T, V>(plan, PlannedKernel::kTile, a, launch_with(a, stream));
      if (err != cudaSuccess) return err;
    }
    if (out.dw != nullptr) {
      err = launch_finish(plan, a.dw_partial, a.cols, out.dw, out.dw_dtype, stream);
      if (err != cudaSuccess) return err;
    }
    if (out.db != nullptr)
      return launch_finish(plan, a.db_partial, a.cols, out.db, out.db_dtype, stream);
    return cudaSuccess;
  });
}

template <typename T>
cudaError_t backward_resident_ctas(const LaunchPlan& plan, PlannedKernel which,
                                   const BackwardArgs& a, int device, int& count) {
  return with_backward_variant(a, [&](auto v) {
    return with_backward_kernel<T, typename decltype(v)::type>(plan, which, a,
                                                               resident_ctas_of(device, count));
  });
}

}  // namespace fusednorm::cuda
