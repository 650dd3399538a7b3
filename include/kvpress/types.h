// Plain data passed between an engine and a press. No model object ever reaches a press:
// everything it may use is in LayerInputs (see docs/ARCHITECTURE.md §2).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace kvpress {

// Token id -> the token's text (a tokenizer decoding that one id, special tokens included, as
// the reference's tokenizer.decode([id]) does). QSMPress derives its semantic weights from it.
using TokenTextFn = std::function<std::string(int64_t token_id)>;

// How a press reaches the KV heads other tensor-parallel ranks hold, when a layer's heads are
// sharded across ranks and budgets are global (kvpress/distributed.h's BudgetMode::kGlobal). The
// few presses whose scores or budgets span heads (BasePress::head_span() == kExchanged) call it
// at those steps; every rank calls it the same number of times in the same order. Implementations
// raise a c10::Error when a rank fails or times out.
class HeadExchange {
 public:
  virtual ~HeadExchange() = default;
  // local: [B, n, ...] rows of this rank's n heads (KV or query heads) -> [B, world·n, ...], every
  // rank's rows in rank order (an all-gather; the rank order is the head order).
  virtual at::Tensor gather_heads(const at::Tensor& local) const = 0;
  // The elementwise sum, or maximum, of `partial` over every rank (an all-reduce); same shape and dtype.
  virtual at::Tensor sum_over_ranks(const at::Tensor& partial) const = 0;
  virtual at::Tensor max_over_ranks(const at::Tensor& partial) const = 0;
};

// Which of the layer's KV heads a LayerInputs holds: all of them (the default), or one
// tensor-parallel rank's block (kvpress::distributed::ShardedPress sets it). Presses that read
// per-head data by the head's number in the layer (a file of per-head filters, a draw per head)
// take this block's rows of it.
struct KVHeadRange {
  int64_t first = 0;           // the layer's KV head that keys[:, 0] is
  int64_t layer_kv_heads = 0;  // the layer's KV heads on every rank together; 0: the keys' own (a whole layer)
};

// One attention layer's state right after prefill. Optional tensors are left undefined
// (`!t.defined()`); a press that needs one it was not given raises a c10::Error naming it.
struct LayerInputs {
  at::Tensor keys;    // [B, Hkv, S, D] as cached: post-RoPE (post k_norm where the model has one)
  at::Tensor values;  // [B, Hkv, S, D]

  // Post-RoPE queries of the last Sq positions (Sq <= S), when the engine already has them.
  at::Tensor queries;  // optional [B, Hq, Sq, D]

  // kvpress's path: recompute queries (or pre-RoPE keys) from the attention input.
  at::Tensor hidden_states;  // optional [B, S, hidden], already input-layernormed
  at::Tensor q_proj;         // optional [Hq * D, hidden] (nn.Linear weight layout)
  at::Tensor k_proj;         // optional [Hkv * D, hidden]
  at::Tensor q_bias;         // optional [Hq * D]: q_proj's bias (Qwen2-style attention biases)
  at::Tensor k_bias;         // optional [Hkv * D]: k_proj's bias
  // The layer's output projection weight, for presses that weigh values by their effect on the
  // attention output (CriticalKVPress, CriticalAdaKVPress).
  at::Tensor o_proj;       // optional [hidden, Hq * D] (nn.Linear weight layout, no bias)
  at::Tensor q_norm;       // optional [D] RMSNorm weight applied per head (Qwen3-style)
  at::Tensor k_norm;       // optional [D]
  double norm_eps = 1e-6;  // eps of q_norm / k_norm

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
  // semantic weights).
  at::Tensor input_ids;  // optional [B, S] int64
  // The text of one token id (the engine's tokenizer, each id decoded alone), for those presses:
  // kvpress::llama's prefill gives its PrefillOptions::tokenizer here. A function, not a tensor, so
  // not among for_each_field's fields (the CLI's input files and the torch ops cannot carry it).
  TokenTextFn token_text;  // optional

  // Set when these inputs are one rank's share of a layer's heads (kvpress::distributed::ShardedPress
  // sets both; neither is a tensor): the block of heads they hold, and under global budgets how
  // presses reach the other ranks' heads. Unset: the inputs are the whole layer.
  KVHeadRange kv_head_range;
  std::shared_ptr<const HeadExchange> head_exchange;  // optional

  // Number of query heads Hq. 0 means "infer it" from queries, attentions or q_proj.
  int64_t num_heads = 0;

  int64_t layer_idx = 0;  // for layer-aware budgets
  int64_t num_layers = 1;

  // The last question_length positions are the user's question (a query-aware prefill: context then
  // question); 0 = no question. Presses that observe the question (FinchPress) need it.
  int64_t question_length = 0;
};

