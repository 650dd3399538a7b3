// The runtime of the CUDA execution model (cuda_emulation.h): launches, block barriers, warp
// collectives and launch limits.
//
// A block's threads are fibers: user-space contexts (ucontext), each on a stack of its own, run one
// at a time on the launching thread. A fiber runs until it must wait for other threads (a barrier,
// a warp collective), then the next ready one runs; a collective that completes makes its waiters
// ready again. A block of 1024 threads thus costs no kernel thread, lock or futex wake-up: with real
// threads the model spent more time in the kernel's scheduler than in the kernels (on a 2-core
// machine, 2026-12-05: 41 s of system time for 10 s of user time).
//
// Under ThreadSanitizer every fiber is a thread of its own to it (__tsan_create_fiber), and a switch
// orders nothing (__tsan_switch_to_fiber_no_sync): a missing __syncthreads() is a race it reports,
// whichever order the fibers ran in. The model's bookkeeping, which the fibers share with no CUDA
// ordering, is hidden from it (ModelInternals), and only what CUDA orders is annotated: the launch
// before the block's threads, each block's threads before the next block (blocks run one at a time)
// and __syncthreads among the block's threads. Shuffles and votes order nothing. Under
// AddressSanitizer every switch is announced (__sanitizer_start/finish_switch_fiber), so that it
// knows which stack each fiber runs on.
#include "cuda_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

// gcc names the sanitizers with macros, clang (14) only through __has_feature.
#if defined(__SANITIZE_THREAD__)
#define KVPRESS_EMULATION_TSAN 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVPRESS_EMULATION_ASAN 1
#endif
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVPRESS_EMULATION_TSAN 1
#endif
#if __has_feature(address_sanitizer)
#define KVPRESS_EMULATION_ASAN 1
#endif
#endif

#if defined(KVPRESS_EMULATION_TSAN)
#include <sanitizer/tsan_interface.h>
extern "C" {
// ThreadSanitizer's runtime: ignore this thread's (fiber's) memory accesses until the matching end.
// Unlike AnnotateIgnoreReadsBegin it records no stack (most of the model's time went there).
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
}
#endif
#if defined(KVPRESS_EMULATION_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

namespace kvpress::cuda_emulation {
namespace {

// While alive: this fiber's memory accesses are invisible to ThreadSanitizer. (The model takes no
// lock and no atomic inside a block, so there is no synchronisation to hide.)
class ModelInternals {
 public:
#if defined(KVPRESS_EMULATION_TSAN)
  ModelInternals() { __tsan_ignore_thread_begin(); }
  ~ModelInternals() { __tsan_ignore_thread_end(); }
#else
  ModelInternals() = default;
#endif
  ModelInternals(const ModelInternals&) = delete;
  ModelInternals& operator=(const ModelInternals&) = delete;
};
// An ordering CUDA guarantees: everything before happens_before(token) in one thread happens before
// everything after happens_after(token) in another.
void happens_before(void* token) {
#if defined(KVPRESS_EMULATION_TSAN)
  __tsan_release(token);
#else
  (void)token;
#endif
}
void happens_after(void* token) {
#if defined(KVPRESS_EMULATION_TSAN)
  __tsan_acquire(token);
#else
  (void)token;
#endif
}

constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr size_t kOptInSharedLimit = 227 * 1024;  // sm_90 (H100 / H200)
// Each emulated thread's stack, below an inaccessible guard page (an overflow faults at once).
// Kernels keep small frames; 1 MiB leaves room for the sanitizers' larger ones. Reserved, not
// committed: only the pages a fiber touches take memory.
constexpr size_t kStackBytes = size_t{1} << 20;
constexpr size_t kGuardBytes = 64 * 1024;

// Thrown inside a block's thread to leave the kernel once the launch has failed.
struct Abort {};

struct Warp {
  unsigned arrived = 0;  // lanes waiting in the collective in progress
  unsigned mask = 0;     // its mask
  const char* what = nullptr;
  uint64_t values[32] = {};
  int sources[32] = {};         // lane whose value each lane reads; -1: a vote
  uint64_t delivered[32] = {};  // each lane's result of its last collective
  bool pending[32] = {};
  std::vector<int> waiters;  // threads (linear index) parked in this warp's collective
  // warp_all_gather's contributions, by the parity of the gather (a lane can be at most one gather
  // ahead of the slowest lane still reading the previous one).
  std::vector<unsigned char> gathered[2];
};

struct Block {
  int threads = 0;
  int exited = 0;
  int waiting = 0;  // threads in a collective that has not completed yet
  int at_barrier = 0;
  uint64_t barrier_generation = 0;
  int accumulator = 0;
  int results[2] = {};
  std::vector<bool> left;  // per thread: has returned from the kernel
  std::vector<Warp> warps;
  std::vector<int> barrier_waiters;  // threads parked at __syncthreads
  // Dynamic shared memory, 128-byte aligned as on the GPU (wmma needs 32-byte aligned tiles).
  struct alignas(128) SharedLine {
    unsigned char bytes[128];
  };
  std::vector<SharedLine> dynamic_shared;
  char barrier_tokens[2] = {};  // __syncthreads of even / odd generations
  std::string error;
  uint3 index{0, 0, 0};

