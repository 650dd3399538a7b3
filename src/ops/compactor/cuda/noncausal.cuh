// Torch-free CUDA kernel of kvpress::noncausal_column_sums for half and bfloat16 (noncausal_launch.h
// has the plan). kvpress's chunked non-causal attention: per chunk of C positions and query head,
// softmax(Q_c K_cᵀ) over the chunk's keys (no 1/sqrt(D)), summed over the chunk's query rows. Its
// composite writes [Hq, C, C] float32 logits per chunk, softmaxes and sums them (about 16x the
// bytes of the queries and keys, docs/PERFORMANCE.md); here they stay in shared memory.
//
// kvpress's padded last chunk (S not a multiple of C): real rows also see C - len key columns of
// logit -1e-9, and each of the C - len pad rows (logit 0 on the real columns, -1e-9 on the pad ones)
// adds 1 / (len + (C - len) e^-1e-9) to every real column, as the CPU kernel counts them.
#pragma once

#if defined(__CUDACC__)
#include <mma.h>
#endif

#include <cuda_runtime.h>

#include <cstdint>

#include "compactor/cuda/noncausal_launch.h"
#include "cuda/common.cuh"

namespace kvpress::cuda {

constexpr float kNoncausalPaddedLogit = -1e-9f;  // kvpress's logit of a pad key column

template <typename T>
__global__ void __launch_bounds__(kNoncausalMaxWarps* kWarpSize)
    noncausal_column_sums_kernel(const T* __restrict__ queries, int64_t q_batch_stride, int64_t q_head_stride,
                                 int64_t q_row_stride, const T* __restrict__ keys, int64_t k_batch_stride,
                                 int64_t k_head_stride, int64_t k_row_stride, float* __restrict__ out, int64_t group,
                                 int64_t seq, int64_t dim, int64_t chunk, NoncausalPlan plan) {
  namespace wmma = nvcuda::wmma;
  KVPRESS_DYNAMIC_SHARED(unsigned char, shared);
  const int warps = plan.warps, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t heads = gridDim.y, h = blockIdx.y, b = blockIdx.z;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * chunk, len = min(chunk, seq - start);
  const int64_t pads = chunk - len;
  const int64_t width = (len + kNoncausalTile - 1) / kNoncausalTile * kNoncausalTile, tiles = width / kNoncausalTile;
  const int64_t ks = plan.key_stride, ls = plan.logit_stride;
  float* const logits = reinterpret_cast<float*>(shared + plan.logits_offset) + warp * kNoncausalTile * ls;
  float* const all_sums = reinterpret_cast<float*>(shared + plan.sums_offset);  // [warps][plan.width]
  float* const sums = all_sums + warp * plan.width;
  T* const keys_s = reinterpret_cast<T*>(shared + plan.keys_offset);
  T* const query_tile = reinterpret_cast<T*>(shared + plan.queries_offset) + warp * kNoncausalTile * ks;

  // The chunk's keys, rows past len zero (their logits are never read), and zero column sums.
  const T* k = keys + b * k_batch_stride + (h / group) * k_head_stride + start * k_row_stride;
  for (int64_t e = threadIdx.x; e < width * dim; e += blockDim.x) {
    const int64_t r = e / dim, d = e % dim;
    keys_s[r * ks + d] = r < len ? k[r * k_row_stride + d] : from_float<T>(0.f);
  }
  for (int64_t j = threadIdx.x; j < warps * plan.width; j += blockDim.x) all_sums[j] = 0.f;
  const T* q = queries + b * q_batch_stride + h * q_head_stride + start * q_row_stride;

  // Warp w takes row tiles w, w + warps, ...; every warp runs every round (barriers).
  for (int64_t round = 0; round < tiles; round += warps) {
    const int64_t tile = round + warp;
    const bool active = tile < tiles;
    if (active) {
      for (int64_t e = lane; e < kNoncausalTile * dim; e += kWarpSize) {
        const int64_t r = e / dim, d = e % dim, i = tile * kNoncausalTile + r;
        query_tile[r * ks + d] = i < len ? q[i * q_row_stride + d] : from_float<T>(0.f);
      }
    }
    __syncthreads();  // the keys (first round) and the query tile are in shared memory
    if (active) {
      for (int64_t kt = 0; kt < tiles; ++kt) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
        for (int64_t d0 = 0; d0 < dim; d0 += kNoncausalTile) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bt;  // Kᵀ: key rows as columns
          wmma::load_matrix_sync(a, query_tile + d0, static_cast<unsigned>(ks));
          wmma::load_matrix_sync(bt, keys_s + kt * kNoncausalTile * ks + d0, static_cast<unsigned>(ks));
          wmma::mma_sync(acc, a, bt, acc);
        }
        wmma::store_matrix_sync(logits + kt * kNoncausalTile, acc, static_cast<unsigned>(ls), wmma::mem_row_major);
      }
    }
    __syncthreads();  // the logits rows are in shared memory
    if (active) {
      // Each real row's softmax (logits rounded to T, as kvpress's GEMM in T), added into the warp's
      // column sums; lane l owns columns l, l + 32, ... in every row, so no two lanes share one.
      for (int r = 0; r < kNoncausalTile && tile * kNoncausalTile + r < len; ++r) {
        float* row = logits + r * ls;
        float row_max = pads > 0 ? kNoncausalPaddedLogit : -INFINITY;
        for (int64_t j = lane; j < len; j += kWarpSize) row_max = fmaxf(row_max, round_to<T>(row[j]));
        row_max = warp_max(row_max);
        float total = 0.f;
        for (int64_t j = lane; j < len; j += kWarpSize) {
          const float e = expf(round_to<T>(row[j]) - row_max);
          row[j] = e;
          total += e;
        }
        total = warp_sum(total);
        if (pads > 0) total += static_cast<float>(pads) * expf(kNoncausalPaddedLogit - row_max);
        const float inverse = 1.0f / total;
        for (int64_t j = lane; j < len; j += kWarpSize) sums[j] += row[j] * inverse;
      }
    }
  }
  __syncthreads();  // every warp's column sums are complete

  // Pad rows: logit 0 on the real columns (their max), -1e-9 on the pad ones.
  const float per_pad_row =
      pads > 0 ? 1.0f / (static_cast<float>(len) + static_cast<float>(pads) * expf(kNoncausalPaddedLogit)) : 0.f;
  float* o = out + (b * heads + h) * seq + start;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += all_sums[w * plan.width + j];
    o[j] = pads > 0 ? total + static_cast<float>(pads) * per_pad_row : total;
  }
}

template <typename T>
cudaError_t launch_noncausal_column_sums(const T* queries, int64_t q_batch_stride, int64_t q_head_stride,
                                         int64_t q_row_stride, const T* keys, int64_t k_batch_stride,
                                         int64_t k_head_stride, int64_t k_row_stride, float* out, int64_t group,
                                         int64_t seq, int64_t dim, int64_t chunk, const NoncausalPlan& plan,
                                         cudaStream_t stream) {
  if (!plan.applies) return cudaErrorInvalidValue;
  if (plan.shared_bytes > kSharedLimit) {
    const cudaError_t err =
        KVPRESS_SET_MAX_DYNAMIC_SHARED(noncausal_column_sums_kernel<T>, static_cast<int>(plan.shared_bytes));
    if (err != cudaSuccess) return err;
  }
  KVPRESS_LAUNCH(noncausal_column_sums_kernel<T>, plan.grid, plan.warps * kWarpSize, plan.shared_bytes, stream, queries,
                 q_batch_stride, q_head_stride, q_row_stride, keys, k_batch_stride, k_head_stride, k_row_stride, out,
                 group, seq, dim, chunk, plan);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
