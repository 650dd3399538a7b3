// The fused attention of the CPU kernels over per-head lists of cached tokens (ragged_attention,
// paged_attention): causal attention of n new tokens, no score matrix, no repeated K/V.
//
// Work unit = (batch row, KV head, new token): the G = Hq / Hkv query heads of the group are handled
// together so each key and value row is read (and converted to float32) once per group instead of
// once per query head. Keys are visited in blocks of kAttentionBlock; the softmax is online (running
// max and sum per query head, the accumulator rescaled once per block), all in float32. Every thread
// gets an equal share of all units' keys (run_attention); a unit shared by two threads is attended
// in pieces merged afterwards (flash-decoding), so one long head does not serialise the call.
//
// A kernel describes where its rows are with a Layout:
//   int64_t units, groups, dim;  float scale;
//   int64_t n_visible(int64_t unit) const;                 // keys unit may attend to
//   const scalar_t* query(int64_t unit, int64_t g) const;  // [D], query head g of the unit's group
//   // Its j-th visible key (positions ascend) and value as float32 [D]: the row itself, or the row
//   // converted or dequantized into `buffer` ([D] scratch).
//   const float* key_row(int64_t unit, int64_t j, float* buffer) const;
//   const float* value_row(int64_t unit, int64_t j, float* buffer) const;
//   void prefetch(int64_t unit, int64_t j) const;          // asks for row j's key and value bytes
//   scalar_t* output(int64_t unit, int64_t g) const;       // [D]
// A layout whose rows lie in memory as scalar_t derives the three row methods from StoredRows.
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

// key_row, value_row and prefetch of a Layout whose key and value rows are scalar_t [D] in memory:
// it gives const scalar_t* key(unit, j) and value(unit, j) (CRTP).
template <typename scalar_t, typename Layout>
struct StoredRows {
  const float* key_row(int64_t unit, int64_t j, float* buffer) const {
    return as_float<scalar_t>(self().key(unit, j), buffer, self().dim);
  }
  const float* value_row(int64_t unit, int64_t j, float* buffer) const {
    return as_float<scalar_t>(self().value(unit, j), buffer, self().dim);
  }
  void prefetch(int64_t unit, int64_t j) const {
    const auto row_bytes = self().dim * static_cast<int64_t>(sizeof(scalar_t));
    const char* k = reinterpret_cast<const char*>(self().key(unit, j));
    const char* v = reinterpret_cast<const char*>(self().value(unit, j));
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(k + b);
      __builtin_prefetch(v + b);
    }
  }

 private:
  const Layout& self() const { return static_cast<const Layout&>(*this); }
};

// Partial attention state of one unit over a range of its visible keys, for the G query heads of
// the group: running max, running sum and unnormalised output.
struct Partial {
  float* max;  // [G]
  float* sum;  // [G]
  float* acc;  // [G, D]
};

// Asks for the key and value rows of the next block while this one is computed: the rows of a
// unit are scattered (pages, per-head lists), and the hardware prefetcher alone leaves the loops
// waiting on memory.
template <typename Layout>
inline void prefetch_block(const Layout& l, int64_t unit, int64_t j_begin, int64_t j_end) {
  const int64_t len = std::min(kAttentionBlock, j_end - j_begin);
  for (int64_t j = 0; j < len; ++j) l.prefetch(unit, j_begin + j);
}

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
    for (int64_t j = 0; j < len; ++j) rows[j] = l.key_row(unit, j0 + j, row_buffer + j * dim);
    prefetch_block(l, unit, j0 + len, j_end);
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
    for (int64_t j = 0; j < len; ++j) rows[j] = l.value_row(unit, j0 + j, row_buffer + j * dim);
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

