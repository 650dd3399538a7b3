// A small Llama-family runner with kvpress presses in the loop: the integration reference.
//
//   auto model = kvpress::llama::LlamaModel::load(dir);          // config.json + model.safetensors
//   kvpress::llama::KVCache cache = model.new_cache();
//   auto press = kvpress::make_press("SnapKVPress", 0.5);
//   kvpress::llama::PrefillOptions opt;
//   opt.press = press.get();
//   auto out = model.prefill(context_ids, cache, opt);             // each layer compressed after its attention
//   auto next = model.forward(question_ids, cache);                // positions continue at context length
//
// The forward pass follows transformers' LlamaForCausalLM (eager attention) operation by operation:
// embedding, per layer RMSNorm -> q/k/v projections (with biases: Qwen2) -> per-head q/k RMSNorm
// (Qwen3) -> RoPE (rotate_half convention, rope_theta) -> cache append -> causal softmax attention (float32 softmax,
// GQA without repeating K/V) -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP -> residual, final RMSNorm, lm_head
// (tied to the embedding when the checkpoint says so). See docs/LLAMA_RUNNER.md.
//
// Thread safety: a LlamaModel is read-only after loading (prefill and forward are const and write
// only the KVCache, press state and outputs they are given), so one model may serve several
// threads at once, each with its own KVCache and PressSequenceState: those belong to one sequence, and
// one thread at a time. Presses may be shared (kvpress/presses/base_press.h); tested by
// tests/test_concurrency.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/llama/config.h"
#include "kvpress/lora.h"
#include "kvpress/model_view.h"
#include "kvpress/paged.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/types.h"

namespace kvpress::llama {

class Tokenizer;     // kvpress/llama/tokenizer.h
class ChatTemplate;  // kvpress/llama/chat.h

// ---- model files ------------------------------------------------------------------------------

// Where models live: $KVPRESS_MODELS when set, else <source tree>/../shared/models.
std::string default_models_dir();

// A Hugging Face checkpoint folder from a path (any folder holding config.json) or a model name
// looked up in default_models_dir() (e.g. "tinystories-656k"), then in user_models_dir()
// (kvpress/llama/checkpoint.h, whose resolve_model also finds GGUF files). Raises c10::Error listing
// where it looked.
std::string resolve_model_dir(const std::string& name_or_path);

// ---- KV cache ---------------------------------------------------------------------------------

// Per-layer keys (post-RoPE) and values, [B, Hkv, length, D] each. After a press has compressed a
// layer, length(layer) is smaller than position(): tokens keep attending over what is left, while
// new tokens get the next ORIGINAL position ids (kvpress's protocol; after a press that re-rotates
// the kept keys, KeyRerotationPress, the next position is the compressed length, as in kvpress's
// pipeline).
//
// A layer compressed by a head-ragged press (BasePress::head_ragged()) is stored either packed
// (is_ragged(): a kvpress::HeadRaggedLayer holding each head's kept tokens only, attended with
// ops::ragged_attention) or dense with a keep mask (keep_mask(): evicted positions masked to -inf,
// kvpress's way, no memory saved). See PrefillOptions::ragged_layout.
//
// One per sequence: a forward writes it, so no other thread may use it meanwhile.
class KVCache {
 public:
  KVCache() = default;
  explicit KVCache(int64_t num_layers);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Tokens consumed so far: the position id the next token gets.
  int64_t position() const { return position_; }
  // Tokens stored in `layer` (0 before the first forward); for a head-ragged layer, the longest
  // head's count (HeadRaggedLayer::max_length()).
  int64_t length(int64_t layer) const;
  std::vector<int64_t> lengths() const;
  // Views of the stored tokens, [B, Hkv, length, D]; undefined before the first forward. Raise for a
  // head-ragged layer (use ragged()).
  at::Tensor keys(int64_t layer) const;
  at::Tensor values(int64_t layer) const;

  // Head-ragged layers: is_ragged() when the layer is stored as a HeadRaggedLayer.
  bool is_ragged(int64_t layer) const;
  const HeadRaggedLayer& ragged(int64_t layer) const;  // raises unless is_ragged(layer)
  // [B, Hkv, length] bool for a dense layer stored with a keep mask (RaggedLayout::kMasked): false =
  // hidden from attention. Undefined when every stored token is visible.
  at::Tensor keep_mask(int64_t layer) const;
  // Bytes allocated by the cache: dense buffers (full capacity), keep masks, ragged layers'
  // HeadRaggedLayer::bytes().
  int64_t bytes() const;

