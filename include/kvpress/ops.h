// Public ops: the building blocks every press is made of. Declarations only; each op on tensors is
// also registered as torch.ops.kvpress.<name> (by its family, src/ops/<family>/<family>.cpp) so
// Python can call it after torch.ops.load_library("libkvpress.so"); the helpers that read a LayerInputs are C++ only.
// Ops with CPU/CUDA kernels go through the dispatcher (docs/ARCHITECTURE.md, "The dispatch rule").
//
// All ops accept float32, float16 and bfloat16 K/V and accumulate in float32. Scores are
// float32 [B, Hkv, S], higher = keep. Bad input raises c10::Error with a message of the form
// "<op>: <argument> must be <expected>, got <actual>".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "kvpress/kv_format.h"
#include "kvpress/types.h"

namespace kvpress::ops {

// A seed argument's "none given": draw from the default CPU generator (torch's global seed).
inline constexpr int64_t kUnseeded = -1;
// The defaults of leverage_scores' sketch_dimension and noncausal_column_sums' chunk_size: kvpress's
// LeverageScorePress and NonCausalAttnPress defaults, which those presses take from here.
inline constexpr int64_t kDefaultSketchDimension = 48;
inline constexpr int64_t kDefaultNoncausalChunkSize = 256;

// ---- selection ---------------------------------------------------------------------------

// kvpress's compute_n_kept: max(1, int(seq_len * (1 - compression_ratio))) in double math.
int64_t n_kept(int64_t seq_len, double compression_ratio);

// Positions of the k highest scores per row, ascending. Ties go to the lower position.
// Raises on NaN scores.
at::Tensor topk_indices(const at::Tensor& scores,  // [B, H, S] float
                        int64_t k);                // -> [B, H, k] int64

// keys/values at `indices`, contiguous.
KV gather_kv(const at::Tensor& keys,      // [B, Hkv, S, D]
             const at::Tensor& values,    // [B, Hkv, S, D]
             const at::Tensor& indices);  // [B, Hkv, n] int64

// gather_kv into the tensors themselves: row i of head (b, h) of keys and values becomes their old
// row indices[b, h, i]; rows n..S-1 are left unspecified. Returns keys/values.narrow(2, 0, n) (views)
// and the indices. indices must be strictly ascending per head (every selection returns them so),
// which lets one forward pass move each row before anything overwrites it; they are checked, with
// their range, before any row moves, so a refused call changes nothing. keys and values need a
// unit stride along D (any layout otherwise, e.g. the front of a larger buffer). The CPU kernel
// allocates nothing; other devices gather the kept rows into a temporary first.
KV compact_kv_in_place(const at::Tensor& keys,      // [B, Hkv, S, D], written
                       const at::Tensor& values,    // [B, Hkv, S, D], written
                       const at::Tensor& indices);  // [B, Hkv, n] int64, ascending

// ---- RoPE and heads (kvpress's utils.py) -------------------------------------------------

// [x1, x2] -> [-x2, x1] along the last dim (HF rotate_half).
at::Tensor rotate_half(const at::Tensor& x);  // [..., D] -> [..., D]

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
                      int64_t num_kv_heads);             // -> [B, Hkv, ...]

// Number of query heads: inputs.num_heads, else inferred from queries, attentions or q_proj.
int64_t num_query_heads(const LayerInputs& inputs);

// Post-RoPE queries of the last `n_last` positions: the given `queries` (their last n_last
// rows) or recomputed from hidden_states + q_proj (+ q_norm) + cos/sin, as kvpress does.
at::Tensor window_queries(const LayerInputs& inputs, int64_t n_last, const char* op);  // -> [B, Hq, n_last, D]

// Pre-RoPE keys, float32: inverse RoPE of the cached keys when cos/sin are given, else recomputed
// from hidden_states + k_proj (+ k_norm) as the model computes them (the projection in
// hidden_states' dtype, the norm in float32).
at::Tensor prerope_keys(const LayerInputs& inputs, const char* op);  // -> [B, Hkv, S, D]

// Pre-RoPE queries of `hidden` through the layer's q_proj, RMS-normed per head by q_norm when the
// inputs have one (Qwen3). Hq is num_query_heads(inputs), D the keys' head_dim. float32.
at::Tensor project_queries(const at::Tensor& hidden,                    // [B, n, hidden], attention input
                           const LayerInputs& inputs, const char* op);  // -> [B, Hq, n, D]

