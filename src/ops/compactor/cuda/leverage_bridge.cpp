// Bridge of kvpress::cholesky_leverage on CUDA: validation, L⁻¹ (one small triangular solve per
// head, in ATen), stream, registration. Sketches wider than kLeverageMaxSketch and more than
// kLeverageMaxUnits heads take the ATen composite.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "compactor/compactor.h"
#include "compactor/cuda/leverage_launch.h"
#include "cuda/dispatch.h"

namespace kvpress::cuda {
namespace {

at::Tensor cholesky_leverage_cuda(const at::Tensor& sketched_in, const at::Tensor& factor) {
  constexpr const char* op = "cholesky_leverage";
  checks::check_cholesky_leverage(op, sketched_in, factor);
  const int64_t units = sketched_in.size(0) * sketched_in.size(1), seq = sketched_in.size(2), k = sketched_in.size(3);
  if (k > kLeverageMaxSketch || units > kLeverageMaxUnits)
    return ops::composite::cholesky_leverage(sketched_in, factor);
  const c10::cuda::CUDAGuard guard(sketched_in.device());
  const at::Tensor x = sketched_in.contiguous();
  const at::Tensor inverse = ops::lower_triangular_inverse(factor).contiguous();  // [B, H, k, k]
  at::Tensor out = at::empty({x.size(0), x.size(1), seq}, x.options());
  check_launch(launch_cholesky_leverage(x.const_data_ptr<float>(), inverse.const_data_ptr<float>(),
                                        out.data_ptr<float>(), units, seq, k, c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("cholesky_leverage", &cholesky_leverage_cuda); }

}  // namespace kvpress::cuda
