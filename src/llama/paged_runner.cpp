// LlamaModel's paged mode: packed prefill with compress-while-storing, and batched decoding steps
// over a PagedKVCache (kvpress/paged.h). The per-layer operations are those of run() (model.cpp).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "greedy.h"
#include "kvpress/llama/model.h"
#include "kvpress/registry.h"

namespace kvpress::llama {
namespace {

// The press states prefill_paged starts (PagedPrefillOptions::press_states), checked, and their
// snapshots, which a failure restores.
std::vector<std::unique_ptr<PressSequenceState>> started_states(const PagedPrefillOptions& options, size_t prompts,
                                                                const char* op) {
  const std::vector<PressSequenceState*>& states = options.press_states;
  if (options.press != nullptr && options.press->decoding_role().records_prefill)
    TORCH_CHECK(states.size() == prompts, op, ": ", options.press->name(),
                " starts its decoding state at prefill: press_states must hold one state per prompt (", prompts,
                ", press->new_sequence_state()), got ", states.size());
  TORCH_CHECK(states.empty() || (options.press != nullptr && states.size() == prompts), op,
              ": press_states must be empty or hold one state per prompt (", prompts, ") of a press, got ",
              states.size(), options.press == nullptr ? " without a press" : "");
  std::vector<std::unique_ptr<PressSequenceState>> snapshots;
  for (PressSequenceState* state : states) {
    TORCH_CHECK(state != nullptr, op, ": press_states must not hold nullptr");
    snapshots.push_back(state->snapshot());
  }
  return snapshots;
}

// record_prefill() of `press` for sequence i's layer inputs (`in`, keys and values set).
void record_prefill_of(const BasePress& press, const LayerInputs& in, PressSequenceState& state, const char* op) {
  const at::Tensor mask = press.record_prefill(in, state);
  TORCH_CHECK(!mask.defined(), op, ": ", press.name(),
              " gives a per-head keep mask at prefill (it evicts per head), which a paged cache does not take");
}

}  // namespace

PagedKVCache LlamaModel::new_paged_cache(int64_t pages_per_layer, int64_t page_size, KVFormat kv_format) const {
  PagedCacheOptions o;
  o.num_layers = config_.num_layers;
  o.kv_heads = config_.num_kv_heads;
  o.head_dim = config_.head_dim;
  o.pages_per_layer = pages_per_layer;
  o.page_size = page_size;
  o.dtype = dtype_;
  o.device = embed_tokens_.device();
  o.kv_format = kv_format;
  return PagedKVCache(o);
}

void LlamaModel::check_paged_cache(const PagedKVCache& cache, const char* op) const {
  const PagedCacheOptions& o = cache.options();
  TORCH_CHECK(o.num_layers == config_.num_layers && o.kv_heads == config_.num_kv_heads &&
                  o.head_dim == config_.head_dim && o.dtype == dtype_,
              op, ": the cache must have ", config_.num_layers, " layers of ", config_.num_kv_heads, " KV heads x ",
              config_.head_dim, " in ", dtype_, " like the model (new_paged_cache()), got ", o.num_layers,
              " layers of ", o.kv_heads, " x ", o.head_dim, " in ", o.dtype);
}

void LlamaModel::check_token_ids(const std::vector<int64_t>& ids, const char* op) const {
  for (int64_t id : ids)
    TORCH_CHECK(id >= 0 && id < config_.vocab_size, op, ": token ids must be in [0, vocab_size (", config_.vocab_size,
                ")), got ", id);
}

at::Tensor LlamaModel::prefill_paged(const std::vector<std::vector<int64_t>>& prompts,
                                     const std::vector<SequenceId>& seqs, PagedKVCache& cache,
                                     const PagedPrefillOptions& options) const {
  constexpr const char* op = "LlamaModel::prefill_paged";
  TORCH_CHECK(!prompts.empty() && prompts.size() == seqs.size(), op,
              ": prompts and seqs must be non-empty and of one size, got ", prompts.size(), " prompts and ",
              seqs.size(), " sequences");
  check_paged_cache(cache, op);
  std::vector<int64_t> ids, positions, cu{0};
  for (size_t i = 0; i < prompts.size(); ++i) {
    TORCH_CHECK(!prompts[i].empty(), op, ": prompt ", i, " is empty");
    check_token_ids(prompts[i], op);
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      const std::vector<int64_t> len = cache.lengths(seqs[i], l);
      TORCH_CHECK(
          cache.next_position(seqs[i], l) == 0 && std::all_of(len.begin(), len.end(), [](int64_t n) { return n == 0; }),
          op, ": sequence ", seqs[i], " already holds tokens; prefill_paged starts new sequences");
    }
    ids.insert(ids.end(), prompts[i].begin(), prompts[i].end());
    for (int64_t p = 0; p < static_cast<int64_t>(prompts[i].size()); ++p) positions.push_back(p);
    cu.push_back(static_cast<int64_t>(ids.size()));
  }
  const BasePress* press = prefill_press_of(options.press);
  check_press_on_shard(press, op);
  TORCH_CHECK(press == nullptr || !press->needs_second_pass(), op, ": ", press->name(),
              " runs the model again over the context before compressing (use prefill())");
  const bool press_attentions = press && wants_attentions(options.press_attentions, ForwardOptions{}, press->name());
  const std::vector<std::unique_ptr<PressSequenceState>> states_before = started_states(options, prompts.size(), op);

