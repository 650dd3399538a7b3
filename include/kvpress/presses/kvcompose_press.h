// KVComposePress (kvpress 0.5.5 kvcompose_press.py; KVCompose, arXiv 2509.05165).
//
// KVCompose cannot compress one layer on its own: its budgets are global over all layers (and, in
// the unstructured variant, all KV heads), and its token scores come from a SECOND pass, in which
// a task prompt (by default the context again) attends to the prefilled context. The press is
// therefore split in two:
//
//   KVComposePress    the parameters (kvpress's names and defaults). Its layer-level compress()
//                     raises: an engine must run the second pass through a session.
//   KVComposeSession  one context's statistics. The engine drives it, model-agnostically:
//
//     kvpress::KVComposeSession s = press.start_session(num_layers, num_heads, num_kv_heads, N);
//     // second pass, any number of times per layer (query chunks, several prompts):
//     s.observe(layer, attn);           // [B, Hq, n, S >= N] attention of new queries; columns 0..N-1 used
//     s.observe_values(layer, values);  // [B, Hkv, S >= N, D], only needed with add_v_norm
//     const kvpress::KVComposeBudgets& b = s.budgets();   // k_l per layer, k_{l,g} per (layer, head)
//     kvpress::KV kv = s.compress(layer, keys, values);   // structured: [B, Hkv, k_l, D]
//     kvpress::RaggedKV r = s.compress_ragged(layer, keys, values);  // unstructured: k_{l,g} per head
//
//   Statistics are aggregated incrementally ([L, Hq, N] float32 accumulators), so no engine ever
//   holds the eager N x 2N weights that kvpress materialises. kvpress::llama::kvcompose_prefill
//   (kvpress/llama/kvcompose.h) runs the whole protocol on the Llama runner.
//
// Method (docs/PRESS_NOTES.md): task statistic T[l, q, i] = agg_task over every observed query row
// of the attention of query head q to context token i; S[l, g, i] = agg_group over the heads of KV
// group g; optionally S *= ||v_i||; with add_mean_across_heads S[l, g] += mean_g S[l, g]. Composite
// tokens: each head's scores sorted descending, c[l, g, j]; C[l, j] = agg_head_g c[l, g, j]; the first
// keep_token_lower_bound ranks get +1e9; layer 0's curve := max over layers. Global budget: the top
// n_kept(L * N, ratio) entries of C decide k_l = their count in layer l (at least
// max(1, keep_token_lower_bound)); unstructured: the top n_kept(L * Hkv * N, ratio) entries of c give
// k_{l,g}. Each head keeps its own k best tokens by S, in position order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// kvpress's aggregators: "max" (running maximum) and "mean" (running sum / count).
enum class KVComposeAggregation { kMax, kMean };

// "max" -> kMax, "mean" -> kMean; anything else raises naming `what` (e.g. "KVComposePress: agg_task").
KVComposeAggregation parse_kvcompose_aggregation(const std::string& what, const std::string& text);

struct KVComposeOptions {
  bool structured = true;              // false: per-(layer, head) budgets, head-ragged layers
  std::string agg_task = "max";        // over the observed query rows (and batch rows)
  std::string agg_group = "mean";      // over the query heads of a KV group
  std::string agg_head = "mean";       // over KV heads, of the sorted curves (structured budgets)
  bool add_v_norm = false;             // multiply scores by ||v_i||
  bool add_mean_across_heads = true;   // S[l, g] += mean over KV heads of S[l]
  int64_t keep_token_lower_bound = 0;  // minimum tokens per layer (and per head's first ranks)

  // KVComposePress's parameters (the aggregations are checked by its constructor: max or mean).
  template <typename Self, typename Visit>
  static void for_each_field(Self& self, Visit&& visit) {
    visit(
        ParamSpec{"structured", "each layer keeps k_l tokens per head; false: per-(layer, head) budgets, head-ragged"},
        self.structured);
    visit(ParamSpec{"agg_task", "over the prompt's queries: max or mean"}, self.agg_task);
    visit(ParamSpec{"agg_group", "over a KV group's query heads: max or mean"}, self.agg_group);
    visit(ParamSpec{"agg_head", "over KV heads, of the sorted curves: max or mean"}, self.agg_head);
    visit(ParamSpec{"add_v_norm", "multiply scores by ||v||"}, self.add_v_norm);
    visit(ParamSpec{"add_mean_across_heads", "add the mean over KV heads to every head's scores"},
          self.add_mean_across_heads);
    visit(ParamSpec{"keep_token_lower_bound", "minimum tokens per layer"}.non_negative(), self.keep_token_lower_bound);
  }
};

