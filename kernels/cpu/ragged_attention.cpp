// CPU kernel for kvpress::ragged_attention: causal attention of n new tokens over a head-ragged
// layer (packed per-head rows + a dense tail), fused: no [n, L] score matrix, no repeated K/V.
//
// Work unit = (batch row, KV head, new token): the G = Hq / Hkv query heads of the group are
// handled together so each key and value row is read (and converted to float32) once per group
// instead of once per query head. Keys are visited in blocks of kBlock; the softmax is online
// (running max and sum per query head, the accumulator rescaled once per block), all in float32.
// With fewer units than 4 x threads (decoding), each unit's keys are split into chunks attended
// in parallel and merged afterwards, so one long head does not serialise the call.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernel_ops.h"

namespace kvpress::kernels {
namespace {

constexpr int64_t kBlock = 64;

// Dot product with eight independent partial sums, so the compiler can vectorise it without
// reassociating a single float reduction.
inline float dot(const float* a, const float* b, int64_t dim) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    for (int u = 0; u < 8; ++u) part[u] += a[d + u] * b[d + u];
  float tail = 0.f;
  for (; d < dim; ++d) tail += a[d] * b[d];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

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

// Partial attention state of one (batch row, KV head, new token) over a range of its visible keys,
// for the G query heads of the group: running max, running sum and unnormalised output.
struct Partial {
  float* max;  // [G]
  float* sum;  // [G]
  float* acc;  // [G, D]
};

template <typename scalar_t>
struct RaggedAttention {
  int64_t batch, q_heads, n, dim, kv_heads, m, groups;
  const scalar_t *q_ptr, *pk, *pv, *tk, *tv;
  int64_t tk_b, tk_h, tk_s, tv_b, tv_h, tv_s;
  const std::vector<int64_t>* offsets;
  float scale;

  int64_t n_visible(int64_t unit) const {  // packed rows of the head, then tail rows 0..m-n+i
    const int64_t i = unit % n, bh = unit / n;
    return (*offsets)[static_cast<size_t>(bh + 1)] - (*offsets)[static_cast<size_t>(bh)] + (m - n + i + 1);
  }

  // Attends unit (= (b * Hkv + h) * n + i) over its visible keys [j_begin, j_end) into `part`.
  // `qf` ([G, D]), `scores` ([G, kBlock]) and `row_buffer` ([D]) are scratch.
  void attend(int64_t unit, int64_t j_begin, int64_t j_end, Partial part, float* qf, float* scores,
              float* row_buffer) const {
    const int64_t i = unit % n, bh = unit / n, b = bh / kv_heads, h = bh % kv_heads;
    for (int64_t g = 0; g < groups; ++g) {  // query heads h*G .. h*G + G - 1 at token i, pre-scaled
      const scalar_t* q = q_ptr + ((b * q_heads + h * groups + g) * n + i) * dim;
      for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(q[d]) * scale;
    }
    std::fill(part.acc, part.acc + groups * dim, 0.f);
    std::fill(part.max, part.max + groups, -std::numeric_limits<float>::infinity());
    std::fill(part.sum, part.sum + groups, 0.f);
    const int64_t packed_begin = (*offsets)[static_cast<size_t>(bh)];
    const int64_t n_packed = (*offsets)[static_cast<size_t>(bh + 1)] - packed_begin;
    const scalar_t* tail_k = tk + b * tk_b + h * tk_h;
    const scalar_t* tail_v = tv + b * tv_b + h * tv_h;
    const scalar_t* key_rows[kBlock];
    const scalar_t* value_rows[kBlock];

    for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlock) {
      const int64_t len = std::min(kBlock, j_end - j0);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t row = j0 + j;
        key_rows[j] = row < n_packed ? pk + (packed_begin + row) * dim : tail_k + (row - n_packed) * tk_s;
        value_rows[j] = row < n_packed ? pv + (packed_begin + row) * dim : tail_v + (row - n_packed) * tv_s;
      }
      // Scores of the block for every query head of the group.
      for (int64_t j = 0; j < len; ++j) {
        const float* k = as_float<scalar_t>(key_rows[j], row_buffer, dim);
        for (int64_t g = 0; g < groups; ++g) scores[g * kBlock + j] = dot(qf + g * dim, k, dim);
      }
      // Online softmax: rescale what was accumulated when the running max grows.
      for (int64_t g = 0; g < groups; ++g) {
        float* sc = scores + g * kBlock;
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
      for (int64_t j = 0; j < len; ++j) {
        const float* v = as_float<scalar_t>(value_rows[j], row_buffer, dim);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * kBlock + j];
          float* a = part.acc + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
        }
      }
    }
  }

  // out rows of `unit` from one or more partials of its key range (merged by their maxima).
  void write(int64_t unit, const Partial* parts, int64_t n_parts, scalar_t* o_ptr) const {
    const int64_t i = unit % n, bh = unit / n, b = bh / kv_heads, h = bh % kv_heads;
    for (int64_t g = 0; g < groups; ++g) {
      float total_max = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < n_parts; ++c) total_max = std::max(total_max, parts[c].max[g]);
      float total_sum = 0.f;
      for (int64_t c = 0; c < n_parts; ++c) total_sum += parts[c].sum[g] * std::exp(parts[c].max[g] - total_max);
      // A token always sees itself, so total_sum > 0.
      scalar_t* o = o_ptr + ((b * q_heads + h * groups + g) * n + i) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        float value = 0.f;
        for (int64_t c = 0; c < n_parts; ++c)
          value += parts[c].acc[g * dim + d] * std::exp(parts[c].max[g] - total_max);
        o[d] = static_cast<scalar_t>(value / total_sum);
      }
    }
  }
};

