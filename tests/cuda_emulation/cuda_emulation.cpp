// The runtime of the CUDA execution model (cuda_emulation.h): launches, block barriers, warp
// collectives and launch limits. One mutex per block guards every collective's state; a waiting
// thread sleeps on a condition variable (blocks have up to 1024 threads and machines 2 cores).
//
// Under ThreadSanitizer the model's own locks would order the kernel's threads where CUDA does not
// (every collective of a block shares one mutex, so a shuffle would hide a missing barrier). So the
// model's bookkeeping is hidden from it (ModelInternals) and only what CUDA orders is annotated:
// the launch before the block's threads, each block's threads before the next block (blocks run one
// at a time here), and __syncthreads among the block's threads. Shuffles and votes order nothing.
#include "cuda_emulation.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}
#endif

namespace kvpress::cuda_emulation {
namespace {

// While alive: this thread's synchronisation and memory accesses are invisible to ThreadSanitizer.
class ModelInternals {
 public:
#if defined(__SANITIZE_THREAD__)
  ModelInternals() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~ModelInternals() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
#else
  ModelInternals() = default;
#endif
  ModelInternals(const ModelInternals&) = delete;
  ModelInternals& operator=(const ModelInternals&) = delete;
};
// An ordering CUDA guarantees: everything before happens_before(token) in one thread happens before
// everything after happens_after(token) in another.
void happens_before(void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(token);
#else
  (void)token;
#endif
}
void happens_after(void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(token);
#else
  (void)token;
#endif
}

constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr size_t kOptInSharedLimit = 227 * 1024;  // sm_90 (H100 / H200)

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
  std::condition_variable cv;
  // warp_all_gather's contributions, by the parity of the gather (a lane can be at most one gather
  // ahead of the slowest lane still reading the previous one).
  std::vector<unsigned char> gathered[2];
};

struct Block {
  std::mutex mutex;
  std::condition_variable barrier_cv;
  int threads = 0;
  int exited = 0;
  int waiting = 0;  // threads in a collective that has not completed yet
  int at_barrier = 0;
  uint64_t barrier_generation = 0;
  int accumulator = 0;
  int results[2] = {};
  std::vector<bool> left;  // per thread: has returned from the kernel
  std::vector<Warp> warps;
  // Dynamic shared memory, 128-byte aligned as on the GPU (wmma needs 32-byte aligned tiles).
  struct alignas(128) SharedLine {
    unsigned char bytes[128];
  };
  std::vector<SharedLine> dynamic_shared;
  char barrier_tokens[2] = {};     // __syncthreads of even / odd generations
  std::atomic<uint64_t> epoch{0};  // bumped whenever waiters are released (wait_for)
  std::string error;
  uint3 index{0, 0, 0};

  void reset(uint3 block_index, size_t shared_bytes) {
    exited = waiting = at_barrier = 0;
    accumulator = 0;
    left.assign(static_cast<size_t>(threads), false);
    for (Warp& w : warps) {
      w.arrived = w.mask = 0;
      w.what = nullptr;
      std::fill(std::begin(w.pending), std::end(w.pending), false);
    }
    dynamic_shared.resize((shared_bytes + sizeof(SharedLine) - 1) / sizeof(SharedLine));
    // A NaN (and -1) pattern: a read before any write shows in the results.
    if (!dynamic_shared.empty()) std::memset(dynamic_shared.data(), 0xff, dynamic_shared.size() * sizeof(SharedLine));
    index = block_index;
  }
};

thread_local ThreadIndex tls_index;
thread_local Block* tls_block = nullptr;
thread_local int tls_linear = 0;
thread_local uint64_t tls_gathers = 0;  // warp_all_gather calls of this thread in the current block

std::mutex launch_mutex;  // one launch at a time: blocks never overlap, so __shared__ is one copy
// ThreadSanitizer tokens: the coordinator starts a block after the launch and the previous block.
char block_start_token, block_done_token;
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
  const ThreadIndex& t = tls_index;
  char buf[160];
  std::snprintf(buf, sizeof(buf), "block (%u, %u, %u), thread (%u, %u, %u)", t.block.x, t.block.y, t.block.z,
                t.thread.x, t.thread.y, t.thread.z);
  return buf;
}

