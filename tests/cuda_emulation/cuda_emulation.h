// A model of CUDA's execution on the CPU, for tests: the torch-free kernels of src/ops/<family>/cuda/*.cuh
// compile with the host compiler against this header and run on host memory, so that every
// machine executes them and compares them with the CPU kernels (tests/test_cuda_emulation.cpp).
//
// What is modelled:
//   * A launch runs its grid one block at a time, in blockIdx order. The block's threads are fibers
//     (a context and a stack each) run one at a time on the launching thread, each until it waits
//     in a barrier or a warp collective; ThreadSanitizer sees each as a thread of its own, ordered
//     only by what CUDA orders, so a missing __syncthreads() or a shared-memory race is a data race
//     it reports.
//   * __syncthreads() (and its _or/_and/_count forms) is a barrier of the whole block. A thread
//     that has left the kernel while others wait at a barrier is an error (CUDA: undefined, hangs
//     or corrupts).
//   * Warp shuffles and votes exchange values among the 32 lanes named by their mask: every lane
//     in the mask must reach the same call with the same mask; a lane outside the mask, a mask
//     naming a lane the block lacks or one that has left, is an error.
//   * __shared__ variables are one copy per kernel, reused by each block (blocks never overlap);
//     dynamic shared memory (KVPRESS_DYNAMIC_SHARED) is a fresh buffer per block, filled with a
//     NaN pattern so that a read before any write shows.
//   * Atomics are real atomic operations; the index variables are per thread.
//   * wmma (nvcuda::wmma, 16x16x16 with half or bfloat16 inputs and a float32 accumulator): each lane
//     holds 8 elements of a fragment, as on the GPU (which elements is the model's choice, as it
//     is the hardware's: kernels may only do the same thing to every element). load/store/mma are
//     collectives of the whole warp: every lane must reach them with the same pointer and leading
//     dimension, the pointer 32-byte aligned and the leading dimension a multiple of 16 bytes. The
//     product is exact and summed in float32 in k order (the tensor cores' order and rounding of
//     that sum are not modelled).
//   * Launch limits as on the GPU: at most 1024 threads a block (x, y <= 1024, z <= 64), grid
//     x < 2^31, y and z <= 65535, no empty dimension, dynamic shared memory above 48 KiB only
//     after cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize); an invalid launch
//     runs nothing and cudaGetLastError() reports it.
// What is not: timing, memory coalescing, shared memory bank conflicts, real warp scheduling (lanes are independent
// threads, which is stricter: code that relies on implicit warp-synchronous execution fails here), the toolkit's code
// generation and the precision of fast intrinsics (__expf is expf here).
//
// Include this header before any kernel header, in a translation unit of its own: it redefines
// __shared__, cudaGetLastError and the launch macro for everything included after it.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.h is for the host compiler; nvcc compiles the kernels for the GPU"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvpress::cuda_emulation {

// What the current thread of an emulated launch sees.
struct ThreadIndex {
  uint3 thread{0, 0, 0}, block{0, 0, 0};
  dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};
};
ThreadIndex& current();

// Collectives of the current block (cuda_emulation.cpp). `predicate` / `value` are this thread's.
int block_barrier(int predicate, int mode);  // mode: 0 plain, 1 or, 2 and, 3 count
uint64_t warp_exchange(unsigned mask, uint64_t value, int source_lane, const char* what);
unsigned warp_ballot(unsigned mask, int predicate, const char* what);
void* dynamic_shared_memory();
// Every lane of the calling warp (all 32 must be present) contributes `bytes` bytes; `all` receives
// the 32 contributions in lane order. An error unless the whole warp reaches the same call.
void warp_all_gather(const void* own, size_t bytes, void* all, const char* what);
// Fails the launch from inside a kernel thread with `message` (as a GPU's fault would) and leaves it.
[[noreturn]] void kernel_error(const std::string& message);

// Runs `body` once per thread of every block of the grid; returns the launch's error.
cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const void* function,
                     const std::function<void()>& body);
cudaError_t take_last_error();
// The message of the last failed launch ("" if none): which rule, which block and thread.
std::string last_error_message();
cudaError_t set_max_dynamic_shared(const void* function, int bytes);

template <typename Kernel, typename... Args>
void launch(Kernel* kernel, dim3 grid, dim3 block, size_t shared, cudaStream_t /*stream*/, Args&&... args) {
  // Arguments are copied once, like a real launch's argument buffer; each thread gets its own
  // copies of the kernel's parameters.
  auto bound = std::make_tuple(std::forward<Args>(args)...);
  run_grid(grid, block, shared, reinterpret_cast<const void*>(kernel), [&] { std::apply(*kernel, bound); });
}

template <typename T>
T bits_to(uint64_t bits) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

inline unsigned lane_id() {
  const ThreadIndex& t = current();
  const unsigned linear = t.thread.x + t.block_dim.x * (t.thread.y + t.block_dim.y * t.thread.z);
  return linear % 32u;
}

}  // namespace kvpress::cuda_emulation

