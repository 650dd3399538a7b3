// KVzip's replay on the Llama runner (include/kvpress/llama/kvzip.h).
#include "kvpress/llama/kvzip.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "kvpress/llama/chat.h"
#include "tensor_bytes.h"

namespace kvpress::llama {
namespace {

using detail::bytes_of;

// Keeps the largest footprint seen, with the breakdown of that moment.
void record_peak(KVzipMemory& m, int64_t layer_kv, int64_t activations, int64_t attention, int64_t scores) {
  const int64_t total = layer_kv + activations + attention + scores;
  if (total <= m.peak_bytes) return;
  m.peak_bytes = total;
  m.layer_kv_bytes = layer_kv;
  m.activation_bytes = activations;
  m.attention_bytes = attention;
  m.scores_bytes = scores;
}

// The second prefill's press: each layer keeps the selection the scoring pass made for it.
class SelectedTokensPress : public BasePress {
 public:
  SelectedTokensPress(const BasePress& press, std::vector<at::Tensor> masks)
      : press_(press), masks_(std::move(masks)) {}
  std::string name() const override { return press_.name(); }
  double compression_ratio() const override { return press_.compression_ratio(); }
  bool head_ragged() const override { return true; }
  KV compress(const LayerInputs&) const override { refuse_uniform_compress(); }
  at::Tensor keep_mask(const LayerInputs& inputs) const override {
    return masks_.at(static_cast<size_t>(inputs.layer_idx)).to(inputs.keys.device());
  }