  // Engine side (LlamaModel calls these; exposed for custom loops and tests).
  void append(int64_t layer, const at::Tensor& keys, const at::Tensor& values);   // [B, Hkv, n, D]
  void replace(int64_t layer, const at::Tensor& keys, const at::Tensor& values);  // e.g. a press's output
  // Compresses a dense layer inside its own buffers: `press`.compress_in_place() on the stored
  // tokens (inputs.keys/values are set to keys(layer)/values(layer)), after which the layer holds
  // the kept tokens at its front and keeps its capacity, so appends fill it before reallocating.
  // Returns the press's result (views of the layer). A press that raises leaves the layer as it was.
  // The prefill uses it on layers it filled itself; a copy of the cache made earlier shares the
  // buffers and would see the move.
  KV compress_in_place(int64_t layer, const BasePress& press, LayerInputs inputs);
  // Stores the layer head-ragged; later append() calls go to its tail.
  void replace_ragged(int64_t layer, HeadRaggedLayer ragged);
  // Keeps the dense tokens but hides those where keep_mask is false ([B, Hkv, length] bool);
  // tokens appended later are visible.
  void set_keep_mask(int64_t layer, const at::Tensor& keep_mask);
  void advance(int64_t n_tokens) { position_ += n_tokens; }
  // The position id the next token gets (after a KeyRerotationPress, the compressed length).
  void set_position(int64_t position);
  // Drops, in each head, the tokens of positions first .. first + m - 1 where evict [B, Hkv, m] is
  // true (DMSPress while decoding). A head-ragged layer is repacked; a dense one gets (or updates)
  // its keep mask, which needs its slots to be its positions (no uniform compression before).
  void evict(int64_t layer, int64_t first, const at::Tensor& evict);
  // Drops everything stored after lengths[layer] in each layer and sets position (e.g. to remove a
  // generated answer and reuse a compressed context, as kvpress's pipeline does per question).
  // A head-ragged layer can drop only appended tokens: max_length() - lengths[layer] of them.
  void truncate(const std::vector<int64_t>& lengths, int64_t position);

 private:
  struct Layer {
    at::Tensor key_buffer, value_buffer;  // [B, Hkv, capacity, D]; tokens [0, length) are valid
    at::Tensor mask_buffer;               // [B, Hkv, capacity] bool, only with a keep mask
    int64_t length = 0;
    HeadRaggedLayer ragged;  // defined() when the layer is stored head-ragged
  };
  // The layer, or a c10::Error "<op>: layer <i> out of range [0, <n>)".
  const Layer& layer_at(int64_t layer, const char* op) const;
  Layer& layer_at(int64_t layer, const char* op);

  std::vector<Layer> layers_;
  int64_t position_ = 0;
};

// ---- forward passes ---------------------------------------------------------------------------

struct ForwardOptions {
  // Keep every layer's eager attention weights [B, Hq, n, length] in ForwardOutput::attentions.
  bool return_attentions = false;
  // Run lm_head on the last position only (kvpress/transformers' logits_to_keep=1).
  bool last_logits_only = false;
  // Compute every layer's attention eagerly (full scores, float32 softmax, then values), as
  // transformers' eager path, even where nobody reads the weights. Default: fused attention
  // (at::scaled_dot_product_attention, transformers' "sdpa") wherever no weights are needed; the
  // two agree to float rounding (~1e-6), the eager path bit for bit with transformers' eager.
  bool eager_attention = false;

