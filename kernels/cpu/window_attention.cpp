// CPU kernel for kvpress::window_attention_mean (SnapKVPress, TOVAPress): the causal softmax
// attention of the last w positions over the keys, averaged over the w window queries, without
// materialising [B, Hq, w, S] or repeated keys. KV heads go through in slabs whose float32 logits
// take at most 32 MiB (the buffer is reused); per slab:
//   logits = (q / sqrt(D)) k^T   one batched GEMM, each KV head's query heads stacked as rows
//                                (up to kFewRows rows per head: vector dot products instead)
//   per query head (a work item): each window row's softmax over the keys it sees (the causal
//   mask is the row's length, never written), accumulated into the head's output row while both
//   rows are in the core's cache, then scaled by 1 / w (window_softmax_mean).
// Each step is one multi-threaded ATen call: BLAS must not run inside an at::parallel_for region
// here, since torch turns MKL's dynamic threading off and nested GEMMs then oversubscribe the
// cores (measured 10x slower on 2 busy cores).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/float_rows.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"
#include "kernel_ops.h"

namespace kvpress::kernels {
namespace {

// Upper bound of one slab's float32 logits; at least one KV head is always taken.
constexpr int64_t kSlabBytes = int64_t{32} << 20;

// Up to this many logits rows per KV head (group x window: TOVA's last query, small windows), the
// logits are streaming dot products instead of a GEMM: with a handful of rows a GEMM spends its
// time packing the keys, while the dot products read each key row once, at memory speed.
constexpr int64_t kFewRows = 8;

// logits[r * seq + j] = q[r] . k[j] for the rows of one KV head and n consecutive keys; q [rows,
// dim] and k [n, dim] contiguous, logits rows `seq` apart.
KVPRESS_VECTOR_CLONES
void few_rows_logits(const float* q, int64_t rows, const float* k, int64_t n, int64_t dim, int64_t seq, float* logits) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) logits[r * seq + j] = vec16::dot(q + r * dim, k + j * dim, dim);
}

// The mean over a query head's `window` rows of their causal softmax, in one pass per row while
// the row (S floats) and the output row stay in the core's cache: row i sees keys 0 .. S - w + i;
// out[j] = (1 / w) sum_i e^(l_ij - max_i) / sum_i for j < S - w. `logits` (w rows `seq` apart) is
// overwritten with the exponentials. Replaces masking the logits, torch's softmax in place and a
// mean over the window: three passes over every slab of logits.
KVPRESS_VECTOR_CLONES
void window_softmax_mean(float* logits, int64_t window, int64_t seq, float* __restrict out) {
  using vec16::kLanes;
  using vec16::Vec;
  const int64_t n_out = seq - window;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n_out; ++j) out[j] = 0.0f;
  for (int64_t i = 0; i < window; ++i) {
    float* row = logits + i * seq;
    const int64_t visible = seq - window + i + 1;
    const int64_t body = visible / kLanes * kLanes;
    // The tail of the visible columns, padded with -inf (e^-inf = 0 adds nothing).
    float tail_in[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail_in[j] = body + j < visible ? row[body + j] : neg_inf;
    Vec max_v = vec16::load(tail_in);
    for (int64_t j = 0; j < body; j += kLanes) {
      const Vec v = vec16::load(row + j);
      max_v = v > max_v ? v : max_v;
    }
    const float row_max = vec16::lane_max(max_v);
    const Vec shift = vec16::broadcast(row_max);
    Vec sum_v{};
    for (int64_t j = 0; j < body; j += kLanes) {
      const Vec e = vec16::exp_nonpositive(vec16::load(row + j) - shift);
      vec16::store(row + j, e);
      sum_v += e;
    }
    const Vec tail_e = vec16::exp_nonpositive(vec16::load(tail_in) - shift);
    sum_v += tail_e;
    for (int64_t j = body; j < visible; ++j) row[j] = tail_e[j - body];
    const float inv = 1.0f / vec16::lane_sum(sum_v);
    for (int64_t j = 0; j < n_out; ++j) out[j] += row[j] * inv;
  }
  const float inv_window = 1.0f / static_cast<float>(window);
  for (int64_t j = 0; j < n_out; ++j) out[j] *= inv_window;
}

