// The vectorised inner loops of the fused CPU attention (attention_core.h).
//
// Decode attention reads each key and value row once and does G dot products and G axpys with it,
// so the loops must keep up with memory: the G query heads of the group are taken in tiles of up
// to four, whose partial sums (scores) or output slices (values) stay in registers while the rows
// stream past (vec16.h).
#include "cpu/attention_core.h"

#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace {

using vec16::broadcast;
using vec16::kLanes;
using vec16::lane_sum;
using vec16::load;
using vec16::store;
using vec16::Vec;

// scores[t][j] = q[t] . rows[j] for the T query heads of one tile; q [T, D] rows of stride dim,
// scores rows of stride kAttentionBlock. The key row is loaded once per 16 dims for all T heads.
template <int T>
KVPRESS_VEC_INLINE void scores_tile(const float* __restrict q, const float* const* rows, int64_t len, int64_t dim,
                                    float* __restrict scores) {
  const int64_t vector_dims = dim / kLanes * kLanes;
  for (int64_t j = 0; j < len; ++j) {
    const float* __restrict k = rows[j];
    Vec sum[T];
    for (int t = 0; t < T; ++t) sum[t] = Vec{};
    for (int64_t d = 0; d < vector_dims; d += kLanes) {
      const Vec kv = load(k + d);
      for (int t = 0; t < T; ++t) sum[t] += load(q + t * dim + d) * kv;
    }
    for (int t = 0; t < T; ++t) {
      float total = lane_sum(sum[t]);
      for (int64_t d = vector_dims; d < dim; ++d) total += q[t * dim + d] * k[d];
      scores[t * kAttentionBlock + j] = total;
    }
  }
}

// acc[t] += sum_j probs[t][j] * rows[j] for the T query heads of one tile; acc [T, D] rows of stride
// dim. Four vectors (64 dims) of each head's output stay in registers across the block's rows.
template <int T>
KVPRESS_VEC_INLINE void accumulate_tile(const float* __restrict probs, const float* const* rows, int64_t len,
                                        int64_t dim, float* __restrict acc) {
  constexpr int64_t kWide = 4 * kLanes;
  int64_t d = 0;
  for (; d + kWide <= dim; d += kWide) {
    Vec a[T][4];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < 4; ++c) a[t][c] = load(acc + t * dim + d + c * kLanes);
    for (int64_t j = 0; j < len; ++j) {
      const float* __restrict v = rows[j] + d;
      const Vec v0 = load(v), v1 = load(v + kLanes), v2 = load(v + 2 * kLanes), v3 = load(v + 3 * kLanes);
      for (int t = 0; t < T; ++t) {
        const Vec p = broadcast(probs[t * kAttentionBlock + j]);
        a[t][0] += p * v0;
        a[t][1] += p * v1;
        a[t][2] += p * v2;
        a[t][3] += p * v3;
      }
    }
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < 4; ++c) store(acc + t * dim + d + c * kLanes, a[t][c]);
  }
  for (; d + kLanes <= dim; d += kLanes) {
    Vec a[T];
    for (int t = 0; t < T; ++t) a[t] = load(acc + t * dim + d);
    for (int64_t j = 0; j < len; ++j) {
      const Vec v = load(rows[j] + d);
      for (int t = 0; t < T; ++t) a[t] += broadcast(probs[t * kAttentionBlock + j]) * v;
    }
    for (int t = 0; t < T; ++t) store(acc + t * dim + d, a[t]);
  }
  for (; d < dim; ++d)
    for (int t = 0; t < T; ++t) {
      float a = acc[t * dim + d];
      for (int64_t j = 0; j < len; ++j) a += probs[t * kAttentionBlock + j] * rows[j][d];
      acc[t * dim + d] = a;
    }
}

}  // namespace

KVPRESS_VECTOR_CLONES
void block_scores(const float* __restrict qf, const float* const* rows, int64_t len, int64_t groups, int64_t dim,
                  float* __restrict scores) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) scores_tile<4>(qf + g * dim, rows, len, dim, scores + g * kAttentionBlock);
  switch (groups - g) {
    case 3: scores_tile<3>(qf + g * dim, rows, len, dim, scores + g * kAttentionBlock); break;
    case 2: scores_tile<2>(qf + g * dim, rows, len, dim, scores + g * kAttentionBlock); break;
    case 1: scores_tile<1>(qf + g * dim, rows, len, dim, scores + g * kAttentionBlock); break;
    default: break;
  }
}

KVPRESS_VECTOR_CLONES
void block_accumulate(const float* __restrict probs, const float* const* rows, int64_t len, int64_t groups, int64_t dim,
                      float* __restrict acc) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) accumulate_tile<4>(probs + g * kAttentionBlock, rows, len, dim, acc + g * dim);
  switch (groups - g) {
    case 3: accumulate_tile<3>(probs + g * kAttentionBlock, rows, len, dim, acc + g * dim); break;
    case 2: accumulate_tile<2>(probs + g * kAttentionBlock, rows, len, dim, acc + g * dim); break;
    case 1: accumulate_tile<1>(probs + g * kAttentionBlock, rows, len, dim, acc + g * dim); break;
    default: break;
  }
}

}  // namespace kvpress::kernels
