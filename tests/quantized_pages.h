// Quantized pages laid out as a paged cache lays them out, for the tests of paged attention over
// them (the CPU kernel and the composite: test_kv_format.cpp; the CUDA kernel through the CPU model:
// test_cuda_emulation.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kvpress/kv_format.h"
#include "kvpress/ops.h"

namespace kvpress::testing {

// Standard normal float32 values from a generator of their own (`seed`), as `dtype`.
inline at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

// Rows like a model's keys: a few channels far larger than the rest (the outliers that make per-channel
// key scales worth their bytes), and tokens of different magnitudes.
inline at::Tensor outlier_rows(int64_t pages, int64_t page_size, int64_t dim, uint64_t seed) {
  at::Tensor rows = seeded_randn({pages, page_size, dim}, seed);
  rows.narrow(2, 0, std::min<int64_t>(dim, 3)).mul_(20.0);
  return rows * (1.0 + seeded_randn({pages, page_size, 1}, seed + 1).abs());
}

// A batch's heads stored as a cache stores them: each head's full pages quantized, in shuffled
// pages of shared pools, and its last length % page_size tokens in full precision at its residual
// rows; `keys` / `values` hold each head's tokens as the kernel reads them (dequantized, then residual).
struct QuantizedLayout {
  at::Tensor key_codes, key_scales, value_codes, value_scales, page_table, lengths;
  at::Tensor residual_keys, residual_values, residual_slots;
  std::vector<at::Tensor> keys, values;  // [B * Hkv] x [L, D] float64
};

inline QuantizedLayout quantized_layout(int64_t batch, int64_t kv_heads, const std::vector<int64_t>& lengths,
                                        int64_t page_size, int64_t dim, KVFormat format, at::ScalarType dtype,
                                        uint64_t seed) {
  int64_t pages = 0, max_pages = 1;
  for (int64_t len : lengths) {
    pages += len / page_size;
    max_pages = std::max(max_pages, len / page_size);
  }
  QuantizedLayout l;
  const at::Tensor key_rows = outlier_rows(pages + 2, page_size, dim, seed).to(dtype);  // 2 pages no head uses
  const at::Tensor value_rows = seeded_randn({pages + 2, page_size, dim}, seed + 1, dtype);
  std::tie(l.key_codes, l.key_scales) = ops::kv_quantize(key_rows, format, KVRole::kKeys);
  std::tie(l.value_codes, l.value_scales) = ops::kv_quantize(value_rows, format, KVRole::kValues);
  const at::Tensor key_pages = ops::kv_dequantize(l.key_codes, l.key_scales, format, KVRole::kKeys, dim);
  const at::Tensor value_pages = ops::kv_dequantize(l.value_codes, l.value_scales, format, KVRole::kValues, dim);
  // Batch row b uses residual row R - 1 - b of R = batch + 1 (one unused).
  l.residual_keys = seeded_randn({batch + 1, kv_heads, page_size, dim}, seed + 2, dtype);
  l.residual_values = seeded_randn({batch + 1, kv_heads, page_size, dim}, seed + 3, dtype);
  l.residual_slots = -at::arange(batch, at::kLong) + batch;
  const at::Tensor order = at::randperm(pages + 2, at::make_generator<at::CPUGeneratorImpl>(seed + 4), at::kLong);
  l.page_table = at::full({batch, kv_heads, max_pages}, -1, at::kLong);  // unused entries: out of the pool
  l.lengths = at::tensor(lengths, at::kLong).view({batch, kv_heads});
  int64_t next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t len = lengths[static_cast<size_t>(b * kv_heads + h)], full = len / page_size;
      std::vector<at::Tensor> k, v;
      for (int64_t p = 0; p < full; ++p) {
        const int64_t page = order[next++].item<int64_t>();
        l.page_table[b][h][p] = page;
        k.push_back(key_pages[page]);
        v.push_back(value_pages[page]);
      }
      const int64_t row = batch - b;
      k.push_back(l.residual_keys[row][h].narrow(0, 0, len - full * page_size).to(at::kFloat));
      v.push_back(l.residual_values[row][h].narrow(0, 0, len - full * page_size).to(at::kFloat));
      l.keys.push_back(at::cat(k).to(at::kDouble));
      l.values.push_back(at::cat(v).to(at::kDouble));
    }
  }
  return l;
}

}  // namespace kvpress::testing
