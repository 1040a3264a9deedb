// The CPU emulation of the CUDA runtime declared in include/cuda_runtime.h: launches, the
// fiber scheduler of a CTA, barriers, warp shuffles, clusters, streams and graph capture.
#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64 (tests/cuda_emu/CMakeLists.txt)"
#endif

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
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

int sm_count() {
  const char* env = std::getenv("FUSEDNORM_EMU_SMS");
  const int n = env != nullptr ? std::atoi(env) : 0;
  return n > 0 ? n : 4;
}

// Registers: the emulation cannot know what ptxas gives a kernel, so every kernel is taken to
// use FUSEDNORM_EMU_REGISTERS per thread (default 32, at which threads alone bound an SM;
// 128, the most the SASS checks allow, gives the fewest CTAs per SM the planner can meet:
// 1 of 512 threads, 2 of 256). The occupancy query answers with it and launches that need
// more than an SM's registers fail, as on hardware.
constexpr int kRegistersPerSm = 65536;
constexpr int kMaxCtasPerSm = 32;
constexpr int kSmemReservedPerCta = 1024;  // what sm_80 / sm_90 reserve per CTA

int registers_per_thread() {
  static const int registers = [] {
    const char* env = std::getenv("FUSEDNORM_EMU_REGISTERS");
    const int n = env != nullptr ? std::atoi(env) : 0;
    return n > 0 ? std::min(n, 255) : 32;
  }();
  return registers;
}

// Registers of one CTA, allocated per warp in units of 8 per thread.
long long cta_registers(unsigned long long threads) {
  return static_cast<long long>((threads + 31) / 32 * 32) * ((registers_per_thread() + 7) / 8 * 8);
}

[[noreturn]] void fatal(const char* format, ...);

// ---- Schedules ---------------------------------------------------------------------------
//
// Which runnable GPU thread runs next, at every switch point (a barrier, a shuffle, an
// atomic): FUSEDNORM_EMU_SCHEDULE. A missing barrier between one thread's write and another
// thread's read is seen only by a schedule that runs the reader first; each schedule below
// runs some racing pair in the order the other schedules do not.
//   forward      threads in index order, each up to its next switch point, then again
//                (the CTAs of a cluster: rank order, each until all its threads wait at
//                cluster.sync() or have finished);
//   reverse      the same from the last thread (and the last rank) to the first;
//   warp-greedy  one warp's lanes until every lane waits at a CTA- or cluster-wide barrier
//                or has finished, then the next warp: a warp runs ahead of the others
//                across its shuffles, as warps do on hardware;
//   random:SEED  seeded: a random warp and lane at each switch point, warps sticky for a
//                random while (how sticky is drawn per CTA), the thread that releases a
//                barrier not always first past it, and the running CTA of a cluster handed
//                over at random switch points. Each launch and CTA draws from
//                (SEED, launch number in the process, CTA index): the same command with
//                the same seed (same tests, same filter) replays the same run.
enum class ScheduleKind { kForward, kReverse, kWarpGreedy, kRandom };
struct Schedule {
  ScheduleKind kind = ScheduleKind::kForward;
  std::uint64_t seed = 0;
  std::string name = "forward";
};

const Schedule& schedule() {
  static const Schedule chosen = [] {
    const char* env = std::getenv("FUSEDNORM_EMU_SCHEDULE");
    const std::string value = env != nullptr ? env : "";
    Schedule s;
    if (value.empty() || value == "forward") return s;
    s.name = value;
    if (value == "reverse") {
      s.kind = ScheduleKind::kReverse;
      return s;
    }
    if (value == "warp-greedy") {
      s.kind = ScheduleKind::kWarpGreedy;
      return s;
    }
    const std::string prefix = "random:";
    if (value.compare(0, prefix.size(), prefix) == 0 && value.size() > prefix.size()) {
      char* end = nullptr;
      s.seed = std::strtoull(value.c_str() + prefix.size(), &end, 10);
      if (end != nullptr && *end == '\0') {
        s.kind = ScheduleKind::kRandom;
        return s;
      }
    }
    fatal("FUSEDNORM_EMU_SCHEDULE=%s: expected forward, reverse, warp-greedy or random:<seed>",
          value.c_str());
  }();
  return chosen;
}

