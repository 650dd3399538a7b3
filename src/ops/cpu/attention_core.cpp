// The vectorised inner loops of the fused CPU attention (attention_core.h).
//
// Decode attention reads each key and value row once and does G dot products and G axpys with it,
// so the loops must keep up with memory: the G query heads of the group are taken in tiles of up
// to four, whose partial sums (scores) or output slices (values) stay in registers while the rows
// stream past (vec16.h).
#include "cpu/attention_core.h"

#include <type_traits>

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

// Calls tile(std::integral_constant<int, T>{}, g) for tiles of T <= 4 query heads starting at g
// that cover the group's heads [0, groups).
template <typename Tile>
KVPRESS_VEC_INLINE void for_each_head_tile(int64_t groups, Tile&& tile) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) tile(std::integral_constant<int, 4>{}, g);
  switch (groups - g) {
    case 3: tile(std::integral_constant<int, 3>{}, g); break;
    case 2: tile(std::integral_constant<int, 2>{}, g); break;
    case 1: tile(std::integral_constant<int, 1>{}, g); break;
    default: break;
  }
}

}  // namespace

// flatten: the tile lambdas must be inlined into each clone, or they would run the baseline code.
KVPRESS_VECTOR_CLONES __attribute__((flatten)) void block_scores(const float* __restrict qf, const float* const* rows,
                                                                 int64_t len, int64_t groups, int64_t dim,
                                                                 float* __restrict scores) {
  for_each_head_tile(groups, [&](auto tile, int64_t g) {
    scores_tile<decltype(tile)::value>(qf + g * dim, rows, len, dim, scores + g * kAttentionBlock);
  });
}

KVPRESS_VECTOR_CLONES __attribute__((flatten)) void block_accumulate(const float* __restrict probs,
                                                                     const float* const* rows, int64_t len,
                                                                     int64_t groups, int64_t dim,
                                                                     float* __restrict acc) {
  for_each_head_tile(groups, [&](auto tile, int64_t g) {
    accumulate_tile<decltype(tile)::value>(probs + g * kAttentionBlock, rows, len, dim, acc + g * dim);
  });
}

}  // namespace kvpress::kernels
