// The CPU emulation of the CUDA runtime declared in include/cuda_runtime.h: launches, the
// fiber scheduler of a CTA, barriers, warp shuffles, clusters, streams and graph capture.
#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64 (tests/cuda_emu/CMakeLists.txt)"
#endif

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cooperative_groups.h"
#include "cuda_runtime.h"
#include "emu_internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FUSEDNORM_EMU_ASAN 1
#endif

thread_local uint3 threadIdx{0, 0, 0};
thread_local uint3 blockIdx{0, 0, 0};
thread_local dim3 blockDim;
thread_local dim3 gridDim;

struct CUstream_st {
  bool capturing = false;
  std::vector<std::function<void()>> recorded;
};
struct CUgraph_st {
  std::vector<std::function<void()>> operations;
};

namespace cuda_emu {

namespace {

// The emulated device: an H200's per-SM and per-CTA limits with few SMs, so that the
// persistent kernels loop over rows (FUSEDNORM_EMU_SMS overrides the count).
constexpr int kMaxThreadsPerCta = 1024;
constexpr int kMaxThreadsPerSm = 2048;
constexpr int kSmemPerCtaOptin = 227 * 1024;
constexpr int kSmemPerSm = 228 * 1024;
constexpr int kDefaultDynamicSmem = 48 * 1024;
constexpr unsigned kMaxClusterSize = 8;
constexpr std::size_t kFiberStackBytes = 256 * 1024;
constexpr unsigned char kSmemGarbage = 0xff;  // uninitialized shared memory reads as NaN
constexpr unsigned char kSmemCanary = 0xa5;    // past the launch's dynamic shared memory

// The order in which the scheduler resumes a CTA's threads in each pass:
// FUSEDNORM_EMU_SCHEDULE=reverse runs them from the last to the first. A missing barrier
// between one thread's write and another's read goes unseen when the writer happens to run
// first; one of the two orders runs the reader first.
bool reverse_schedule() {
  static const bool reverse = [] {
    const char* env = std::getenv("FUSEDNORM_EMU_SCHEDULE");
    return env != nullptr && std::string(env) == "reverse";
  }();
  return reverse;
}

int sm_count() {
  const char* env = std::getenv("FUSEDNORM_EMU_SMS");
  const int n = env != nullptr ? std::atoi(env) : 0;
  return n > 0 ? n : 4;
}

[[noreturn]] void fatal(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::fputs("cuda_emu: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::fflush(stderr);
  std::abort();
}

// ---- Fiber stacks and the context switch ---------------------------------------------------
//
// A switch saves the callee-saved registers on the current stack, stores the stack pointer,
// loads the other one and restores its registers: the System V x86-64 calling convention
// makes everything else caller-saved. (glibc's swapcontext also saves the signal mask with
// a system call per switch, which made the emulated suite ten times slower.)
extern "C" void fusednorm_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl fusednorm_emu_switch
  .type fusednorm_emu_switch, @function
fusednorm_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fusednorm_emu_switch, .-fusednorm_emu_switch
)");

// Stacks for a CTA's fibers, reused across CTAs (mapping and first-touching them per CTA
// dominated small launches). Blocks of kMaxThreadsPerCta stacks; a cluster holds one per CTA.
class StackPool {
 public:
  static constexpr std::size_t kBlockBytes = std::size_t{kMaxThreadsPerCta} * kFiberStackBytes;
  char* take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        char* block = free_.back();
        free_.pop_back();
        return block;
      }
    }
    void* block = mmap(nullptr, kBlockBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (block == MAP_FAILED) fatal("cannot map %zu bytes of fiber stacks", kBlockBytes);
    return static_cast<char*>(block);
  }
  void give_back(char* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(block);
  }

 private:
  std::mutex mutex_;
  std::vector<char*> free_;
};
StackPool stack_pool;

thread_local cudaError_t last_error = cudaSuccess;
cudaError_t fail(cudaError_t err) {
  last_error = err;
  return err;
}

// ---- A cluster's OS-level barrier and its CTAs' shared-memory anchors --------------------