  // The sequence's press (the lifecycle of kvpress/presses/base_press.h, docs/INTEGRATION.md). At
  // prefill (prefill()) it compresses each layer; in a forward that does not start at position 0,
  // right after each layer's attention, a press whose decoding_role().compresses calls
  // decoding_update(), which may replace the layer's cache or evict tokens from it (the NEXT forward
  // reads the result); any other press does nothing there. nullptr: no press.
  const BasePress* press = nullptr;
  // The sequence's state (press->new_sequence_state(), one per sequence and one thread at a time,
  // fresh for each generation): required while decoding with a press that keeps one; at prefill it
  // records what decoding will need (DMSPress's window). nullptr when the press keeps none.
  PressSequenceState* press_state = nullptr;
  // Give the press's decoding update this forward's eager attention weights [B, Hq, n, length]
  // (kvpress on an eager model does). Otherwise only when its scorer cannot work without them
  // (DecodingRole::scorer, kvpress::needs_attentions); kvpress's default (sdpa) model gives none.
  bool decoding_attentions = false;
  // Called after each decoding update that replaced a layer, with what the press saw and returned.
  std::function<void(const LayerInputs&, const KV&)> on_decoding_compress;
};

// Whether a press gets the layer's eager attention weights in LayerInputs::attentions.
enum class PressAttentions {
  kAuto,    // when return_attentions is set, or the press cannot work without them
            // (kvpress::needs_attentions); otherwise the press recomputes what it needs
  kAlways,  // always, as kvpress on a model loaded with attn_implementation="eager"
  kNever,
};

struct PrefillOptions : ForwardOptions {
  // `press` compresses each layer's cache right after that layer's attention (which used the full
  // cache), exactly where kvpress's forward hook does: its prefill_press() (a DecodingPress: none; a
  // PrefillDecodingPress: its prefilling press).
  PressAttentions press_attentions = PressAttentions::kAuto;
  // How the layers of a head-ragged press (press->head_ragged()) are stored.
  enum class RaggedLayout {
    kPacked,  // HeadRaggedLayer: each head's kept tokens only; attention by ops::ragged_attention
    kMasked,  // the full dense layer with evicted positions masked to -inf (kvpress; the reference)
  };
  RaggedLayout ragged_layout = RaggedLayout::kPacked;
  // The prefill's last question_length tokens are the user's question (query-aware): the presses
  // see it as LayerInputs::question_length (FinchPress observes the question). 0: no question.
  int64_t question_length = 0;
  // The model's tokenizer, for presses that prompt the model themselves (KVzipPress replays the
  // context after a text prompt, kvpress/llama/kvzip.h); such a press raises without it.
  const Tokenizer* tokenizer = nullptr;
  // The chat template the context was framed in (its user turn), for those presses: KVzipPress
  // replays the context inside the template's user turn, as kvpress does with a tokenizer that has
  // one. nullptr: the context is plain text (kvpress: BOS + text, replay after "\n").
  const ChatTemplate* chat_template = nullptr;
  // Uniform presses compress each layer inside its own buffer (KVCache::compress_in_place): no
  // allocation for the kept tokens, peak S tokens per layer instead of S + kept, and the capacity
  // stays for the tokens decoding appends. false: the layer is replaced by a copy of the kept tokens
  // (frees the evicted tokens' memory now; the first append then doubles the buffer).
  bool compress_in_place = true;
  // Called after each head-ragged compression with what the press saw and returned.
  std::function<void(const LayerInputs&, const RaggedKV&)> on_compress_ragged;
  // Called after each layer's compression with what the press saw and returned (tests, analysis).
  std::function<void(const LayerInputs&, const KV&)> on_compress;
};

// Paged mode (continuous batching over a kvpress::PagedKVCache; docs/INTEGRATION.md).
struct PagedPrefillOptions {
  // Compresses each layer while storing it: each sequence is scored alone at its own length, with the
  // same inputs as prefill() gives the press. A DecodingPress does nothing here and a
  // PrefillDecodingPress applies its prefilling press. KVComposePress (second pass) is refused.
  const BasePress* press = nullptr;
  PressAttentions press_attentions = PressAttentions::kAuto;
  // One state per prompt (same order; press->new_sequence_state()) when the press starts its
  // decoding state at prefill (DecodingRole::records_prefill: RKVDecodingPress's query window):
  // prefill_paged calls record_prefill() for each sequence and layer, and decode_paged() continues
  // from these states. Unused otherwise.
  std::vector<PressSequenceState*> press_states;
};
struct PagedDecodeOptions {
  // The sequences' press in the loop (ForwardOptions::press), with one state per sequence (same order
  // as seqs) when it keeps one. Its replacements are applied with PagedKVCache::compact() once every
  // layer has run. Refused: presses whose scorer needs attention weights (the paged kernel computes
  // none), that read the whole cache every step, or that evict per head while decoding.
  const BasePress* press = nullptr;
  std::vector<PressSequenceState*> press_states;
};

struct ForwardOutput {
  at::Tensor logits;                     // [B, n, vocab] (n = 1 with last_logits_only), model dtype
  std::vector<at::Tensor> attentions;    // per layer [B, Hq, n, length] when return_attentions
  std::vector<at::Tensor> kept_indices;  // prefill with a press: per layer [B, Hkv, n_kept], ascending
  std::vector<at::Tensor> keep_masks;    // prefill with a head-ragged press: per layer [B, Hkv, S] bool
                                         // (kept_indices stays empty then)
};

// A prefill kept so that several presses can compress it (LlamaModel::capture_prefill).
struct CapturedPrefill {
  KVCache cache;                    // the uncompressed cache
  std::vector<LayerInputs> layers;  // per layer, what a press at prefill sees (queries included, no attentions)
  at::Tensor logits;                // the forward's logits (as ForwardOptions::last_logits_only asked)

