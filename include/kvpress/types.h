// Plain data passed between an engine and a press. No model object ever reaches a press:
// everything it may use is in LayerInputs (see docs/ARCHITECTURE.md §2).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvpress {

// One attention layer's state right after prefill. Optional tensors are left undefined
// (`!t.defined()`); a press that needs one it was not given raises a c10::Error naming it.
struct LayerInputs {
  at::Tensor keys;    // [B, Hkv, S, D] as cached: post-RoPE (post k_norm where the model has one)
  at::Tensor values;  // [B, Hkv, S, D]

  // Post-RoPE queries of the last Sq positions (Sq <= S), when the engine already has them.
  at::Tensor queries;  // optional [B, Hq, Sq, D]

  // kvpress's path: recompute queries (or pre-RoPE keys) from the attention input.
  at::Tensor hidden_states;  // optional [B, S, hidden], already input-layernormed
  at::Tensor q_proj;         // optional [Hq * D, hidden] (nn.Linear weight layout, no bias)
  at::Tensor k_proj;         // optional [Hkv * D, hidden]
  // The layer's output projection weight, for presses that weigh values by their effect on the
  // attention output (CriticalKVPress, CriticalAdaKVPress).
  at::Tensor o_proj;         // optional [hidden, Hq * D] (nn.Linear weight layout, no bias)
  at::Tensor q_norm;         // optional [D] RMSNorm weight applied per head (Qwen3-style)
  at::Tensor k_norm;         // optional [D]
  double norm_eps = 1e-6;    // eps of q_norm / k_norm

  // Eager attention weights of the last Sq query positions over all S keys.
  at::Tensor attentions;  // optional [B, Hq, Sq, S]

  // RoPE tables for positions 0..S-1 (HF layout: each half of D repeats the frequencies).
  at::Tensor cos;  // optional [S, D]
  at::Tensor sin;  // optional [S, D]

  // RoPE inverse frequencies (HF rotary_emb.inv_freq), for presses that rotate by positions
  // outside 0..S-1 (ExpectedAttentionPress's future positions, KeyRerotationPress). When absent
  // they are derived from cos/sin row 1 (atan2), which needs float32 tables to be exact.
  at::Tensor inv_freq;  // optional [D / 2]

  // Token ids of the S cached positions, for presses that read token text (QSMPress/CTRPress's
  // semantic weights, through a callback on the press).
  at::Tensor input_ids;  // optional [B, S] int64

  // Number of query heads Hq. 0 means "infer it" from queries, attentions or q_proj.
  int64_t num_heads = 0;

  int64_t layer_idx = 0;   // for layer-aware budgets
  int64_t num_layers = 1;
};

// A compressed layer. Every KV head keeps the same number of tokens here; head-ragged caches
// are the business of cache-level presses.
struct KV {
  at::Tensor keys;          // [B, Hkv, n_kept, D], contiguous
  at::Tensor values;        // [B, Hkv, n_kept, D], contiguous
  at::Tensor kept_indices;  // [B, Hkv, n_kept] int64, original positions, ascending per head
};

// A compressed layer whose KV heads keep different numbers of tokens (across-heads selection,
// e.g. CompactorPress with selection "across_heads"). heads[b * kv_heads + h] holds one head.
struct HeadKV {
  at::Tensor keys;          // [n_bh, D]
  at::Tensor values;        // [n_bh, D]
  at::Tensor kept_indices;  // [n_bh] int64, original positions, ascending
};
struct RaggedKV {
  int64_t batch = 0;
  int64_t kv_heads = 0;
  std::vector<HeadKV> heads;  // batch * kv_heads entries, row-major
  at::Tensor keep_mask;       // [B, Hkv, S] bool, the same selection as a mask
  const HeadKV& at(int64_t b, int64_t h) const { return heads.at(static_cast<size_t>(b * kv_heads + h)); }
};

}  // namespace kvpress