thread_local char shared_anchor;  // every OS thread's static TLS has the same layout

struct ClusterRun {
  explicit ClusterRun(unsigned n) : size(n), anchors(n, nullptr) {}
  unsigned size;
  std::vector<char*> anchors;  // per rank: &shared_anchor in that CTA's OS thread
  std::mutex mutex;
  std::condition_variable changed;
  unsigned arrived = 0;
  std::uint64_t generation = 0;

  void os_barrier(const char* what) {
    std::unique_lock<std::mutex> lock(mutex);
    const std::uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      changed.notify_all();
      return;
    }
    if (!changed.wait_for(lock, std::chrono::seconds(300), [&] { return generation != gen; })) {
      fatal("%s: a CTA of the cluster never arrived (deadlock)", what);
    }
  }
};

// ---- One CTA: its GPU threads as fibers on one OS thread ----------------------------------

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  char* stack = nullptr;
  uint3 tid{0, 0, 0};
  bool done = false;
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while switched out
};

struct Warp {
  unsigned arrived = 0;
  unsigned generation = 0;
  float values[32];
};

struct CtaRun {
  dim3 grid, block;
  uint3 bid{0, 0, 0};
  unsigned threads = 0;
  const std::function<void()>* body = nullptr;
  ClusterRun* cluster = nullptr;
  unsigned rank = 0;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  void* scheduler_sp = nullptr;
  const void* scheduler_stack = nullptr;
  std::size_t scheduler_stack_size = 0;
  unsigned bar_arrived = 0, bar_generation = 0;
  unsigned cluster_arrived = 0, cluster_generation = 0;
  std::vector<Warp> warps;
  std::uint64_t progress = 0;  // barrier arrivals and releases, finished threads
};

thread_local CtaRun* current_cta = nullptr;

CtaRun& cta() {
  if (current_cta == nullptr || current_cta->current == nullptr) fatal("device function called outside a kernel");
  return *current_cta;
}

void yield_to_scheduler() {
  CtaRun& c = *current_cta;
  Fiber* f = c.current;
#ifdef FUSEDNORM_EMU_ASAN
  __sanitizer_start_switch_fiber(&f->fake_stack, c.scheduler_stack, c.scheduler_stack_size);
#endif
  fusednorm_emu_switch(&f->sp, c.scheduler_sp);
#ifdef FUSEDNORM_EMU_ASAN
  __sanitizer_finish_switch_fiber(f->fake_stack, &c.scheduler_stack, &c.scheduler_stack_size);
#endif
}

// Where a new fiber's first switch lands; it never returns (the scheduler does not switch
// to a finished fiber again).
[[noreturn]] void fiber_main() {
  CtaRun& c = *current_cta;
#ifdef FUSEDNORM_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &c.scheduler_stack, &c.scheduler_stack_size);
#endif
  (*c.body)();
  c.current->done = true;
  ++c.progress;
#ifdef FUSEDNORM_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, c.scheduler_stack, c.scheduler_stack_size);
#endif
  void* unused = nullptr;
  fusednorm_emu_switch(&unused, c.scheduler_sp);
  fatal("a finished GPU thread was resumed");
}

// The initial stack of a fiber, as fusednorm_emu_switch expects to find it: six saved
// registers, then fiber_main as the return address, placed so that fiber_main starts with
// the stack alignment of a called function (rsp + 8 a multiple of 16).
void* initial_stack(char* stack) {
  auto* top = reinterpret_cast<std::uintptr_t*>(stack + kFiberStackBytes);  // 16-byte aligned
  *--top = 0;                                                  // alignment slot
  *--top = reinterpret_cast<std::uintptr_t>(&fiber_main);      // return address
  for (int i = 0; i < 6; ++i) *--top = 0;                      // rbp rbx r12 r13 r14 r15
  return top;
}

// Arrives at a barrier of `expected` threads (counter / generation pair) and waits until all
// have arrived. The last to arrive runs before_release (if any) before releasing the others.
void barrier(CtaRun& c, unsigned& arrived, unsigned& generation, unsigned expected,
             const std::function<void()>& before_release = {}) {
  const unsigned gen = generation;
  ++c.progress;
  if (++arrived == expected) {
    arrived = 0;
    if (before_release) before_release();
    ++generation;
    return;
  }
  while (generation == gen) yield_to_scheduler();
}

