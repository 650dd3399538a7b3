// CPU kernel of kvpress::rescue_column_max (CTRPress's rescue): for each row of logits / scale, its
// maximum, the sum of its exponentials and then every key's running maximum of x - lse, in one
// visit per row while it sits in L1/L2. The ATen composite makes about seven passes over the whole
// [n, R] matrix (the division, logsumexp's maximum, difference, exponentials and sum, the
// subtraction, the column maximum) and a temporary of its size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/per_isa.h"
#include "cpu/vec16.h"
#include "scores/scores.h"

namespace kvpress::kernels {
namespace {

// Rows [0, n) of r logits each: column_max[j] <- max(column_max[j], l_ij / scale - lse_i). Each row
// is divided once into `x` (r floats, the thread's; IEEE division, as the composite's), whose three
// passes then stay in L1/L2. The exponentials are vec16's (within 2 ulp of std::exp).
struct ColumnMaxOfRows {
  template <class V>
  static KVPRESS_VEC_INLINE void run(const float* logits, int64_t n, int64_t r, float scale, float* x,
                                     float* column_max) {
    constexpr int64_t L = vec16::lanes<V>;
    const int64_t vec_end = r - r % L;
    const V scale_v = vec16::broadcast<V>(scale);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = logits + i * r;
      // The row divided by the scale, and its maximum.
      V max_v = vec16::broadcast<V>(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < vec_end; j += L) {
        const V v = vec16::load<V>(row + j) / scale_v;
        vec16::store(x + j, v);
        max_v = v > max_v ? v : max_v;
      }
      float m = vec16::lane_max(max_v);
      for (int64_t j = vec_end; j < r; ++j) {
        x[j] = row[j] / scale;
        m = std::max(m, x[j]);
      }
      // Its log-sum-exp.
      const V m_v = vec16::broadcast<V>(m);
      V sum_v{};
      for (int64_t j = 0; j < vec_end; j += L) sum_v += vec16::exp_nonpositive<V>(vec16::load<V>(x + j) - m_v);
      float sum = vec16::lane_sum(sum_v);
      for (int64_t j = vec_end; j < r; ++j) sum += std::exp(x[j] - m);
      const float lse = m + std::log(sum);
      // Every key's running maximum of x - lse.
      const V lse_v = vec16::broadcast<V>(lse);
      for (int64_t j = 0; j < vec_end; j += L) {
        const V y = vec16::load<V>(x + j) - lse_v;
        const V c = vec16::load<V>(column_max + j);
        vec16::store(column_max + j, y > c ? y : c);
      }
      for (int64_t j = vec_end; j < r; ++j) column_max[j] = std::max(column_max[j], x[j] - lse);
    }
  }
};

at::Tensor rescue_column_max_cpu(const at::Tensor& logits_in, double scale) {
  checks::check_rescue_logits("rescue_column_max", logits_in, scale);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t n = logits.size(0), r = logits.size(1);
  const float* l = logits.data_ptr<float>();
  // One partial maximum per block of rows, reduced at the end: no two threads write one column.
  const int64_t blocks = std::min<int64_t>(n, std::max<int64_t>(1, at::get_num_threads()));
  std::vector<float> partial(static_cast<size_t>(blocks * r), -std::numeric_limits<float>::infinity());
  at::parallel_for(0, blocks, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(r));  // one divided row at a time
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = n * b / blocks, last = n * (b + 1) / blocks;
      run_per_isa<ColumnMaxOfRows>(l + first * r, last - first, r, static_cast<float>(scale), row.data(),
                                   partial.data() + b * r);
    }
  });
  at::Tensor out = at::empty({r}, logits.options());
  float* o = out.data_ptr<float>();
  for (int64_t j = 0; j < r; ++j) {
    float m = partial[static_cast<size_t>(j)];
    for (int64_t b = 1; b < blocks; ++b) m = std::max(m, partial[static_cast<size_t>(b * r + j)]);
    o[j] = m;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("rescue_column_max", &rescue_column_max_cpu); }

}  // namespace kvpress::kernels