// ---- The CUDA names the kernels use --------------------------------------------------------
#define threadIdx (::kvpress::cuda_emulation::current().thread)
#define blockIdx (::kvpress::cuda_emulation::current().block)
#define blockDim (::kvpress::cuda_emulation::current().block_dim)
#define gridDim (::kvpress::cuda_emulation::current().grid_dim)

// One copy per kernel (per template instance), shared by the block's threads.
#undef __shared__
#define __shared__ static
#define KVPRESS_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::kvpress::cuda_emulation::dynamic_shared_memory())
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define KVPRESS_LAUNCH(kernel, grid, block, shared, stream, ...) \
  ::kvpress::cuda_emulation::launch(&kernel, grid, block, shared, stream, __VA_ARGS__)
#define cudaGetLastError ::kvpress::cuda_emulation::take_last_error

inline void __syncthreads() { ::kvpress::cuda_emulation::block_barrier(0, 0); }
inline int __syncthreads_or(int p) { return ::kvpress::cuda_emulation::block_barrier(p, 1); }
inline int __syncthreads_and(int p) { return ::kvpress::cuda_emulation::block_barrier(p, 2); }
inline int __syncthreads_count(int p) { return ::kvpress::cuda_emulation::block_barrier(p, 3); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  namespace emu = ::kvpress::cuda_emulation;
  const int lane = static_cast<int>(emu::lane_id());
  const int source = (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1));
  return emu::bits_to<T>(emu::warp_exchange(mask, emu::to_bits(v), source, "__shfl_xor_sync"));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  namespace emu = ::kvpress::cuda_emulation;
  const int lane = static_cast<int>(emu::lane_id());
  const int in_segment = lane & (width - 1);
  const int source = in_segment >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return emu::bits_to<T>(emu::warp_exchange(mask, emu::to_bits(v), source, "__shfl_up_sync"));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  namespace emu = ::kvpress::cuda_emulation;
  const int lane = static_cast<int>(emu::lane_id());
  const int in_segment = lane & (width - 1);
  const int source = in_segment + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
  return emu::bits_to<T>(emu::warp_exchange(mask, emu::to_bits(v), source, "__shfl_down_sync"));
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  namespace emu = ::kvpress::cuda_emulation;
  const int lane = static_cast<int>(emu::lane_id());
  const int source = (lane & ~(width - 1)) | (src_lane & (width - 1));
  return emu::bits_to<T>(emu::warp_exchange(mask, emu::to_bits(v), source, "__shfl_sync"));
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  return ::kvpress::cuda_emulation::warp_ballot(mask, p, "__ballot_sync");
}
inline int __any_sync(unsigned mask, int p) {
  return ::kvpress::cuda_emulation::warp_ballot(mask, p, "__any_sync") != 0;
}
inline int __all_sync(unsigned mask, int p) {
  return (::kvpress::cuda_emulation::warp_ballot(mask, p, "__all_sync") & mask) == mask;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::kvpress::cuda_emulation::warp_ballot(mask, 0, "__syncwarp"); }

// Atomics: gcc's __atomic builtins (ThreadSanitizer understands them), relaxed like CUDA's.
template <typename T>
T atomicAdd(T* address, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
    Bits* word = reinterpret_cast<Bits*>(address);
    Bits old = __atomic_load_n(word, __ATOMIC_RELAXED);
    for (;;) {
      T value;
      std::memcpy(&value, &old, sizeof(T));
      const T sum = value + v;
      Bits desired;
      std::memcpy(&desired, &sum, sizeof(T));
      if (__atomic_compare_exchange_n(word, &old, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return value;
    }
  } else {
    return __atomic_fetch_add(address, v, __ATOMIC_RELAXED);
  }
}
template <typename T>
T atomicExch(T* address, T v) {
  return __atomic_exchange_n(address, v, __ATOMIC_RELAXED);
}
template <typename T>
T atomicOr(T* address, T v) {
  return __atomic_fetch_or(address, v, __ATOMIC_RELAXED);
}
template <typename T>
T atomicMax(T* address, T v) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(address, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

// Device intrinsics and overloads the host lacks.
using std::isfinite;
using std::isinf;
using std::isnan;
inline float __expf(float x) { return std::exp(x); }
// Rounded products and differences, never fused (the test binary is compiled with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline unsigned __float_as_uint(float x) {
  return ::kvpress::cuda_emulation::bits_to<unsigned>(::kvpress::cuda_emulation::to_bits(x));
}
inline float __uint_as_float(unsigned x) { return ::kvpress::cuda_emulation::bits_to<float>(x); }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a < b ? b : a; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }

// ---- wmma: warp-wide matrix tiles (the subset the kernels use) ------------------------------
namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the CUDA model has wmma's 16x16x16 shape only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "the CUDA model has half / bfloat16 inputs and float32 accumulators only");

 public:
  static constexpr int num_elements = 16 * 16 / 32;
  T x[num_elements];
};