void run_cta(CtaRun& c) {
  current_cta = &c;
  blockIdx = c.bid;
  blockDim = c.block;
  gridDim = c.grid;
  char* stacks = stack_pool.take();
#ifdef FUSEDNORM_EMU_ASAN
  // A finished fiber leaves its frames' redzones poisoned on the stack it is handed back with.
  ASAN_UNPOISON_MEMORY_REGION(stacks, c.threads * kFiberStackBytes);
#endif
  c.fibers.resize(c.threads);
  c.warps.resize((c.threads + 31) / 32);
  for (unsigned t = 0; t < c.threads; ++t) {
    Fiber& f = c.fibers[t];
    f.tid = {t % c.block.x, (t / c.block.x) % c.block.y, t / (c.block.x * c.block.y)};
    f.stack = stacks + t * kFiberStackBytes;
    f.sp = initial_stack(f.stack);
  }
  for (;;) {
    bool alive = false;
    const std::uint64_t before = c.progress;
    for (unsigned i = 0; i < c.threads; ++i) {
      Fiber& f = c.fibers[reverse_schedule() ? c.threads - 1 - i : i];
      if (f.done) continue;
      alive = true;
      c.current = &f;
      threadIdx = f.tid;
#ifdef FUSEDNORM_EMU_ASAN
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, f.stack, kFiberStackBytes);
#endif
      fusednorm_emu_switch(&c.scheduler_sp, f.sp);
#ifdef FUSEDNORM_EMU_ASAN
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    }
    if (!alive) break;
    if (c.progress == before) {
      unsigned waiting = 0;
      for (const Fiber& f : c.fibers) waiting += f.done ? 0 : 1;
      fatal("deadlock in CTA (%u, %u, %u): %u of %u threads wait at a barrier (or shuffle) that the others "
            "never reach",
            c.bid.x, c.bid.y, c.bid.z, waiting, c.threads);
    }
  }
  c.current = nullptr;
  current_cta = nullptr;
  stack_pool.give_back(stacks);
}

// Runs one CTA on the calling OS thread with `smem` bytes of dynamic shared memory: garbage
// in it, and a canary in the kCanaryBytes after it that must survive (in ASan builds the
// whole rest of the array is poisoned instead).
constexpr std::size_t kCanaryBytes = 4096;

void run_cta_with_smem(CtaRun& c, std::size_t smem) {
  const auto arrays = dynamic_smem_arrays();
  for (const DynamicSmemArray& a : arrays) {
    if (smem > a.capacity) fatal("dynamic shared memory of %zu bytes exceeds the emulation's %zu", smem, a.capacity);
    std::memset(a.address(), kSmemGarbage, smem);
    std::memset(a.address() + smem, kSmemCanary, std::min(kCanaryBytes, a.capacity - smem));
#ifdef FUSEDNORM_EMU_ASAN
    ASAN_POISON_MEMORY_REGION(a.address() + smem, a.capacity - smem);
#endif
  }
  if (c.cluster != nullptr) c.cluster->anchors[c.rank] = &shared_anchor;
  if (c.cluster != nullptr) c.cluster->os_barrier("cluster start");
  run_cta(c);
  // No CTA's storage may go away while another of its cluster can still map it.
  if (c.cluster != nullptr) c.cluster->os_barrier("cluster end");
  for (const DynamicSmemArray& a : arrays) {
#ifdef FUSEDNORM_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(a.address() + smem, a.capacity - smem);
#endif
    const std::size_t canary = std::min(kCanaryBytes, a.capacity - smem);
    for (std::size_t i = 0; i < canary; ++i) {
      if (static_cast<unsigned char>(a.address()[smem + i]) != kSmemCanary) {
        fatal("CTA (%u, %u, %u) wrote shared memory at byte %zu, past the launch's %zu bytes", c.bid.x, c.bid.y,
              c.bid.z, smem + i, smem);
      }
    }
  }
}