// Pre-RoPE queries of positions [start, start + n): the given post-RoPE queries of all S positions
// with RoPE inverted by cos/sin when there are such, else projected from hidden_states + q_proj
// (+ q_norm).
at::Tensor prerope_queries(const LayerInputs& inputs, int64_t start, int64_t n,
                           const char* op);  // -> [B, Hq, n, D] float32

// prerope_queries of positions [start, start + n) handed to `visit` chunk by chunk, so that no more
// than one chunk exists at a time (the queries of every position are Hq / Hkv times the size of K):
// first min(n, 256) rows, then about 16 MiB per chunk. visit(q [B, Hq, rows, D] float32, offset of
// its first row within [0, n)).
void for_each_prerope_query_chunk(const LayerInputs& inputs, int64_t start, int64_t n, const char* op,
                                  const std::function<void(const at::Tensor&, int64_t)>& visit);

// RoPE inverse frequencies: inputs.inv_freq, else derived from row 1 of cos/sin (atan2; exact for
// float32 tables, since every HF frequency is below pi).
at::Tensor rope_inv_freq(const LayerInputs& inputs, const char* op);  // -> [D / 2] float32

// The RoPE rotation averaged over positions [start, start + count): R̄ = mean_t cos_t·I + sin_t·P,
// P the matrix of rotate_half, so that R̄x = x·c̄ + rotate_half(x)·s̄ (ExpectedAttentionPress's and
// CapPress's future-query rotation).
at::Tensor average_rope_rotation(const at::Tensor& inv_freq,     // [D / 2] float32
                                 int64_t start, int64_t count);  // -> [D, D] float32

// Causal softmax attention of the last w positions (queries) over the first S - w keys.
// Query i sits at position S - w + i. Softmax over all S keys in float32; GQA without
// repeat_kv.
at::Tensor window_attention(const at::Tensor& queries,  // [B, Hq, w, D] post-RoPE
                            const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, w, S - w] float32

// window_attention(queries, keys).mean(2), fused: float32 blocks of a few MiB, never the
// [B, Hq, w, S] tensor (src/ops/rope_heads/cpu/window_attention.cpp, src/ops/rope_heads/cuda/window_attention.cu).
at::Tensor window_attention_mean(const at::Tensor& queries,  // [B, Hq, w, D] post-RoPE
                                 const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, S - w] float32

// The same for a layer's inputs (SnapKVPress, TOVAPress): the mean of the last `window` rows of the
// given attentions, else window_attention_mean over window_queries(inputs, window).
at::Tensor window_attention_mean(const LayerInputs& inputs, int64_t window,
                                 const char* op);  // -> [B, Hq, S - window] float32

// The window attention itself for a layer's inputs (FinchPress weighs its rows): the last `window`
// rows of the given attentions, else window_attention over window_queries(inputs, window).
at::Tensor window_attention(const LayerInputs& inputs, int64_t window,
                            const char* op);  // -> [B, Hq, window, S - window] float32

// The attention probabilities of the last `window` queries over EVERY key, their own columns
// included (DropKVPress reads the outputs they make): the given attentions' last rows, else the
// causal softmax of window_queries(inputs, window). 1 <= window <= S.
at::Tensor window_probabilities(const LayerInputs& inputs, int64_t window,
                                const char* op);  // -> [B, Hq, window, S] float32

// ---- scores -----------------------------------------------------------------------------

// -||k_i||_2.
at::Tensor key_norm_scores(const at::Tensor& keys);  // [B, Hkv, S, D] -> [B, Hkv, S]
// CTRPress's rescue (ctr_rescue_scores): for logits [n, R] float32 of n query rows over R keys, each
// key's largest log-softmax weight over the rows of logits / scale: max_r (l_rj / scale - lse_r),
// lse_r the log-sum-exp of row r / scale. -> [R] float32. One fused pass per row on CPU.
at::Tensor rescue_column_max(const at::Tensor& logits, double scale);
// MergingPress's nearest kept key: for each row, its largest dot product with any candidate of the
// same head and the first candidate reaching it (ATen's max over the last dim of rows · candidatesᵀ).
// -> (values [B, H, n] float32, indices [B, H, n] int64). On CPU register tiles whose products are
// compared in registers; the [n, m] similarities are never stored.
std::tuple<at::Tensor, at::Tensor> max_similarity(const at::Tensor& rows,         // [B, H, n, D] float32
                                                  const at::Tensor& candidates);  // [B, H, m, D] float32, m >= 1