// Every unit of the layout, in parallel. The keys of all units, concatenated, are cut into one
// equal span per thread, so units of very different lengths (per-head budgets, a mixed-length
// batch) and a few long units (decoding one sequence) are balanced alike. A unit cut by a span
// boundary is attended in pieces whose partial softmaxes are merged afterwards (flash-decoding);
// every other unit is normalised and written by the thread that attends it.
template <typename scalar_t, typename Layout>
void run_attention(const Layout& l) {
  const int64_t units = l.units, groups = l.groups, dim = l.dim;
  const size_t state = static_cast<size_t>(groups * (dim + 2));  // max, sum, acc of one partial
  const size_t scratch = static_cast<size_t>(groups * dim + groups * kAttentionBlock + kAttentionBlock * dim);

  std::vector<int64_t> first_key(static_cast<size_t>(units + 1), 0);  // unit u: keys [first[u], first[u+1])
  for (int64_t u = 0; u < units; ++u)
    first_key[static_cast<size_t>(u + 1)] = first_key[static_cast<size_t>(u)] + l.n_visible(u);
  const int64_t total = first_key.back();
  // At least 4 blocks per span: below that, splitting costs more than it saves.
  const int64_t spans = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / (4 * kAttentionBlock)));

  struct Piece {
    int64_t unit, j_begin, j_end;
    int64_t partial;  // its slot in `partials`, or -1 when the piece is the whole unit
  };
  std::vector<Piece> pieces;
  std::vector<size_t> span_first(static_cast<size_t>(spans + 1), 0);  // pieces of span s: [first[s], first[s+1])
  int64_t n_partials = 0;
  int64_t u = 0;
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t lo = total * s / spans, hi = total * (s + 1) / spans;
    while (u < units && first_key[static_cast<size_t>(u + 1)] <= lo) ++u;
    for (int64_t v = u; v < units && first_key[static_cast<size_t>(v)] < hi; ++v) {
      const int64_t begin = first_key[static_cast<size_t>(v)], end = first_key[static_cast<size_t>(v + 1)];
      const int64_t j_begin = std::max(lo, begin) - begin, j_end = std::min(hi, end) - begin;
      if (j_end <= j_begin) continue;
      const bool cut = j_begin > 0 || j_end < end - begin;  // its partial is merged later
      pieces.push_back(Piece{v, j_begin, j_end, cut ? n_partials++ : -1});
    }
    span_first[static_cast<size_t>(s + 1)] = pieces.size();
  }

  std::vector<float> partials(static_cast<size_t>(n_partials) * state);
  const auto partial_at = [&](int64_t slot) {
    float* st = partials.data() + static_cast<size_t>(slot) * state;
    return Partial{st, st + groups, st + 2 * groups};
  };
  at::parallel_for(0, spans, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(state + scratch);
    const Partial own{buf.data(), buf.data() + groups, buf.data() + 2 * groups};
    float* qf = buf.data() + state;
    for (int64_t s = begin; s < end; ++s) {
      for (size_t p = span_first[static_cast<size_t>(s)]; p < span_first[static_cast<size_t>(s + 1)]; ++p) {
        const Piece& piece = pieces[p];
        const Partial part = piece.partial < 0 ? own : partial_at(piece.partial);
        attend<scalar_t>(l, piece.unit, piece.j_begin, piece.j_end, part, qf, qf + groups * dim,
                         qf + groups * dim + groups * kAttentionBlock);
        if (piece.partial < 0) write<scalar_t>(l, piece.unit, &part, 1);
      }
    }
  });
  // At most spans - 1 units are cut, and a cut unit's pieces are consecutive in `pieces`: merging
  // them is cheap and serial.
  std::vector<Partial> parts;
  for (size_t p = 0; p < pieces.size(); ++p) {
    if (pieces[p].partial < 0) continue;
    parts.push_back(partial_at(pieces[p].partial));
    if (p + 1 == pieces.size() || pieces[p + 1].unit != pieces[p].unit) {
      write<scalar_t>(l, pieces[p].unit, parts.data(), static_cast<int64_t>(parts.size()));
      parts.clear();
    }
  }
}

}  // namespace kvpress::kernels
