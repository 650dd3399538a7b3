// CPU kernel for kvpress::key_norm_scores: -||k_i||_2 per (batch, head, position), one pass over
// the keys with float32 accumulation for every input dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"

namespace kvpress::kernels {
namespace {

// The sum runs in order over d. Vector partial sums (as keydiff.cpp uses) round differently, and
// one kvpress model run of the parity fixtures (CriticalAdaKVPress over KnormPress, RaggedParity)
// has a near-tie that such a reordering flips; neither order is ATen's own, which depends on the
// CPU capability.
template <typename scalar_t>
void key_norm_rows(const scalar_t* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  // Eight rows at a time, each still summed in order: one row's sum waits on every add, eight
  // independent sums keep the adders busy, with the same result bit for bit.
  constexpr int64_t kRows = 8;
  int64_t row = begin;
  for (; row + kRows <= end; row += kRows) {
    const scalar_t* k = keys + row * dim;
    float sum[kRows] = {};
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t r = 0; r < kRows; ++r) {
        const float v = static_cast<float>(k[r * dim + d]);
        sum[r] += v * v;
      }
    }
    for (int64_t r = 0; r < kRows; ++r) out[row + r] = -std::sqrt(sum[r]);
  }
  for (; row < end; ++row) {
    const scalar_t* k = keys + row * dim;
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float v = static_cast<float>(k[d]);
      sum += v * v;
    }
    out[row] = -std::sqrt(sum);
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