 private:
  const BasePress& press_;
  std::vector<at::Tensor> masks_;  // per layer [1, Hkv, N] bool
};

// RestoreKV's restore tokens riding the scoring pass: they attend to each layer's full context with
// the adapter active, and leave their keys/values for the compressed cache.
struct RestoreStream {
  at::Tensor x;  // [1, n, hidden]: their residual stream entering the current layer
  const LoraAdapter* adapter = nullptr;
  std::vector<at::Tensor> keys, values;  // per layer [1, Hkv, n, D]
};

// Scores a layer's context tokens from its attention input: [1, Hkv, N] (FastKVzip's gates).
using ContextScorer = std::function<at::Tensor(int64_t layer, const LlamaModel::LayerQKV& context)>;

// The scores of every context token: the context and every replay chunk (none for FastKVzip) go
// through the model together, layer by layer, so only one layer's keys/values exist at a time. A
// layer's scores come from context_scorer (when given) and the replay blocks (KVzip's chunk scores,
// a running maximum). With `restore`, its tokens run through each layer right after the context.
at::Tensor scoring_pass(const LlamaModel& model, const at::Tensor& context_ids, const KVzipPress* press,
                        const std::vector<KVzipReplayChunk>& chunks, const ContextScorer& context_scorer,
                        int64_t query_chunk, KVzipMemory& memory, RestoreStream* restore = nullptr,
                        const CapturedPrefill* captured = nullptr) {
  const LlamaConfig& c = model.config();
  const int64_t n = context_ids.size(1), hkv = c.num_kv_heads, d = c.head_dim;
  const auto options = model.embed(context_ids.narrow(1, 0, 1)).options();
  at::Tensor scores = at::zeros({c.num_layers, hkv, n}, options.dtype(at::kFloat));

  // Residual streams entering the current layer: the context's [1, N, hidden] and each chunk's
  // [1, P_i, hidden]. A replay block's rows are overwritten by the layer's output as soon as the
  // block is done: later blocks read only their own rows (earlier rows live on as keys/values).
  at::Tensor x = model.embed(context_ids);
  std::vector<at::Tensor> streams;
  int64_t longest = 0;
  for (const KVzipReplayChunk& chunk : chunks) {
    streams.push_back(model.embed(at::tensor(chunk.repeat_ids, at::kLong).unsqueeze(0).to(context_ids.device())));
    longest = std::max(longest, static_cast<int64_t>(chunk.repeat_ids.size()));
  }
  const RopeTables context_rope = model.rope(0, n);
  const int64_t n_restore = restore ? restore->x.size(1) : 0;
  const RopeTables restore_rope = model.rope(n, n_restore);  // positions N .. N + n - 1
  longest = std::max(longest, n_restore);
  const auto activation_bytes = [&] {
    return bytes_of({&x}) + bytes_of(streams) +
           (restore ? bytes_of({&restore->x}) + bytes_of(restore->keys) + bytes_of(restore->values) : 0);
  };

  for (int64_t li = 0; li < c.num_layers; ++li) {
    const bool last = li + 1 == c.num_layers;  // its outputs feed nothing KVzip reads
    // This layer's keys/values: the context's at [0, N), then one replay chunk's at [N, N + P).
    at::Tensor layer_keys = at::empty({1, hkv, n + longest, d}, options);
    at::Tensor layer_values = at::empty({1, hkv, n + longest, d}, options);
    if (captured != nullptr) {  // the context's keys/values as its plain prefill computed them
      layer_keys.narrow(2, 0, n).copy_(captured->layers[static_cast<size_t>(li)].keys);
      layer_values.narrow(2, 0, n).copy_(captured->layers[static_cast<size_t>(li)].values);
    } else {
      LlamaModel::LayerQKV qkv = model.layer_qkv(li, x, context_rope);
      if (context_scorer) scores[li].copy_(context_scorer(li, qkv)[0]);
      layer_keys.narrow(2, 0, n).copy_(qkv.k);
      layer_values.narrow(2, 0, n).copy_(qkv.v);
      qkv.k.reset();
      qkv.v.reset();
      if (!last) {
        const at::Tensor attn = model.layer_attention(qkv.q, layer_keys.narrow(2, 0, n), layer_values.narrow(2, 0, n));
        record_peak(memory, bytes_of({&layer_keys, &layer_values, &qkv.q}), activation_bytes(),
                    bytes_of({&attn, &qkv.h}), bytes_of({&scores}));
        x = model.layer_output(li, x, attn);
      }
    }
    if (restore) {  // kvpress's one LoRA-adapted pass over the full cache, layer by layer
      LlamaModel::LayerQKV qkv = model.layer_qkv(li, restore->x, restore_rope, restore->adapter);
      layer_keys.narrow(2, n, n_restore).copy_(qkv.k);
      layer_values.narrow(2, n, n_restore).copy_(qkv.v);
      restore->keys.push_back(qkv.k);
      restore->values.push_back(qkv.v);
      if (!last) {
        const at::Tensor attn = model.layer_attention(qkv.q, layer_keys.narrow(2, 0, n + n_restore),
                                                      layer_values.narrow(2, 0, n + n_restore));
        record_peak(memory, bytes_of({&layer_keys, &layer_values, &qkv.q}), activation_bytes(),
                    bytes_of({&attn, &qkv.h}), bytes_of({&scores}));
        restore->x = model.layer_output(li, restore->x, attn, restore->adapter);
      }
    }
    const at::Tensor context_keys = layer_keys.narrow(2, 0, n);
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      TORCH_CHECK(press != nullptr, "scoring_pass: replay chunks need the KVzipPress that scores them");
      const KVzipReplayChunk& chunk = chunks[ci];
      at::Tensor& stream = streams[ci];
      const int64_t p = stream.size(1), len = chunk.end - chunk.start;
      const int64_t sink = std::min(press->n_sink(), chunk.start);
      // KVzip+: ||W_o v|| of the chunk's values, per query head.
      const at::Tensor column_scale =
          press->kvzip_plus_normalization()
              ? KVzipPress::value_output_norms(layer_values.narrow(2, chunk.start, len), model.o_proj(li))
              : at::Tensor();
      at::Tensor chunk_max = scores[li].narrow(1, chunk.start, len);  // [Hkv, len] view
      for (int64_t r0 = 0; r0 < p; r0 += query_chunk) {
        const int64_t rows = std::min(query_chunk, p - r0), seen = r0 + rows;
        const at::Tensor x_rows = stream.narrow(1, r0, rows);
        LlamaModel::LayerQKV qkv = model.layer_qkv(li, x_rows, model.rope(n + r0, rows));
        layer_keys.narrow(2, n + r0, rows).copy_(qkv.k);
        layer_values.narrow(2, n + r0, rows).copy_(qkv.v);
        const at::Tensor row_scale =
            column_scale.defined() ? at::reciprocal(qkv.h.to(at::kFloat).norm(2, {-1})) : at::Tensor();
        const at::Tensor block =
            press->chunk_scores(qkv.q, context_keys.narrow(2, 0, sink), context_keys.narrow(2, chunk.start, len),
                                layer_keys.narrow(2, n, seen), r0, row_scale, column_scale);
        chunk_max.copy_(at::maximum(chunk_max, block[0]));
        // What chunk_scores held: float32 logits and weights over sink + chunk + seen keys.
        const int64_t block_bytes = 2 * 4 * c.num_heads * rows * (sink + len + seen);
        record_peak(memory, bytes_of({&layer_keys, &layer_values, &qkv.q, &column_scale}), activation_bytes(),
                    block_bytes, bytes_of({&scores}));
        if (last) continue;
        const at::Tensor attn =
            model.layer_attention(qkv.q, layer_keys.narrow(2, 0, n + seen), layer_values.narrow(2, 0, n + seen));
        stream.narrow(1, r0, rows).copy_(model.layer_output(li, x_rows, attn));
      }
    }
  }
  return scores;
}

}  // namespace