// CriticalKVPress's value norms (kvpress's vwl1norm): for each token and KV head, the L1 norm of
// v W_o^h over the hidden size, averaged over the head's group of query heads h (W_o^h: the columns
// h·D .. h·D + D - 1 of o_proj). -> [B, Hkv, S] float32. On CPU one register-tiled product whose
// [rows, hidden] results are summed in registers, never stored.
at::Tensor output_projected_l1_norms(const at::Tensor& values,  // [B, Hkv, S, D]
                                     const at::Tensor& o_proj,  // [hidden, num_heads * D]
                                     int64_t num_heads);

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
at::Tensor snapkv_scores(const at::Tensor& window_attn,               // [B, Hq, w, S - w] float
                         int64_t num_kv_heads, int64_t kernel_size);  // -> [B, Hkv, S]

// The same from the window attention already averaged over its `window_size` queries
// (window_attention_mean), so the window attention itself never has to exist.
at::Tensor snapkv_scores_from_mean(const at::Tensor& mean_attn,  // [B, Hq, S - w] float
                                   int64_t num_kv_heads, int64_t kernel_size,
                                   int64_t window_size);  // -> [B, Hkv, S]

// TOVA: last query's attention averaged over ALL query heads, same for every KV head; the last
// position gets max + 1.
at::Tensor tova_scores(const at::Tensor& last_attn,  // [B, Hq, 1, S - 1] float
                       int64_t num_kv_heads);        // -> [B, Hkv, S]

// ObservedAttention: attention received by key i summed over the queries, divided by the
// number of queries that can see it (S - i), then group mean.
at::Tensor observed_attention_scores(const at::Tensor& attentions,  // [B, Hq, S, S]
                                     int64_t num_kv_heads);         // -> [B, Hkv, S]

// ---- Compactor: leverage, non-causal chunked attention, z-score blending ------------------

// kvpress's normalisation of LeverageScorePress / NonCausalAttnPress: (x - mean) / max(std, floor)
// with ONE mean and ONE (unbiased) std over the whole tensor (every batch row, head and token),
// in float32. A tensor of fewer than two elements (no std) gives zeros.
at::Tensor zscore(const at::Tensor& scores);  // any shape -> same shape, float32
constexpr double kZscoreStdFloor = 1e-6;      // kvpress's floor on the standard deviation

// sum_i weights[i] * s_i, each s_i first z-scored (zscore above) when `normalize`. Summed left to
// right (weights[0] * s_0 + weights[1] * s_1 + ...), so CompactorPress's blending * lev + attn is
// reproduced bit for bit with weights {blending, 1}.
at::Tensor blend_scores(at::TensorList scores,         // each [B, H, S], same shape
                        at::ArrayRef<double> weights,  // one per score tensor
                        bool normalize);               // -> [B, H, S] float32

// The right Gaussian sketch of LeverageScorePress: randn(batch, heads, head_dim, k) * (1 / sqrt(k))
// drawn in `dtype` from a CPU generator, then moved to `device` as float32. seed >= 0 seeds a fresh
// generator, so the values equal torch.randn(...) right after torch.manual_seed(seed) (what
// kvpress draws on a CPU cache); seed < 0 draws from the default CPU generator.
at::Tensor gaussian_sketch(int64_t batch, int64_t heads, int64_t head_dim, int64_t sketch_dimension,
                           at::ScalarType dtype, at::Device device, int64_t seed);  // -> [B, H, D, k]

// The sketched, sequence-centred keys X = (K - mean_S K) Φ, float32. Like kvpress, the centring
// and the product are computed in the keys' dtype (Φ rounded to it) and X is then cast.
at::Tensor sketch_keys(const at::Tensor& prerope_keys,  // [B, Hkv, S, D]
                       const at::Tensor& sketch);       // [B, Hkv, D, k] or [D, k] -> [B, Hkv, S, k]