// One field of LayerInputs, for code that handles every field by name: the CLI's input files,
// torch.ops.kvpress.press_compress, the registry's input lists, the runner's hooks.
struct LayerInputField {
  const char* name;   // the member's name, e.g. "queries"
  const char* shape;  // e.g. "[B, Hq, Sq, D]"; "" for scalars
  const char* help;   // one line
  bool required;      // keys and values: every press needs them
  bool integer;       // an integer tensor (input_ids); the other tensors are floating
};

// Calls visit(field, member) for every field of `inputs`, in declaration order. `member` is an
// at::Tensor&, int64_t& or double& (const for a const LayerInputs), so one generic lambda handles
// tensors and scalars with `if constexpr`. This list is the one place the fields are enumerated.
template <typename Inputs, typename Visitor>
void for_each_field(Inputs& in, Visitor&& visit) {
  static_assert(std::is_same_v<std::remove_const_t<Inputs>, LayerInputs>, "for_each_field visits a LayerInputs");
  visit(LayerInputField{"keys", "[B, Hkv, S, D]", "as cached: post-RoPE", true, false}, in.keys);
  visit(LayerInputField{"values", "[B, Hkv, S, D]", "as cached", true, false}, in.values);
  visit(LayerInputField{"queries", "[B, Hq, Sq, D]", "post-RoPE queries of the last Sq positions", false, false},
        in.queries);
  visit(LayerInputField{"hidden_states", "[B, S, hidden]", "attention input (after the input layernorm)", false, false},
        in.hidden_states);
  visit(LayerInputField{"q_proj", "[Hq * D, hidden]", "query projection weight", false, false}, in.q_proj);
  visit(LayerInputField{"k_proj", "[Hkv * D, hidden]", "key projection weight", false, false}, in.k_proj);
  visit(LayerInputField{"q_bias", "[Hq * D]", "query projection bias (Qwen2)", false, false}, in.q_bias);
  visit(LayerInputField{"k_bias", "[Hkv * D]", "key projection bias (Qwen2)", false, false}, in.k_bias);
  visit(LayerInputField{"o_proj", "[hidden, Hq * D]", "output projection weight", false, false}, in.o_proj);
  visit(LayerInputField{"q_norm", "[D]", "per-head RMSNorm weight of the queries (Qwen3)", false, false}, in.q_norm);
  visit(LayerInputField{"k_norm", "[D]", "per-head RMSNorm weight of the keys (Qwen3)", false, false}, in.k_norm);
  visit(LayerInputField{"norm_eps", "", "eps of q_norm / k_norm", false, false}, in.norm_eps);
  visit(
      LayerInputField{"attentions", "[B, Hq, Sq, S]", "eager attention weights of the last Sq positions", false, false},
      in.attentions);
  visit(LayerInputField{"cos", "[S, D]", "RoPE cosines of positions 0..S-1 (HF layout)", false, false}, in.cos);
  visit(LayerInputField{"sin", "[S, D]", "RoPE sines of positions 0..S-1", false, false}, in.sin);
  visit(LayerInputField{"inv_freq", "[D / 2]", "RoPE inverse frequencies", false, false}, in.inv_freq);
  visit(LayerInputField{"input_ids", "[B, S]", "token ids of the cached positions (int64)", false, true}, in.input_ids);
  visit(LayerInputField{"num_heads", "", "Hq; 0 = infer from queries, attentions, q_proj or o_proj", false, false},
        in.num_heads);
  visit(LayerInputField{"layer_idx", "", "index of this layer", false, false}, in.layer_idx);
  visit(LayerInputField{"num_layers", "", "layers in the model", false, false}, in.num_layers);
  visit(LayerInputField{"question_length", "", "trailing positions that are the question (0: none)", false, false},
        in.question_length);
}

// Every field, in the order of for_each_field.
std::vector<LayerInputField> layer_input_fields();

// Checks the fields against each other: keys/values [B, Hkv, S, D] with S, D > 0, one dtype; every
// other tensor floating (input_ids: integer), on the keys' device and of the shape above; cos and
// sin together; every source of Hq (num_heads, queries, attentions, q_proj, o_proj) agreeing and a
// multiple of Hkv; 0 <= layer_idx < num_layers; 0 <= question_length <= S; norm_eps >= 0. Raises a c10::Error
// "<op>: <field> must be <expected>, got <actual>". For inputs at prefill (S positions 0..S-1); a
// decoding step's inputs (hidden_states and cos/sin of the latest forward only) do not pass.
void validate_layer_inputs(const LayerInputs& inputs, const std::string& op);

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
