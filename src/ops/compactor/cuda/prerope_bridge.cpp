// Bridge of kvpress::sketch_prerope_keys on CUDA: per KV head, the column means of the pre-RoPE keys
// from the post-RoPE keys (prerope.cuh), then for half and bfloat16 the fused sketch X = (P - means) Φ
// on the tensor cores (K read twice, X written once); for float32 (and shapes the fused kernel does
// not cover: dim or k not a multiple of 16, shared memory) the centred keys written once and the
// composite's own sketch (cuBLAS, in the cache dtype as kvpress). Then the Gram matrix XᵀX. More than
// 65535 batch rows take the composite.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "compactor/compactor.h"
#include "compactor/cuda/prerope_launch.h"
#include "cuda/dispatch.h"

namespace kvpress::cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys_cuda(const at::Tensor& keys_in, const at::Tensor& cos,
                                                            const at::Tensor& sin, const at::Tensor& sketch) {
  constexpr const char* op = "sketch_prerope_keys";
  checks::check_sketch_prerope_keys(keys_in, cos, sin, sketch);
  const int64_t batch = keys_in.size(0), heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t k = sketch.size(-1);
  if (batch > 65535) return ops::composite::sketch_prerope_keys(keys_in, cos, sin, sketch);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor cos_f = cos.to(at::kFloat).contiguous(), sin_f = sin.to(at::kFloat).contiguous();
  at::Tensor x = at::empty({batch, heads, seq, k}, keys.options().dtype(at::kFloat));
  at::Tensor means = at::empty({batch, dim}, keys.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t unit_stride = heads * seq * dim;  // batch row b of a head
  // Half and bfloat16: the fused sketch on the tensor cores, where its shared memory fits.
  const PreropeSketchPlan plan =
      keys.scalar_type() == at::kFloat
          ? PreropeSketchPlan{}
          : plan_prerope_sketch(batch, seq, dim, k, 2,
                                at::cuda::getDeviceProperties(keys.get_device())->sharedMemPerBlockOptin);
  // Φ in the keys' dtype, as the composite multiplies: [D, k] for every unit or [B, Hkv, D, k].
  const at::Tensor phi = plan.applies ? sketch.to(keys.scalar_type()).contiguous() : at::Tensor();
  at::Tensor centred = plan.applies ? at::Tensor() : at::empty({batch, 1, seq, dim}, keys.options());  // one head
  for (int64_t h = 0; h < heads; ++h) {
    dispatch_float_types(keys.scalar_type(), op, "keys", [&](auto element) {
      using T = decltype(element);
      const T* head = static_cast<const T*>(keys.const_data_ptr()) + h * seq * dim;
      check_launch(launch_prerope_column_means<T>(head, unit_stride, cos_f.const_data_ptr<float>(),
                                                  sin_f.const_data_ptr<float>(), means.data_ptr<float>(), batch, seq,
                                                  dim, stream),
                   op);
      if constexpr (!std::is_same_v<T, float>) {
        if (plan.applies) {
          const bool shared_phi = sketch.dim() == 2;
          check_launch(
              launch_prerope_sketch<T>(head, unit_stride, cos_f.const_data_ptr<float>(), sin_f.const_data_ptr<float>(),
                                       means.const_data_ptr<float>(),
                                       static_cast<const T*>(phi.const_data_ptr()) + (shared_phi ? 0 : h * dim * k),
                                       shared_phi ? 0 : heads * dim * k, x.data_ptr<float>() + h * seq * k,
                                       heads * seq * k, seq, dim, k, plan, stream),
              op);
          return;
        }
      }
      check_launch(launch_prerope_centred<T>(head, unit_stride, cos_f.const_data_ptr<float>(),
                                             sin_f.const_data_ptr<float>(), means.const_data_ptr<float>(),
                                             static_cast<T*>(centred.data_ptr()), batch, seq, dim, stream),
                   op);
      ops::sketch_centred_into(centred, sketch.dim() == 2 ? sketch : sketch.narrow(1, h, 1), x.narrow(1, h, 1));
    });
  }
  return {x, at::matmul(x.transpose(2, 3), x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("sketch_prerope_keys", &sketch_prerope_keys_cuda); }

}  // namespace kvpress::cuda