// Marks the launch failed (first message wins) and wakes every sleeper. Caller holds b.mutex.
void fail_locked(Block& b, const std::string& message) {
  if (b.error.empty()) b.error = message + " (" + where() + ")";
  b.epoch.fetch_add(1, std::memory_order_release);
  b.barrier_cv.notify_all();
  for (Warp& w : b.warps) w.cv.notify_all();
}

[[noreturn]] void abort_locked(Block& b, const std::string& message) {
  fail_locked(b, message);
  throw Abort{};
}

// Before sleeping: if every thread still in the kernel is asleep, none will wake the others.
void check_deadlock_locked(Block& b) {
  if (b.waiting + b.exited == b.threads)
    abort_locked(b, "deadlock: every thread of the block waits in a collective that others never reach");
}

// Waits until done(): first by yielding the CPU (the threads that can release this one are usually
// runnable, and a yield costs far less than a futex sleep and wake-up), looking at the lock only
// when `epoch` moved (every release of waiters bumps it), then asleep.
template <typename Done>
void wait_for(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, const std::atomic<uint64_t>& epoch,
              Done done) {
  constexpr int kYields = 1024;
  int yields = 0;
  while (yields < kYields && !done()) {
    const uint64_t seen = epoch.load(std::memory_order_acquire);
    lock.unlock();
    while (yields < kYields && epoch.load(std::memory_order_acquire) == seen) {
      std::this_thread::yield();
      ++yields;
    }
    lock.lock();
  }
  cv.wait(lock, done);
}

Block& block_of_thread(const char* what) {
  if (tls_block == nullptr) {
    std::fprintf(stderr, "cuda_emulation: %s called outside an emulated kernel\n", what);
    std::abort();
  }
  return *tls_block;
}

// The threads that play a block's threads, kept for the whole process: starting 256 threads takes
// tens of milliseconds (libtorch's thread-local storage), far more than running a small launch.
class ThreadPool {
 public:
  // Runs job(i) on threads i = 0 .. n - 1 and returns when all have returned.
  void run(int n, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < n) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { loop(index); });
    }
    job_ = &job;
    job_threads_ = n;
    finished_ = 0;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return finished_ == job_threads_; });
    job_ = nullptr;
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      shutdown_ = true;
    }
    start_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

 private:
  void loop(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return generation_ != seen || shutdown_; });
      if (shutdown_) return;
      seen = generation_;
      if (index >= job_threads_) continue;
      const std::function<void(int)>* job = job_;
      lock.unlock();
      (*job)(index);
      lock.lock();
      if (++finished_ == job_threads_) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int job_threads_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool shutdown_ = false;
};

ThreadPool& pool() {
  static ThreadPool instance;
  return instance;
}

}  // namespace

ThreadIndex& current() { return tls_index; }

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
    // The generation is read under the lock; its token is released outside the hidden region.
    ModelInternals hidden;
    std::lock_guard<std::mutex> lock(b.mutex);
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
  std::unique_lock<std::mutex> lock(b.mutex);
  if (!b.error.empty()) throw Abort{};
  if (b.exited > 0) abort_locked(b, "__syncthreads reached after some threads of the block returned");
  const uint64_t generation = b.barrier_generation;
  if (b.at_barrier == 0) b.accumulator = mode == 2 ? 1 : 0;
  const int p = predicate != 0;
  if (mode == 1) b.accumulator |= p;
  if (mode == 2) b.accumulator &= p;
  if (mode == 3) b.accumulator += p;
  if (++b.at_barrier == b.threads) {
    b.results[generation & 1] = b.accumulator;
    b.at_barrier = 0;
    b.waiting -= b.threads - 1;  // the sleepers are released now, before they wake
    ++b.barrier_generation;
    b.epoch.fetch_add(1, std::memory_order_release);
    b.barrier_cv.notify_all();
    return b.results[generation & 1];
  }
  ++b.waiting;
  check_deadlock_locked(b);
  wait_for(lock, b.barrier_cv, b.epoch, [&] { return b.barrier_generation != generation || !b.error.empty(); });
  if (!b.error.empty()) throw Abort{};
  return b.results[generation & 1];
}

