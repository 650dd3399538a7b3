// CPU kernel for kvpress::key_norm_scores: -||k_i||_2 per (batch, head, position), one pass over
// the keys with float32 accumulation for every input dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "checks.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

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

using vec16::Vec;

// Sixteen rows at a time, one row per vector lane: each 16-dimension slice of the 16 rows is
// squared, transposed in registers, and added to the lanes' sums one dimension after another.
// Every row is still summed in order over d (the squares and adds of key_norm_rows, bit for bit),
// but sixteen rows share each add instruction instead of waiting on each other's latency. Rows
// [begin, end) of dim elements of type element_t (float, or bfloat16 bits); returns the first row
// it did not do (begin when dim is not a multiple of 16).
template <typename element_t>
KVPRESS_VEC_INLINE int64_t key_norm_tiles(const element_t* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  constexpr int64_t kRows = vec16::kLanes;
  int64_t row = begin;
  if (dim % kRows != 0) return row;
  for (; row + kRows <= end; row += kRows) {
    const element_t* k = keys + row * dim;
    Vec sum{};
    for (int64_t d = 0; d < dim; d += kRows) {
      Vec tile[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        Vec v;
        if constexpr (std::is_same_v<element_t, float>)
          v = vec16::load(k + r * dim + d);
        else
          v = vec16::load_bfloat16(k + r * dim + d);
        tile[r] = v * v;
        // One line of the next 16 rows per line read here: the sixteen rows' lines are read
        // across the block, a pattern the hardware prefetcher follows poorly.
        __builtin_prefetch(k + (kRows + r) * dim + d);
      }
      vec16::transpose(tile);
      for (int64_t j = 0; j < kRows; ++j) sum += tile[j];
    }
    for (int64_t r = 0; r < kRows; ++r) out[row + r] = -std::sqrt(sum[r]);
  }
  return row;
}

KVPRESS_VECTOR_CLONES
void key_norm_rows_float(const float* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  key_norm_rows<float>(keys, out, key_norm_tiles(keys, out, begin, end, dim), end, dim);
}

KVPRESS_VECTOR_CLONES
void key_norm_rows_bfloat16(const c10::BFloat16* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  const auto* bits = reinterpret_cast<const uint16_t*>(keys);
  key_norm_rows<c10::BFloat16>(keys, out, key_norm_tiles(bits, out, begin, end, dim), end, dim);
}

template <typename scalar_t>
void key_norm_rows_any(const scalar_t* keys, float* out, int64_t begin, int64_t end, int64_t dim) {
  if constexpr (std::is_same_v<scalar_t, float>)
    key_norm_rows_float(keys, out, begin, end, dim);
  else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    key_norm_rows_bfloat16(keys, out, begin, end, dim);
  else
    key_norm_rows<scalar_t>(keys, out, begin, end, dim);
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
                     [&](int64_t begin, int64_t end) { key_norm_rows_any(k, out_ptr, begin, end, dim); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("key_norm_scores", &key_norm_scores_cpu); }

}  // namespace kvpress::kernels