  const auto batch = static_cast<int64_t>(prompts.size());
  const at::Tensor input_ids = detail::as_batch(ids);  // [1, T]
  const at::Tensor cu_seqlens = at::tensor(at::ArrayRef<int64_t>(cu), at::kLong);
  const RopeTables rope_tables = rope_at(positions);  // [T, D]: each prompt from position 0
  at::Tensor x = embed(input_ids);                    // [1, T, hidden]
  at::Tensor logits;  // computed inside the undo's reach: a failure there too leaves the sequences empty
  try {
    for (int64_t li = 0; li < config_.num_layers; ++li) {
      const Layer& w = layers_[static_cast<size_t>(li)];
      const at::Tensor h = rms_norm(x, w.input_norm);
      const LayerQKV qkv = project_qkv(li, h, rope_tables);  // q [1, Hq, T, D], k/v [1, Hkv, T, D]
      // Causal attention within each prompt (block-diagonal over the packed tokens).
      std::vector<at::Tensor> attn(static_cast<size_t>(batch)), weights(static_cast<size_t>(batch));
      for (int64_t i = 0; i < batch; ++i) {
        const int64_t start = cu[static_cast<size_t>(i)], len = cu[static_cast<size_t>(i + 1)] - start;
        attn[static_cast<size_t>(i)] =
            dense_attention(qkv.q.narrow(2, start, len), qkv.k.narrow(2, start, len), qkv.v.narrow(2, start, len),
                            at::Tensor(), press_attentions ? &weights[static_cast<size_t>(i)] : nullptr);
      }
      // Sequence i's press inputs are prefill()'s for that prompt alone; store() adds its K/V.
      const SequenceInputsFn inputs = [&](int64_t i, LayerInputs& in) {
        const int64_t start = cu[static_cast<size_t>(i)], len = cu[static_cast<size_t>(i + 1)] - start;
        const RopeTables rows{rope_tables.cos.narrow(0, start, len), rope_tables.sin.narrow(0, start, len)};
        in =
            hook_inputs(li, input_ids.narrow(1, start, len), h.narrow(1, start, len), rows, at::Tensor(), at::Tensor());
        in.queries = qkv.q.narrow(2, start, len);  // computed anyway, as prefill() gives them
        if (press_attentions) in.attentions = weights[static_cast<size_t>(i)];
      };
      for (size_t i = 0; i < options.press_states.size(); ++i) {  // as forward() records a prefill
        LayerInputs in;
        inputs(static_cast<int64_t>(i), in);
        in.keys = qkv.k.narrow(2, cu[i], cu[i + 1] - cu[i]);
        in.values = qkv.v.narrow(2, cu[i], cu[i + 1] - cu[i]);
        record_prefill_of(*options.press, in, *options.press_states[i], op);
      }
      // [1, Hkv, T, D] -> [T, Hkv, D], the varlen layout.
      cache.store(li, seqs, qkv.k[0].transpose(0, 1), qkv.v[0].transpose(0, 1), cu_seqlens, press, inputs);
      x = mlp_residual(li, x + project_output(li, at::cat(attn, 1)), nullptr);
    }
    const at::Tensor last = cu_seqlens.narrow(0, 1, batch) - 1;                  // each prompt's last token
    logits = at::linear(rms_norm(x.index_select(1, last), norm_), lm_head_)[0];  // [B, vocab]
  } catch (...) {
    for (SequenceId s : seqs)
      if (cache.contains(s)) cache.reset_sequence(s);
    for (size_t i = 0; i < states_before.size(); ++i) options.press_states[i]->restore(*states_before[i]);
    throw;
  }
  return logits;
}

std::string LlamaModel::why_not_paged_decoding(const BasePress* press) {
  if (press == nullptr) return "";
  const DecodingRole role = press->decoding_role();
  if (!role.compresses) return "";
  if (role.evicts_per_head)
    return press->name() + " evicts per head while generating on the dense runner only (generate_greedy)";
  if (role.scorer && needs_attentions(role.scorer->name()))
    return press->name() + "'s scorer " + role.scorer->name() +
           " needs attention weights, which paged attention does not compute";
  if (role.reads_cache_every_step)
    return press->name() +
           " reads the layer's whole cache on every step, which the paged decode gives only when it "
           "compresses";
  return "";
}