namespace {

// The context's replay chunks as kvpress frames them. Without a chat template the context is plain
// text: every token is replayed, each chunk after "\n". With one (the template the context's user
// turn was rendered in), the template's text before the user's message is not replayed (kvpress
// skips its token count) and the text after the message (end of turn, the assistant's header, as
// rendered without thinking) comes between each prompt and its chunk.
std::vector<KVzipReplayChunk> framed_replay_chunks(const char* op, const KVzipPress& press,
                                                   const at::Tensor& context_ids,  // [1, N] int64
                                                   const Tokenizer& tokenizer, const ChatTemplate* chat) {
  const at::Tensor ids_cpu = context_ids.cpu().contiguous();
  const std::vector<int64_t> ids(ids_cpu.data_ptr<int64_t>(), ids_cpu.data_ptr<int64_t>() + ids_cpu.numel());
  const auto encode = [&](const std::string& text) { return tokenizer.encode(text, /*add_special_tokens=*/false); };
  std::string prefix_text, suffix_text = KVzipPress::kRepeatSuffix;
  if (chat != nullptr) {
    // kvpress's own probe: a dummy message followed by a separator, rendered with the generation prompt.
    const std::string dummy = "dummy context", separator = "\n" + std::string(dummy.size(), '#');
    ChatOptions no_thinking;
    no_thinking.enable_thinking = false;
    const std::string rendered =
        chat->apply({{"user", dummy + separator}}, /*add_generation_prompt=*/true, no_thinking);
    const size_t at = rendered.find(separator);
    TORCH_CHECK(at != std::string::npos && rendered.find(separator, at + 1) == std::string::npos, op,
                ": the chat template ", chat->name(), " must render the user message once");
    const std::string before = rendered.substr(0, at);
    prefix_text = before.substr(0, before.find(dummy));
    suffix_text = rendered.substr(at + separator.size());
  }
  const int64_t prefix_length = prefix_text.empty() ? 0 : static_cast<int64_t>(encode(prefix_text).size());
  TORCH_CHECK(prefix_length < static_cast<int64_t>(ids.size()), op, ": the context has ", ids.size(),
              " tokens, no more than the chat template's ", prefix_length, " before the user's message");
  return press.replay_chunks(ids, encode(KVzipPress::kFirstRepeatPrompt), encode(KVzipPress::kNextRepeatPrompt),
                             encode(suffix_text), prefix_length);
}

// The checks both entry points share; returns the full cache's bytes (for KVzipMemory).
int64_t check_prefill_args(const char* op, const LlamaModel& model, const at::Tensor& context_ids,
                           const KVCache& cache) {
  std::ostringstream shape;
  shape << context_ids.sizes();
  TORCH_CHECK(context_ids.dim() == 2 && context_ids.size(0) == 1 && context_ids.size(1) > 0 &&
                  context_ids.scalar_type() == at::kLong,
              op, ": context_ids must be a non-empty int64 [1, n] tensor (batch 1, as kvpress), got ", shape.str(), " ",
              context_ids.scalar_type());
  TORCH_CHECK(cache.position() == 0, op, ": the cache already holds ", cache.position(),
              " tokens; it prefills an empty cache");
  const LlamaConfig& c = model.config();
  const int64_t elt = static_cast<int64_t>(c10::elementSize(model.dtype()));
  return c.num_layers * 2 * c.num_kv_heads * context_ids.size(1) * c.head_dim * elt;
}

// The ordinary prefill with each layer compressed to its mask right after its attention.
ForwardOutput prefill_selected(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                               const BasePress& press, std::vector<at::Tensor> masks, const PrefillOptions& prefill) {
  const SelectedTokensPress selected(press, std::move(masks));
  PrefillOptions compressing = prefill;
  compressing.press = &selected;
  return model.prefill(context_ids, cache, compressing);  // leaves the cache as it was on failure
}

}  // namespace