// The global budgets of one context.
struct KVComposeBudgets {
  std::vector<int64_t> per_layer;  // k_l (structured), each in [max(1, keep_token_lower_bound), ...]
  at::Tensor per_head;             // [L, Hkv] int64 on CPU: k_{l,g} (unstructured; may be 0)
};

class KVComposeSession;

struct KVComposeRunOptions {
  // Task prompts, each [B, P] int64 (B = the context's). Empty: the context itself (kvpress's
  // default). Each prompt runs over the context alone at positions N .. N + P - 1.
  std::vector<at::Tensor> task_prompts;
  // Prompt queries per attention block; bounds the attention scores held at once to
  // [B, Hq, query_chunk, N + P] float32.
  int64_t query_chunk = 128;
};

// Bytes of the tensors the second pass holds beyond the model weights and the context's cache,
// at the moment they peaked (breakdown of that moment).
struct KVComposeMemory {
  int64_t peak_bytes = 0;
  int64_t hidden_bytes = 0;      // the prompt's residual stream [B, P, hidden] (updated in place)
  int64_t prompt_kv_bytes = 0;   // the prompt's keys/values of ONE layer (+ the chunk's q/k/v)
  int64_t attention_bytes = 0;   // one chunk's scores/probabilities (or its output and MLP activations)
  int64_t statistics_bytes = 0;  // the session's accumulators ([L, Hq, N] float32)
  // What kvpress holds for the same pass (a lower bound): every layer's prompt keys/values
  // (the ~2N cache) + one layer's eager scores and probabilities [B, Hq, P, N + P] in the model
  // dtype + the same statistics.
  int64_t kvpress_bytes = 0;
};

// What KVCompose's second pass reports beside the cache it compressed.
struct KVComposePassResult {
  KVComposeBudgets budgets;
  at::Tensor scores;  // [L, Hkv, N] float32: the session's token scores (KVComposeSession::scores)
  KVComposeMemory memory;
};

class KVComposePress : public BasePress {
 public:
  using Params = KVComposeOptions;

  // Raises c10::Error unless 0 <= compression_ratio < 1, the aggregations are "max" or "mean" and
  // keep_token_lower_bound >= 0.
  explicit KVComposePress(double compression_ratio, KVComposeOptions options = {});

  std::string name() const override { return "KVComposePress"; }
  double compression_ratio() const override { return compression_ratio_; }
  bool head_ragged() const override { return !options_.structured; }
  bool needs_second_pass() const override { return true; }
  bool second_pass_shardable() const override { return true; }
  const KVComposeOptions& options() const { return options_; }

  // Always raise: KVCompose needs the engine's second pass (start_session, or
  // kvpress::llama::kvcompose_prefill). One layer's cache is not enough.
  KV compress(const LayerInputs& inputs) const override;
  RaggedKV compress_ragged(const LayerInputs& inputs) const override;

  // A session for one context of `context_len` tokens; accumulators live on `device`.
  KVComposeSession start_session(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t context_len,
                                 at::Device device = at::kCPU) const;

  // ---- the second pass (kvpress/model_view.h; src/presses/kvcompose_pass.cpp) ----
  // The context's prefill, uncompressed; then each task prompt (by default the context again)
  // through every layer, LAYER BY LAYER and in QUERY CHUNKS: a layer's prompt keys/values exist for
  // that layer only, each chunk of options.query_chunk queries attends to the context plus the
  // prompt up to itself, its attention to the N context tokens feeds the session, its output the
  // next layer; nothing of the prompt is written to the cache. Then budgets, and every layer of the
  // cache compressed (structured: k_l tokens per head; else per head, through run.store_ragged()).
  KVComposePassResult run_second_pass(SecondPassRun& run, const KVComposeRunOptions& options) const;
  void second_pass(SecondPassRun& run) const override;  // with the default KVComposeRunOptions

 private:
  double compression_ratio_;
  KVComposeOptions options_;
};