at::Tensor LlamaModel::decode_paged(const std::vector<SequenceId>& seqs, const std::vector<int64_t>& tokens,
                                    PagedKVCache& cache, const PagedDecodeOptions& options) const {
  constexpr const char* op = "LlamaModel::decode_paged";
  TORCH_CHECK(!seqs.empty() && seqs.size() == tokens.size(), op,
              ": seqs and tokens must be non-empty and of one size, got ", seqs.size(), " sequences and ",
              tokens.size(), " tokens");
  check_paged_cache(cache, op);
  check_token_ids(tokens, op);
  const BasePress* decoding = options.press && options.press->decoding_role().compresses ? options.press : nullptr;
  check_press_on_shard(decoding, op);
  if (decoding) {
    const std::string why = why_not_paged_decoding(decoding);
    TORCH_CHECK(why.empty(), op, ": ", why);
    TORCH_CHECK(options.press_states.size() == seqs.size(), op, ": ", decoding->name(),
                " needs one press state per sequence (", seqs.size(), "), got ", options.press_states.size());
    for (const PressSequenceState* state : options.press_states)
      TORCH_CHECK(state != nullptr, op, ": press_states must not hold nullptr");
  }
  const auto batch = static_cast<int64_t>(seqs.size());
  // Every page the step takes, in every layer, before anything is written.
  for (int64_t li = 0; li < config_.num_layers; ++li) {
    const int64_t needed = cache.pages_to_append(li, seqs, 1), free = cache.free_pages(li);
    TORCH_CHECK(needed <= free, op, ": out of pages at layer ", li, ": the step needs ", needed, " new pages, ", free,
                " are free; nothing was written");
  }
  std::vector<int64_t> positions;
  for (SequenceId s : seqs) positions.push_back(cache.next_position(s, 0));
  std::vector<std::unique_ptr<PressSequenceState>> saved_states;
  if (decoding)
    for (const PressSequenceState* state : options.press_states) saved_states.push_back(state->snapshot());

  const double scaling = 1.0 / std::sqrt(static_cast<double>(config_.head_dim));
  const at::Tensor input_ids = at::tensor(at::ArrayRef<int64_t>(tokens), at::kLong).unsqueeze(0);  // [1, B]
  // The B tokens ride along the sequence axis of one [1, B] forward, each with its own position.
  const RopeTables rope_tables = rope_at(positions);  // [B, D]
  at::Tensor x = embed(input_ids);                    // [1, B, hidden]
  std::vector<PagedKVCache::Compaction> compactions;  // applied once every layer ran
  int64_t appended_layers = 0;
  at::Tensor logits;
  try {
    for (int64_t li = 0; li < config_.num_layers; ++li) {
      const Layer& w = layers_[static_cast<size_t>(li)];
      const at::Tensor h = rms_norm(x, w.input_norm);
      const LayerQKV qkv = project_qkv(li, h, rope_tables);  // q [1, Hq, B, D], k/v [1, Hkv, B, D]
      const auto per_sequence = [](const at::Tensor& t) { return t[0].transpose(0, 1).unsqueeze(2).contiguous(); };
      cache.append(li, seqs, per_sequence(qkv.k), per_sequence(qkv.v));  // [B, Hkv, 1, D]
      ++appended_layers;
      const at::Tensor attn = cache.attention(li, seqs, per_sequence(qkv.q), scaling);  // [B, Hq, 1, D]
      if (decoding) {
        for (int64_t i = 0; i < batch; ++i) {
          const auto b = static_cast<size_t>(i);
          const RopeTables rows{rope_tables.cos.narrow(0, i, 1), rope_tables.sin.narrow(0, i, 1)};
          LayerInputs in = hook_inputs(li, input_ids.narrow(1, i, 1), h.narrow(1, i, 1), rows, qkv.k.narrow(2, i, 1),
                                       qkv.v.narrow(2, i, 1));
          const int64_t tokens_seen = positions[b] + 1;
          PressSequenceState& state = *options.press_states[b];
          // The dense copy a compression scores is made only on the steps that read it.
          if (decoding->decoding_reads_cache(li, 1, tokens_seen, state))
            std::tie(in.keys, in.values) = cache.dense(seqs[b], li);
          const DecodingUpdate update = decoding->decoding_update(in, tokens_seen, state);
          // why_not_paged_decoding refuses kEvict; kKeepEveryLayer comes from the last layer, for all.
          const bool every_layer = update.kind == DecodingUpdate::Kind::kKeepEveryLayer;
          if (update.kind != DecodingUpdate::Kind::kReplace && !every_layer) continue;
          at::Tensor keep = at::zeros({config_.num_kv_heads, in.keys.size(2)}, at::kBool);
          keep.scatter_(1, (every_layer ? update.keep : update.replacement.kept_indices)[0].to(at::kCPU), true);
          for (int64_t layer = every_layer ? 0 : li; layer <= li; ++layer)
            compactions.push_back({layer, seqs[b], keep});
        }
      }
      x = mlp_residual(
          li, x + project_output(li, attn.transpose(1, 2).reshape({1, batch, config_.num_heads * config_.head_dim})),
          nullptr);
    }
    logits = at::linear(rms_norm(x, norm_), lm_head_)[0];  // [B, vocab]
    // Last, as one mutation: every compaction staged before any is applied, so a failure there still
    // finds the appends to undo.
    cache.compact(compactions);
  } catch (...) {
    for (int64_t li = 0; li < appended_layers; ++li) cache.remove_last(li, seqs, 1);
    for (size_t i = 0; i < saved_states.size(); ++i) options.press_states[i]->restore(*saved_states[i]);
    throw;
  }
  return logits;
}

}  // namespace kvpress::llama
