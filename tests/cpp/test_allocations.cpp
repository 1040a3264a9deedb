// The forward operators allocate nothing once warmed up (issue 8: inference engines call them
// once per layer and token). Every operator new of the process is counted while a call runs:
// its own executable, since replacing the global operator new would take the sanitizers'
// checks of new / delete away from the main suite.
#include <atomic>
#include <cstdlib>
#include <new>

#include "test_util.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<long> allocations{0};

void* counted(std::size_t size, std::size_t alignment) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1);
  if (size == 0) size = 1;
  void* p = alignment > alignof(std::max_align_t)
                ? std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment)
                : std::malloc(size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return counted(size, 0); }
void* operator new[](std::size_t size) { return counted(size, 0); }
void* operator new(std::size_t size, std::align_val_t a) {
  return counted(size, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t size, std::align_val_t a) {
  return counted(size, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace fusednorm::test {
namespace {

// Allocations made by the second of two identical calls (the first may grow the library's
// per-thread buffers and start the thread pool).
template <typename Call>
long allocations_when_warm(Call call) {
  call();
  allocations = 0;
  counting = true;
  call();
  counting = false;
  return allocations.load();
}

class ForwardAllocations : public ::testing::TestWithParam<DType> {};

TEST_P(ForwardAllocations, NoneOnceWarm) {
  const DType dtype = GetParam();
  for (const std::int64_t rows : {1, 3, 64}) {
    for (const std::int64_t cols : {128, 4096}) {
      for (const int threads : {1, 2}) {
        SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", " << threads
                                          << " threads, " << dtype_str(dtype));
        Rng rng(seed_for(current_test_name(), static_cast<int>(rows * cols)));
        Buffer x(dtype, rows, cols), y(dtype, rows, cols), residual(dtype, rows, cols);
        fill_activations(x, rng, true);
        fill_activations(residual, rng, false);
        const Buffer w = make_weight(WeightKind::kSame, dtype, cols, rng, 1.0);
        const Buffer b = make_weight(WeightKind::kSame, dtype, cols, rng, 0.0);
        std::vector<float> mean(rows), rstd(rows), scales(rows);
        std::vector<signed char> q(static_cast<std::size_t>(rows * cols));
        const Matrix q_view{q.data(), DType::kInt8, rows, cols, cols};
        Context ctx;
        ctx.num_threads = threads;
        RmsNormOptions gemma;
        gemma.weight_offset = 1.0f;
        EXPECT_EQ(0, allocations_when_warm([&] {
                    rms_norm(ctx, x.cmatrix(), w.cvector(), y.matrix(), rstd.data(), gemma);
                  }))
            << "rms_norm";
        EXPECT_EQ(0, allocations_when_warm([&] {
                    layer_norm(ctx, x.cmatrix(), w.cvector(), b.cvector(), y.matrix(), mean.data(),
                               rstd.data());
                  }))
            << "layer_norm";
        EXPECT_EQ(0, allocations_when_warm([&] {
                    fused_add_rms_norm(ctx, x.cmatrix(), residual.matrix(), w.cvector(), y.matrix(),
                                       rstd.data());
                  }))
            << "fused_add_rms_norm";
        EXPECT_EQ(0, allocations_when_warm([&] {
                    QuantScale scale;
                    scale.row_scales = scales.data();
                    rms_norm_quant(ctx, x.cmatrix(), w.cvector(), q_view, scale);
                  }))
            << "rms_norm_quant dynamic int8";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ForwardAllocations, ::testing::ValuesIn(kAllDTypes),
                         dtype_param_name);

}  // namespace
}  // namespace fusednorm::test
