// Torch-free CUDA selection kernels of kvpress::topk_indices and kvpress::gather_kv.
// Top-k: one block per row. Scores become order-preserving uint32 keys (-0 folded into +0, so
// equal floats stay equal); four 8-bit radix passes find the k-th largest key T and how many of
// the keys equal to T are kept (the k - #(> T) lowest positions among them). Each thread then
// owns a contiguous run of positions: two block scans (ties before the run, kept before the run)
// give every thread its output offset, and a last sweep writes the kept positions in ascending
// order. The same set as a stable descending sort, without sorting.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "selection/cuda/selection_launch.h"

namespace kvpress::cuda {

constexpr int kTopkThreads = 1024;

// Order-preserving uint32 key of a float (-0 folded into +0, so equal floats stay equal).
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v == 0.f) v = 0.f;  // -0 == +0
  const uint32_t bits = __float_as_uint(v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_rows_kernel(const float* __restrict__ scores, int64_t seq, int64_t k, int64_t* __restrict__ out,
                     int* __restrict__ not_finite) {
  __shared__ int64_t scan_scratch[kWarpSize];
  __shared__ unsigned int hist[256];
  __shared__ uint32_t prefix_sh;
  __shared__ int64_t remaining_sh;
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * seq;
  int64_t* dst = out + static_cast<int64_t>(blockIdx.x) * k;

  bool finite = true;
  for (int64_t i = threadIdx.x; i < seq; i += blockDim.x) finite &= isfinite(row[i]);
  if (__syncthreads_or(!finite)) {
    if (threadIdx.x == 0) atomicExch(not_finite, 1);
    return;
  }

  // Radix select of the k-th largest key, most significant byte first.
  uint32_t prefix = 0, mask = 0;
  int64_t remaining = k;  // rank of the wanted key among the keys that match `prefix`
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < seq; i += blockDim.x) {
      const uint32_t key = order_key(row[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t above = 0;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (above + hist[digit] >= remaining) break;
        above += hist[digit];
      }
      prefix_sh = prefix | (static_cast<uint32_t>(digit) << shift);
      remaining_sh = remaining - above;
    }
    __syncthreads();
    prefix = prefix_sh;
    remaining = remaining_sh;
    mask |= 0xffu << shift;
  }
  const uint32_t threshold = prefix;
  const int64_t ties_kept = remaining;  // keys equal to the threshold that are kept, lowest first

  // Contiguous run of positions per thread.
  const int64_t per_thread = (seq + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(seq, per_thread * threadIdx.x), end = min(seq, begin + per_thread);
  int64_t greater = 0, equal = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = order_key(row[i]);
    greater += key > threshold;
    equal += key == threshold;
  }
  const int64_t equal_before = block_exclusive_sum(equal, scan_scratch);
  int64_t ties_here = ties_kept - equal_before;
  ties_here = ties_here < 0 ? 0 : (ties_here > equal ? equal : ties_here);
  int64_t offset = block_exclusive_sum(greater + ties_here, scan_scratch);
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = order_key(row[i]);
    if (key > threshold || (key == threshold && ties_here-- > 0)) dst[offset++] = i;
  }
}

// out[row, j, :] = in[row, indices[row, j], :] for keys and values; bad indices raise a flag.
template <typename word_t>
__global__ void gather_rows_kernel(const word_t* __restrict__ keys, const word_t* __restrict__ values,
                                   const int64_t* __restrict__ indices, int64_t seq, int64_t n, int64_t words,
                                   int64_t total, word_t* __restrict__ keys_out, word_t* __restrict__ values_out,
                                   int* __restrict__ bad) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t w = e % words, slot = e / words;  // slot = row * n + j
    const int64_t row = slot / n;
    const int64_t pos = indices[slot];
    if (pos < 0 || pos >= seq) {
      atomicExch(bad, 1);  // many threads may flag at once
      continue;
    }
    const int64_t src = (row * seq + pos) * words + w;
    keys_out[e] = keys[src];
    values_out[e] = values[src];
  }
}

cudaError_t launch_topk_rows(const float* scores, int64_t rows, int64_t seq, int64_t k, int64_t* out, int* not_finite,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 2147483647) return cudaErrorInvalidValue;  // gridDim.x
  KVPRESS_LAUNCH(topk_rows_kernel, static_cast<unsigned>(rows), kTopkThreads, 0, stream, scores, seq, k, out,
                 not_finite);
  return cudaGetLastError();
}

// Copies in the widest word that divides a row and every base address (views may start anywhere).
cudaError_t launch_gather_rows(const void* keys, const void* values, const int64_t* indices, int64_t rows, int64_t seq,
                               int64_t n, int64_t row_bytes, void* keys_out, void* values_out, int* bad,
                               cudaStream_t stream) {
  if (rows * n == 0 || row_bytes == 0) return cudaSuccess;
  auto launch = [&](auto word) {
    using word_t = decltype(word);
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(word_t));
    const int64_t total = rows * n * words;
    const int64_t blocks = (total + 255) / 256 < 65535 * 4 ? (total + 255) / 256 : 65535 * 4;
    KVPRESS_LAUNCH(gather_rows_kernel<word_t>, static_cast<unsigned>(blocks), 256, 0, stream,
                   static_cast<const word_t*>(keys), static_cast<const word_t*>(values), indices, seq, n, words, total,
                   static_cast<word_t*>(keys_out), static_cast<word_t*>(values_out), bad);
  };
  const auto address = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  const int64_t align = row_bytes | address(keys) | address(values) | address(keys_out) | address(values_out);
  if (align % 16 == 0)
    launch(uint4{});
  else if (align % 8 == 0)
    launch(uint2{});
  else if (align % 4 == 0)
    launch(uint32_t{});
  else
    launch(uint16_t{});
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