template <typename scalar_t>
void ragged_attention_kernel(const at::Tensor& queries, const at::Tensor& packed_keys, const at::Tensor& packed_values,
                             const std::vector<int64_t>& offsets, const at::Tensor& tail_keys,
                             const at::Tensor& tail_values, double scale, at::Tensor& out) {
  RaggedAttention<scalar_t> k;
  k.batch = queries.size(0);
  k.q_heads = queries.size(1);
  k.n = queries.size(2);
  k.dim = queries.size(3);
  k.kv_heads = tail_keys.size(1);
  k.m = tail_keys.size(2);
  k.groups = k.q_heads / k.kv_heads;
  k.q_ptr = queries.const_data_ptr<scalar_t>();
  k.pk = packed_keys.const_data_ptr<scalar_t>();
  k.pv = packed_values.const_data_ptr<scalar_t>();
  k.tk = tail_keys.const_data_ptr<scalar_t>();
  k.tv = tail_values.const_data_ptr<scalar_t>();
  k.tk_b = tail_keys.stride(0);
  k.tk_h = tail_keys.stride(1);
  k.tk_s = tail_keys.stride(2);
  k.tv_b = tail_values.stride(0);
  k.tv_h = tail_values.stride(1);
  k.tv_s = tail_values.stride(2);
  k.offsets = &offsets;
  k.scale = static_cast<float>(scale);
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t units = k.batch * k.kv_heads * k.n, groups = k.groups, dim = k.dim;
  const size_t state = static_cast<size_t>(groups * (dim + 2));  // max, sum, acc of one partial

  // Decoding has few units (B * Hkv) of very different lengths (per-head budgets): split every
  // unit's keys into chunks of about total / (4 * threads) keys, each attended separately, then
  // merge the partials (flash-decoding). With enough units, each unit is one piece of work.
  const int64_t threads = at::get_num_threads();
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (units < 4 * threads) {
    int64_t total = 0;
    for (int64_t u = 0; u < units; ++u) total += k.n_visible(u);
    chunk = std::max<int64_t>(4 * kBlock, (total + 4 * threads - 1) / (4 * threads));
  }
  std::vector<int64_t> first_piece(static_cast<size_t>(units + 1), 0);  // pieces of unit u: [first[u], first[u+1])
  for (int64_t u = 0; u < units; ++u) {
    const int64_t pieces = chunk == std::numeric_limits<int64_t>::max() ? 1 : (k.n_visible(u) + chunk - 1) / chunk;
    first_piece[static_cast<size_t>(u + 1)] = first_piece[static_cast<size_t>(u)] + std::max<int64_t>(1, pieces);
  }
  const int64_t n_pieces = first_piece.back();

  if (n_pieces == units) {  // one piece per unit: normalise and write directly
    at::parallel_for(0, units, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(state + static_cast<size_t>(groups * dim + groups * kBlock + dim));
      float* st = buf.data();
      const Partial part{st, st + groups, st + 2 * groups};
      float* qf = st + state;
      for (int64_t u = begin; u < end; ++u) {
        k.attend(u, 0, k.n_visible(u), part, qf, qf + groups * dim, qf + groups * dim + groups * kBlock);
        k.write(u, &part, 1, o_ptr);
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
    std::vector<float> scratch(static_cast<size_t>(groups * dim + groups * kBlock + dim));
    float* qf = scratch.data();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t u = piece_unit[static_cast<size_t>(p)];
      const int64_t j_begin = (p - first_piece[static_cast<size_t>(u)]) * chunk;
      const int64_t j_end = std::min(j_begin + chunk, k.n_visible(u));
      k.attend(u, j_begin, j_end, partial_at(p), qf, qf + groups * dim, qf + groups * dim + groups * kBlock);
    }
  });
  at::parallel_for(0, units, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    std::vector<Partial> parts;
    for (int64_t u = begin; u < end; ++u) {
      parts.clear();
      for (int64_t p = first_piece[static_cast<size_t>(u)]; p < first_piece[static_cast<size_t>(u + 1)]; ++p)
        parts.push_back(partial_at(p));
      k.write(u, parts.data(), static_cast<int64_t>(parts.size()), o_ptr);
    }
  });
}

at::Tensor ragged_attention_cpu(const at::Tensor& queries_in, const at::Tensor& packed_keys_in,
                                const at::Tensor& packed_values_in, const at::Tensor& offsets_in,
                                const at::Tensor& tail_keys_in, const at::Tensor& tail_values_in,
                                std::optional<double> scale_in) {
  const checks::RaggedAttentionArgs a = checks::ragged_attention_args(
      queries_in, packed_keys_in, packed_values_in, offsets_in, tail_keys_in, tail_values_in, scale_in);
  const int64_t* o = a.offsets.const_data_ptr<int64_t>();
  const std::vector<int64_t> offsets(o, o + a.offsets.numel());
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  if (a.queries.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.queries.scalar_type(), "ragged_attention_cpu", [&] {
    ragged_attention_kernel<scalar_t>(a.queries, a.packed_keys, a.packed_values, offsets, a.tail_keys, a.tail_values,
                                      a.scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("ragged_attention", &ragged_attention_cpu); }

}  // namespace kvpress::kernels
