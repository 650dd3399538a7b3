// Head-ragged KV cache: one attention layer whose (batch row, KV head) pairs each hold their own
// number of tokens, and attention over it.
//
// Presses that give KV heads different budgets (BasePress::head_ragged(): AdaKV, CriticalAdaKV,
// Compactor/ScoreBlend across heads, KVCompose unstructured) return a RaggedKV. kvpress can only
// mask the evicted tokens of such a selection, so no memory is freed. HeadRaggedLayer stores the
// kept tokens and nothing else:
//
//   packed part   every head's kept tokens back to back, [T, D] keys and values, T = sum of the
//                 per-head counts; head (b, h) owns rows [offset(b, h), offset(b, h + 1)).
//                 Written once (at compression), never grown.
//   tail          tokens appended afterwards (decoding, a question after a compressed context).
//                 Every head receives the same new tokens, so the tail is a dense
//                 [B, Hkv, capacity, D] buffer grown geometrically: appending copies only the
//                 tail, O(log n) times over n tokens, never the packed part.
//
// Right after compression the storage is exactly the kept tokens plus the index (per-token
// original positions and per-head offsets); bytes() reports what is allocated.
//
//   kvpress::RaggedKV kv = press.compress_ragged(inputs);
//   auto layer = kvpress::HeadRaggedLayer::from_ragged(kv);    // S = kv.keep_mask.size(2)
//   layer.append(k_new, v_new);                                 // [B, Hkv, n, D] at positions S..S+n-1
//   at::Tensor out = kvpress::ops::ragged_attention(q_new, layer);  // [B, Hq, n, D]
//
// Thread safety: the const members of HeadRaggedLayer and HeadRaggedCache only read (no lazy
// state), so any number of threads may read one layer or cache at once: ops::ragged_attention,
// keys(), to_ragged(), bytes(), ... (tests/test_concurrency.cpp). Mutation (append,
// truncate_appended, shrink_to_fit, assignment; HeadRaggedCache::set_layer and writes through its
// non-const layer()) needs exclusive access: no other thread may read or write the layer
// meanwhile. A cache belongs to one sequence; an engine decoding several gives each its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kvpress/types.h"

namespace kvpress {

class HeadRaggedLayer {
 public:
  // An empty layer (defined() == false).
  HeadRaggedLayer() = default;

  // From a press's per-head output. heads[b * Hkv + h] must share dtype, device and D;
  // kept_indices ascending. `seq_len` is the number of positions the compressed layer covered
  // (appended tokens get positions seq_len, seq_len + 1, ...); -1 takes kv.keep_mask.size(2),
  // or max(kept index) + 1 when the mask is undefined.
  static HeadRaggedLayer from_ragged(const RaggedKV& kv, int64_t seq_len = -1);

  // Every head keeps all S tokens (positions 0..S-1).
  static HeadRaggedLayer from_dense(const at::Tensor& keys,     // [B, Hkv, S, D]
                                    const at::Tensor& values);  // [B, Hkv, S, D]

  // The tokens where keep_mask is true (ops::gather_ragged, then from_ragged).
  static HeadRaggedLayer from_mask(const at::Tensor& keys,        // [B, Hkv, S, D]
                                   const at::Tensor& values,      // [B, Hkv, S, D]
                                   const at::Tensor& keep_mask);  // [B, Hkv, S] bool

  bool defined() const { return packed_keys_.defined(); }
  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  at::ScalarType dtype() const;
  at::Device device() const;

  // ---- sizes -----------------------------------------------------------------------------------
  int64_t length(int64_t b, int64_t h) const;  // tokens head (b, h) holds (packed + appended)
  at::Tensor lengths() const;                  // [B, Hkv] int64 on CPU
  int64_t max_length() const;                  // max over heads of length(b, h)
  int64_t min_length() const;
  int64_t total_tokens() const;  // sum over heads of length(b, h)
  int64_t packed_tokens() const { return static_cast<int64_t>(offsets_host_.back()); }  // T
  int64_t appended() const { return tail_length_; }         // tokens added by append(), every head
  int64_t next_position() const { return next_position_; }  // position the next appended token gets

  // ---- contents (copies, for inspection, tests and serialisation) ------------------------------
  // Head (b, h)'s tokens in position order: packed then appended.
  at::Tensor keys(int64_t b, int64_t h) const;          // [length(b, h), D]
  at::Tensor values(int64_t b, int64_t h) const;        // [length(b, h), D]
  at::Tensor kept_indices(int64_t b, int64_t h) const;  // [length(b, h)] int64, ascending positions
  // Every head as a RaggedKV; keep_mask is [B, Hkv, next_position()].
  RaggedKV to_ragged() const;
  // [B, Hkv, next_position()] bool: true where a head holds the token of that position.
  at::Tensor keep_mask() const;

