// A model of CUDA's execution on the CPU, for tests: the torch-free kernels of kernels/cuda/*.cuh
// compile with the host compiler against this header and run on host memory, so that every
// machine executes them and compares them with the CPU kernels (tests/test_cuda_emulation.cpp).
//
// What is modelled:
//   * A launch runs its grid one block at a time, in blockIdx order; the block's threads are real
//     concurrent threads (std::thread), so a missing __syncthreads() or a shared-memory race is a
//     real data race, which ThreadSanitizer reports.
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
//   * Launch limits as on the GPU: at most 1024 threads a block (x, y <= 1024, z <= 64), grid
//     x < 2^31, y and z <= 65535, no empty dimension, dynamic shared memory above 48 KiB only
//     after cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize); an invalid launch
//     runs nothing and cudaGetLastError() reports it.
// What is not: timing, memory coalescing, real warp scheduling (lanes are independent threads,
// which is stricter: code that relies on implicit warp-synchronous execution fails here),
// the toolkit's code generation and the precision of fast intrinsics (__expf is expf here).
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