class KVComposeSession {
 public:
  KVComposeSession(double compression_ratio, KVComposeOptions options, int64_t num_layers, int64_t num_heads,
                   int64_t num_kv_heads, int64_t context_len, at::Device device = at::kCPU);

  int64_t num_layers() const { return num_layers_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  int64_t context_len() const { return context_len_; }
  bool structured() const { return options_.structured; }

  // ---- statistics (before budgets()) --------------------------------------------------------------
  // Attention weights of n new queries (every batch row) over S >= N keys, the context's first:
  // columns N.. (the prompt's own keys) are ignored, as kvpress's hook does.
  void observe(int64_t layer,
               const at::Tensor& attentions);  // [B, Hq, n, S], S >= context_len
  // Pre-aggregated statistics from an engine's own kernel: per query head and context token, the
  // maximum (agg_task "max") or the sum (agg_task "mean") over `rows` query rows.
  void observe_statistics(int64_t layer,
                          const at::Tensor& statistics,  // [Hq, context_len]
                          int64_t rows);
  // The layer's value vectors, for add_v_norm (batch row 0, first context_len positions, as kvpress).
  void observe_values(int64_t layer,
                      const at::Tensor& values);  // [B, Hkv, S, D], S >= context_len
  // Rows aggregated so far into `layer`.
  int64_t observed_rows(int64_t layer) const;
  // A tensor-parallel rank's session: it observes its KV heads (range.first .. + num_kv_heads of the
  // layer's range.layer_kv_heads) and their query heads, and budgets() sets the budgets over every
  // rank's heads through `exchange` (the mean over heads, the composite curves, the per-head
  // ranking), as one session over the whole model would. Every rank calls budgets() together.
  void share_heads(const KVHeadRange& range, std::shared_ptr<const HeadExchange> exchange);

  // ---- budgets (once every layer was observed) -------------------------------------------------
  // Computes the scores and budgets on the first call; later observe calls raise.
  const KVComposeBudgets& budgets();
  bool has_budgets() const { return has_budgets_; }
  // Enhanced scores S, [L, Hkv, N] float32 (after budgets()).
  const at::Tensor& scores() const;
  // Tokens each head of `layer` keeps: k_l (structured) or k_{l,g} (unstructured).
  std::vector<int64_t> kept_counts(int64_t layer) const;
  // [Hkv, N] bool: each head's kept tokens.
  at::Tensor keep_mask(int64_t layer) const;

  // ---- compression (after budgets()) -------------------------------------------------------------
  // Structured only: every head keeps k_l tokens (its own), in position order. keys/values are the
  // layer's cache of exactly context_len tokens; every batch row gets the same selection.
  KV compress(int64_t layer,
              const at::Tensor& keys,           // [B, Hkv, N, D]
              const at::Tensor& values) const;  // [B, Hkv, N, D]
  // Either variant: the kept tokens of every head (unstructured: k_{l,g} per head).
  RaggedKV compress_ragged(int64_t layer,
                           const at::Tensor& keys,           // [B, Hkv, N, D]
                           const at::Tensor& values) const;  // [B, Hkv, N, D]

  // Bytes of the accumulators this session holds (statistics + value norms).
  int64_t statistics_bytes() const;

 private:
  void check_layer(const char* op, int64_t layer) const;
  void check_open(const char* op) const;
  void check_budgets(const char* op) const;
  void check_cache(const char* op, const at::Tensor& keys, const at::Tensor& values) const;

  double compression_ratio_;
  KVComposeOptions options_;
  KVComposeAggregation agg_task_, agg_group_, agg_head_;
  int64_t num_layers_, num_heads_, num_kv_heads_, context_len_;
  at::Tensor task_;            // [L, Hq, N] float32: running max, or running sum (mean)
  std::vector<int64_t> rows_;  // per layer, query rows aggregated
  at::Tensor value_norms_;     // [L, Hkv, N] float32 with add_v_norm
  std::vector<bool> has_values_;
  bool has_budgets_ = false;
  KVComposeBudgets budgets_;
  at::Tensor scores_;  // [L, Hkv, N] float32
  KVHeadRange range_;  // share_heads
  std::shared_ptr<const HeadExchange> exchange_;
};

}  // namespace kvpress