  // True when this is the prefill of `input_ids` [B, S] (the ids its layers saw).
  bool is_prefill_of(const at::Tensor& input_ids) const;
};

using RopeTables = kvpress::RopeTables;  // kvpress/model_view.h

// A tensor-parallel rank's place, for LlamaModel::shard (kvpress/llama/tensor_parallel.h makes one
// from a c10d process group): rank `rank` of `world` holds the world-th block of every layer's KV
// heads (with their query heads) and of its MLP's intermediate rows, as vLLM and TensorRT-LLM shard.
struct TensorParallelRank {
  int64_t rank = 0, world = 1;
  // Sums the rank's partial o_proj and down_proj outputs over every rank (all-reduces); with global
  // budgets, the presses' head exchange too.
  std::shared_ptr<const HeadExchange> exchange;
  // Presses keep what one process compressing the whole layer keeps (kvpress::distributed's global
  // mode); false: each rank's heads alone (per-rank mode).
  bool global_budgets = true;
};

// The model is its own ModelView (kvpress/model_view.h): a press's second pass reads it layer by layer.
class LlamaModel : public ModelView {
 public:
  // Loads <dir>/config.json and <dir>/model.safetensors, casting weights to `dtype`
  // (float32, float16 or bfloat16).
  static LlamaModel load(const std::string& dir, at::ScalarType dtype = at::kFloat);

  // From a parsed config and tensors named as in a Hugging Face Llama checkpoint
  // ("model.layers.0.self_attn.q_proj.weight", ...). Raises c10::Error on a missing tensor or a
  // shape that does not match the config.
  LlamaModel(LlamaConfig config, const std::map<std::string, at::Tensor>& weights, at::ScalarType dtype = at::kFloat);

  // A tensor-parallel shard's config() holds its own head and intermediate counts
  // (num_heads / world, num_kv_heads / world, intermediate_size / world); the rest is the model's.
  const LlamaConfig& config() const { return config_; }
  at::ScalarType dtype() const { return dtype_; }

  // ---- tensor parallelism ----------------------------------------------------------------------
  // This rank's shard (copies of its rows and columns: the whole model may go): q/k/v projections
  // (and biases) of its heads, o_proj's columns of its query heads, gate/up rows and down_proj
  // columns of its intermediate block; norms, embedding and lm_head whole. Its forwards compute its
  // heads' attention and its part of the MLP, and sum o_proj's and down_proj's partial outputs over
  // the ranks (o_proj's bias added once, after the sum), so every rank holds the whole residual
  // stream and the same logits. Its KV caches hold its heads only (new_paged_cache()); presses see
  // its heads (LayerInputs::kv_head_range; with global budgets, LayerInputs::head_exchange). Every
  // rank must run the same calls in the same order. LoRA adapters apply as on the whole model
  // (lora_update), and gradients flow through the ranks' sums (into_shard, sum_over_ranks).
  // Refused on a shard: second-pass presses whose pass does not shard
  // (BasePress::second_pass_shardable) and presses kvpress::distributed::why_not_sharded names.
  // Raises unless world divides the KV heads and the intermediate size and `tp.exchange` is set.
  LlamaModel shard(const TensorParallelRank& tp) const;
  const TensorParallelRank* tensor_parallel() const { return tp_ ? &*tp_ : nullptr; }  // nullptr: a whole model
  // Raises (naming `op`) when this is a shard and `press` cannot compress a share of the heads;
  // every entry point taking a press calls it.
  void check_press_on_shard(const BasePress* press, const char* op) const;
  // A shard's block of KV heads ({rank * its heads, world * its heads}); {} for a whole model.
  KVHeadRange kv_head_range() const override;
  // The presses' exchange: a shard's with global budgets; nullptr otherwise.
  std::shared_ptr<const HeadExchange> head_exchange() const override;

