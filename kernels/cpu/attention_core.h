// The fused attention of the CPU kernels over per-head lists of cached tokens (ragged_attention,
// paged_attention): causal attention of n new tokens, no score matrix, no repeated K/V.
//
// Work unit = (batch row, KV head, new token): the G = Hq / Hkv query heads of the group are handled
// together so each key and value row is read (and converted to float32) once per group instead of
// once per query head. Keys are visited in blocks of kAttentionBlock; the softmax is online (running
// max and sum per query head, the accumulator rescaled once per block), all in float32. With fewer
// units than 4 x threads (decoding), each unit's keys are split into chunks attended in parallel and
// merged afterwards (flash-decoding), so one long head does not serialise the call.
//
// A kernel describes where its rows are with a Layout:
//   int64_t units, groups, dim;  float scale;
//   int64_t n_visible(int64_t unit) const;                 // keys unit may attend to
//   const scalar_t* query(int64_t unit, int64_t g) const;  // [D], query head g of the unit's group
//   const scalar_t* key(int64_t unit, int64_t j) const;    // [D], its j-th visible key (positions ascend)
//   const scalar_t* value(int64_t unit, int64_t j) const;  // [D]
//   scalar_t* output(int64_t unit, int64_t g) const;       // [D]
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvpress::kernels {

constexpr int64_t kAttentionBlock = 64;

// The two loops where the time goes, over one block of len <= kAttentionBlock float32 rows given by
// their addresses (attention_core.cpp: compiled for AVX-512, AVX2 and the baseline, chosen at load
// time). scores and probs are [G, kAttentionBlock], qf [G, D] (pre-scaled queries), acc [G, D].
//   block_scores:      scores[g][j] = qf[g] . rows[j]
//   block_accumulate:  acc[g] += probs[g][j] * rows[j], for every j
void block_scores(const float* qf, const float* const* rows, int64_t len, int64_t groups, int64_t dim, float* scores);
void block_accumulate(const float* probs, const float* const* rows, int64_t len, int64_t groups, int64_t dim,
                      float* acc);

// A row as float32: the row itself for float input, else converted into `buffer`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buffer, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(row[d]);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* row, float* /*buffer*/, int64_t /*dim*/) {
  return row;
}

// Partial attention state of one unit over a range of its visible keys, for the G query heads of
// the group: running max, running sum and unnormalised output.
struct Partial {
  float* max;  // [G]
  float* sum;  // [G]
  float* acc;  // [G, D]
};

// Attends `unit` over its visible keys [j_begin, j_end) into `part`. `qf` ([G, D]), `scores`
// ([G, kAttentionBlock]) and `row_buffer` ([kAttentionBlock, D]: rows converted to float32) are
// scratch.
template <typename scalar_t, typename Layout>
void attend(const Layout& l, int64_t unit, int64_t j_begin, int64_t j_end, Partial part, float* qf, float* scores,
            float* row_buffer) {
  const int64_t groups = l.groups, dim = l.dim;
  for (int64_t g = 0; g < groups; ++g) {  // the group's query heads, pre-scaled
    const scalar_t* q = l.query(unit, g);
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(q[d]) * l.scale;
  }
  std::fill(part.acc, part.acc + groups * dim, 0.f);
  std::fill(part.max, part.max + groups, -std::numeric_limits<float>::infinity());
  std::fill(part.sum, part.sum + groups, 0.f);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kAttentionBlock) {
    const int64_t len = std::min(kAttentionBlock, j_end - j0);
    const float* rows[kAttentionBlock];
    // Scores of the block for every query head of the group.
    for (int64_t j = 0; j < len; ++j) rows[j] = as_float<scalar_t>(l.key(unit, j0 + j), row_buffer + j * dim, dim);
    block_scores(qf, rows, len, groups, dim, scores);
    // Online softmax: rescale what was accumulated when the running max grows.
    for (int64_t g = 0; g < groups; ++g) {
      float* sc = scores + g * kAttentionBlock;
      float block_max = sc[0];
      for (int64_t j = 1; j < len; ++j) block_max = std::max(block_max, sc[j]);
      const float new_max = std::max(part.max[g], block_max);
      const float correction = std::exp(part.max[g] - new_max);  // 0 on the first block
      float sum = part.sum[g] * correction;
      if (correction != 1.f) {
        float* a = part.acc + g * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
      }
      for (int64_t j = 0; j < len; ++j) {
        sc[j] = std::exp(sc[j] - new_max);
        sum += sc[j];
      }
      part.max[g] = new_max;
      part.sum[g] = sum;
    }
    for (int64_t j = 0; j < len; ++j) rows[j] = as_float<scalar_t>(l.value(unit, j0 + j), row_buffer + j * dim, dim);
    block_accumulate(scores, rows, len, groups, dim, part.acc);
  }
}

