// The second pass of a press's lifecycle: what a press that runs the model again over the context
// (BasePress::needs_second_pass(): KVzipPress, KVgradPress, RestoreKVPress, FastKVzipPress with its
// global selection, KVComposePress) sees of the model and of the prefill it takes over.
//
// A runner implements SecondPassRun for one prefill and calls BasePress::second_pass(run); the press
// runs its passes layer by layer through run.model(), then fills the cache through the run
// (prefill() with a press of its own, or store() / store_ragged() layer by layer). kvpress::llama
// implements both views for LlamaModel (LlamaModel::prefill does this); an engine implements them for
// its own model to run these presses (docs/INTEGRATION.md, "The second pass").
//
//   class MyRun : public kvpress::SecondPassRun { ... };   // the model, the context, the cache
//   MyRun run(model, context_ids, cache);
//   press.second_pass(run);                                 // any press with needs_second_pass()
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvpress/types.h"

namespace kvpress {

class BasePress;
class LoraAdapter;  // kvpress/lora.h

// RoPE tables in the model dtype: cos/sin [n, head_dim], each half repeating the frequencies.
struct RopeTables {
  at::Tensor cos, sin;
};

// One decoder layer's attention inputs for n positions.
struct LayerQKV {
  at::Tensor q;     // [B, Hq, n, D] post-RoPE
  at::Tensor k, v;  // [B, Hkv, n, D], k post-RoPE
  at::Tensor h;     // [B, n, hidden]: the attention input (after the input RMSNorm)
};

struct ModelShape {
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t hidden_size = 0, intermediate_size = 0;
  at::ScalarType dtype = at::kFloat;  // of the weights, activations and cache
};

// A decoder-only model one layer at a time, with the same operations as its forward pass.
class ModelView {
 public:
  virtual ~ModelView() = default;

  virtual ModelShape shape() const = 0;
  virtual at::Tensor embed(const at::Tensor& input_ids) const = 0;  // [B, n] int64 -> [B, n, hidden]
  // cos/sin of positions [start, start + n).
  virtual RopeTables rope(int64_t start, int64_t n) const = 0;
  // Input norm, q/k/v projections and RoPE of the residual stream x [B, n, hidden] entering `layer`,
  // at the positions of `rope_tables` ([n, D] each). `lora` (optional; check_adapter() first) adds
  // its updates to the layer's projections, here and in project_output / layer_mlp / layer_output.
  virtual LayerQKV layer_qkv(int64_t layer, const at::Tensor& x, const RopeTables& rope_tables,
                             const LoraAdapter* lora = nullptr) const = 0;
  // Causal attention of the last n of L positions: q [B, Hq, n, D] are the queries of positions
  // L - n .. L - 1. keys/values [B, Hkv, L, D] -> [B, n, Hq * D] (heads concatenated).
  virtual at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) const = 0;
  // The layer's output projection weight [hidden, Hq * D].
  virtual const at::Tensor& o_proj(int64_t layer) const = 0;
  // attn [B, n, Hq * D] -> its output projection [B, n, hidden].
  virtual at::Tensor project_output(int64_t layer, const at::Tensor& attn, const LoraAdapter* lora = nullptr) const = 0;
  // The MLP half of a layer: y + MLP(norm(y)), y [B, n, hidden] the residual after attention.
  virtual at::Tensor layer_mlp(int64_t layer, const at::Tensor& y, const LoraAdapter* lora = nullptr) const = 0;
  // The rest of the layer: x + o_proj(attn), then the MLP with its residual -> [B, n, hidden].
  virtual at::Tensor layer_output(int64_t layer, const at::Tensor& x, const at::Tensor& attn,
                                  const LoraAdapter* lora = nullptr) const = 0;
  // Raises "<op>: <what>" unless every module of `adapter` fits one of this model's layers.
  virtual void check_adapter(const LoraAdapter& adapter, const char* op) const = 0;
  // A tensor-parallel rank's view (kvpress/llama/tensor_parallel.h): the block of each layer's KV
  // heads it holds, and, with global budgets, the exchange a press's second pass sets them with
  // (KVComposeSession::share_heads). A whole model: {} and nullptr.
  virtual KVHeadRange kv_head_range() const { return {}; }
  virtual std::shared_ptr<const HeadExchange> head_exchange() const { return nullptr; }
};

// The text a chat template puts around a user message (rendered with the generation prompt and
// without thinking): `before` opens the user turn, `after` closes it and opens the assistant's.
struct UserTurnFrame {
  std::string before, after;
};

// One prefill taken over by a press's second pass: the model, the context and the (empty) cache it
// fills. A failure part-way must leave the cache as it was: the runner restores it.
class SecondPassRun {
 public:
  virtual ~SecondPassRun() = default;

  // The call that runs the pass, prefixing its errors ("kvzip_prefill", "LlamaModel::prefill").
  virtual const char* op() const = 0;
  virtual const ModelView& model() const = 0;
  virtual const at::Tensor& context_ids() const = 0;  // [B, N] int64
  // The context's keys/values of `layer` ([B, Hkv, N, D] each) from a plain prefill captured
  // beforehand, or a pair of undefined tensors (the pass computes them).
  virtual std::pair<at::Tensor, at::Tensor> captured_layer(int64_t layer) const { return {}; }

  // ---- text, for presses that prompt the model themselves (KVzip's repeat prompts) ----
  // The ids of `text` without special tokens; raises when the runner has no tokenizer.
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // The frame of the chat template the context's user turn was rendered in; nullopt when the context
  // is plain text.
  virtual std::optional<UserTurnFrame> user_turn_frame() const = 0;

  // ---- the cache ----
  // The ordinary prefill of the context into the empty cache, each layer compressed by `press`
  // (nullptr: none; never a press that needs a second pass), with the runner's forward options. It
  // gives the run's logits.
  virtual void prefill(const BasePress* press) = 0;
  // A prefilled layer's keys/values, [B, Hkv, N, D].
  virtual at::Tensor cached_keys(int64_t layer) const = 0;
  virtual at::Tensor cached_values(int64_t layer) const = 0;
  // Replaces a prefilled layer by what the press kept of `inputs` (its keys/values, layer_idx,
  // num_layers): the uniform KV, or the per-head RaggedKV (packed or masked, packs_ragged_layers()).
  virtual void store(const LayerInputs& inputs, const KV& kv) = 0;
  virtual void store_ragged(const LayerInputs& inputs, const RaggedKV& kv) = 0;
  // Whether store_ragged() keeps only the kept tokens (any batch) or masks the dense layer (batch 1).
  virtual bool packs_ragged_layers() const = 0;
  // Appends n tokens after the kept ones in every layer (keys[l], values[l]: [B, Hkv, n, D]) and
  // moves the next position on by n (RestoreKV's restore tokens).
  virtual void append(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) = 0;
};

// A press that keeps, in each layer, a selection made beforehand: masks[l] [B, Hkv, N] bool (the
// compressing prefill of a second pass). It reports `press`'s name and ratio; `press` must outlive it.
std::unique_ptr<BasePress> selected_tokens_press(const BasePress& press, std::vector<at::Tensor> masks);

}  // namespace kvpress