// The sketched, centred pre-RoPE keys of a post-RoPE cache and their Gram matrix, LeverageScorePress's
// work before its Cholesky factorisation: P = invert_rope(keys, cos, sin) rounded to the keys'
// dtype, X = sketch_keys(P, sketch) (float32) and XᵀX. On the CPU with float32 keys it is one
// kernel (RoPE undone, centred and multiplied by the sketch on blocks of rows in the core's cache:
// K is read twice and nothing of its size is written); elsewhere per head, the same values.
std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys(
    const at::Tensor& keys,     // [B, Hkv, S, D] post-RoPE, D even
    const at::Tensor& cos,      // [S, D]
    const at::Tensor& sin,      // [S, D]
    const at::Tensor& sketch);  // [B, Hkv, D, k] or [D, k] -> X [B, Hkv, S, k], XᵀX [B, Hkv, k, k] float32

// ℓ_i = ||L⁻¹ x_i||² for every row x_i of X: the ridge leverage x_iᵀ (L Lᵀ)⁻¹ x_i given the lower
// Cholesky factor L of the regularised Gram matrix. float32.
at::Tensor cholesky_leverage(const at::Tensor& sketched,  // [B, Hkv, S, k] float32
                             const at::Tensor& factor);   // [B, Hkv, k, k] float32, lower -> [B, Hkv, S]

// Ridge leverage of the rows of X: ℓ_i = x_iᵀ (G + λI)⁻¹ x_i, G = sym(XᵀX), by Cholesky (λ = 1e-2,
// ×10 for every head when any head's factorisation fails, at most 5 tries, then an error),
// clamped at 0. float32, not z-scored.
at::Tensor ridge_leverage(const at::Tensor& sketched);  // [B, Hkv, S, k] float32 -> [B, Hkv, S]

// ridge_leverage(sketch_keys(prerope_keys, sketch)). With Φ = I (D × D) this is the exact ridge
// leverage of the centred keys.
at::Tensor sketched_leverage(const at::Tensor& prerope_keys,  // [B, Hkv, S, D]
                             const at::Tensor& sketch);       // [B, Hkv, D, k] or [D, k] -> [B, Hkv, S]

// LeverageScorePress's raw scores: sketched_leverage with gaussian_sketch drawn in the keys'
// dtype (kvpress draws it in the dtype of its pre-RoPE keys, the model dtype).
at::Tensor leverage_scores(const at::Tensor& prerope_keys,  // [B, Hkv, S, D]
                           int64_t sketch_dimension,
                           int64_t seed = kUnseeded);  // -> [B, Hkv, S] float32

// The same from a layer's inputs, with the pre-RoPE keys of prerope_keys() rounded to the cache
// dtype. With cos/sin, RoPE is inverted one KV head at a time, so the extra memory stays below the
// keys' size; from hidden_states + k_proj all heads are projected at once, as kvpress does.
at::Tensor leverage_scores(const LayerInputs& inputs, int64_t sketch_dimension, int64_t seed, const char* op);

// Non-causal attention within chunks of `chunk_size` positions, summed over each chunk's query
// rows: out[b, h, i] = sum over the queries q of i's chunk of softmax_j(q·k_j)[i], with NO 1/sqrt(D)
// scaling (kvpress's NonCausalAttnPress). When S is not a multiple of chunk_size the last chunk is
// padded like kvpress: logits of padded query rows are 0 (so each padded row spreads a uniform
// weight that real keys receive too), logits of padded key columns are -1e-9 (not masked: they
// absorb weight), then softmax in float32 and the padding is trimmed. Computed one chunk at a
// time: extra memory O(Hq * chunk_size^2), never O(S * chunk_size). GQA without repeat_kv.
at::Tensor noncausal_column_sums(const at::Tensor& queries,  // [B, Hq, S, D] post-RoPE, all positions
                                 const at::Tensor& keys,     // [B, Hkv, S, D] post-RoPE
                                 int64_t chunk_size);        // -> [B, Hq, S] float32