  void reset(uint3 block_index, size_t shared_bytes) {
    exited = waiting = at_barrier = 0;
    accumulator = 0;
    left.assign(static_cast<size_t>(threads), false);
    barrier_waiters.clear();
    for (Warp& w : warps) {
      w.arrived = w.mask = 0;
      w.what = nullptr;
      w.waiters.clear();
      std::fill(std::begin(w.pending), std::end(w.pending), false);
    }
    dynamic_shared.resize((shared_bytes + sizeof(SharedLine) - 1) / sizeof(SharedLine));
    // A NaN (and -1) pattern: a read before any write shows in the results.
    if (!dynamic_shared.empty()) std::memset(dynamic_shared.data(), 0xff, dynamic_shared.size() * sizeof(SharedLine));
    index = block_index;
  }
};

// One emulated thread: its context, stack and what it sees of CUDA.
struct Fiber {
  ucontext_t context{};
  char* stack = nullptr;  // kStackBytes, above a guard of kGuardBytes
  int linear = 0;         // threadIdx, linearised
  ThreadIndex index;
  uint64_t gathers = 0;        // warp_all_gather calls in the current block
  bool finished = true;        // has left the kernel (its context is dead until the next block)
  void* fake_stack = nullptr;  // AddressSanitizer's fake stack of the suspended fiber
  void* tsan_fiber = nullptr;  // ThreadSanitizer's context of the fiber