// The output rows of `unit` from one or more partials of its key range (merged by their maxima).
template <typename scalar_t, typename Layout>
void write(const Layout& l, int64_t unit, const Partial* parts, int64_t n_parts) {
  const int64_t groups = l.groups, dim = l.dim;
  for (int64_t g = 0; g < groups; ++g) {
    float total_max = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n_parts; ++c) total_max = std::max(total_max, parts[c].max[g]);
    float total_sum = 0.f;
    for (int64_t c = 0; c < n_parts; ++c) total_sum += parts[c].sum[g] * std::exp(parts[c].max[g] - total_max);
    // A new token always sees itself, so total_sum > 0.
    scalar_t* o = l.output(unit, g);
    for (int64_t d = 0; d < dim; ++d) {
      float value = 0.f;
      for (int64_t c = 0; c < n_parts; ++c) value += parts[c].acc[g * dim + d] * std::exp(parts[c].max[g] - total_max);
      o[d] = static_cast<scalar_t>(value / total_sum);
    }
  }
}

// Every unit of the layout, in parallel.
template <typename scalar_t, typename Layout>
void run_attention(const Layout& l) {
  const int64_t units = l.units, groups = l.groups, dim = l.dim;
  const size_t state = static_cast<size_t>(groups * (dim + 2));  // max, sum, acc of one partial
  const size_t scratch = static_cast<size_t>(groups * dim + groups * kAttentionBlock + kAttentionBlock * dim);

  // Decoding has few units (B * Hkv) of very different lengths (per-head budgets): split every
  // unit's keys into chunks of about total / (4 * threads) keys, each attended separately, then
  // merge the partials. With enough units, each unit is one piece of work.
  const int64_t threads = at::get_num_threads();
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (units < 4 * threads) {
    int64_t total = 0;
    for (int64_t u = 0; u < units; ++u) total += l.n_visible(u);
    chunk = std::max<int64_t>(4 * kAttentionBlock, (total + 4 * threads - 1) / (4 * threads));
  }
  std::vector<int64_t> first_piece(static_cast<size_t>(units + 1), 0);  // pieces of unit u: [first[u], first[u+1])
  for (int64_t u = 0; u < units; ++u) {
    const int64_t pieces = chunk == std::numeric_limits<int64_t>::max() ? 1 : (l.n_visible(u) + chunk - 1) / chunk;
    first_piece[static_cast<size_t>(u + 1)] = first_piece[static_cast<size_t>(u)] + std::max<int64_t>(1, pieces);
  }
  const int64_t n_pieces = first_piece.back();

  if (n_pieces == units) {  // one piece per unit: normalise and write directly
    at::parallel_for(0, units, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(state + scratch);
      float* st = buf.data();
      const Partial part{st, st + groups, st + 2 * groups};
      float* qf = st + state;
      for (int64_t u = begin; u < end; ++u) {
        attend<scalar_t>(l, u, 0, l.n_visible(u), part, qf, qf + groups * dim,
                         qf + groups * dim + groups * kAttentionBlock);
        write<scalar_t>(l, u, &part, 1);
      }
    });
    return;
  }
  std::vector<float> partials(static_cast<size_t>(n_pieces) * state);
  std::vector<int64_t> piece_unit(static_cast<size_t>(n_pieces));
  for (int64_t u = 0; u < units; ++u)
    for (int64_t p = first_piece[static_cast<size_t>(u)]; p < first_piece[static_cast<size_t>(u + 1)]; ++p)
      piece_unit[static_cast<size_t>(p)] = u;
  const auto partial_at = [&](int64_t p) {
    float* st = partials.data() + static_cast<size_t>(p) * state;
    return Partial{st, st + groups, st + 2 * groups};
  };
  at::parallel_for(0, n_pieces, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(scratch);
    float* qf = buf.data();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t u = piece_unit[static_cast<size_t>(p)];
      const int64_t j_begin = (p - first_piece[static_cast<size_t>(u)]) * chunk;
      const int64_t j_end = std::min(j_begin + chunk, l.n_visible(u));
      attend<scalar_t>(l, u, j_begin, j_end, partial_at(p), qf, qf + groups * dim,
                       qf + groups * dim + groups * kAttentionBlock);
    }
  });
  at::parallel_for(0, units, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    std::vector<Partial> parts;
    for (int64_t u = begin; u < end; ++u) {
      parts.clear();
      for (int64_t p = first_piece[static_cast<size_t>(u)]; p < first_piece[static_cast<size_t>(u + 1)]; ++p)
        parts.push_back(partial_at(p));
      write<scalar_t>(l, u, parts.data(), static_cast<int64_t>(parts.size()));
    }
  });
}

}  // namespace kvpress::kernels