// The few-rows logits of a slab: q [nh, rows, D] float32 contiguous, k [nh, S, D] in the cache
// dtype, logits [nh, rows, S]. float16/bfloat16 keys are converted a block of rows at a time
// (exactly), never as a float32 copy of the slab.
void few_rows_slab(const at::Tensor& q, const at::Tensor& k_in, int64_t rows, float* logits) {
  const at::Tensor k = k_in.contiguous();
  const int64_t nh = k.size(0), seq = k.size(1), dim = k.size(2);
  const float* qp = q.data_ptr<float>();
  AT_DISPATCH_V2(
      k.scalar_type(), "window_attention_mean_cpu", AT_WRAP([&] {
        const scalar_t* kp = k.data_ptr<scalar_t>();
        at::parallel_for(0, nh * seq, /*grain_size=*/1024, [&](int64_t begin, int64_t end) {
          std::vector<float> block(std::is_same_v<scalar_t, float> ? 0 : static_cast<size_t>(kConvertBlockRows * dim));
          for (int64_t i = begin; i < end;) {  // (head, key) pairs [begin, end), head by head, in blocks
            const int64_t h = i / seq, j0 = i % seq;
            const int64_t j1 = std::min({seq, j0 + (end - i), j0 + kConvertBlockRows});
            // keys j0 .. j1 as float32, [j1 - j0, dim]
            const float* rows_f32 = as_float32(kp + (h * seq + j0) * dim, (j1 - j0) * dim, block);
            few_rows_logits(qp + h * rows * dim, rows, rows_f32, j1 - j0, dim, seq, logits + h * rows * seq + j0);
            i += j1 - j0;
          }
        });
      }),
      at::kFloat, at::kHalf, at::kBFloat16);
}

at::Tensor window_attention_mean_cpu(const at::Tensor& queries_in, const at::Tensor& keys_in) {
  constexpr const char* op = "window_attention_mean";
  checks::check_window_attention(op, queries_in, keys_in);
  const int64_t batch = keys_in.size(0), kv_heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), window = queries_in.size(2), group = heads / kv_heads;
  const int64_t rows = group * window;  // logits rows of one KV head
  // Scaling the (small) queries once replaces a pass over every logit.
  const at::Tensor queries = (queries_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(dim))))
                                 .contiguous()
                                 .view({batch, kv_heads, rows, dim});
  at::Tensor out = at::empty({batch, heads, seq - window}, keys_in.options().dtype(at::kFloat));
  const int64_t slab = std::clamp<int64_t>(kSlabBytes / std::max<int64_t>(1, rows * seq * 4), 1, kv_heads);
  at::Tensor logits_buffer = at::empty({slab, rows, seq}, out.options());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h0 = 0; h0 < kv_heads; h0 += slab) {
      const int64_t nh = std::min(slab, kv_heads - h0);
      at::Tensor logits = logits_buffer.narrow(0, 0, nh);
      const at::Tensor q = queries.select(0, b).narrow(0, h0, nh);  // [nh, rows, D]
      float* lp = logits.data_ptr<float>();
      if (rows <= kFewRows) {
        few_rows_slab(q, keys_in.select(0, b).narrow(0, h0, nh), rows, lp);
      } else {
        // float32 keys of the slab: a view when the cache is float32, else one converted copy.
        const at::Tensor k = keys_in.select(0, b).narrow(0, h0, nh).to(at::kFloat);  // [nh, S, D]
        at::bmm_out(logits, q, k.transpose(1, 2));
      }
      // Softmax of each window row over the keys it sees, averaged over the window, written
      // straight into the output: one work item per query head.
      float* dst = out.select(0, b).data_ptr<float>() + h0 * group * (seq - window);
      at::parallel_for(0, nh * group, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
        for (int64_t head = begin; head < end; ++head)
          window_softmax_mean(lp + head * window * seq, window, seq, dst + head * (seq - window));
      });
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("window_attention_mean", &window_attention_mean_cpu); }

}  // namespace kvpress::kernels