KVzipResult kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                          const KVzipPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill,
                          const KVzipRunOptions& run) {
  if (const auto* kvgrad = dynamic_cast<const KVgradPress*>(&press))
    return kvgrad_prefill(model, context_ids, cache, *kvgrad, tokenizer, prefill);
  constexpr const char* op = "kvzip_prefill";
  const auto* restore_press = dynamic_cast<const RestoreKVPress*>(&press);
  KVzipResult result;
  result.memory.full_cache_bytes = check_prefill_args(op, model, context_ids, cache);
  TORCH_CHECK(run.query_chunk > 0, op, ": query_chunk must be > 0, got ", run.query_chunk);
  const LlamaConfig& c = model.config();
  const int64_t n = context_ids.size(1);
  PrefillOptions plain = prefill;
  plain.press = nullptr;
  if (press.compression_ratio() == 0.0) {  // kvpress skips the replay (and RestoreKV's restore pass)
    result.prefill = model.prefill(context_ids, cache, plain);
    result.scores = at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat);
    return result;
  }

  std::optional<RestoreStream> restore;
  if (restore_press) {
    const RestoreKVPress::Restore& artifacts = restore_press->restore();
    TORCH_CHECK(artifacts.embeddings.size(1) == c.hidden_size, op, ": the restore embeddings are [",
                artifacts.embeddings.size(0), ", ", artifacts.embeddings.size(1), "], the model's hidden size is ",
                c.hidden_size);
    model.check_adapter(artifacts.adapter, op);
    restore.emplace();
    restore->x = artifacts.embeddings.to(context_ids.device(), model.dtype()).unsqueeze(0);
    restore->adapter = &artifacts.adapter;
  }
  const std::vector<KVzipReplayChunk> chunks =
      framed_replay_chunks(op, press, context_ids, tokenizer, prefill.chat_template);
  result.scores = scoring_pass(model, context_ids, &press, chunks, {}, run.query_chunk, result.memory,
                               restore ? &*restore : nullptr);
  result.prefill = prefill_selected(model, context_ids, cache, press, press.keep_masks(result.scores), plain);
  if (restore) {
    // The restore tokens join every layer after the kept context tokens, never evicted; the next
    // token comes after them (kvpress's pipeline: position N + n).
    try {
      for (int64_t l = 0; l < c.num_layers; ++l) cache.append(l, restore->keys[l], restore->values[l]);
      cache.advance(restore->x.size(1));
    } catch (...) {
      cache = model.new_cache();  // it was empty
      throw;
    }
    result.restore_keys = at::cat(restore->keys, 0);
    result.restore_values = at::cat(restore->values, 0);
  }
  return result;
}

