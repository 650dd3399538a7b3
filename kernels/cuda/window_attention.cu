// CUDA kernel for kvpress::window_attention_mean (SnapKVPress, TOVAPress). Per (batch, KV head):
// the float32 logits of all its query heads' window rows come from one cuBLAS GEMM
// ([group * w, D] x [D, S], queries pre-scaled by 1 / sqrt(D)); one kernel takes each row's
// causal max and softmax normaliser, a second averages exp(l - max) / sum over the w rows of every
// query head, column by column (coalesced), straight into the output. Extra memory: one
// [group * w, S] float32 block, reused for every KV head, and a float32 copy of one head's keys
// when the cache is float16/bfloat16.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cmath>

#include "score_kernels.h"

namespace kvpress::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_reduce(float v, float* shared, bool is_max) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float o = __shfl_down_sync(0xffffffffu, v, offset);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : (is_max ? -INFINITY : 0.f);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float o = __shfl_down_sync(0xffffffffu, v, offset);
      v = is_max ? fmaxf(v, o) : v + o;
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

// One block per logits row r: window query i = r % window sees keys [0, seq - window + i].
__global__ void causal_row_stats(const float* __restrict__ logits, int64_t seq, int64_t window,
                                 float* __restrict__ row_max, float* __restrict__ row_inv_sum) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const int64_t valid = seq - window + (r % window) + 1;
  const float* l = logits + r * seq;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, l[j]);
  m = block_reduce(m, shared, true);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(l[j] - m);
  s = block_reduce(s, shared, false);
  if (threadIdx.x == 0) {
    row_max[r] = m;
    row_inv_sum[r] = 1.f / s;
  }
}

// out[h, j] = mean over the window rows of query head h of softmax(row)[j], for j < seq - window
// (every window row sees those keys). grid: (column blocks, query heads of the chunk).
__global__ void window_column_mean(const float* __restrict__ logits, const float* __restrict__ row_max,
                                   const float* __restrict__ row_inv_sum, int64_t seq, int64_t window,
                                   float* __restrict__ out, int64_t out_row_stride) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t h = blockIdx.y;
  if (j >= seq - window) return;
  float acc = 0.f;
  for (int64_t i = 0; i < window; ++i) {
    const int64_t r = h * window + i;
    acc += expf(logits[r * seq + j] - row_max[r]) * row_inv_sum[r];
  }
  out[h * out_row_stride + j] = acc / static_cast<float>(window);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "window_attention_mean: CUDA launch of ", what, " failed: ",
              cudaGetErrorString(err));
}

at::Tensor window_attention_mean_cuda(const at::Tensor& queries_in, const at::Tensor& keys_in) {
  constexpr const char* op = "window_attention_mean";
  checks::check_window_attention(op, queries_in, keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const int64_t batch = keys_in.size(0), kv_heads = keys_in.size(1), seq = keys_in.size(2),
                dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), window = queries_in.size(2), group = heads / kv_heads;
  const int64_t rows = group * window;
  const at::Tensor queries =
      (queries_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(dim)))).contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const auto float_opts = keys.options().dtype(at::kFloat);
  at::Tensor out = at::empty({batch, heads, seq - window}, float_opts);
  at::Tensor logits = at::empty({rows, seq}, float_opts);
  at::Tensor row_max = at::empty({rows}, float_opts), row_inv_sum = at::empty({rows}, float_opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 mean_grid(static_cast<unsigned>((seq - window + kThreads - 1) / kThreads),
                       static_cast<unsigned>(group));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const at::Tensor k = keys.select(0, b).select(0, h).to(at::kFloat);                      // [S, D]
      const at::Tensor q = queries.select(0, b).narrow(0, h * group, group).reshape({rows, dim});  // view
      at::mm_out(logits, q, k.t());  // cuBLAS
      causal_row_stats<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          logits.const_data_ptr<float>(), seq, window, row_max.data_ptr<float>(), row_inv_sum.data_ptr<float>());
      check_launch("causal_row_stats");
      at::Tensor dst = out.select(0, b).narrow(0, h * group, group);  // [group, S - w], contiguous rows
      window_column_mean<<<mean_grid, kThreads, 0, stream>>>(logits.const_data_ptr<float>(),
                                                             row_max.const_data_ptr<float>(),
                                                             row_inv_sum.const_data_ptr<float>(), seq, window,
                                                             dst.data_ptr<float>(), dst.stride(0));
      check_launch("window_column_mean");
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("window_attention_mean", &window_attention_mean_cuda); }

}  // namespace kvpress::cuda