  explicit Fiber(int linear_index) : linear(linear_index) {
    void* mapping = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (mapping == MAP_FAILED || mprotect(mapping, kGuardBytes, PROT_NONE) != 0) {
      std::fprintf(stderr, "cuda_emulation: cannot map a %zu-byte stack for emulated thread %d\n", kStackBytes,
                   linear_index);
      std::abort();
    }
    stack = static_cast<char*>(mapping) + kGuardBytes;
#if defined(KVPRESS_EMULATION_TSAN)
    tsan_fiber = __tsan_create_fiber(0);
    char name[48];
    std::snprintf(name, sizeof(name), "emulated CUDA thread %d", linear_index);
    __tsan_set_fiber_name(tsan_fiber, name);
#endif
  }
  ~Fiber() {
#if defined(KVPRESS_EMULATION_TSAN)
    __tsan_destroy_fiber(tsan_fiber);
#endif
    munmap(stack - kGuardBytes, kGuardBytes + kStackBytes);
  }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
};

// The launch in progress (one at a time: launch_mutex) and its scheduler, which runs on the
// launching thread and resumes ready fibers until none is left.
struct Launch {
  Block* block = nullptr;
  const std::function<void()>* body = nullptr;
  std::deque<int> ready;  // threads to resume, in order
  ucontext_t scheduler{};
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;  // AddressSanitizer: the launching thread's stack
  size_t scheduler_stack_size = 0;
  void* scheduler_tsan_fiber = nullptr;
};

std::mutex launch_mutex;  // one launch at a time: blocks never overlap, so __shared__ is one copy
Launch* active_launch = nullptr;
thread_local Fiber* current_fiber = nullptr;  // the emulated thread running here, if any
thread_local ThreadIndex outside_index;       // what current() gives outside a kernel
// ThreadSanitizer tokens: the launching thread starts a block after the launch and the previous block.
char block_start_token, block_done_token;

// Every fiber ever started, kept for the process: they are reused by every launch.
std::vector<std::unique_ptr<Fiber>>& fiber_pool() {
  static std::vector<std::unique_ptr<Fiber>> pool;
  return pool;
}

std::mutex error_mutex;
cudaError_t last_error = cudaSuccess;
std::string last_message;
std::map<const void*, size_t> max_dynamic_shared;

void record_error(cudaError_t err, std::string message) {
  std::lock_guard<std::mutex> lock(error_mutex);
  last_error = err;
  last_message = std::move(message);
}

std::string where() {
  const ThreadIndex& t = current();
  char buf[160];
  std::snprintf(buf, sizeof(buf), "block (%u, %u, %u), thread (%u, %u, %u)", t.block.x, t.block.y, t.block.z,
                t.thread.x, t.thread.y, t.thread.z);
  return buf;
}

// ---- Switching: the scheduler into a fiber and back ----------------------------------------

// Scheduler: runs fiber `f` until it parks or leaves the kernel.
void resume(Launch& launch, Fiber& f) {
  current_fiber = &f;
#if defined(KVPRESS_EMULATION_TSAN)
  __tsan_switch_to_fiber(f.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(KVPRESS_EMULATION_ASAN)
  __sanitizer_start_switch_fiber(&launch.scheduler_fake_stack, f.stack, kStackBytes);
#endif
  swapcontext(&launch.scheduler, &f.context);
#if defined(KVPRESS_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(launch.scheduler_fake_stack, nullptr, nullptr);
#endif
  current_fiber = nullptr;
}

// The current fiber, just after a switch into it: AddressSanitizer learns where the scheduler's
// stack is (the switch back needs it).
void arrived_in_fiber(Fiber& f) {
#if defined(KVPRESS_EMULATION_ASAN)
  Launch& launch = *active_launch;
  __sanitizer_finish_switch_fiber(f.fake_stack, &launch.scheduler_stack_bottom, &launch.scheduler_stack_size);
#else
  (void)f;
#endif
}

// The current fiber: back to the scheduler, until it resumes this fiber (never, once finished).
// What it reads of the model is hidden from ThreadSanitizer, but not the switch itself: a finished
// fiber never comes back to end a hidden region, and its next run must be seen whole.
void switch_to_scheduler() {
  Fiber* f;
  ucontext_t* scheduler;
  [[maybe_unused]] void* scheduler_tsan_fiber;
  [[maybe_unused]] void** fake_stack_save;
  [[maybe_unused]] const void* scheduler_stack_bottom;
  [[maybe_unused]] size_t scheduler_stack_size;
  {
    ModelInternals hidden;
    f = current_fiber;
    scheduler = &active_launch->scheduler;
    scheduler_tsan_fiber = active_launch->scheduler_tsan_fiber;
    // A finished fiber's frames are dead: AddressSanitizer drops its fake stack with them.
    fake_stack_save = f->finished ? nullptr : &f->fake_stack;
    scheduler_stack_bottom = active_launch->scheduler_stack_bottom;
    scheduler_stack_size = active_launch->scheduler_stack_size;
  }
#if defined(KVPRESS_EMULATION_TSAN)
  __tsan_switch_to_fiber(scheduler_tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(KVPRESS_EMULATION_ASAN)
  __sanitizer_start_switch_fiber(fake_stack_save, scheduler_stack_bottom, scheduler_stack_size);
#endif
  swapcontext(&f->context, scheduler);
  arrived_in_fiber(*f);
}

// Makes the threads parked in `queue` ready to run.
void wake(std::vector<int>& queue) {
  std::deque<int>& ready = active_launch->ready;
  ready.insert(ready.end(), queue.begin(), queue.end());
  queue.clear();
}

// The current thread waits in `queue` until done().
template <typename Done>
void wait_until(std::vector<int>& queue, Done done) {
  while (!done()) {
    queue.push_back(current_fiber->linear);
    switch_to_scheduler();
  }
}

// Marks the launch failed (first message wins) and wakes every waiting thread.
void fail(Block& b, const std::string& message) {
  if (b.error.empty()) b.error = message + " (" + where() + ")";
  wake(b.barrier_waiters);
  for (Warp& w : b.warps) wake(w.waiters);
}

[[noreturn]] void abort_thread(Block& b, const std::string& message) {
  fail(b, message);
  throw Abort{};
}

// Before waiting: if every thread still in the kernel waits, none will release the others.
void check_deadlock(Block& b) {
  if (b.waiting + b.exited == b.threads)
    abort_thread(b, "deadlock: every thread of the block waits in a collective that others never reach");
}

Block& block_of_thread(const char* what) {
  if (current_fiber == nullptr) {
    std::fprintf(stderr, "cuda_emulation: %s called outside an emulated kernel\n", what);
    std::abort();
  }
  return *active_launch->block;
}

void thread_exit(Block& b);

// A fiber's first frame: runs the kernel as this thread of the current block, then parks for good.
void fiber_main() {
  Fiber& f = *current_fiber;
  arrived_in_fiber(f);
  happens_after(&block_start_token);  // the launch and the block's set-up come before
  Block& b = *active_launch->block;
  const dim3 block_dim = f.index.block_dim;
  const unsigned linear = static_cast<unsigned>(f.linear);
  f.index.thread =
      uint3{linear % block_dim.x, linear / block_dim.x % block_dim.y, linear / (block_dim.x * block_dim.y)};
  f.index.block = b.index;
  f.gathers = 0;
  try {
    (*active_launch->body)();
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    ModelInternals hidden;
    fail(b, std::string("the kernel threw: ") + e.what());
  }
  thread_exit(b);
  {
    ModelInternals hidden;
    f.finished = true;
  }
  happens_before(&block_done_token);
  switch_to_scheduler();
  std::fprintf(stderr, "cuda_emulation: a finished emulated thread was resumed\n");
  std::abort();
}

// Scheduler: prepares fiber `f` to run the kernel from its start.
void start_fiber(Fiber& f, dim3 grid, dim3 block) {
  if (getcontext(&f.context) != 0) {
    std::fprintf(stderr, "cuda_emulation: getcontext failed\n");
    std::abort();
  }
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;  // fiber_main never returns
  makecontext(&f.context, fiber_main, 0);
  // The stack is set up. AddressSanitizer's swapcontext would clear the shadow of the whole stack
  // named here on every switch into the fiber (1 MiB, each time: most of the run's time); the
  // switches tell it the stack instead (resume, switch_to_scheduler).
  f.context.uc_stack.ss_size = 0;
  f.finished = false;
  f.fake_stack = nullptr;
  f.index.block_dim = block;
  f.index.grid_dim = grid;
}

}  // namespace

ThreadIndex& current() { return current_fiber != nullptr ? current_fiber->index : outside_index; }

void* dynamic_shared_memory() {
  Block& b = block_of_thread("dynamic shared memory");
  return b.dynamic_shared.empty() ? nullptr : b.dynamic_shared.data();
}

namespace {
int block_barrier_wait(Block& b, int predicate, int mode);
}  // namespace

int block_barrier(int predicate, int mode) {
  Block& b = block_of_thread("__syncthreads");
  char* token;
  {
    // The generation is read hidden; its token is released outside the hidden region.
    ModelInternals hidden;
    token = &b.barrier_tokens[b.barrier_generation & 1];
  }
  happens_before(token);
  const int result = block_barrier_wait(b, predicate, mode);
  happens_after(token);
  return result;
}

namespace {

int block_barrier_wait(Block& b, int predicate, int mode) {
  ModelInternals hidden;
  if (!b.error.empty()) throw Abort{};
  if (b.exited > 0) abort_thread(b, "__syncthreads reached after some threads of the block returned");
  const uint64_t generation = b.barrier_generation;
  if (b.at_barrier == 0) b.accumulator = mode == 2 ? 1 : 0;
  const int p = predicate != 0;
  if (mode == 1) b.accumulator |= p;
  if (mode == 2) b.accumulator &= p;
  if (mode == 3) b.accumulator += p;
  if (++b.at_barrier == b.threads) {
    b.results[generation & 1] = b.accumulator;
    b.at_barrier = 0;
    b.waiting -= b.threads - 1;  // the waiters are released now, before they run
    ++b.barrier_generation;
    wake(b.barrier_waiters);
    return b.results[generation & 1];
  }
  ++b.waiting;
  check_deadlock(b);
  wait_until(b.barrier_waiters, [&] { return b.barrier_generation != generation || !b.error.empty(); });
  if (!b.error.empty()) throw Abort{};
  return b.results[generation & 1];
}

// A warp collective: `source` >= 0 reads that lane's value; -1 is a vote (ballot of predicates).
uint64_t warp_collective(unsigned mask, uint64_t value, int source, const char* what) {
  Block& b = block_of_thread(what);
  ModelInternals hidden;
  if (!b.error.empty()) throw Abort{};
  const int linear = current_fiber->linear;
  const int warp = linear / 32, lane = linear % 32;
  const int lanes = std::min(32, b.threads - warp * 32);
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  char buf[200];
  if (((mask >> lane) & 1u) == 0) {
    std::snprintf(buf, sizeof(buf), "%s: lane %d calls it with mask 0x%08x, which leaves the lane out", what, lane,
                  mask);
    abort_thread(b, buf);
  }
  if ((mask & ~present) != 0) {
    std::snprintf(buf, sizeof(buf), "%s: mask 0x%08x names lanes that warp %d lacks (it has %d)", what, mask, warp,
                  lanes);
    abort_thread(b, buf);
  }
  for (int l = 0; l < lanes; ++l) {
    if (((mask >> l) & 1u) && b.left[static_cast<size_t>(warp * 32 + l)]) {
      std::snprintf(buf, sizeof(buf), "%s: mask 0x%08x names lane %d, which has returned from the kernel", what, mask,
                    l);
      abort_thread(b, buf);
    }
  }
  Warp& w = b.warps[static_cast<size_t>(warp)];
  if (w.arrived == 0) {
    w.mask = mask;
    w.what = what;
  } else if (w.mask != mask || std::strcmp(w.what, what) != 0) {
    std::snprintf(buf, sizeof(buf),
                  "lanes of warp %d meet in different collectives: %s with mask 0x%08x and %s with 0x%08x", warp,
                  w.what, w.mask, what, mask);
    abort_thread(b, buf);
  }
  if (source >= 0 && ((mask >> source) & 1u) == 0) {
    std::snprintf(buf, sizeof(buf), "%s: lane %d reads lane %d, outside the mask 0x%08x", what, lane, source, mask);
    abort_thread(b, buf);
  }
  w.values[lane] = value;
  w.sources[lane] = source;
  w.pending[lane] = true;
  w.arrived |= 1u << lane;
  if (w.arrived == mask) {
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l)
      if ((mask >> l) & 1u) ballot |= (w.values[l] != 0 ? 1u : 0u) << l;
    for (int l = 0; l < 32; ++l) {
      if (((mask >> l) & 1u) == 0) continue;
      w.delivered[l] = w.sources[l] >= 0 ? w.values[w.sources[l]] : ballot;
      w.pending[l] = false;
    }
    w.arrived = 0;
    b.waiting -= __builtin_popcount(mask) - 1;  // the waiters are released now, before they run
    wake(w.waiters);
    return w.delivered[lane];
  }
  ++b.waiting;
  check_deadlock(b);
  wait_until(w.waiters, [&] { return !w.pending[lane] || !b.error.empty(); });
  if (!b.error.empty()) throw Abort{};
  return w.delivered[lane];
}

// The thread has returned from the kernel (or left it on an error).
void thread_exit(Block& b) {
  ModelInternals hidden;
  const int linear = current_fiber->linear;
  b.left[static_cast<size_t>(linear)] = true;
  ++b.exited;
  if (!b.error.empty()) return;
  if (b.at_barrier > 0) {
    fail(b, "a thread returned from the kernel while others wait at __syncthreads");
    return;
  }
  const int warp = linear / 32, lane = linear % 32;
  const Warp& w = b.warps[static_cast<size_t>(warp)];
  if (w.arrived != 0 && ((w.mask >> lane) & 1u)) {
    fail(b, std::string(w.what) + ": a lane in the mask returned from the kernel while the others wait");
    return;
  }
  if (b.waiting > 0 && b.waiting + b.exited == b.threads)
    fail(b, "deadlock: every thread left waits in a collective that others never reach");
}

}  // namespace

uint64_t warp_exchange(unsigned mask, uint64_t value, int source_lane, const char* what) {
  return warp_collective(mask, value, source_lane, what);
}

unsigned warp_ballot(unsigned mask, int predicate, const char* what) {
  return static_cast<unsigned>(warp_collective(mask, predicate != 0 ? 1u : 0u, -1, what));
}

void warp_all_gather(const void* own, size_t bytes, void* all, const char* what) {
  Block& b = block_of_thread(what);
  const int linear = current_fiber->linear;
  const int warp = linear / 32, lane = linear % 32;
  Warp& w = b.warps[static_cast<size_t>(warp)];
  std::vector<unsigned char>& buffer = w.gathered[current_fiber->gathers++ & 1];
  {
    ModelInternals hidden;
    if (!b.error.empty()) throw Abort{};
    if (buffer.size() < 32 * bytes) buffer.resize(32 * bytes);
    std::memcpy(buffer.data() + static_cast<size_t>(lane) * bytes, own, bytes);
  }
  // The whole warp meets here (an error if a lane is missing, has left, or is elsewhere).
  warp_collective(0xffffffffu, 0, -1, what);
  ModelInternals hidden;
  std::memcpy(all, buffer.data(), 32 * bytes);
}

void kernel_error(const std::string& message) {
  Block& b = block_of_thread("kernel_error");
  ModelInternals hidden;
  if (!b.error.empty()) throw Abort{};
  abort_thread(b, message);
}

cudaError_t set_max_dynamic_shared(const void* function, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > kOptInSharedLimit) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(error_mutex);
  max_dynamic_shared[function] = static_cast<size_t>(bytes);
  return cudaSuccess;
}

cudaError_t take_last_error() {
  std::lock_guard<std::mutex> lock(error_mutex);
  const cudaError_t err = last_error;
  last_error = cudaSuccess;
  return err;
}

std::string last_error_message() {
  std::lock_guard<std::mutex> lock(error_mutex);
  return last_message;
}

cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const void* function,
                     const std::function<void()>& body) {
  char buf[200];
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      threads > 1024 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    std::snprintf(buf, sizeof(buf), "invalid launch configuration: grid (%u, %u, %u), block (%u, %u, %u)", grid.x,
                  grid.y, grid.z, block.x, block.y, block.z);
    record_error(cudaErrorInvalidConfiguration, buf);
    return cudaErrorInvalidConfiguration;
  }
  size_t shared_limit = kDefaultSharedLimit;
  {
    std::lock_guard<std::mutex> lock(error_mutex);
    const auto it = max_dynamic_shared.find(function);
    if (it != max_dynamic_shared.end()) shared_limit = std::max(shared_limit, it->second);
  }
  if (dynamic_shared_bytes > shared_limit) {
    std::snprintf(buf, sizeof(buf), "%zu bytes of dynamic shared memory exceed the kernel's limit of %zu",
                  dynamic_shared_bytes, shared_limit);
    record_error(cudaErrorInvalidValue, buf);
    return cudaErrorInvalidValue;
  }
  if (current_fiber != nullptr) {
    std::fprintf(stderr, "cuda_emulation: a kernel launched from inside an emulated kernel\n");
    std::abort();
  }

  std::lock_guard<std::mutex> launch_lock(launch_mutex);
  Block b;
  b.threads = static_cast<int>(threads);
  b.warps = std::vector<Warp>(static_cast<size_t>((b.threads + 31) / 32));
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  std::vector<std::unique_ptr<Fiber>>& fibers = fiber_pool();
  while (static_cast<int>(fibers.size()) < b.threads)
    fibers.push_back(std::make_unique<Fiber>(static_cast<int>(fibers.size())));

  Launch launch;
  launch.block = &b;
  launch.body = &body;