bool random_schedule() { return schedule().kind == ScheduleKind::kRandom; }

// splitmix64: small, seedable, and the same on every platform (std:: distributions are not).
struct Rng {
  std::uint64_t state = 0;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  unsigned below(unsigned n) { return static_cast<unsigned>(((next() >> 32) * n) >> 32); }
  bool one_in(unsigned n) { return below(n) == 0; }
};
Rng rng_for(std::uint64_t launch, std::uint64_t block) {
  Rng r{schedule().seed};
  r.state = r.next() ^ (launch * 0xd1b54a32d192ed03ull);
  r.state = r.next() ^ (block * 0x8cb92ba72f3d8dd7ull);
  return r;
}
std::atomic<std::uint64_t> launch_count{0};

[[noreturn]] void fatal(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::fputs("cuda_emu: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  const char* env = std::getenv("FUSEDNORM_EMU_SCHEDULE");
  std::fprintf(stderr, "cuda_emu: schedule FUSEDNORM_EMU_SCHEDULE=%s\n",
               env != nullptr ? env : "forward");
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

// ---- A cluster: its CTAs' OS threads, shared-memory anchors and the turn between them ------
//
// Each CTA of a cluster runs on an OS thread of its own (its shared memory is that thread's
// thread_local storage), but only one of them runs GPU threads at a time: the one whose
// turn it is. A CTA hands the turn over when none of its threads can run (all wait at
// cluster.sync() or have finished) or, in the random schedule, at a random switch point. So
// the interleaving across a cluster is the schedule's, and a seed replays it.
thread_local char shared_anchor;  // every OS thread's static TLS has the same layout

struct ClusterRun {
  ClusterRun(unsigned n, unsigned cta_threads, Rng r)
      : size(n), threads_per_cta(cta_threads), anchors(n, nullptr), finished(n, 0), rng(r) {
    switch (schedule().kind) {
      case ScheduleKind::kReverse:
        turn = n - 1;
        break;
      case ScheduleKind::kRandom:
        turn = rng.below(n);
        break;
      default:
        turn = 0;
    }
  }
  unsigned size;
  unsigned threads_per_cta;
  std::vector<char*> anchors;  // per rank: &shared_anchor in that CTA's OS thread
  // Owned by the CTA whose turn it is (handing the turn over orders them).
  std::vector<char> finished;                    // per rank
  unsigned idle_turns = 0;                       // turns in a row that found nothing to run
  unsigned bar_arrived = 0, bar_generation = 0;  // cluster.sync(): every thread of the cluster
  Rng rng;
  // Guarded by mutex.
  std::mutex mutex;
  std::condition_variable changed;
  unsigned turn;
  unsigned os_arrived = 0;
  std::uint64_t os_generation = 0;

  // Start and end of the cluster's run (no CTA's storage may go away while another can map it).
  void os_barrier(const char* what) {
    std::unique_lock<std::mutex> lock(mutex);
    const std::uint64_t gen = os_generation;
    if (++os_arrived == size) {
      os_arrived = 0;
      ++os_generation;
      changed.notify_all();
      return;
    }
    if (!changed.wait_for(lock, std::chrono::seconds(300), [&] { return os_generation != gen; })) {
      fatal("%s: a CTA of the cluster never arrived (deadlock)", what);
    }
  }
  void wait_for_turn(unsigned rank) {
    if (size == 1) return;
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return turn == rank; });
  }
  void hand_over(unsigned to) {
    if (size == 1) return;
    std::lock_guard<std::mutex> lock(mutex);
    turn = to;
    changed.notify_all();
  }
  // The next unfinished CTA after `rank` in the schedule's order (reverse: downwards); rank
  // itself when it is the only one left.
  unsigned next_rank(unsigned rank) const {
    for (unsigned step = 1; step <= size; ++step) {
      const unsigned r = schedule().kind == ScheduleKind::kReverse ? (rank + size - step) % size
                                                                   : (rank + step) % size;
      if (!finished[r]) return r;
    }
    return rank;
  }
};

