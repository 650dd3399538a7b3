// CUDA kernels behind kernels::keydiff_scores_cuda: the anchor of every head (sequence mean of the
// L2-normalised keys, eps 1e-12), then -cos(k_i, anchor) with eps 1e-8 on each norm, as
// kernels/cpu/keydiff.cpp. float32 accumulation; the anchor sums are float atomics, so their
// order (not the formula) differs from the CPU kernel's.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/key_norm.cuh"  // to_float

namespace kvpress::kernels {
namespace {

using cuda::to_float;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerBlock = 64;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// grid: (row blocks of kRowsPerBlock tokens, heads). anchor_sum[h, d] += k[d] / max(||k||, 1e-12).
// Shared: dim floats of block-local sums.
template <typename T>
__global__ void anchor_sums(const T* __restrict__ keys, int64_t seq, int dim, float* __restrict__ anchor_sum) {
  extern __shared__ float local[];
  for (int d = threadIdx.x; d < dim; d += blockDim.x) local[d] = 0.f;
  __syncthreads();
  const int64_t head = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  for (int64_t s = first + warp; s < min(seq, first + kRowsPerBlock); s += kWarps) {
    const T* k = keys + (head * seq + s) * dim;
    float sq = 0.f;
    for (int d = lane; d < dim; d += 32) {
      const float v = to_float(k[d]);
      sq += v * v;
    }
    const float inv = 1.f / fmaxf(sqrtf(warp_sum(sq)), 1e-12f);
    for (int d = lane; d < dim; d += 32) atomicAdd(&local[d], to_float(k[d]) * inv);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += blockDim.x) atomicAdd(&anchor_sum[head * dim + d], local[d]);
}

// One warp per token: -dot(k, a) / (max(||k||, 1e-8) * max(||a||, 1e-8)), a = anchor_sum / seq.
template <typename T>
__global__ void cosine_to_anchor(const T* __restrict__ keys, int64_t rows, int64_t seq, int dim,
                                 const float* __restrict__ anchor_sum, float* __restrict__ out) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* a = anchor_sum + (row / seq) * dim;
  const T* k = keys + row * dim;
  const float inv_seq = 1.f / static_cast<float>(seq);
  float dot = 0.f, kk = 0.f, aa = 0.f;
  for (int d = lane; d < dim; d += 32) {
    const float v = to_float(k[d]), m = a[d] * inv_seq;
    dot += v * m;
    kk += v * v;
    aa += m * m;
  }
  dot = warp_sum(dot);
  kk = warp_sum(kk);
  aa = warp_sum(aa);
  if (lane == 0) out[row] = -dot / (fmaxf(sqrtf(kk), 1e-8f) * fmaxf(sqrtf(aa), 1e-8f));
}

template <typename T>
void run(const at::Tensor& keys, at::Tensor& anchor, at::Tensor& out, cudaStream_t stream) {
  const int64_t heads = keys.size(0) * keys.size(1), seq = keys.size(2);
  const int dim = static_cast<int>(keys.size(3));
  const T* k = reinterpret_cast<const T*>(keys.const_data_ptr());
  const dim3 grid(static_cast<unsigned>((seq + kRowsPerBlock - 1) / kRowsPerBlock), static_cast<unsigned>(heads));
  anchor_sums<T><<<grid, kThreads, static_cast<size_t>(dim) * sizeof(float), stream>>>(k, seq, dim,
                                                                                      anchor.data_ptr<float>());
  cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "keydiff_scores: CUDA launch failed: ", cudaGetErrorString(err));
  const int64_t rows = heads * seq;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  cosine_to_anchor<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(k, rows, seq, dim,
                                                                               anchor.const_data_ptr<float>(),
                                                                               out.data_ptr<float>());
  err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "keydiff_scores: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

bool cuda_kernels_built() { return true; }

at::Tensor keydiff_scores_cuda(const at::Tensor& keys_in) {
  TORCH_CHECK(keys_in.is_cuda() && keys_in.dim() == 4, "keydiff_scores_cuda: keys must be a CUDA [B, H, S, D] tensor");
  TORCH_CHECK(keys_in.size(3) * sizeof(float) <= 48 * 1024, "keydiff_scores_cuda: head_dim must be <= 12288, got ",
              keys_in.size(3));
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const auto float_opts = keys.options().dtype(at::kFloat);
  at::Tensor anchor = at::zeros({keys.size(0) * keys.size(1), keys.size(3)}, float_opts);
  at::Tensor out = at::empty({keys.size(0), keys.size(1), keys.size(2)}, float_opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (keys.scalar_type()) {
    case at::kFloat: run<float>(keys, anchor, out, stream); break;
    case at::kHalf: run<__half>(keys, anchor, out, stream); break;
    case at::kBFloat16: run<__nv_bfloat16>(keys, anchor, out, stream); break;
    default: TORCH_CHECK(false, "keydiff_scores: keys must be float32, float16 or bfloat16, got ", keys.scalar_type());
  }
  return out;
}

}  // namespace kvpress::kernels