const KVzipPress* plain_kvzip(const BasePress* press) {
  if (dynamic_cast<const RestoreKVPress*>(press) != nullptr || dynamic_cast<const KVgradPress*>(press) != nullptr)
    return nullptr;  // they add to KVzip's passes (restore tokens, gradients)
  return dynamic_cast<const KVzipPress*>(press);
}

namespace {

void require_plain_kvzip(const char* op, const KVzipPress& press) {
  TORCH_CHECK(plain_kvzip(&press) != nullptr, op, ": ", press.name(),
              " adds to KVzip's passes (restore tokens, gradients); run kvzip_prefill");
}

}  // namespace

at::Tensor kvzip_scores(const LlamaModel& model, const at::Tensor& context_ids, const KVzipPress& press,
                        const Tokenizer& tokenizer, const ChatTemplate* chat_template, const KVzipRunOptions& run,
                        const CapturedPrefill* captured) {
  constexpr const char* op = "kvzip_scores";
  require_plain_kvzip(op, press);
  KVzipMemory memory;
  check_prefill_args(op, model, context_ids, model.new_cache());
  TORCH_CHECK(run.query_chunk > 0, op, ": query_chunk must be > 0, got ", run.query_chunk);
  TORCH_CHECK(captured == nullptr || (static_cast<int64_t>(captured->layers.size()) == model.config().num_layers &&
                                      captured->is_prefill_of(context_ids)),
              op, ": captured holds another prefill than context_ids (capture_prefill of them)");
  const std::vector<KVzipReplayChunk> chunks = framed_replay_chunks(op, press, context_ids, tokenizer, chat_template);
  return scoring_pass(model, context_ids, &press, chunks, {}, run.query_chunk, memory, nullptr, captured);
}

KVCache kvzip_compress_captured(const LlamaModel& model, const CapturedPrefill& captured, const KVzipPress& press,
                                const at::Tensor& scores, const PrefillOptions& options) {
  constexpr const char* op = "kvzip_compress_captured";
  require_plain_kvzip(op, press);
  const LlamaConfig& c = model.config();
  TORCH_CHECK(!captured.layers.empty() && captured.layers.front().keys.defined(), op,
              ": the capture is empty (LlamaModel::capture_prefill)");
  const int64_t n = captured.layers.front().keys.size(2);
  TORCH_CHECK(scores.defined() && scores.dim() == 3 && scores.size(0) == c.num_layers &&
                  scores.size(1) == c.num_kv_heads && scores.size(2) == n,
              op, ": scores must be [", c.num_layers, ", ", c.num_kv_heads, ", ", n,
              "] (kvzip_scores of the captured context), got ",
              scores.defined() ? c10::str(scores.sizes()) : std::string("undefined"));
  PrefillOptions compressing = options;
  if (press.compression_ratio() == 0.0) {  // kvzip_prefill's plain prefill
    compressing.press = nullptr;
    return model.compress_captured(captured, compressing);
  }
  const SelectedTokensPress selected(press, press.keep_masks(scores));
  compressing.press = &selected;
  return model.compress_captured(captured, compressing);
}