// A warp collective: `source` >= 0 reads that lane's value; -1 is a vote (ballot of predicates).
uint64_t warp_collective(unsigned mask, uint64_t value, int source, const char* what) {
  Block& b = block_of_thread(what);
  ModelInternals hidden;
  std::unique_lock<std::mutex> lock(b.mutex);
  if (!b.error.empty()) throw Abort{};
  const int warp = tls_linear / 32, lane = tls_linear % 32;
  const int lanes = std::min(32, b.threads - warp * 32);
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  char buf[200];
  if (((mask >> lane) & 1u) == 0) {
    std::snprintf(buf, sizeof(buf), "%s: lane %d calls it with mask 0x%08x, which leaves the lane out", what, lane,
                  mask);
    abort_locked(b, buf);
  }
  if ((mask & ~present) != 0) {
    std::snprintf(buf, sizeof(buf), "%s: mask 0x%08x names lanes that warp %d lacks (it has %d)", what, mask, warp,
                  lanes);
    abort_locked(b, buf);
  }
  for (int l = 0; l < lanes; ++l) {
    if (((mask >> l) & 1u) && b.left[static_cast<size_t>(warp * 32 + l)]) {
      std::snprintf(buf, sizeof(buf), "%s: mask 0x%08x names lane %d, which has returned from the kernel", what, mask,
                    l);
      abort_locked(b, buf);
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
    abort_locked(b, buf);
  }
  if (source >= 0 && ((mask >> source) & 1u) == 0) {
    std::snprintf(buf, sizeof(buf), "%s: lane %d reads lane %d, outside the mask 0x%08x", what, lane, source, mask);
    abort_locked(b, buf);
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
    b.waiting -= __builtin_popcount(mask) - 1;  // the sleepers are released now, before they wake
    b.epoch.fetch_add(1, std::memory_order_release);
    w.cv.notify_all();
    return w.delivered[lane];
  }
  ++b.waiting;
  check_deadlock_locked(b);
  wait_for(lock, w.cv, b.epoch, [&] { return !w.pending[lane] || !b.error.empty(); });
  if (!b.error.empty()) throw Abort{};
  return w.delivered[lane];
}

// The thread has returned from the kernel (or left it on an error).
void thread_exit(Block& b) {
  ModelInternals hidden;
  std::lock_guard<std::mutex> lock(b.mutex);
  b.left[static_cast<size_t>(tls_linear)] = true;
  ++b.exited;
  if (!b.error.empty()) return;
  if (b.at_barrier > 0) {
    fail_locked(b, "a thread returned from the kernel while others wait at __syncthreads");
    return;
  }
  const int warp = tls_linear / 32, lane = tls_linear % 32;
  const Warp& w = b.warps[static_cast<size_t>(warp)];
  if (w.arrived != 0 && ((w.mask >> lane) & 1u)) {
    fail_locked(b, std::string(w.what) + ": a lane in the mask returned from the kernel while the others wait");
    return;
  }
  if (b.waiting > 0 && b.waiting + b.exited == b.threads)
    fail_locked(b, "deadlock: every thread left waits in a collective that others never reach");
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
  const int warp = tls_linear / 32, lane = tls_linear % 32;
  Warp& w = b.warps[static_cast<size_t>(warp)];
  std::vector<unsigned char>& buffer = w.gathered[tls_gathers++ & 1];
  {
    ModelInternals hidden;
    std::lock_guard<std::mutex> lock(b.mutex);
    if (!b.error.empty()) throw Abort{};
    if (buffer.size() < 32 * bytes) buffer.resize(32 * bytes);
    std::memcpy(buffer.data() + static_cast<size_t>(lane) * bytes, own, bytes);
  }
  // The whole warp meets here (an error if a lane is missing, has left, or is elsewhere).
  warp_collective(0xffffffffu, 0, -1, what);
  ModelInternals hidden;
  std::lock_guard<std::mutex> lock(b.mutex);
  std::memcpy(all, buffer.data(), 32 * bytes);
}

void kernel_error(const std::string& message) {
  Block& b = block_of_thread("kernel_error");
  ModelInternals hidden;
  std::lock_guard<std::mutex> lock(b.mutex);
  if (!b.error.empty()) throw Abort{};
  abort_locked(b, message);
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

  std::lock_guard<std::mutex> launch_lock(launch_mutex);
  Block b;
  b.threads = static_cast<int>(threads);
  b.warps = std::vector<Warp>(static_cast<size_t>((b.threads + 31) / 32));
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;

  // The block's threads live for the whole launch; the coordinator (this thread) starts each block
  // once the previous one has finished in every thread.
  std::mutex start_mutex;
  std::condition_variable start_cv, done_cv;
  uint64_t started = 0;  // blocks started so far
  std::atomic<uint64_t> start_epoch{0};
  int done = 0;  // threads finished with the current block
  bool stop = false;

  const std::function<void(int)> worker = [&](int linear) {
    tls_linear = linear;
    tls_block = &b;
    for (uint64_t next = 1;; ++next) {
      {
        ModelInternals hidden;
        std::unique_lock<std::mutex> lock(start_mutex);
        wait_for(lock, start_cv, start_epoch, [&] { return started >= next || stop; });
        if (stop) break;
      }
      happens_after(&block_start_token);
      tls_index.block_dim = block;
      tls_index.grid_dim = grid;
      tls_index.thread =
          uint3{static_cast<unsigned>(linear) % block.x, static_cast<unsigned>(linear) / block.x % block.y,
                static_cast<unsigned>(linear) / (block.x * block.y)};
      tls_index.block = b.index;
      tls_gathers = 0;
      try {
        body();
      } catch (const Abort&) {
      } catch (const std::exception& e) {
        ModelInternals hidden;
        std::lock_guard<std::mutex> lock(b.mutex);
        fail_locked(b, std::string("the kernel threw: ") + e.what());
      }
      thread_exit(b);
      happens_before(&block_done_token);
      {
        ModelInternals hidden;
        std::lock_guard<std::mutex> lock(start_mutex);
        ++done;
        done_cv.notify_one();
      }
    }
    tls_block = nullptr;
  };

  std::string error;
  std::thread coordinator([&] {
    for (uint64_t n = 0; n < blocks && error.empty(); ++n) {
      const uint3 index{static_cast<unsigned>(n % grid.x), static_cast<unsigned>(n / grid.x % grid.y),
                        static_cast<unsigned>(n / (static_cast<uint64_t>(grid.x) * grid.y))};
      {
        std::lock_guard<std::mutex> lock(b.mutex);
        b.reset(index, dynamic_shared_bytes);
      }
      happens_before(&block_start_token);
      {
        ModelInternals hidden;
        std::unique_lock<std::mutex> lock(start_mutex);
        done = 0;
        ++started;
        start_epoch.fetch_add(1, std::memory_order_release);
        start_cv.notify_all();
        done_cv.wait(lock, [&] { return done == b.threads; });
      }
      happens_after(&block_done_token);
      std::lock_guard<std::mutex> lock(b.mutex);
      error = b.error;
    }
    {
      ModelInternals hidden;
      std::lock_guard<std::mutex> lock(start_mutex);
      stop = true;
      start_epoch.fetch_add(1, std::memory_order_release);
      start_cv.notify_all();
    }
  });
  pool().run(b.threads, worker);
  coordinator.join();
  if (!error.empty()) {
    record_error(cudaErrorLaunchFailure, error);
    return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace kvpress::cuda_emulation