// ---- One CTA: its GPU threads as fibers on one OS thread ----------------------------------

enum class Wait : std::uint8_t { kNone, kWarp, kCta, kCluster };

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  char* stack = nullptr;
  uint3 tid{0, 0, 0};
  bool done = false;
  // At a barrier: runnable again once *wait_generation != wait_value.
  Wait wait = Wait::kNone;
  const unsigned* wait_generation = nullptr;
  unsigned wait_value = 0;
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while switched out

  bool runnable() const { return !done && (wait == Wait::kNone || *wait_generation != wait_value); }
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
  std::vector<Warp> warps;
  unsigned finished_threads = 0;
  unsigned last = 0;  // the fiber resumed last
  Rng rng;
  unsigned warp_switch_one_in = 1;  // random schedule: leave the current warp at 1 in n switches
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
  ++c.finished_threads;
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

// A switch point where the running thread stays runnable: the random schedule may run
// another thread first (the others do not switch here).
void switch_point() {
  if (random_schedule()) yield_to_scheduler();
}

// Arrives at a barrier of `expected` threads (counter / generation pair) and waits until all
// have arrived; the last to arrive releases the others.
void barrier(CtaRun& c, unsigned& arrived, unsigned& generation, unsigned expected, Wait scope) {
  const unsigned gen = generation;
  if (++arrived == expected) {
    arrived = 0;
    ++generation;
    switch_point();
    return;
  }
  Fiber& f = *c.current;
  f.wait = scope;
  f.wait_generation = &generation;
  f.wait_value = gen;
  yield_to_scheduler();  // resumed only once released
  f.wait = Wait::kNone;
}

// The schedule's choice of the next thread of this CTA to resume, or null when none can run.
Fiber* pick_in_order(CtaRun& c, bool reverse) {
  const unsigned n = c.threads;
  for (unsigned step = 1; step <= n; ++step) {
    const unsigned i = reverse ? (c.last + n - step) % n : (c.last + step) % n;
    if (c.fibers[i].runnable()) return &c.fibers[i];
  }
  return nullptr;
}

// The first runnable lane of warp w, scanning from lane `from` (cyclically).
Fiber* runnable_lane(CtaRun& c, unsigned w, unsigned from) {
  for (unsigned step = 0; step < 32; ++step) {
    const unsigned i = w * 32 + (from + step) % 32;
    if (i < c.threads && c.fibers[i].runnable()) return &c.fibers[i];
  }
  return nullptr;
}

Fiber* pick_warp_greedy(CtaRun& c) {
  const unsigned warps = static_cast<unsigned>(c.warps.size());
  const unsigned w = c.last / 32;
  if (Fiber* f = runnable_lane(c, w, c.last % 32 + 1)) return f;
  for (unsigned step = 1; step <= warps; ++step) {
    if (Fiber* f = runnable_lane(c, (w + step) % warps, 0)) return f;
  }
  return nullptr;
}

Fiber* pick_random(CtaRun& c) {
  const unsigned warps = static_cast<unsigned>(c.warps.size());
  if (!c.rng.one_in(c.warp_switch_one_in)) {
    if (Fiber* f = runnable_lane(c, c.last / 32, c.rng.below(32))) return f;
  }
  const unsigned w0 = c.rng.below(warps), lane = c.rng.below(32);
  for (unsigned step = 0; step < warps; ++step) {
    if (Fiber* f = runnable_lane(c, (w0 + step) % warps, lane)) return f;
  }
  return nullptr;
}

Fiber* pick(CtaRun& c) {
  switch (schedule().kind) {
    case ScheduleKind::kForward:
      return pick_in_order(c, false);
    case ScheduleKind::kReverse:
      return pick_in_order(c, true);
    case ScheduleKind::kWarpGreedy:
      return pick_warp_greedy(c);
    case ScheduleKind::kRandom:
      return pick_random(c);
  }
  return nullptr;
}

