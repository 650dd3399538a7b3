// KVzipPress (kvpress 0.5.5 kvzip_press.py; KVzip, arXiv 2505.23416): query-agnostic importance
// from context reconstruction.
//
// After the context's prefill, the model is asked to repeat the context ("\n\nRepeat the previous
// context exactly." + "\n" + the context, in chunks of chunk_size tokens). A cached token matters
// as much as the most any repeat query attends to it: per (layer, KV head, token), the maximum
// over the group's query heads and the repeat's rows of a softmax taken over the sink tokens, the
// chunk being repeated and the repeat's own keys (causal). The n_sink first tokens are always kept;
// then the int(L * Hkv * N * ratio) lowest scores over ALL layers and heads are evicted
// (layerwise: int(Hkv * N * ratio) per layer), so layers and heads keep different amounts. With
// kvzip_plus_normalization (KVzip+), each weight is divided by the repeat row's ||h|| (attention
// input) and multiplied by the token's ||W_o v|| for that query head.
//
// Like KVComposePress, one layer's cache is not enough, so compress() raises. The press gives an
// engine the model-agnostic pieces (token ids, scores, selection):
//
//   auto chunks = press.replay_chunks(context_ids, tok(KVzipPress::kFirstRepeatPrompt),
//                                     tok(KVzipPress::kNextRepeatPrompt), tok(KVzipPress::kRepeatSuffix));
//   at::Tensor scores = at::zeros({L, Hkv, N});          // float32
//   // forward each chunk.repeat_ids over the context's cache (positions N..); per layer and rows:
//   scores[l].narrow(1, chunk.start, chunk.end - chunk.start) =
//       max(that, press.chunk_scores(queries, keys.narrow(2, 0, sink), keys.narrow(2, chunk.start, ..),
//                                    repeat_keys, first_row, row_scale, column_scale));
//   std::vector<at::Tensor> masks = press.keep_masks(scores);   // per layer [1, Hkv, N] bool
//
// kvpress::llama::kvzip_prefill (kvpress/llama/kvzip.h) runs it on the Llama runner with peak
// memory of the compressed cache plus one layer's full K/V. Batch 1 only, as kvpress.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// The KVzip family's selection (KVzipPress, FastKVzipPress): the int(L * Hkv * N * ratio) lowest of
// `scores` over all layers and heads are evicted (layerwise: int(Hkv * N * ratio) per layer), each
// layer's evictions taken across its heads. Ties: the higher (layer, head, position) goes first.
// Ratio 0 keeps everything, ratio 1 nothing (RestoreKV's budget can reach it). Raises on NaN/Inf
// scores or a ratio outside [0, 1].
std::vector<at::Tensor> kvzip_evict_lowest(const at::Tensor& scores,  // [L, Hkv, N]
                                           double compression_ratio, bool layerwise, const char* op);
// -> L x [1, Hkv, N] bool

// One replay pass: the context tokens [start, end) and the ids the model reads to repeat them.
struct KVzipReplayChunk {
  int64_t start = 0, end = 0;
  std::vector<int64_t> repeat_ids;  // prompt (+ the previous chunk's last tokens) + suffix + context[start, end)
};

struct KVzipRunOptions {
  // Replay queries per attention block: bounds the scores held at once to
  // [Hq, query_chunk, n_sink + chunk_size + repeat length] float32.
  int64_t query_chunk = 128;
};

// Bytes the scoring pass held beyond the model weights at its peak, and what that moment held.
struct KVzipMemory {
  int64_t peak_bytes = 0;
  int64_t layer_kv_bytes = 0;    // one layer's keys/values: the context's and the replay's
  int64_t activation_bytes = 0;  // residual streams of the context and of every replay chunk
  int64_t attention_bytes = 0;   // one block's scores and weights, or its output
  int64_t scores_bytes = 0;      // the token scores [L, Hkv, N] float32
  // The full cache of the context in every layer (what kvpress holds before compressing, plus
  // a replay chunk's keys/values in every layer).
  int64_t full_cache_bytes = 0;
};

// What a KVzip-family second pass reports beside the cache it filled.
struct KVzipPassResult {
  at::Tensor scores;  // [L, Hkv, N] float32: the token scores (before the sinks' + 1)
  KVzipMemory memory;
  // RestoreKVPress: what its restore tokens left in every layer, [L, Hkv, n, D] each (keys post-RoPE).
  at::Tensor restore_keys, restore_values;
};