namespace detail {

// Element e of a lane is the tile's element (row, col) with row * 16 + col = e * 32 + lane.
inline int tile_row(int e, int lane) { return (e * 32 + lane) / 16; }
inline int tile_col(int e, int lane) { return (e * 32 + lane) % 16; }
inline size_t offset(int row, int col, unsigned ldm, bool row_major) {
  return row_major ? static_cast<size_t>(row) * ldm + col : static_cast<size_t>(col) * ldm + row;
}
template <typename T>
float to_float(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else
    return __bfloat162float(v);
}

// The warp must agree on the tile's address and leading dimension; both must suit wmma.
inline void check_tile(const void* p, unsigned ldm, size_t element_bytes, const char* what) {
  namespace emu = ::kvpress::cuda_emulation;
  struct Tile {
    const void* p;
    uint64_t ldm;
  } own{p, ldm}, all[32];
  emu::warp_all_gather(&own, sizeof(Tile), all, what);
  char buf[200];
  for (int l = 1; l < 32; ++l) {
    if (all[l].p != all[0].p || all[l].ldm != all[0].ldm) {
      std::snprintf(buf, sizeof(buf), "%s: lane %d passes (%p, ldm %llu), lane 0 (%p, ldm %llu)", what, l, all[l].p,
                    static_cast<unsigned long long>(all[l].ldm), all[0].p, static_cast<unsigned long long>(all[0].ldm));
      emu::kernel_error(buf);
    }
  }
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) {
    std::snprintf(buf, sizeof(buf), "%s: tile address %p is not 32-byte aligned", what, p);
    emu::kernel_error(buf);
  }
  if ((ldm * element_bytes) % 16 != 0) {
    std::snprintf(buf, sizeof(buf), "%s: leading dimension %u is not a multiple of 16 bytes", what, ldm);
    emu::kernel_error(buf);
  }
}

template <typename Layout>
constexpr bool is_row_major() {
  static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>,
                "an input fragment needs row_major or col_major");
  return std::is_same_v<Layout, row_major>;
}

}  // namespace detail

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, T value) {
  for (T& v : f.x) v = value;
}

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  detail::check_tile(p, ldm, sizeof(T), "wmma::load_matrix_sync");
  const int lane = static_cast<int>(::kvpress::cuda_emulation::lane_id());
  for (int e = 0; e < f.num_elements; ++e)
    f.x[e] =
        p[detail::offset(detail::tile_row(e, lane), detail::tile_col(e, lane), ldm, detail::is_row_major<Layout>())];
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm,
                             layout_t layout) {
  detail::check_tile(p, ldm, sizeof(float), "wmma::load_matrix_sync");
  const int lane = static_cast<int>(::kvpress::cuda_emulation::lane_id());
  for (int e = 0; e < f.num_elements; ++e)
    f.x[e] = p[detail::offset(detail::tile_row(e, lane), detail::tile_col(e, lane), ldm, layout == mem_row_major)];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  detail::check_tile(p, ldm, sizeof(float), "wmma::store_matrix_sync");
  const int lane = static_cast<int>(::kvpress::cuda_emulation::lane_id());
  for (int e = 0; e < f.num_elements; ++e)
    p[detail::offset(detail::tile_row(e, lane), detail::tile_col(e, lane), ldm, layout == mem_row_major)] = f.x[e];
}

// d = a b + c; d may be c.
template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  constexpr int n = 16 * 16 / 32;
  float own[2 * n], all[32][2 * n];
  for (int e = 0; e < n; ++e) {
    own[e] = detail::to_float(a.x[e]);
    own[n + e] = detail::to_float(b.x[e]);
  }
  ::kvpress::cuda_emulation::warp_all_gather(own, sizeof(own), all, "wmma::mma_sync");
  float tile_a[16][16], tile_b[16][16];
  for (int l = 0; l < 32; ++l) {
    for (int e = 0; e < n; ++e) {
      tile_a[detail::tile_row(e, l)][detail::tile_col(e, l)] = all[l][e];
      tile_b[detail::tile_row(e, l)][detail::tile_col(e, l)] = all[l][n + e];
    }
  }
  const int lane = static_cast<int>(::kvpress::cuda_emulation::lane_id());
  for (int e = 0; e < n; ++e) {
    const int row = detail::tile_row(e, lane), col = detail::tile_col(e, lane);
    float sum = c.x[e];
    for (int k = 0; k < 16; ++k) sum += tile_a[row][k] * tile_b[k][col];
    d.x[e] = sum;
  }
}

}  // namespace nvcuda::wmma

// The model's launch-time opt-in to more than 48 KiB of dynamic shared memory.
#define KVPRESS_SET_MAX_DYNAMIC_SHARED(kernel, bytes) \
  ::kvpress::cuda_emulation::set_max_dynamic_shared(reinterpret_cast<const void*>(&kernel), bytes)