// ---- Launch bookkeeping ------------------------------------------------------------------

std::mutex attribute_mutex;
std::map<const void*, int> max_dynamic_smem;
int capturing_streams = 0;

void execute(const cudaLaunchConfig_t& config, unsigned cluster_size, const std::function<void()>& body) {
  const dim3 grid = config.gridDim;
  const unsigned threads = config.blockDim.x * config.blockDim.y * config.blockDim.z;
  auto make = [&](unsigned x, unsigned y, unsigned z) {
    CtaRun c;
    c.grid = grid;
    c.block = config.blockDim;
    c.bid = {x, y, z};
    c.threads = threads;
    c.body = &body;
    return c;
  };
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x0 = 0; x0 < grid.x; x0 += cluster_size) {
        if (cluster_size == 1) {
          CtaRun c = make(x0, y, z);
          run_cta_with_smem(c, config.dynamicSmemBytes);
          continue;
        }
        ClusterRun cluster(cluster_size);
        std::vector<std::thread> workers;
        for (unsigned r = 0; r < cluster_size; ++r) {
          workers.emplace_back([&, r] {
            CtaRun c = make(x0 + r, y, z);
            c.cluster = &cluster;
            c.rank = r;
            run_cta_with_smem(c, config.dynamicSmemBytes);
          });
        }
        for (std::thread& w : workers) w.join();
      }
    }
  }
}

}  // namespace

// ---- Device-side entry points ------------------------------------------------------------

void syncthreads() {
  CtaRun& c = cta();
  barrier(c, c.bar_arrived, c.bar_generation, c.threads);
}

float shfl_xor(unsigned mask, float value, int lane_mask) {
  CtaRun& c = cta();
  if (mask != 0xffffffffu) fatal("__shfl_xor_sync with mask %#x: only full-warp shuffles are emulated", mask);
  if (lane_mask < 0 || lane_mask >= 32) fatal("__shfl_xor_sync lane mask %d out of range", lane_mask);
  const uint3 t = c.current->tid;
  const unsigned linear = t.x + t.y * c.block.x + t.z * c.block.x * c.block.y;
  const unsigned warp = linear / 32, lane = linear % 32;
  if (c.threads % 32 != 0 && warp == c.threads / 32) {
    fatal("full-mask __shfl_xor_sync in a partial warp (CTA of %u threads)", c.threads);
  }
  Warp& w = c.warps[warp];
  w.values[lane] = value;
  barrier(c, w.arrived, w.generation, 32);
  const float result = w.values[lane ^ static_cast<unsigned>(lane_mask)];
  barrier(c, w.arrived, w.generation, 32);  // nobody overwrites values before all have read
  return result;
}

void trap() {
  const CtaRun& c = cta();
  fatal("__trap() in CTA (%u, %u, %u), thread (%u, %u, %u)", c.bid.x, c.bid.y, c.bid.z, c.current->tid.x,
        c.current->tid.y, c.current->tid.z);
}

unsigned cluster_num_blocks() { return cta().cluster != nullptr ? cta().cluster->size : 1; }
unsigned cluster_block_rank() { return cta().rank; }

void cluster_sync() {
  CtaRun& c = cta();
  // The last of this CTA's threads waits (holding its OS thread) for the other CTAs.
  barrier(c, c.cluster_arrived, c.cluster_generation, c.threads, [&c] {
    if (c.cluster != nullptr) c.cluster->os_barrier("cluster.sync()");
  });
}

void* map_shared_rank(void* address, unsigned rank) {
  CtaRun& c = cta();
  if (c.cluster == nullptr) {
    if (rank != 0) fatal("map_shared_rank(rank %u) outside a cluster", rank);
    return address;
  }
  if (rank >= c.cluster->size) fatal("map_shared_rank(rank %u) in a cluster of %u", rank, c.cluster->size);
  return static_cast<char*>(address) - c.cluster->anchors[c.rank] + c.cluster->anchors[rank];
}