  // ---- decoding ---------------------------------------------------------------------------------
  // Adds the same n tokens to every head at positions next_position() .. + n - 1. Same dtype,
  // device, B, Hkv and D as the layer; amortised O(n) copies.
  void append(const at::Tensor& keys,     // [B, Hkv, n, D]
              const at::Tensor& values);  // [B, Hkv, n, D]
  // Keeps the first `n_keep` appended tokens (0 <= n_keep <= appended()) and sets the position the
  // next appended token gets (e.g. drop an answer and reuse the compressed context).
  void truncate_appended(int64_t n_keep, int64_t next_position);
  // Frees the tail's unused capacity (shrinks the tail buffer to appended() tokens).
  void shrink_to_fit();

  // ---- memory -----------------------------------------------------------------------------------
  int64_t storage_bytes() const;  // packed keys + values + tail buffers (full capacity)
  int64_t index_bytes() const;    // packed positions + offsets (device and host copies) + tail positions
  int64_t bytes() const { return storage_bytes() + index_bytes(); }

  // ---- raw storage, for kernels -----------------------------------------------------------------
  const at::Tensor& packed_keys() const { return packed_keys_; }            // [T, D]
  const at::Tensor& packed_values() const { return packed_values_; }        // [T, D]
  const at::Tensor& packed_positions() const { return packed_positions_; }  // [T] int64, on device()
  // [B * Hkv + 1] int64 on device(): head b * Hkv + h owns packed rows [offsets[bh], offsets[bh + 1]).
  const at::Tensor& offsets() const { return offsets_; }
  at::Tensor tail_keys() const;    // [B, Hkv, appended(), D] view into the tail buffer (strided)
  at::Tensor tail_values() const;  // [B, Hkv, appended(), D]
  // Original positions of the appended tokens (the same for every head).
  const std::vector<int64_t>& tail_positions() const { return tail_positions_; }

 private:
  // An empty layer of this shape; the factories fill it.
  HeadRaggedLayer(int64_t batch, int64_t kv_heads, int64_t head_dim)
      : batch_(batch), kv_heads_(kv_heads), head_dim_(head_dim) {}

  int64_t batch_ = 0, kv_heads_ = 0, head_dim_ = 0;
  at::Tensor packed_keys_, packed_values_;          // [T, D]
  at::Tensor packed_positions_;                     // [T] int64
  at::Tensor offsets_;                              // [B * Hkv + 1] int64, device
  std::vector<int64_t> offsets_host_{0};            // the same on the host
  at::Tensor tail_key_buffer_, tail_value_buffer_;  // [B, Hkv, capacity, D], undefined until append
  int64_t tail_length_ = 0;
  std::vector<int64_t> tail_positions_;
  int64_t next_position_ = 0;
  int64_t max_packed_position_ = -1;  // -1 when the packed part is empty
};

// Several layers, each head-ragged; layers may hold different numbers of tokens.
class HeadRaggedCache {
 public:
  HeadRaggedCache() = default;
  explicit HeadRaggedCache(int64_t num_layers) : layers_(static_cast<size_t>(num_layers)) {}

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  HeadRaggedLayer& layer(int64_t i);
  const HeadRaggedLayer& layer(int64_t i) const;
  void set_layer(int64_t i, HeadRaggedLayer layer);
  int64_t bytes() const;  // sum over the defined layers

 private:
  std::vector<HeadRaggedLayer> layers_;
};

namespace ops {

// Causal attention of the last n tokens appended to `layer` (their queries) over the layer: new
// token i (position next_position() - n + i) attends to every packed token of its KV head and to
// appended tokens 0 .. appended() - n + i. softmax(q k^T * scale) v with float32 accumulation
// (online softmax); GQA without repeating K/V (query head j uses KV head j / (Hq / Hkv)). scale
// defaults to 1 / sqrt(D). Requires n <= layer.appended(). Output in the queries' dtype.
at::Tensor ragged_attention(const at::Tensor& queries,  // [B, Hq, n, D], same dtype/device as layer
                            const HeadRaggedLayer& layer,
                            std::optional<double> scale = std::nullopt);  // -> [B, Hq, n, D]

}  // namespace ops
}  // namespace kvpress