class KVzipPress : public BasePress {
 public:
  static constexpr bool kDefaultLayerwise = false;
  static constexpr int64_t kDefaultNSink = 4;
  static constexpr bool kDefaultKVzipPlusNormalization = false;
  static constexpr int64_t kDefaultChunkSize = 2048;
  // kvpress's repeat prompts (for a tokenizer without a chat template: suffix "\n", no prefix).
  static constexpr const char* kFirstRepeatPrompt = "\n\nRepeat the previous context exactly.";
  static constexpr const char* kNextRepeatPrompt = "\n\nRepeat the part of the previous context exactly, starting with";
  static constexpr const char* kRepeatSuffix = "\n";
  // A later chunk's prompt ends with this many last tokens of the chunk before it.
  static constexpr int64_t kPreviousTailTokens = 8;

  struct Params {
    bool layerwise = kDefaultLayerwise;
    int64_t n_sink = kDefaultNSink;
    bool kvzip_plus_normalization = kDefaultKVzipPlusNormalization;
    int64_t chunk_size = kDefaultChunkSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit_fields(self, visit, /*with_plus=*/true);
    }
    // The fields, kvzip_plus_normalization only `with_plus` (KVgradPress has no KVzip+).
    template <typename Self, typename Visit>
    static void visit_fields(Self& self, Visit&& visit, bool with_plus) {
      visit(ParamSpec{"layerwise", "the same ratio in every layer (else global)"}, self.layerwise);
      visit(ParamSpec{"n_sink", "first tokens always kept"}.non_negative(), self.n_sink);
      if (with_plus)
        visit(ParamSpec{"kvzip_plus_normalization", "KVzip+: weights divided by ||h|| and multiplied by ||W_o v||"},
              self.kvzip_plus_normalization);
      visit(ParamSpec{"chunk_size", "context tokens repeated per replay pass"}.positive(), self.chunk_size);
    }
  };

  // Raises c10::Error unless 0 <= compression_ratio < 1 and the parameters are in their declared ranges.
  KVzipPress(double compression_ratio, const Params& params);
  explicit KVzipPress(double compression_ratio = 0.0, bool layerwise = kDefaultLayerwise,
                      int64_t n_sink = kDefaultNSink, bool kvzip_plus_normalization = kDefaultKVzipPlusNormalization,
                      int64_t chunk_size = kDefaultChunkSize)
      : KVzipPress(compression_ratio, Params{layerwise, n_sink, kvzip_plus_normalization, chunk_size}) {}

  std::string name() const override { return "KVzipPress"; }
  double compression_ratio() const override { return compression_ratio_; }
  bool head_ragged() const override { return true; }
  bool needs_second_pass() const override { return true; }
  // Its evictions are taken across layers and heads: on tensor-parallel shards the selection gathers
  // every rank's scores (RestoreKVPress's restore tokens ride the pass with the adapter cut as the
  // shard's weights; KVgradPress's backward crosses the ranks' sums as autograd functions).
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  bool second_pass_shardable() const override { return true; }
  bool layerwise() const { return layerwise_; }
  int64_t n_sink() const { return n_sink_; }
  bool kvzip_plus_normalization() const { return kvzip_plus_normalization_; }
  int64_t chunk_size() const { return chunk_size_; }

  // Always raise: KVzip needs the context replayed through the model (kvpress::llama::kvzip_prefill,
  // or the pieces below).
  KV compress(const LayerInputs& inputs) const override;
  RaggedKV compress_ragged(const LayerInputs& inputs) const override;
  at::Tensor keep_mask(const LayerInputs& inputs) const override;

  // The replay passes for a context of N tokens: chunks of chunk_size tokens of positions
  // [prefix_length, N) (the first prefix_length tokens, a chat template's text before the user's
  // message, are not replayed, as kvpress); the first chunk's prompt is first_prompt_ids, a later
  // one's next_prompt_ids + the previous chunk's last kPreviousTailTokens tokens; each followed by
  // suffix_ids and the chunk. Chunk positions are absolute. Raises unless 0 <= prefix_length < N.
  std::vector<KVzipReplayChunk> replay_chunks(const std::vector<int64_t>& context_ids,
                                              const std::vector<int64_t>& first_prompt_ids,
                                              const std::vector<int64_t>& next_prompt_ids,
                                              const std::vector<int64_t>& suffix_ids, int64_t prefix_length = 0) const;

  // The chunk's token scores from `r` rows of one replay pass in one layer: per KV head and chunk
  // token, the maximum over the group's query heads and the rows of the softmax over
  // [sink keys | chunk keys | the repeat's keys up to each row]. Rows are repeat positions
  // first_row .. first_row + r - 1; repeat_keys holds the repeat's keys 0 .. first_row + r - 1.
  // Softmax in float32. KVzip+ (both or neither): row_scale = 1 / ||h|| of the rows, column_scale
  // = value_output_norms() of the chunk's values.
  at::Tensor chunk_scores(const at::Tensor& queries,                            // [1, Hq, r, D] post-RoPE
                          const at::Tensor& sink_keys,                          // [1, Hkv, s, D]
                          const at::Tensor& chunk_keys,                         // [1, Hkv, c, D]
                          const at::Tensor& repeat_keys,                        // [1, Hkv, first_row + r, D]
                          int64_t first_row, const at::Tensor& row_scale = {},  // [1, r]
                          const at::Tensor& column_scale = {}) const;           // [1, Hkv, G, c]
  // -> [1, Hkv, c] float32

  // ||W_o v|| per query head of each value: the size of what token t writes into the residual
  // stream through head (h, g). Computed as sqrt(v^T (W_hg^T W_hg) v): no [c, hidden] product.
  static at::Tensor value_output_norms(const at::Tensor& values,   // [1, Hkv, c, D]
                                       const at::Tensor& o_proj);  // [hidden, Hq * D]
  // -> [1, Hkv, G, c] float32

  // The kept tokens of every layer from the scores of all layers: the n_sink first tokens first
  // (kvpress gives them max + 1), then the lowest scores are evicted, globally over layers (or per
  // layer when layerwise), each layer's evictions taken across its heads. At ratio 0 everything
  // is kept. Ties: the higher position (flattened head-major) is evicted first.
  std::vector<at::Tensor> keep_masks(const at::Tensor& scores) const;  // [L, Hkv, N] -> L x [1, Hkv, N] bool

  // The ratio keep_masks() evicts for a context of context_length tokens: compression_ratio()
  // (RestoreKVPress adds its restore tokens' share).
  virtual double eviction_ratio(int64_t context_length) const;

  // ---- the second pass (kvpress/model_view.h; src/presses/kvzip_pass.cpp) ----
  // run_second_pass() with the default KVzipRunOptions.
  void second_pass(SecondPassRun& run) const override;
  // KVzip's prefill of run.context_ids() [1, N]: the scoring pass (the context and every replay
  // chunk through the model together, layer by layer: one layer's keys/values at a time; the replay's
  // queries in blocks of options.query_chunk rows), the global selection (keep_masks), then the
  // ordinary prefill with each layer compressed to its selection. At ratio 0 the plain prefill
  // (kvpress skips the replay). RestoreKVPress also runs its restore tokens through the scoring pass
  // and appends them after the kept tokens; KVgradPress scores by gradients (its own pass).
  virtual KVzipPassResult run_second_pass(SecondPassRun& run, const KVzipRunOptions& options) const;
  // The scoring pass alone: [L, Hkv, N] float32, run_second_pass()'s scores at any ratio > 0. Reads
  // the context's keys/values from run.captured_layer() when given. Plain KVzipPress only (plain()).
  at::Tensor replay_scores(const SecondPassRun& run, const KVzipRunOptions& options) const;
  // `press` as one of the KVzip family (KVzipPress, RestoreKVPress, KVgradPress), or nullptr.
  static const KVzipPress* of(const BasePress* press);
  // `press` as a KVzipPress whose scores come from the replay alone, or nullptr (another press, or
  // RestoreKVPress and KVgradPress, which add restore tokens and gradients to it).
  static const KVzipPress* plain(const BasePress* press);

 private:
  double compression_ratio_;
  bool layerwise_;
  int64_t n_sink_;
  bool kvzip_plus_normalization_;
  int64_t chunk_size_;
};

}  // namespace kvpress
