// Bridge for kvpress::key_norm_scores on CUDA: validation, dtype dispatch, stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/key_norm.cuh"

namespace kvpress::cuda {

namespace {

template <typename T>
void run(const at::Tensor& keys, at::Tensor& out, cudaStream_t stream) {
  const int64_t dim = keys.size(3);
  const cudaError_t err = launch_key_norm_scores<T>(reinterpret_cast<const T*>(keys.const_data_ptr()),
                                                    out.data_ptr<float>(), keys.numel() / dim, dim, stream);
  TORCH_CHECK(err == cudaSuccess, "key_norm_scores: CUDA launch failed: ", cudaGetErrorString(err));
}

at::Tensor key_norm_scores_cuda(const at::Tensor& keys_in) {
  checks::check_keys("key_norm_scores", keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor out = at::empty({keys.size(0), keys.size(1), keys.size(2)}, keys.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (keys.scalar_type()) {
    case at::kFloat: run<float>(keys, out, stream); break;
    case at::kHalf: run<__half>(keys, out, stream); break;
    case at::kBFloat16: run<__nv_bfloat16>(keys, out, stream); break;
    default: TORCH_CHECK(false, "key_norm_scores: keys must be float32, float16 or bfloat16, got ", keys.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("key_norm_scores", &key_norm_scores_cuda); }

}  // namespace kvpress::cuda
