// CPU kernel for kvpress::key_norm_scores: -||k_i||_2 per (batch, head, position), one pass over
// the keys with float32 accumulation for every input dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace {

// Rows [begin, end) of float32 keys [rows, dim]: out[row] = -||k_row||.
KVPRESS_VECTOR_CLONES
void key_norm_rows_f32(const float* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  for (int64_t row = begin; row < end; ++row) {
    const float* k = keys + row * dim;
    out[row] = -std::sqrt(vec16::dot(k, k, dim));
  }
}

// Any dtype: float32 accumulation (double for double), half and bfloat16 rows converted one block
// at a time so that they take the vector loop too.
template <typename scalar_t>
void key_norm_rows(const scalar_t* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    key_norm_rows_f32(keys, out, begin, end, dim);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    for (int64_t row = begin; row < end; ++row) {
      const double* k = keys + row * dim;
      double sum = 0;
      for (int64_t d = 0; d < dim; ++d) sum += k[d] * k[d];
      out[row] = static_cast<float>(-std::sqrt(sum));
    }
  } else {
    constexpr int64_t kBlockRows = 64;
    std::vector<float> block(static_cast<size_t>(kBlockRows * dim));
    for (int64_t first = begin; first < end; first += kBlockRows) {
      const int64_t n = std::min(kBlockRows, end - first);
      for (int64_t i = 0; i < n * dim; ++i) block[static_cast<size_t>(i)] = static_cast<float>(keys[first * dim + i]);
      key_norm_rows_f32(block.data(), out + first, 0, n, dim);
    }
  }
}

at::Tensor key_norm_scores_cpu(const at::Tensor& keys_in) {
  checks::check_keys("key_norm_scores", keys_in);
  const at::Tensor keys = keys_in.contiguous();
  const int64_t dim = keys.size(3);
  const int64_t rows = keys.numel() / dim;
  at::Tensor out = at::empty({keys.size(0), keys.size(1), keys.size(2)}, keys.options().dtype(at::kFloat));
  float* out_ptr = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "key_norm_scores_cpu", [&] {
    const scalar_t* k = keys.data_ptr<scalar_t>();
    at::parallel_for(0, rows, /*grain_size=*/2048,
                     [&](int64_t begin, int64_t end) { key_norm_rows<scalar_t>(k, out_ptr, begin, end, dim); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("key_norm_scores", &key_norm_scores_cpu); }

}  // namespace kvpress::kernels
