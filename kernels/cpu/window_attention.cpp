// CPU kernel for kvpress::window_attention_mean (SnapKVPress, TOVAPress): the causal softmax
// attention of the last w positions over the keys, averaged over the w window queries, without
// materialising [B, Hq, w, S] or repeated keys. KV heads go through in slabs whose float32 logits
// take at most 32 MiB (the buffer is reused); per slab:
//   logits = (q / sqrt(D)) k^T   one batched GEMM, each KV head's query heads stacked as rows
//                                (up to kFewRows rows per head: vector dot products instead)
//   causal mask on the last w columns, softmax per row in place (torch's vectorised kernel)
//   mean over the w rows of each query head, written straight into the output.
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
  const float neg_inf = -std::numeric_limits<float>::infinity();
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
      // Window query i sits at position S - w + i and sees keys 0 .. S - w + i.
      at::parallel_for(0, nh * rows, /*grain_size=*/64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = r % window;
          std::fill(lp + r * seq + (seq - window + i + 1), lp + (r + 1) * seq, neg_inf);
        }
      });
      at::_softmax_out(logits, logits, /*dim=*/2, /*half_to_float=*/false);  // in place, row by row
      at::Tensor dst = out.select(0, b).narrow(0, h0 * group, nh * group);   // [nh * group, S - w]
      at::mean_out(dst, logits.view({nh * group, window, seq}).narrow(2, 0, seq - window), at::IntArrayRef{1});
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("window_attention_mean", &window_attention_mean_cpu); }

}  // namespace kvpress::kernels