#if defined(KVPRESS_EMULATION_TSAN)
  launch.scheduler_tsan_fiber = __tsan_get_current_fiber();
#endif
  active_launch = &launch;

  std::string error;
  for (uint64_t n = 0; n < blocks && error.empty(); ++n) {
    const uint3 index{static_cast<unsigned>(n % grid.x), static_cast<unsigned>(n / grid.x % grid.y),
                      static_cast<unsigned>(n / (static_cast<uint64_t>(grid.x) * grid.y))};
    b.reset(index, dynamic_shared_bytes);
    happens_before(&block_start_token);
    {
      ModelInternals hidden;
      for (int t = 0; t < b.threads; ++t) {
        start_fiber(*fibers[static_cast<size_t>(t)], grid, block);
        launch.ready.push_back(t);
      }
      while (!launch.ready.empty()) {
        const int t = launch.ready.front();
        launch.ready.pop_front();
        resume(launch, *fibers[static_cast<size_t>(t)]);
      }
      // Every wait is checked for a deadlock before it parks, so no thread can be left waiting.
      for (int t = 0; t < b.threads; ++t) {
        if (!fibers[static_cast<size_t>(t)]->finished) {
          std::fprintf(stderr, "cuda_emulation: thread %d of a block was left waiting with no thread ready\n", t);
          std::abort();
        }
      }
    }
    happens_after(&block_done_token);
    error = b.error;
  }
  active_launch = nullptr;
  if (!error.empty()) {
    record_error(cudaErrorLaunchFailure, error);
    return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace kvpress::cuda_emulation