  KVCache new_cache() const { return KVCache(config_.num_layers); }

  // The first forward pass on an empty cache: input_ids [B, S] (int64) at positions 0..S-1. With a
  // press, each layer's cache is replaced by press->compress(inputs) right after that layer's
  // attention, where `inputs` holds the layer's keys/values, the attention input (hidden_states,
  // post input-layernorm), q_proj/k_proj weights, cos/sin of positions 0..S-1, the attention
  // weights (per press_attentions), num_heads, layer_idx and num_layers. The returned logits are
  // the uncompressed forward's (the press acts after each layer's attention). A press that
  // needs_second_pass() (KVzip, KVgrad, RestoreKV, FastKVzip global, KVCompose) takes the prefill
  // over: BasePress::second_pass() over this model (kvpress/model_view.h); a failure leaves the cache
  // as it was.
  ForwardOutput prefill(const at::Tensor& input_ids, KVCache& cache, const PrefillOptions& options = {}) const;

  // ---- one prefill, several presses (benchmarks: kvpress-cli bench) ----------------------------
  // A press acts after each layer's attention, which used the full cache, so a prefill's forward is
  // the same whatever the press: only the tokens kept differ. capture_prefill() runs it once, without
  // a press, and keeps what each layer's press would see; compress_captured() then gives, for one
  // press, the cache prefill() with that press leaves (the same tensors: tests/test_llama.cpp).
  // input_ids [B, S] as prefill()'s; the press fields of `options` are ignored.
  CapturedPrefill capture_prefill(const at::Tensor& input_ids, const ForwardOptions& options = {}) const;
  // Why `press` cannot compress a captured prefill, or "" when it can (no press, or a DecodingPress,
  // leaves it as it is): it runs a second pass over the context (KVzip, KVCompose), starts its
  // per-sequence state at prefill (DMSPress with decoding), or reads attention weights (the capture keeps none, and
  // computing them changes the forward's rounding). A press that observes the question (FinchPress) can: capture the
  // prefill that ends with the question and give its length in options.question_length.
  static std::string why_not_captured(const BasePress* press, PressAttentions press_attentions);
  // The cache prefill() with options.press leaves (its prefilling press: prefill_press_of), from
  // `captured`, which stays as it was: a compressed layer is a copy of its kept tokens (as with
  // PrefillOptions::compress_in_place = false). Honours ragged_layout, on_compress and
  // on_compress_ragged and question_length (the capture's last question_length tokens are the
  // question, as for prefill()); tokenizer does not apply. `out` (optional) receives the
  // kept_indices / keep_masks prefill() returns. Raises c10::Error with why_not_captured()'s reason.
  KVCache compress_captured(const CapturedPrefill& captured, const PrefillOptions& options,
                            ForwardOutput* out = nullptr) const;

  // Any later forward: input_ids [B, n] at positions cache.position() .. + n - 1, each attending
  // over the whole (possibly compressed) cache and the new tokens up to itself. A failure part-way
  // (a press raising in some layer) leaves the cache and the press state as they were (prefill too).
  ForwardOutput forward(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options = {}) const;

  // cos/sin of positions [start, start + n), computed as transformers' LlamaRotaryEmbedding does
  // (float32 inverse frequencies and angles, then cast to the model dtype).
  RopeTables rope(int64_t start, int64_t n) const override;
  // The same for any positions (one row each).
  RopeTables rope_at(const std::vector<int64_t>& positions) const;