cudaError_t set_max_dynamic_smem(const void* kernel, int bytes) {
  if (bytes < 0 || bytes > kSmemPerCtaOptin) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(attribute_mutex);
  max_dynamic_smem[kernel] = bytes;
  return cudaSuccess;
}

cudaError_t launch(const void* kernel, const cudaLaunchConfig_t& config, std::function<void()> body) {
  const dim3 g = config.gridDim, b = config.blockDim;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (threads == 0 || threads > kMaxThreadsPerCta || b.z > 64) return fail(cudaErrorInvalidConfiguration);
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    return fail(cudaErrorInvalidConfiguration);
  }
  unsigned cluster_size = 1;
  for (unsigned i = 0; i < config.numAttrs; ++i) {
    const cudaLaunchAttribute& a = config.attrs[i];
    if (a.id != cudaLaunchAttributeClusterDimension) return fail(cudaErrorInvalidValue);
    if (a.val.clusterDim.y != 1 || a.val.clusterDim.z != 1) return fail(cudaErrorNotSupported);
    cluster_size = a.val.clusterDim.x;
  }
  if (cluster_size == 0 || cluster_size > kMaxClusterSize || g.x % cluster_size != 0) {
    return fail(cudaErrorInvalidConfiguration);
  }
  {
    std::lock_guard<std::mutex> lock(attribute_mutex);
    const auto it = max_dynamic_smem.find(kernel);
    const std::size_t limit = it != max_dynamic_smem.end() ? static_cast<std::size_t>(it->second) : kDefaultDynamicSmem;
    if (config.dynamicSmemBytes > limit) return fail(cudaErrorInvalidValue);
  }
  if (config.stream == nullptr && capturing_streams > 0) return fail(cudaErrorStreamCaptureUnsupported);
  auto run = [config, cluster_size, body = std::move(body)] { execute(config, cluster_size, body); };
  if (config.stream != nullptr && config.stream->capturing) {
    config.stream->recorded.push_back(std::move(run));
  } else {
    run();
  }
  return cudaSuccess;
}

}  // namespace cuda_emu

// ---- Runtime API -------------------------------------------------------------------------

using cuda_emu::fail;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = cuda_emu::kMaxThreadsPerCta; break;
    case cudaDevAttrMultiProcessorCount: *value = cuda_emu::sm_count(); break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = cuda_emu::kMaxThreadsPerSm; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = cuda_emu::kSmemPerSm; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = cuda_emu::kSmemPerCtaOptin; break;
    case cudaDevAttrClusterLaunch: *value = 1; break;
    default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, std::size_t bytes) {
  // An exact-size heap block (ASan sees accesses past it), filled with 0xff: memory nothing
  // wrote reads as NaN, as uninitialized device memory would read as garbage.
  *ptr = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{256}, std::nothrow);
  if (*ptr == nullptr) return fail(cudaErrorMemoryAllocation);
  std::memset(*ptr, 0xff, bytes);
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr) ::operator delete(ptr, std::align_val_t{256});
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (cuda_emu::capturing_streams > 0) return fail(cudaErrorStreamCaptureUnsupported);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream) {
  if (stream == nullptr && cuda_emu::capturing_streams > 0) return fail(cudaErrorStreamCaptureUnsupported);
  auto op = [dst, value, bytes] { std::memset(dst, value, bytes); };
  if (stream != nullptr && stream->capturing) {
    stream->recorded.push_back(op);
  } else {
    op();
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  *stream = new CUstream_st;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  if (stream == nullptr || stream->capturing) return fail(cudaErrorStreamCaptureUnsupported);
  stream->capturing = true;
  stream->recorded.clear();
  ++cuda_emu::capturing_streams;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || !stream->capturing) return fail(cudaErrorInvalidValue);
  stream->capturing = false;
  --cuda_emu::capturing_streams;
  *graph = new CUgraph_st{std::move(stream->recorded)};
  stream->recorded.clear();
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraph_st{graph->operations};
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  for (const auto& op : exec->operations) op();
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = cuda_emu::last_error;
  cuda_emu::last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError() { return cuda_emu::last_error; }

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) { return cudaGetErrorName(err); }