// The same from a layer's inputs: `queries` (they must cover all S positions), else queries
// recomputed chunk by chunk from hidden_states + q_proj (+ q_norm) + cos/sin.
at::Tensor noncausal_column_sums(const LayerInputs& inputs, int64_t chunk_size, const char* op);

// NonCausalAttnPress's scores from the column sums: group mean over each GQA group, times
// ||v_i||, avg_pool1d(kernel 3, stride 1, zero padding 1, padding counted), zscore.
at::Tensor noncausal_attention_scores(const at::Tensor& column_sums,  // [B, Hq, S]
                                      const at::Tensor& values);      // [B, Hkv, S, D] -> [B, Hkv, S]
// The same before the zscore, for a caller that z-scores over more heads than these (a rank's
// share of a layer's heads).
at::Tensor noncausal_attention_pooled(const at::Tensor& column_sums,  // [B, Hq, S]
                                      const at::Tensor& values);      // [B, Hkv, S, D] -> [B, Hkv, S] float32

// Across-heads selection (Compactor paper): the `n_total` highest scores over all (head, position)
// pairs of each batch row. Ties go to the lower head, then the lower position. Heads may keep
// different numbers of tokens, so the result is a mask, not indices.
at::Tensor topk_mask_across_heads(const at::Tensor& scores,  // [B, H, S] float
                                  int64_t n_total);          // -> [B, H, S] bool

// The kept keys/values of every (batch row, KV head) under `keep_mask`, for selections that keep
// a different number of tokens per head.
RaggedKV gather_ragged(const at::Tensor& keys,        // [B, Hkv, S, D]
                       const at::Tensor& values,      // [B, Hkv, S, D]
                       const at::Tensor& keep_mask);  // [B, Hkv, S] bool

// ---- head-ragged attention (kvpress/cache.h has the HeadRaggedLayer overload) --------------

// Causal attention of n new tokens over a head-ragged layer given as raw storage: KV head
// bh = b * Hkv + h holds packed rows [offsets[bh], offsets[bh + 1]) followed by tail[b, h, 0..m).
// The queries are those of the last n tail tokens: new token i sees every packed token of its
// head and tail tokens 0 .. m - n + i. float32 accumulation, GQA without repeat_kv, scale
// defaults to 1 / sqrt(D). CPU and CUDA kernels (torch.ops.kvpress.ragged_attention).
at::Tensor ragged_attention(const at::Tensor& queries,                    // [B, Hq, n, D]
                            const at::Tensor& packed_keys,                // [T, D]
                            const at::Tensor& packed_values,              // [T, D]
                            const at::Tensor& offsets,                    // [B * Hkv + 1] int64, same device
                            const at::Tensor& tail_keys,                  // [B, Hkv, m, D], m >= n, last dim contiguous
                            const at::Tensor& tail_values,                // [B, Hkv, m, D]
                            std::optional<double> scale = std::nullopt);  // -> [B, Hq, n, D]

// ---- paged KV cache (kvpress/paged.h) --------------------------------------------------------

// Causal attention of n new tokens over per-head lists of fixed-size pages. Head (b, h) holds
// lengths[b, h] tokens; token t sits at row t % page_size of page page_table[b, h, t / page_size] of
// the pools. The queries are those of each head's last n tokens: new token i sees tokens
// 0 .. lengths[b, h] - n + i. GQA without repeat_kv (query head q reads KV head q / G), float32
// accumulation, scale defaults to 1 / sqrt(D). CPU and CUDA kernels (torch.ops.kvpress.paged_attention).
at::Tensor paged_attention(const at::Tensor& queries,                    // [B, Hq, n, D]
                           const at::Tensor& key_pool,                   // [num_pages, page_size, D]
                           const at::Tensor& value_pool,                 // [num_pages, page_size, D]
                           const at::Tensor& page_table,                 // [B, Hkv, max_pages] int64, same device
                           const at::Tensor& lengths,                    // [B, Hkv] int64, same device
                           std::optional<double> scale = std::nullopt);  // -> [B, Hq, n, D]