void resume(CtaRun& c, Fiber& f) {
  c.current = &f;
  c.last = static_cast<unsigned>(&f - c.fibers.data());
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

[[noreturn]] void report_deadlock(const CtaRun& c) {
  unsigned at[4] = {0, 0, 0, 0};
  for (const Fiber& f : c.fibers) {
    if (!f.done) ++at[static_cast<int>(f.wait)];
  }
  fatal(
      "deadlock in CTA (%u, %u, %u): of %u threads, %u wait at __syncthreads(), %u at a shuffle "
      "and %u at "
      "cluster.sync() that the others never reach (%u finished)",
      c.bid.x, c.bid.y, c.bid.z, c.threads, at[static_cast<int>(Wait::kCta)],
      at[static_cast<int>(Wait::kWarp)], at[static_cast<int>(Wait::kCluster)], c.finished_threads);
}

// Hands the cluster's turn to the next CTA and waits until it comes back.
void take_turns(CtaRun& c, unsigned to) {
  ClusterRun& k = *c.cluster;
  if (to == c.rank) return;
  k.hand_over(to);
  k.wait_for_turn(c.rank);
}

constexpr unsigned kClusterSwitchOneIn = 256;  // random schedule: another CTA runs next

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
  // The first resumed thread: 0 (reverse: the last); random: a random one.
  c.last = schedule().kind == ScheduleKind::kReverse ? 0 : c.threads - 1;
  if (random_schedule()) {
    static constexpr unsigned kStickiness[] = {1, 4, 64};
    c.warp_switch_one_in = kStickiness[c.rng.below(3)];
    c.last = c.rng.below(c.threads);
  }
  ClusterRun& k = *c.cluster;
  k.wait_for_turn(c.rank);
  for (;;) {
    Fiber* f = pick(c);
    if (f == nullptr) {
      if (c.finished_threads == c.threads) {
        k.finished[c.rank] = 1;
        k.idle_turns = 0;
        const unsigned to = k.next_rank(c.rank);
        if (to != c.rank) k.hand_over(to);
        break;
      }
      // All wait at barriers: other CTAs of the cluster must run (cluster.sync()), unless
      // every CTA has found nothing to run since the last progress.
      if (++k.idle_turns > k.size) report_deadlock(c);
      take_turns(c, k.next_rank(c.rank));
      continue;
    }
    k.idle_turns = 0;
    resume(c, *f);
    if (random_schedule() && k.size > 1 && k.rng.one_in(kClusterSwitchOneIn)) {
      const unsigned to = k.rng.below(k.size);
      take_turns(c, k.finished[to] ? k.next_rank(to) : to);
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
  ClusterRun& k = *c.cluster;
  k.anchors[c.rank] = &shared_anchor;
  if (k.size > 1) k.os_barrier("cluster start");
  run_cta(c);
  // No CTA's storage may go away while another of its cluster can still map it.
  if (k.size > 1) k.os_barrier("cluster end");
  for (const DynamicSmemArray& a : arrays) {
#ifdef FUSEDNORM_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(a.address() + smem, a.capacity - smem);
#endif
    const std::size_t canary = std::min(kCanaryBytes, a.capacity - smem);
    const char* const past = a.address() + smem;  // a TLS look-up: once, not per byte
    for (std::size_t i = 0; i < canary; ++i) {
      if (static_cast<unsigned char>(past[i]) != kSmemCanary) {
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
  const std::uint64_t launch_number = launch_count++;
  if (launch_number == 0 && schedule().kind != ScheduleKind::kForward) {
    std::fprintf(stderr, "cuda_emu: schedule FUSEDNORM_EMU_SCHEDULE=%s\n", schedule().name.c_str());
  }
  auto make = [&](unsigned x, unsigned y, unsigned z) {
    CtaRun c;
    c.grid = grid;
    c.block = config.blockDim;
    c.bid = {x, y, z};
    c.threads = threads;
    c.body = &body;
    c.rng = rng_for(launch_number, (std::uint64_t{z} * grid.y + y) * grid.x + x);
    return c;
  };
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x0 = 0; x0 < grid.x; x0 += cluster_size) {
        ClusterRun cluster(
            cluster_size, threads,
            rng_for(launch_number, ~((std::uint64_t{z} * grid.y + y) * grid.x + x0)));
        if (cluster_size == 1) {
          CtaRun c = make(x0, y, z);
          c.cluster = &cluster;
          run_cta_with_smem(c, config.dynamicSmemBytes);
          continue;
        }
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
  barrier(c, c.bar_arrived, c.bar_generation, c.threads, Wait::kCta);
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
  barrier(c, w.arrived, w.generation, 32, Wait::kWarp);
  const float result = w.values[lane ^ static_cast<unsigned>(lane_mask)];
  barrier(c, w.arrived, w.generation, 32,
          Wait::kWarp);  // nobody overwrites values before all have read
  return result;
}

float atomic_add(float* address, float value) {
  cta();
  switch_point();  // the order of a CTA's atomics is the schedule's
  const float old = *address;
  *address = old + value;
  return old;
}

void trap() {
  const CtaRun& c = cta();
  fatal("__trap() in CTA (%u, %u, %u), thread (%u, %u, %u)", c.bid.x, c.bid.y, c.bid.z, c.current->tid.x,
        c.current->tid.y, c.current->tid.z);
}

unsigned cluster_num_blocks() { return cta().cluster->size; }
unsigned cluster_block_rank() { return cta().rank; }

void cluster_sync() {
  CtaRun& c = cta();
  ClusterRun& k = *c.cluster;
  barrier(c, k.bar_arrived, k.bar_generation, k.threads_per_cta * k.size, Wait::kCluster);
}

void* map_shared_rank(void* address, unsigned rank) {
  CtaRun& c = cta();
  const ClusterRun& k = *c.cluster;
  if (rank >= k.size) fatal("map_shared_rank(rank %u) in a cluster of %u", rank, k.size);
  // On hardware an exited CTA's shared memory is gone (a cluster.sync() must keep it alive).
  if (k.finished[rank]) {
    fatal("CTA (%u, %u, %u) maps the shared memory of cluster rank %u, which has exited", c.bid.x,
          c.bid.y, c.bid.z, rank);
  }
  return static_cast<char*>(address) - k.anchors[c.rank] + k.anchors[rank];
}

const char* schedule_name() { return schedule().name.c_str(); }

cudaError_t set_max_dynamic_smem(const void* kernel, int bytes) {
  if (bytes < 0 || bytes > kSmemPerCtaOptin) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(attribute_mutex);
  max_dynamic_smem[kernel] = bytes;
  return cudaSuccess;
}

cudaError_t resident_ctas(const void* kernel, int threads, std::size_t smem, int* count) {
  if (count == nullptr || threads <= 0) return fail(cudaErrorInvalidValue);
  std::size_t smem_limit = kDefaultDynamicSmem;
  {
    std::lock_guard<std::mutex> lock(attribute_mutex);
    const auto it = max_dynamic_smem.find(kernel);
    if (it != max_dynamic_smem.end()) smem_limit = static_cast<std::size_t>(it->second);
  }
  if (threads > kMaxThreadsPerCta || smem > smem_limit) {
    *count = 0;  // as the runtime: a CTA that cannot launch is 0 resident, not an error
    return cudaSuccess;
  }
  const long long warp_threads = (threads + 31) / 32 * 32;
  const long long by_smem = kSmemPerSm / static_cast<long long>(smem + kSmemReservedPerCta);
  *count = static_cast<int>(
      std::min({static_cast<long long>(kMaxCtasPerSm), kMaxThreadsPerSm / warp_threads, by_smem,
                kRegistersPerSm / cta_registers(threads)}));
  return cudaSuccess;
}

cudaError_t launch(const void* kernel, const cudaLaunchConfig_t& config, std::function<void()> body) {
  const dim3 g = config.gridDim, b = config.blockDim;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (threads == 0 || threads > kMaxThreadsPerCta || b.z > 64) return fail(cudaErrorInvalidConfiguration);
  if (cta_registers(threads) > kRegistersPerSm) return fail(cudaErrorLaunchOutOfResources);
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
    case cudaErrorLaunchOutOfResources:
      return "cudaErrorLaunchOutOfResources";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) { return cudaGetErrorName(err); }
