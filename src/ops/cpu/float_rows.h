// as_float32: rows of a float16/bfloat16 cache as float32 in a scratch buffer (exact), or the rows
// themselves when the cache is float32, so one float32 loop serves every cache dtype.
#pragma once

#include <cstdint>
#include <vector>

namespace kvpress::kernels {

// Rows converted at a time by the kernels that stream float16/bfloat16 keys through float32 loops:
// a block stays in L1/L2 while it is used.
constexpr int64_t kConvertBlockRows = 64;

inline const float* as_float32(const float* src, int64_t /*n*/, std::vector<float>& /*scratch*/) { return src; }

// The n elements at src, converted into scratch (at least n long).
template <typename scalar_t>
const float* as_float32(const scalar_t* src, int64_t n, std::vector<float>& scratch) {
  for (int64_t i = 0; i < n; ++i) scratch[static_cast<size_t>(i)] = static_cast<float>(src[i]);
  return scratch.data();
}

}  // namespace kvpress::kernels