// paged_attention over quantized pages (kvpress/kv_format.h): head (b, h) of length L holds its
// first L / page_size pages quantized, at page_table[b, h, 0 ..], and its last L % page_size tokens
// in full precision at residual_keys/values[residual_slots[b], h, 0 ..] (the page that is not full
// yet). Rows are dequantized inside the kernel, a block at a time; nothing else as paged_attention.
at::Tensor paged_attention_quantized(const at::Tensor& queries,          // [B, Hq, n, D]
                                     const at::Tensor& key_codes,        // [num_pages, page_size, code_bytes] uint8
                                     const at::Tensor& key_scales,       // [num_pages, ...] (kv_page_layout)
                                     const at::Tensor& value_codes,      // [num_pages, page_size, code_bytes] uint8
                                     const at::Tensor& value_scales,     // [num_pages, ...]
                                     KVFormat format,                    // int8, fp8 or int4
                                     const at::Tensor& page_table,       // [B, Hkv, max_pages] int64, same device
                                     const at::Tensor& lengths,          // [B, Hkv] int64, same device
                                     const at::Tensor& residual_keys,    // [R, Hkv, page_size, D], queries' dtype
                                     const at::Tensor& residual_values,  // [R, Hkv, page_size, D]
                                     const at::Tensor& residual_slots,   // [B] int64 in [0, R)
                                     std::optional<double> scale = std::nullopt);  // -> [B, Hq, n, D]

// Quantizes P full pages of keys or values (kvpress/kv_format.h): {codes [P, page_size,
// code_bytes] uint8, scales [P, ...] of kv_page_layout}. Any device (ATen operations).
std::tuple<at::Tensor, at::Tensor> kv_quantize(const at::Tensor& rows,  // [P, page_size, D] float
                                               KVFormat format, KVRole role);
// The inverse reading: [P, page_size, D] float32 (code times scale, plus the minimum for int4).
at::Tensor kv_dequantize(const at::Tensor& codes,   // [P, page_size, code_bytes] uint8
                         const at::Tensor& scales,  // [P, ...] of kv_page_layout
                         KVFormat format, KVRole role, int64_t head_dim);

// Writes row r of keys/values into slot slots[r] = page * page_size + row of the pools, in place
// (vLLM's reshape_and_cache). Slots must be in range and distinct (c10::Error otherwise; on CUDA
// see device_argument_checks).
void paged_write(at::Tensor& key_pool,      // [num_pages, page_size, D], contiguous, written
                 at::Tensor& value_pool,    // [num_pages, page_size, D], contiguous, written
                 const at::Tensor& keys,    // [N, D]
                 const at::Tensor& values,  // [N, D]
                 const at::Tensor& slots);  // [N] int64

// On CUDA, paged_attention and paged_write do not read their page tables, lengths or slots on the
// host by default: a decode step makes no host synchronisation and can be captured in a CUDA graph.
// Their kernels check every index they take from those tensors and never read or write outside the
// pools: the queries of a head whose length lies outside [n, max_pages * page_size] or whose used
// pages lie outside the pool get NaN outputs, a row whose slot lies outside the pool is not written,
// and the device records which (check_device_errors raises it). Repeated slots are not detected
// (the rows race). With device argument checks on, the ops copy those tensors to the host and raise
// before launching, as on the CPU (one synchronisation per call). Off unless turned on here or by
// KVPRESS_CHECK_DEVICE_ARGUMENTS=1 in the environment (read at the first use). PagedKVCache derives
// its tables and slots on the host from its own bookkeeping, so what it passes is valid either way.
void set_device_argument_checks(bool on);
bool device_argument_checks();

// Raises a c10::Error naming what the CUDA kernels on `device` found wrong in device data since the
// last call (see set_device_argument_checks), and clears the record. Copies one int to the host, a
// synchronisation: an engine calls it where it synchronises anyway (after sampling a step's tokens).
// Does nothing for other devices or without the CUDA kernels.
void check_device_errors(const c10::Device& device);

// What the CPU kernels' hot loops run in this process, for benchmark tables and bug reports: the
// register tiles' ISA, "avx512", "avx2" (AVX2 + FMA) or "baseline" (no tiles: the composites),
// followed by "+<isa>-clones" when the loader's clones of the other loops run another ISA (e.g.
// "avx2+avx512-clones" under KVPRESS_DISABLE_AVX512=1 on an AVX-512 CPU).
// src/ops/cpu/cpu_features.cpp.
std::string cpu_kernel_isa();

}  // namespace kvpress::ops
