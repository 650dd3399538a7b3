// The vectorised inner loops of the fused CPU attention (attention_core.h).
#include "cpu/attention_core.h"

#include "cpu/vector_clones.h"

namespace kvpress::kernels {

KVPRESS_VECTOR_CLONES
void block_scores(const float* __restrict qf, const float* const* rows, int64_t len, int64_t groups, int64_t dim,
                  float* __restrict scores) {
  for (int64_t j = 0; j < len; ++j) {
    const float* __restrict k = rows[j];
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict q = qf + g * dim;
      // Sixteen independent partial sums: one AVX-512 register, or two AVX2 ones, without
      // reassociating a single float reduction.
      float part[16] = {};
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16)
        for (int u = 0; u < 16; ++u) part[u] += q[d + u] * k[d + u];
      float total = 0.f;
      for (; d < dim; ++d) total += q[d] * k[d];
      for (int u = 0; u < 16; ++u) total += part[u];
      scores[g * kAttentionBlock + j] = total;
    }
  }
}

KVPRESS_VECTOR_CLONES
void block_accumulate(const float* __restrict probs, const float* const* rows, int64_t len, int64_t groups, int64_t dim,
                      float* __restrict acc) {
  for (int64_t j = 0; j < len; ++j) {
    const float* __restrict v = rows[j];
    for (int64_t g = 0; g < groups; ++g) {
      const float p = probs[g * kAttentionBlock + j];
      float* __restrict a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
    }
  }
}

}  // namespace kvpress::kernels
