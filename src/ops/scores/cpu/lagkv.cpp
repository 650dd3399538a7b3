// CPU kernel for kvpress::lagkv_partition_scores (LagKVPress), one pass over K and V.
// Per (batch, head), partitions are visited in order: partition p + 1 is read for its per-channel
// min/max (the reference), and partition p, read just before as the previous reference and still
// in L2, is normalised by it; the unbiased std over channels of every token, a softmax over the
// partition's tokens, the K/V average and, unless cross_scoring, the stable rank within the
// partition follow on lag_size floats. float32 accumulation for every dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/float_rows.h"
#include "cpu/order_key.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"
#include "scores/scores.h"

namespace kvpress::kernels {
namespace {

constexpr int64_t kLanes = vec16::kLanes;  // independent partial sums, so the compiler can vectorise reductions
constexpr int64_t kPrefetchRows = 8;       // rows ahead that partition_stds asks for

// Sum of the n floats at x: kLanes partial sums (lane j adds x[j], x[j + 16], ... in order), added by
// vec16::lane_sum's halving tree, then the tail in order. The tiled path below forms the same
// partial sums in a vector and adds them by the same tree, so both give the same bits (a tree, not
// a chain of 16 dependent adds per reduction).
inline float lane_sum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[d + j];
  float total = vec16::lane_sum(vec16::load(acc));
  for (; d < n; ++d) total += x[d];
  return total;
}

// partition_stds for dim = 16 * NV: the per-channel min/max, their inverse range and each row's
// normalised values stay in registers, and R rows are reduced together so their in-order lane
// sums (a chain of dependent adds each) overlap. The same operations, in the same order, as the
// generic loop (the file is compiled with -ffp-contract=off so neither fuses a multiply-add).
template <int NV>
KVPRESS_VEC_INLINE void partition_stds_tiled(const float* __restrict cur, const float* __restrict ref, int64_t lag,
                                             float* __restrict stds) {
  using vec16::Vec;
  constexpr int64_t dim = NV * vec16::kLanes;
  Vec lo[NV], hi[NV], scale[NV];
  for (int v = 0; v < NV; ++v) lo[v] = hi[v] = vec16::load(ref + v * vec16::kLanes);
  for (int64_t t = 1; t < lag; ++t) {
    const float* x = ref + t * dim;
    if (t + kPrefetchRows < lag)
      for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(x + kPrefetchRows * dim + d);
    for (int v = 0; v < NV; ++v) {
      const Vec xv = vec16::load(x + v * vec16::kLanes);
      lo[v] = xv < lo[v] ? xv : lo[v];
      hi[v] = xv > hi[v] ? xv : hi[v];
    }
  }
  for (int v = 0; v < NV; ++v) scale[v] = vec16::broadcast(1.f) / (hi[v] - lo[v]);
  const float inv_dim = 1.f / static_cast<float>(dim);
  const float inv_dof = 1.f / static_cast<float>(dim - 1);
  auto rows = [&](auto rows_tag, int64_t t0) {
    constexpr int R = decltype(rows_tag)::value;
    Vec y[R][NV];
    Vec acc[R] = {};
    for (int r = 0; r < R; ++r) {
      const float* x = cur + (t0 + r) * dim;
      for (int v = 0; v < NV; ++v) {
        y[r][v] = (vec16::load(x + v * vec16::kLanes) - lo[v]) * scale[v];
        acc[r] += y[r][v];
      }
    }
    float mean[R], total[R];
    for (int r = 0; r < R; ++r) mean[r] = vec16::lane_sum(acc[r]) * inv_dim;
    for (int r = 0; r < R; ++r) {
      acc[r] = Vec{};
      for (int v = 0; v < NV; ++v) {
        const Vec centred = y[r][v] - mean[r];
        acc[r] += centred * centred;
      }
    }
    for (int r = 0; r < R; ++r) total[r] = vec16::lane_sum(acc[r]);
    for (int r = 0; r < R; ++r) stds[t0 + r] = std::sqrt(total[r] * inv_dof);
  };
  int64_t t = 0;
  for (; t + 4 <= lag; t += 4) rows(std::integral_constant<int, 4>{}, t);
  for (; t < lag; ++t) rows(std::integral_constant<int, 1>{}, t);
}

// Per-token unbiased std over channels of partition `cur` ([lag, dim] float32 rows), normalised
// by the per-channel min/max of partition `ref`. `work` holds 3 * dim floats (generic path).
KVPRESS_VECTOR_CLONES
void partition_stds(const float* __restrict cur, const float* __restrict ref, int64_t lag, int64_t dim,
                    float* __restrict work, float* __restrict stds) {
  switch (dim) {  // head dims up to 128 in steps of 16 keep their rows in registers
    case 16: return partition_stds_tiled<1>(cur, ref, lag, stds);
    case 32: return partition_stds_tiled<2>(cur, ref, lag, stds);
    case 48: return partition_stds_tiled<3>(cur, ref, lag, stds);
    case 64: return partition_stds_tiled<4>(cur, ref, lag, stds);
    case 80: return partition_stds_tiled<5>(cur, ref, lag, stds);
    case 96: return partition_stds_tiled<6>(cur, ref, lag, stds);
    case 112: return partition_stds_tiled<7>(cur, ref, lag, stds);
    case 128: return partition_stds_tiled<8>(cur, ref, lag, stds);
    default: break;
  }
  float* __restrict lo = work;
  float* __restrict hi = work + dim;
  float* __restrict y = work + 2 * dim;
  for (int64_t d = 0; d < dim; ++d) lo[d] = hi[d] = ref[d];
  for (int64_t t = 1; t < lag; ++t) {
    const float* x = ref + t * dim;
    // The reference partition comes from memory: ask for rows a few ahead (a 2-op loop per 16
    // floats otherwise waits on every line).
    if (t + kPrefetchRows < lag)
      for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(x + kPrefetchRows * dim + d);
    for (int64_t d = 0; d < dim; ++d) {
      lo[d] = x[d] < lo[d] ? x[d] : lo[d];
      hi[d] = x[d] > hi[d] ? x[d] : hi[d];
    }
  }
  // x / (hi - lo) as x * (1 / (hi - lo)): at most one ulp from kvpress's division.
  for (int64_t d = 0; d < dim; ++d) hi[d] = 1.f / (hi[d] - lo[d]);
  const float inv_dim = 1.f / static_cast<float>(dim);
  const float inv_dof = 1.f / static_cast<float>(dim - 1);  // unbiased; dim 1 gives NaN as torch does
  for (int64_t t = 0; t < lag; ++t) {
    const float* x = cur + t * dim;
    for (int64_t d = 0; d < dim; ++d) y[d] = (x[d] - lo[d]) * hi[d];
    const float mean = lane_sum(y, dim) * inv_dim;
    for (int64_t d = 0; d < dim; ++d) y[d] = (y[d] - mean) * (y[d] - mean);
    stds[t] = std::sqrt(lane_sum(y, dim) * inv_dof);
  }
}

// In place: softmax over n values (NaN anywhere gives NaN everywhere), the exponentials 16 at a
// time (vec16::exp_nonpositive; the tail padded with -inf, whose exponential is 0).
KVPRESS_VECTOR_CLONES
void softmax_in_place(float* v, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t t = 0; t < n; ++t) {
    nan |= std::isnan(v[t]);
    m = std::max(m, v[t]);
  }
  if (nan) {
    std::fill(v, v + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const int64_t t = n / kLanes * kLanes;
  vec16::Vec sum = vec16::exp_shifted_in_place(v, t, m);
  if (t < n) {
    float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = t + j < n ? v[t + j] : -std::numeric_limits<float>::infinity();
    const vec16::Vec e = vec16::exp_nonpositive(vec16::load(tail) - vec16::broadcast(m));
    sum += e;
    for (int64_t j = 0; t + j < n; ++j) v[t + j] = e[j];
  }
  const float inv_total = 1.f / vec16::lane_sum(sum);
  for (int64_t j = 0; j < n; ++j) v[j] *= inv_total;
}

// Partitions up to this length are ranked by counting (O(lag^2) vector compares, no branches),
// longer ones by a sort.
constexpr int64_t kCountingRankMax = 512;

// rank[t] = #{u < t : keys[u] <= keys[t]} + #{u > t : keys[u] < keys[t]}: the stable ascending
// rank, ties to the lower position. Two branch-free counting loops per key, which the compiler
// vectorises.
KVPRESS_VECTOR_CLONES
void stable_ranks(const uint32_t* __restrict keys, int64_t n, int32_t* __restrict rank) {
  for (int64_t t = 0; t < n; ++t) {
    const uint32_t pivot = keys[t];
    int32_t count = 0;
    for (int64_t u = 0; u < t; ++u) count += keys[u] <= pivot;
    for (int64_t u = t + 1; u < n; ++u) count += keys[u] < pivot;
    rank[t] = count;
  }
}

// Scratch of one thread. float16/bfloat16 partitions are converted to float32 once: the
// reference of partition p is the current partition of p + 1.
struct LagScratch {
  std::vector<float> work, key_soft, value_soft;
  std::vector<float> conv[4];   // K cur, K ref, V cur, V ref
  std::vector<uint64_t> order;  // (score key << 32) | position
  std::vector<uint32_t> keys;   // score keys for stable_ranks
  std::vector<int32_t> ranks;
  LagScratch(int64_t dim, int64_t lag, bool convert)
      : work(3 * dim), key_soft(lag), value_soft(lag), order(lag), keys(lag), ranks(lag) {
    if (convert)
      for (auto& c : conv) c.resize(static_cast<size_t>(lag * dim));
  }
};

// Scores of partitions [p_begin, p_end) of one head; k and v point at the first partition.
template <typename scalar_t>
void score_head_partitions(const scalar_t* k, const scalar_t* v, int64_t p_begin, int64_t p_end, int64_t lag,
                           int64_t dim, bool cross_scoring, LagScratch& s, float* out) {
  const int64_t part = lag * dim;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float *kc, *kr, *vc, *vr;
    if constexpr (std::is_same_v<scalar_t, float>) {
      kc = k + p * part, kr = k + (p + 1) * part, vc = v + p * part, vr = v + (p + 1) * part;
    } else {
      if (p == p_begin) {
        as_float32(k + p * part, part, s.conv[0]);
        as_float32(v + p * part, part, s.conv[2]);
      } else {
        std::swap(s.conv[0], s.conv[1]);
        std::swap(s.conv[2], s.conv[3]);
      }
      as_float32(k + (p + 1) * part, part, s.conv[1]);
      as_float32(v + (p + 1) * part, part, s.conv[3]);
      kc = s.conv[0].data(), kr = s.conv[1].data(), vc = s.conv[2].data(), vr = s.conv[3].data();
    }
    partition_stds(kc, kr, lag, dim, s.work.data(), s.key_soft.data());
    partition_stds(vc, vr, lag, dim, s.work.data(), s.value_soft.data());
    softmax_in_place(s.key_soft.data(), lag);
    softmax_in_place(s.value_soft.data(), lag);
    float* sc = s.key_soft.data();
    bool nan = false;
    for (int64_t t = 0; t < lag; ++t) {
      sc[t] = (sc[t] + s.value_soft[t]) / 2.f;
      nan |= std::isnan(sc[t]);
    }
    float* dst = out + p * lag;
    if (cross_scoring || nan) {  // NaN ranks would hide bad input from the selection's check
      std::copy(sc, sc + lag, dst);
      continue;
    }
    // Stable rank within the partition (argsort(argsort)); ties go to the lower position. rank / lag
    // in float32, rounded to the cache dtype as kvpress does.
    const auto rank_value = [&](int64_t r) {
      return static_cast<float>(static_cast<scalar_t>(static_cast<float>(r) / static_cast<float>(lag)));
    };
    if (lag <= kCountingRankMax) {
      for (int64_t t = 0; t < lag; ++t) s.keys[t] = order_key(sc[t]);
      stable_ranks(s.keys.data(), lag, s.ranks.data());
      for (int64_t t = 0; t < lag; ++t) dst[t] = rank_value(s.ranks[t]);
      continue;
    }
    // Longer partitions: sorting (score key, position) as one integer orders ties by position.
    for (int64_t t = 0; t < lag; ++t)
      s.order[t] = (static_cast<uint64_t>(order_key(sc[t])) << 32) | static_cast<uint64_t>(t);
    std::sort(s.order.begin(), s.order.end());
    for (int64_t r = 0; r < lag; ++r) dst[s.order[r] & 0xFFFFFFFFu] = rank_value(r);
  }
}

at::Tensor lagkv_partition_scores_cpu(const at::Tensor& keys_in, const at::Tensor& values_in, int64_t n_sink,
                                      int64_t lag_size, bool cross_scoring) {
  constexpr const char* op = "lagkv_partition_scores";
  checks::check_lagkv_partitions(op, keys_in, values_in, n_sink, lag_size);
  const int64_t batch = keys_in.size(0), heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const checks::LagLayout layout = checks::lag_layout(seq, n_sink, lag_size);
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous();
  // Ones everywhere (sinks, last partition and remainder); the scored partitions are overwritten.
  at::Tensor out = at::ones({batch, heads, seq}, keys.options().dtype(at::kFloat));
  const int64_t scored = layout.n_parts - 1;
  // Tasks: (batch, head, run of partitions); a run re-reads only its last reference partition.
  constexpr int64_t kPartsPerTask = 16;
  const int64_t runs = (scored + kPartsPerTask - 1) / kPartsPerTask;
  float* out_ptr = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "lagkv_partition_scores_cpu", [&] {
    const scalar_t* k = keys.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    at::parallel_for(0, batch * heads * runs, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
      LagScratch scratch(dim, lag_size, !std::is_same_v<scalar_t, float>);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / runs, run = task % runs;
        const int64_t head_offset = row * seq * dim + n_sink * dim;
        score_head_partitions<scalar_t>(k + head_offset, v + head_offset, run * kPartsPerTask,
                                        std::min(scored, (run + 1) * kPartsPerTask), lag_size, dim, cross_scoring,
                                        scratch, out_ptr + row * seq + n_sink);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("lagkv_partition_scores", &lagkv_partition_scores_cpu); }

}  // namespace kvpress::kernels