KVzipResult kvgrad_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                           const KVgradPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill,
                           const KVgradRunOptions& run) {
  constexpr const char* op = "kvgrad_prefill";
  KVzipResult result;
  result.memory.full_cache_bytes = check_prefill_args(op, model, context_ids, cache);
  const LlamaConfig& c = model.config();
  const int64_t n = context_ids.size(1);
  PrefillOptions plain = prefill;
  plain.press = nullptr;
  if (press.compression_ratio() == 0.0) {  // kvpress skips the replay
    result.prefill = model.prefill(context_ids, cache, plain);
    result.scores = at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat);
    return result;
  }
  // Gradients need tensors made outside inference mode, with autograd on.
  c10::InferenceMode no_inference(false);
  at::AutoGradMode grad(true);

  const std::vector<KVzipReplayChunk> chunks =
      framed_replay_chunks(op, press, context_ids, tokenizer, prefill.chat_template);
  at::Tensor scores = at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat);
  // A chunk's scores in one layer: KVzip's chunk scores of the repeat's queries over the layer's
  // keys ([1, Hkv, N + P, D]: the context's, then the repeat's), the rows scaled by ||dPhi/da_p||
  // (output_grad [1, P, hidden]) and the columns by ||v W_O||.
  const auto score_layer = [&](const KVzipReplayChunk& chunk, int64_t li, const at::Tensor& keys,
                               const at::Tensor& values, const at::Tensor& queries, const at::Tensor& output_grad) {
    at::NoGradGuard no_grad;
    const int64_t len = chunk.end - chunk.start, sink = std::min(press.n_sink(), chunk.start);
    const at::Tensor gradient_norm = output_grad.to(at::kFloat).norm(2, {-1});  // [1, P]
    const at::Tensor value_norm = KVzipPress::value_output_norms(values.narrow(2, chunk.start, len), model.o_proj(li));
    scores[li]
        .narrow(1, chunk.start, len)
        .copy_(press.chunk_scores(queries, keys.narrow(2, 0, sink), keys.narrow(2, chunk.start, len),
                                  keys.narrow(2, n, keys.size(2) - n), 0, gradient_norm, value_norm)[0]);
  };

  if (!run.recompute_context) {
    // The context's full cache, read by every chunk's forward and backward.
    KVCache full = model.new_cache();
    {
      at::NoGradGuard no_grad;
      model.prefill(context_ids, full, plain);
    }
    for (const KVzipReplayChunk& chunk : chunks) {
      const int64_t p = static_cast<int64_t>(chunk.repeat_ids.size());
      const at::Tensor repeat = at::tensor(chunk.repeat_ids, at::kLong).unsqueeze(0).to(context_ids.device());
      const RopeTables rope = model.rope(n, p);
      at::Tensor x = model.embed(repeat).detach().requires_grad_(true);
      std::vector<at::Tensor> outputs, queries, keys, values;  // per layer: a_l [1, P, hidden], q, [context | repeat]
      for (int64_t li = 0; li < c.num_layers; ++li) {
        const LlamaModel::LayerQKV qkv = model.layer_qkv(li, x, rope);
        keys.push_back(at::cat({full.keys(li), qkv.k}, 2));
        values.push_back(at::cat({full.values(li), qkv.v}, 2));
        at::Tensor a = model.project_output(li, model.layer_attention(qkv.q, keys.back(), values.back()));
        a.retain_grad();
        outputs.push_back(a);
        queries.push_back(qkv.q.detach());
        x = model.layer_mlp(li, x + a);
      }
      x.to(at::kFloat).square().sum().backward();  // Phi = sum_p ||h_p^L||^2
      for (int64_t li = 0; li < c.num_layers; ++li)
        score_layer(chunk, li, keys[li].detach(), values[li].detach(), queries[li], outputs[li].grad());
    }
  } else {
    at::Tensor context_embedding;
    {
      at::NoGradGuard no_grad;
      context_embedding = model.embed(context_ids);
    }
    const RopeTables context_rope = model.rope(0, n);
    // The context's keys/values in `layer`, recomputed from its embeddings (layers before it run again).
    const auto context_kv = [&](int64_t layer) {
      at::NoGradGuard no_grad;
      at::Tensor x = context_embedding;
      for (int64_t j = 0;; ++j) {
        LlamaModel::LayerQKV qkv = model.layer_qkv(j, x, context_rope);
        if (j == layer) return std::make_pair(qkv.k, qkv.v);
        x = model.layer_output(j, x, model.layer_attention(qkv.q, qkv.k, qkv.v));
      }
    };
    for (const KVzipReplayChunk& chunk : chunks) {
      const int64_t p = static_cast<int64_t>(chunk.repeat_ids.size());
      const at::Tensor repeat = at::tensor(chunk.repeat_ids, at::kLong).unsqueeze(0).to(context_ids.device());
      const RopeTables rope = model.rope(n, p);
      // Forward, the context alongside, one layer at a time: only the chunk's input to each layer stays.
      std::vector<at::Tensor> inputs;  // per layer [1, P, hidden]
      at::Tensor x;
      {
        at::NoGradGuard no_grad;
        at::Tensor xc = context_embedding;
        x = model.embed(repeat);
        for (int64_t li = 0; li < c.num_layers; ++li) {
          inputs.push_back(x);
          LlamaModel::LayerQKV context = model.layer_qkv(li, xc, context_rope);
          const LlamaModel::LayerQKV qkv = model.layer_qkv(li, x, rope);
          const at::Tensor keys = at::cat({context.k, qkv.k}, 2), values = at::cat({context.v, qkv.v}, 2);
          context.k.reset();  // the layer's keys/values live on in `keys` and `values` only
          context.v.reset();
          record_peak(result.memory, bytes_of({&keys, &values}), bytes_of({&xc}) + bytes_of(inputs),
                      bytes_of({&context.q, &qkv.q}), bytes_of({&scores}));
          x = model.layer_output(li, x, model.layer_attention(qkv.q, keys, values));
          if (li + 1 < c.num_layers)
            xc = model.layer_output(li, xc,
                                    model.layer_attention(context.q, keys.narrow(2, 0, n), values.narrow(2, 0, n)));
        }
      }
      // Backward from Phi = sum_p ||h_p^L||^2, one layer at a time, its context keys/values recomputed.
      at::Tensor upstream = (2 * x.to(at::kFloat)).to(x.scalar_type());  // dPhi/dh^L
      for (int64_t li = c.num_layers - 1; li >= 0; --li) {
        auto [context_keys, context_values] = context_kv(li);
        const at::Tensor xin = inputs[static_cast<size_t>(li)].detach().requires_grad_(true);
        const LlamaModel::LayerQKV qkv = model.layer_qkv(li, xin, rope);
        const at::Tensor keys = at::cat({context_keys, qkv.k}, 2), values = at::cat({context_values, qkv.v}, 2);
        context_keys.reset();
        context_values.reset();
        record_peak(result.memory, bytes_of({&keys, &values}),
                    bytes_of(inputs) + bytes_of({&context_embedding, &upstream}), bytes_of({&qkv.q}),
                    bytes_of({&scores}));
        at::Tensor a = model.project_output(li, model.layer_attention(qkv.q, keys, values));
        a.retain_grad();
        model.layer_mlp(li, xin + a).backward(upstream);
        score_layer(chunk, li, keys.detach(), values.detach(), qkv.q.detach(), a.grad());
        upstream = xin.grad();
        inputs[static_cast<size_t>(li)].reset();
      }
    }
  }
  result.scores = scores;
  at::NoGradGuard no_grad;
  // The compressing prefill holds one full layer at a time.
  result.prefill = prefill_selected(model, context_ids, cache, press, press.keep_masks(result.scores), plain);
  return result;
}

KVzipResult fast_kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                               const FastKVzipPress& press, const PrefillOptions& prefill) {
  constexpr const char* op = "fast_kvzip_prefill";
  KVzipResult result;
  result.memory.full_cache_bytes = check_prefill_args(op, model, context_ids, cache);
  const int64_t num_layers = model.config().num_layers;
  const ContextScorer gate = [&](int64_t layer, const LlamaModel::LayerQKV& context) {
    LayerInputs in;
    in.keys = context.k;
    in.values = context.v;
    in.hidden_states = context.h;
    in.layer_idx = layer;
    in.num_layers = num_layers;
    return press.layer_scores(in);
  };
  result.scores = scoring_pass(model, context_ids, nullptr, {}, gate, /*query_chunk=*/1, result.memory);
  PrefillOptions plain = prefill;
  plain.press = nullptr;
  result.prefill = prefill_selected(model, context_ids, cache, press, press.keep_masks(result.scores), plain);
  return result;
}

}  // namespace kvpress::llama