  // ---- paged mode: many sequences of different lengths over one PagedKVCache --------------------
  // A cache shaped for this model (layers, KV heads, head_dim, dtype), pages_per_layer pages of
  // page_size tokens per layer.
  PagedKVCache new_paged_cache(int64_t pages_per_layer, int64_t page_size = PagedCacheOptions::kDefaultPageSize,
                               KVFormat kv_format = KVFormat::kFull) const;
  // Prefills new sequences together, packed along tokens: prompts[i] at positions 0..S_i-1 into the
  // empty sequence seqs[i]. Each layer attends causally within each prompt, then
  // PagedKVCache::store() writes what options.press keeps (every token without a press). Returns
  // each prompt's last-position logits [B, vocab]. A failure resets the sequences (no pages kept) and
  // restores the press states.
  at::Tensor prefill_paged(const std::vector<std::vector<int64_t>>& prompts, const std::vector<SequenceId>& seqs,
                           PagedKVCache& cache, const PagedPrefillOptions& options = {}) const;
  // One decoding step: tokens[i] is appended to seqs[i] at its next position and attends over each
  // head's pages (PagedKVCache::attention). Returns logits [B, vocab]. The pages the step needs in
  // every layer are checked first; a failure part-way undoes the appends and restores the
  // press states, so the cache is as it was.
  at::Tensor decode_paged(const std::vector<SequenceId>& seqs, const std::vector<int64_t>& tokens, PagedKVCache& cache,
                          const PagedDecodeOptions& options = {}) const;
  // Why decode_paged() refuses `press` while decoding, or "" when it takes it (no press, or one that
  // does nothing while decoding, included): its scorer needs attention weights, it reads the whole
  // cache every step, or it evicts per head (DecodingRole).
  static std::string why_not_paged_decoding(const BasePress* press);

  // ---- the ModelView: one decoder layer at a time, for the presses' second passes (kvpress/model_view.h)
  // and engines that run a pass layer by layer; the same operations as forward() -------------------
  using LayerQKV = kvpress::LayerQKV;
  ModelShape shape() const override;
  at::Tensor embed(const at::Tensor& input_ids) const override;  // [B, n] int64 -> [B, n, hidden]
  // Input RMSNorm, q/k/v projections and RoPE of the residual stream x [B, n, hidden] entering
  // `layer`, at the positions of `rope_tables` ([n, D] each). `lora` (optional; check_adapter()
  // first) adds its updates to the layer's projections, here and in layer_output / layer_mlp.
  LayerQKV layer_qkv(int64_t layer, const at::Tensor& x, const RopeTables& rope_tables,
                     const LoraAdapter* lora = nullptr) const override;
  // Causal attention of the last n of L positions, as forward() computes it where nobody reads
  // the weights (fused): q [B, Hq, n, D] are the queries of positions L - n .. L - 1, which see
  // every earlier key and themselves. keys/values [B, Hkv, L, D] -> [B, n, Hq * D].
  at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) const override;
  // The layer's output projection weight [hidden, Hq * D].
  const at::Tensor& o_proj(int64_t layer) const override;
  // The layer's output projection of attn [B, n, Hq * D] (heads concatenated), with its bias where
  // the model has one -> [B, n, hidden].
  at::Tensor project_output(int64_t layer, const at::Tensor& attn, const LoraAdapter* lora = nullptr) const override;
  // The MLP half of a layer: y + MLP(RMSNorm(y)), y [B, n, hidden] the residual after attention.
  at::Tensor layer_mlp(int64_t layer, const at::Tensor& y, const LoraAdapter* lora = nullptr) const override;
  // The rest of the layer: x + o_proj(attn), then the MLP with its residual. attn [B, n, Hq * D]
  // (heads concatenated) -> [B, n, hidden].
  at::Tensor layer_output(int64_t layer, const at::Tensor& x, const at::Tensor& attn,
                          const LoraAdapter* lora = nullptr) const override;
  // Raises c10::Error "<op>: <what>" unless every module of `adapter` is in one of this model's
  // layers and its A/B shapes fit that projection's weight ([r, in] and [out, r]).
  void check_adapter(const LoraAdapter& adapter, const char* op) const override;

 private:
  // inv_freq [D/2] float32 scaled as config.rope_type says (the constructor's RoPE frequencies).
  static at::Tensor scaled_inv_freq(const LlamaConfig& config, const at::Tensor& inv_freq);
  struct Layer {
    at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, post_norm, gate_proj, up_proj, down_proj;
    at::Tensor q_bias, k_bias, v_bias, o_bias;  // [out] each; undefined where config_ says none
    at::Tensor q_norm, k_norm;                  // [D] (Qwen3); undefined otherwise
  };

