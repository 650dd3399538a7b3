// CUDA kernel for kvpress::lagkv_partition_scores (LagKVPress): one block per (batch, head,
// scored partition p) reads partition p + 1 of K and V for the per-channel min/max, normalises
// partition p by it, takes each token's unbiased std over channels (one warp per token), the
// softmax over the partition in shared memory, the K/V average and, unless cross_scoring, the
// stable rank within the partition (ties to the lower position), rounded to the cache dtype as
// kvpress does. float32 accumulation for every dtype; K and V are read once (plus the reference).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "cuda/key_norm.cuh"  // to_float
#include "score_kernels.h"

namespace kvpress::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T>
__device__ __forceinline__ float round_to(float v) { return v; }
template <>
__device__ __forceinline__ float round_to<__half>(float v) { return __half2float(__float2half(v)); }
template <>
__device__ __forceinline__ float round_to<__nv_bfloat16>(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide max or sum (every thread gets the result).
__device__ float block_reduce(float v, float* scratch, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = is_max ? -INFINITY : 0.f;
  for (int w = 0; w < kWarps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// Softmax over the partition's lag per-token stds of one of K/V, into soft[0..lag).
// Shared layout: lo[dim], inv[dim].
template <typename T>
__device__ void partition_softmax(const T* __restrict__ cur, const T* __restrict__ ref, int lag, int dim,
                                  float* lo, float* inv, float* soft, float* scratch) {
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float mn = to_float(ref[d]), mx = mn;
    for (int t = 1; t < lag; ++t) {
      const float v = to_float(ref[static_cast<int64_t>(t) * dim + d]);
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    lo[d] = mn;
    inv[d] = 1.f / (mx - mn);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int t = warp; t < lag; t += kWarps) {
    const T* x = cur + static_cast<int64_t>(t) * dim;
    float s = 0.f;
    for (int d = lane; d < dim; d += 32) s += (to_float(x[d]) - lo[d]) * inv[d];
    const float mean = warp_sum(s) / static_cast<float>(dim);
    float q = 0.f;
    for (int d = lane; d < dim; d += 32) {
      const float y = (to_float(x[d]) - lo[d]) * inv[d] - mean;
      q += y * y;
    }
    q = warp_sum(q);
    if (lane == 0) soft[t] = sqrtf(q / static_cast<float>(dim - 1));  // dim 1: NaN, as torch
  }
  __syncthreads();
  float m = -INFINITY;
  for (int t = threadIdx.x; t < lag; t += blockDim.x) m = fmaxf(m, soft[t]);
  m = block_reduce(m, scratch, true);
  float total = 0.f;
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    soft[t] = expf(soft[t] - m);
    total += soft[t];
  }
  total = block_reduce(total, scratch, false);
  for (int t = threadIdx.x; t < lag; t += blockDim.x) soft[t] /= total;
  __syncthreads();
}

// grid: (scored partitions, batch * heads). Shared: lo[dim], inv[dim], soft_k[lag], soft_v[lag].
template <typename T>
__global__ void lagkv_partition_kernel(const T* __restrict__ keys, const T* __restrict__ values, int64_t seq,
                                       int n_sink, int lag, int dim, bool cross_scoring, float* __restrict__ out) {
  extern __shared__ float smem[];
  __shared__ float scratch[kWarps];
  __shared__ int any_nan;
  float* lo = smem;
  float* inv = lo + dim;
  float* soft_k = inv + dim;
  float* soft_v = soft_k + lag;
  const int64_t row = blockIdx.y, p = blockIdx.x;
  const int64_t part = static_cast<int64_t>(lag) * dim;
  const int64_t base = row * seq * dim + static_cast<int64_t>(n_sink) * dim + p * part;
  if (threadIdx.x == 0) any_nan = 0;
  partition_softmax<T>(keys + base, keys + base + part, lag, dim, lo, inv, soft_k, scratch);
  partition_softmax<T>(values + base, values + base + part, lag, dim, lo, inv, soft_v, scratch);
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    soft_k[t] = (soft_k[t] + soft_v[t]) / 2.f;
    if (isnan(soft_k[t])) any_nan = 1;
  }
  __syncthreads();
  float* dst = out + row * seq + n_sink + p * lag;
  if (cross_scoring || any_nan) {  // NaN ranks would hide bad input from the selection's check
    for (int t = threadIdx.x; t < lag; t += blockDim.x) dst[t] = soft_k[t];
    return;
  }
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    const float s = soft_k[t];
    int rank = 0;
    for (int u = 0; u < lag; ++u) {
      const float o = soft_k[u];
      rank += (o < s) || (o == s && u < t);
    }
    dst[t] = round_to<T>(static_cast<float>(rank) / static_cast<float>(lag));
  }
}

template <typename T>
void launch(const at::Tensor& keys, const at::Tensor& values, int64_t n_sink, int64_t lag, bool cross_scoring,
            int64_t scored, at::Tensor& out, size_t smem, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(scored), static_cast<unsigned>(keys.size(0) * keys.size(1)));
  lagkv_partition_kernel<T><<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const T*>(keys.const_data_ptr()), reinterpret_cast<const T*>(values.const_data_ptr()),
      keys.size(2), static_cast<int>(n_sink), static_cast<int>(lag), static_cast<int>(keys.size(3)),
      cross_scoring, out.data_ptr<float>());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "lagkv_partition_scores: CUDA launch failed: ", cudaGetErrorString(err));
}

at::Tensor lagkv_partition_scores_cuda(const at::Tensor& keys_in, const at::Tensor& values_in, int64_t n_sink,
                                       int64_t lag_size, bool cross_scoring) {
  constexpr const char* op = "lagkv_partition_scores";
  checks::check_lagkv(op, keys_in, values_in, n_sink, lag_size);
  const int64_t seq = keys_in.size(2), dim = keys_in.size(3);
  TORCH_CHECK(seq >= n_sink + 2 * lag_size, op, ": seq_len must be >= n_sink + 2 * lag_size (",
              n_sink + 2 * lag_size, "), got ", seq);
  const size_t smem = static_cast<size_t>(2 * dim + 2 * lag_size) * sizeof(float);
  // Partitions too large for shared memory (lag_size or head_dim in the thousands) take the
  // ATen path.
  if (smem > 48 * 1024) return ops::lagkv_partition_scores_aten(keys_in, values_in, n_sink, lag_size, cross_scoring);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous();
  const checks::LagLayout layout = checks::lag_layout(seq, n_sink, lag_size);
  at::Tensor out = at::ones({keys.size(0), keys.size(1), seq}, keys.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t scored = layout.n_parts - 1;
  switch (keys.scalar_type()) {
    case at::kFloat: launch<float>(keys, values, n_sink, lag_size, cross_scoring, scored, out, smem, stream); break;
    case at::kHalf: launch<__half>(keys, values, n_sink, lag_size, cross_scoring, scored, out, smem, stream); break;
    case at::kBFloat16:
      launch<__nv_bfloat16>(keys, values, n_sink, lag_size, cross_scoring, scored, out, smem, stream);
      break;
    default: TORCH_CHECK(false, op, ": keys must be float32, float16 or bfloat16, got ", keys.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("lagkv_partition_scores", &lagkv_partition_scores_cuda); }

}  // namespace kvpress::cuda
