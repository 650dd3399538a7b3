// Public ops: the building blocks every press is made of. Declarations only; each op is also
// registered as torch.ops.kvpress.<name> (src/ops.cpp) so Python can call it after
// torch.ops.load_library("libkvpress.so").
//
// All ops accept float32, float16 and bfloat16 K/V and accumulate in float32. Scores are
// float32 [B, Hkv, S], higher = keep. Bad input raises c10::Error with a message of the form
// "<op>: <argument> must be <expected>, got <actual>".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kvpress/types.h"

namespace kvpress::ops {

// ---- selection ---------------------------------------------------------------------------

// kvpress's compute_n_kept: max(1, int(seq_len * (1 - compression_ratio))) in double math.
int64_t n_kept(int64_t seq_len, double compression_ratio);

// Positions of the k highest scores per row, ascending. Ties go to the lower position.
// Raises on NaN scores.
at::Tensor topk_indices(const at::Tensor& scores,  // [B, H, S] float
                        int64_t k);                 // -> [B, H, k] int64

// keys/values at `indices`, contiguous.
KV gather_kv(const at::Tensor& keys,      // [B, Hkv, S, D]
             const at::Tensor& values,    // [B, Hkv, S, D]
             const at::Tensor& indices);  // [B, Hkv, n] int64

// ---- RoPE and heads ---------------------------------------------------------------------

// x * cos + rotate_half(x) * sin (HF convention).
at::Tensor apply_rope(const at::Tensor& x,     // [B, H, n, D]
                      const at::Tensor& cos,   // [n, D]
                      const at::Tensor& sin);  // [n, D]

// Exact inverse of apply_rope (rotation by the opposite angle).
at::Tensor invert_rope(const at::Tensor& x,     // [B, H, n, D]
                       const at::Tensor& cos,   // [n, D]
                       const at::Tensor& sin);  // [n, D]

// Mean over each group of Hq / num_kv_heads consecutive query heads (kvpress's GQA rule),
// without materialising repeated keys.
at::Tensor group_mean(const at::Tensor& per_query_head,  // [B, Hq, ...]
                      int64_t num_kv_heads);              // -> [B, Hkv, ...]

// Number of query heads: inputs.num_heads, else inferred from queries, attentions or q_proj.
int64_t num_query_heads(const LayerInputs& inputs);

// Post-RoPE queries of the last `n_last` positions: the given `queries` (their last n_last
// rows) or recomputed from hidden_states + q_proj (+ q_norm) + cos/sin, as kvpress does.
at::Tensor window_queries(const LayerInputs& inputs, int64_t n_last, const char* op);  // -> [B, Hq, n_last, D]

// Pre-RoPE keys: inverse RoPE of the cached keys when cos/sin are given, else recomputed
// from hidden_states + k_proj (+ k_norm).
at::Tensor prerope_keys(const LayerInputs& inputs, const char* op);  // -> [B, Hkv, S, D]

// Causal softmax attention of the last w positions (queries) over the first S - w keys.
// Query i sits at position S - w + i. Softmax over all S keys in float32; GQA without
// repeat_kv.
at::Tensor window_attention(const at::Tensor& queries,  // [B, Hq, w, D] post-RoPE
                            const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, w, S - w] float32

// ---- scores -----------------------------------------------------------------------------

// -||k_i||_2.
at::Tensor key_norm_scores(const at::Tensor& keys);  // [B, Hkv, S, D] -> [B, Hkv, S]

// -cos(k_i, anchor), anchor = sequence mean of the L2-normalised keys of the head.
at::Tensor keydiff_scores(const at::Tensor& keys);  // [B, Hkv, S, D] -> [B, Hkv, S]

// 1 everywhere except 0 on [n_sink, n_sink + n_pruned), n_pruned = S - int(S * (1 - ratio)).
at::Tensor streaming_llm_scores(const at::Tensor& keys,  // [B, Hkv, S, D]
                                int64_t n_sink, double compression_ratio);

// Uniform [0, 1) scores from a CPU generator seeded with `seed`, drawn in keys' dtype so
// they equal torch.rand(..., generator=manual_seed(seed), dtype=keys.dtype).
at::Tensor random_scores(const at::Tensor& keys,  // [B, Hkv, S, D]
                         int64_t seed);

// LagKV lag-relative statistics (see docs/PRESS_NOTES.md).
at::Tensor lagkv_scores(const at::Tensor& keys,    // [B, Hkv, S, D]
                        const at::Tensor& values,  // [B, Hkv, S, D]
                        int64_t n_sink, int64_t lag_size, bool cross_scoring);

// SnapKV: mean over the window queries, avg-pool (zero padded, padding counted), group mean,
// then the last `window_size` positions get max + 1 so the window is always kept.
at::Tensor snapkv_scores(const at::Tensor& window_attn,  // [B, Hq, w, S - w] float
                         int64_t num_kv_heads, int64_t kernel_size);  // -> [B, Hkv, S]

// TOVA: last query's attention averaged over ALL query heads, same for every KV head; the last
// position gets max + 1.
at::Tensor tova_scores(const at::Tensor& last_attn,  // [B, Hq, 1, S - 1] float
                       int64_t num_kv_heads);          // -> [B, Hkv, S]

// ObservedAttention: attention received by key i summed over the queries, divided by the
// number of queries that can see it (S - i), then group mean.
at::Tensor observed_attention_scores(const at::Tensor& attentions,  // [B, Hq, S, S]
                                     int64_t num_kv_heads);          // -> [B, Hkv, S]

}  // namespace kvpress::ops