  // One forward pass (prefill when `prefill` is given): per layer, the projections, the attention
  // over the cache (dense or head-ragged), the presses' hooks, the MLP.
  // With `capture`, a prefill without a press that appends each layer's press inputs to it.
  ForwardOutput run(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options,
                    const PrefillOptions* prefill, std::vector<LayerInputs>* capture = nullptr) const;
  // Whether the prefill press gets the layer's attention weights.
  static bool wants_attentions(PressAttentions mode, const ForwardOptions& options, const std::string& press_name);
  LayerQKV project_qkv(int64_t layer, const at::Tensor& h,  // h: [B, n, hidden] after the input norm
                       const RopeTables& rope_tables, const LoraAdapter* lora = nullptr) const;
  // y + MLP(RMSNorm(y)) of `layer` (with the adapter's updates when given).
  at::Tensor mlp_residual(int64_t layer, const at::Tensor& y, const LoraAdapter* lora) const;
  // The layer's weight named as in the checkpoint and in kvpress::LoraAdapter::kModules ("q_proj", ...).
  const at::Tensor& projection(int64_t layer, const std::string& module) const;
  // The block of the whole model's `module` weight a shard holds: its output rows (dim 0: q/k/v and
  // their biases, gate/up) or input columns (dim 1: o_proj, down_proj) [first, first + count), from
  // the shard's counts and rank. Only on a shard.
  struct ShardBlock {
    int64_t dim = 0, first = 0, count = 0;
  };
  ShardBlock shard_block(const std::string& module) const;
  // The adapter's update of `module` in `layer` as this model applies it: on a shard, the rows of B
  // (dim 0 blocks) or columns of A (dim 1 blocks) of its block; nullopt where the adapter has none.
  std::optional<LoraLinear> lora_update(const LoraAdapter* lora, int64_t layer, const char* module) const;
  // Causal attention of q [B, Hq, n, D] over a dense layer's keys/values [B, Hkv, L, D] (the last n
  // are the new tokens), hiding positions where keep_mask [B, Hkv, L] (if defined) is false.
  // -> [B, n, Hq * D]. With weights_out, eagerly as transformers' eager path (scores, float32
  // softmax, values) and *weights_out = the weights [B, Hq, n, L] in the model dtype; without,
  // fused (at::scaled_dot_product_attention: no L x n matrix), which is what every layer uses
  // unless someone reads the weights or ForwardOptions::eager_attention is set.
  at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& keep_mask, at::Tensor* weights_out) const;
  at::Tensor ragged_attention(const at::Tensor& q, const HeadRaggedLayer& layer) const;  // -> [B, n, Hq * D]
  // What both presses' hooks see of one layer in this forward (all but the attention weights).
  LayerInputs hook_inputs(int64_t layer, const at::Tensor& input_ids, const at::Tensor& h,
                          const RopeTables& rope_tables, const at::Tensor& keys, const at::Tensor& values) const;
  // The paged calls' checks: the cache has this model's shape and dtype; ids in the vocabulary.
  void check_paged_cache(const PagedKVCache& cache, const char* op) const;
  void check_token_ids(const std::vector<int64_t>& ids, const char* op) const;
  // kvpress's forward hook at prefill: compress the layer, store it dense or head-ragged.
  // A head-ragged press's keep mask computed beforehand may be given (DMSPress filling its window).
  void compress_at_prefill(const BasePress& press, const PrefillOptions& options, int64_t layer, LayerInputs in,
                           bool in_place, KVCache& cache, ForwardOutput& out,
                           const at::Tensor& keep_mask = at::Tensor()) const;
  // forward()'s checks: input_ids a non-empty int64 [B, n] in the vocabulary; the cache this model's.
  void check_forward_inputs(const at::Tensor& input_ids, const KVCache& cache) const;
  // The press's hook in a decoding forward (BasePress::decoding_update), applied to the layer.
  void update_while_decoding(const BasePress& press, const ForwardOptions& options, int64_t layer, LayerInputs in,
                             int64_t tokens_seen, KVCache& cache) const;
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const;

  LlamaConfig config_;
  at::ScalarType dtype_;
  at::Tensor embed_tokens_;  // [vocab, hidden]
  std::vector<Layer> layers_;
  at::Tensor norm_;                       // [hidden]
  at::Tensor lm_head_;                    // [vocab, hidden]; the embedding when tied
  at::Tensor inv_freq_;                   // [head_dim / 2] float32
  std::optional<TensorParallelRank> tp_;  // set on a shard
  // A partial projection output summed over the ranks on a shard; itself on a whole model.
  at::Tensor sum_over_ranks(const at::Tensor& partial) const;
  // A whole input (the same on every rank) entering a shard's block of projections: itself, except
  // that with autograd recording, its gradient is the sum over the ranks of each rank's part.
  at::Tensor into_shard(const at::Tensor& whole) const;
};

}  // namespace kvpress::llama
