// kernels/cuda/kernels.h in a build without CUDA: no kernels, callers use their ATen path.
#include <c10/util/Exception.h>

#include "cuda/kernels.h"

namespace kvpress::kernels {

bool cuda_kernels_built() { return false; }

at::Tensor keydiff_scores_cuda(const at::Tensor&) {
  TORCH_CHECK(false, "keydiff_scores: libkvpress was built without CUDA kernels");
}

bool topk_indices_cuda(const at::Tensor&, int64_t, at::Tensor&) {
  TORCH_CHECK(false, "topk_indices: libkvpress was built without CUDA kernels");
}

int64_t gather_rows_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "gather_kv: libkvpress was built without CUDA kernels");
}

}  // namespace kvpress::kernels
