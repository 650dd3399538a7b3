// The KVzip family's second pass over a model view (kvpress/model_view.h): KVzipPress's replay,
// RestoreKVPress's restore tokens riding it, FastKVzipPress's global selection. KVgradPress's pass is
// in kvgrad_pass.cpp.
#include "presses/kvzip_pass.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "checks.h"
#include "kvpress/presses/fastkvzip_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/presses/restorekv_press.h"
#include "presses/pass_memory.h"

namespace kvpress {
namespace detail {

void record_peak(KVzipMemory& m, int64_t layer_kv, int64_t activations, int64_t attention, int64_t scores) {
  const int64_t total = layer_kv + activations + attention + scores;
  if (total <= m.peak_bytes) return;
  m.peak_bytes = total;
  m.layer_kv_bytes = layer_kv;
  m.activation_bytes = activations;
  m.attention_bytes = attention;
  m.scores_bytes = scores;
}

int64_t check_kvzip_context(const SecondPassRun& run) {
  const at::Tensor& ids = run.context_ids();
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == 1 && ids.size(1) > 0 && ids.scalar_type() == at::kLong, run.op(),
              ": context_ids must be a non-empty int64 [1, n] tensor (batch 1, as kvpress), got ",
              checks::shape_str(ids), " ", ids.scalar_type());
  const ModelShape m = run.model().shape();
  const int64_t elt = static_cast<int64_t>(c10::elementSize(m.dtype));
  return m.num_layers * 2 * m.num_kv_heads * ids.size(1) * m.head_dim * elt;
}

std::vector<KVzipReplayChunk> framed_replay_chunks(const KVzipPress& press, const SecondPassRun& run) {
  const at::Tensor ids_cpu = run.context_ids().cpu().contiguous();
  const std::vector<int64_t> ids(ids_cpu.data_ptr<int64_t>(), ids_cpu.data_ptr<int64_t>() + ids_cpu.numel());
  std::string prefix_text, suffix_text = KVzipPress::kRepeatSuffix;
  if (const std::optional<UserTurnFrame> frame = run.user_turn_frame()) {
    prefix_text = frame->before;
    suffix_text = frame->after;
  }
  const int64_t prefix_length = prefix_text.empty() ? 0 : static_cast<int64_t>(run.encode(prefix_text).size());
  TORCH_CHECK(prefix_length < static_cast<int64_t>(ids.size()), run.op(), ": the context has ", ids.size(),
              " tokens, no more than the chat template's ", prefix_length, " before the user's message");
  return press.replay_chunks(ids, run.encode(KVzipPress::kFirstRepeatPrompt), run.encode(KVzipPress::kNextRepeatPrompt),
                             run.encode(suffix_text), prefix_length);
}

std::vector<at::Tensor> keep_masks_over_ranks(const ModelView& model, const at::Tensor& scores,
                                              const KeepMasksFn& keep_masks) {
  const std::shared_ptr<const HeadExchange> exchange = model.head_exchange();
  if (!exchange) return keep_masks(scores);
  std::vector<at::Tensor> masks = keep_masks(exchange->gather_heads(scores.contiguous()));  // every rank's heads
  const int64_t first = model.kv_head_range().first, heads = scores.size(1);
  for (at::Tensor& mask : masks) mask = mask.narrow(1, first, heads).contiguous();
  return masks;
}

void prefill_selected(SecondPassRun& run, const BasePress& press, std::vector<at::Tensor> masks) {
  const std::unique_ptr<BasePress> selected = selected_tokens_press(press, std::move(masks));
  run.prefill(selected.get());
}

}  // namespace detail

namespace {

using detail::bytes_of;
using detail::record_peak;

// RestoreKV's restore tokens riding the scoring pass: they attend to each layer's full context with
// the adapter active, and leave their keys/values for the compressed cache.
struct RestoreStream {
  at::Tensor x;  // [1, n, hidden]: their residual stream entering the current layer
  const LoraAdapter* adapter = nullptr;
  std::vector<at::Tensor> keys, values;  // per layer [1, Hkv, n, D]
};

// One layer of the replay: each chunk's queries, in blocks of query_chunk rows, score the chunk's
// context tokens (a running maximum into `scores`) and, but in the last layer, move its stream on.
struct ReplayLayer {
  const KVzipPress& press;
  const ModelView& model;
  int64_t layer, n, num_heads;  // n: context tokens; num_heads: Hq
  at::Tensor keys, values;      // [1, Hkv, N + longest, D]: the context's at [0, N), the chunk's after
  at::Tensor scores;            // [Hkv, N] float32 view of the layer's scores
  bool last;                    // its outputs feed nothing KVzip reads

  // stream [1, P, hidden]: the chunk's residual stream entering the layer, overwritten by its output.
  // record(layer_kv_bytes, attention_bytes) at each block.
  template <typename Record>
  void score_chunk(const KVzipReplayChunk& chunk, at::Tensor& stream, int64_t query_chunk, Record&& record) {
    const int64_t p = stream.size(1), len = chunk.end - chunk.start;
    const int64_t sink = std::min(press.n_sink(), chunk.start);
    const at::Tensor context_keys = keys.narrow(2, 0, n);
    // KVzip+: ||W_o v|| of the chunk's values, per query head.
    const at::Tensor column_scale =
        press.kvzip_plus_normalization()
            ? KVzipPress::value_output_norms(values.narrow(2, chunk.start, len), model.o_proj(layer))
            : at::Tensor();
    at::Tensor chunk_max = scores.narrow(1, chunk.start, len);  // [Hkv, len] view
    for (int64_t r0 = 0; r0 < p; r0 += query_chunk) {
      const int64_t rows = std::min(query_chunk, p - r0), seen = r0 + rows;
      const at::Tensor x_rows = stream.narrow(1, r0, rows);
      LayerQKV qkv = model.layer_qkv(layer, x_rows, model.rope(n + r0, rows));
      keys.narrow(2, n + r0, rows).copy_(qkv.k);
      values.narrow(2, n + r0, rows).copy_(qkv.v);
      const at::Tensor row_scale =
          column_scale.defined() ? at::reciprocal(qkv.h.to(at::kFloat).norm(2, {-1})) : at::Tensor();
      const at::Tensor block =
          press.chunk_scores(qkv.q, context_keys.narrow(2, 0, sink), context_keys.narrow(2, chunk.start, len),
                             keys.narrow(2, n, seen), r0, row_scale, column_scale);
      chunk_max.copy_(at::maximum(chunk_max, block[0]));
      // What chunk_scores held: float32 logits and weights over sink + chunk + seen keys.
      const int64_t block_bytes = 2 * 4 * num_heads * rows * (sink + len + seen);
      record(bytes_of({&keys, &values, &qkv.q, &column_scale}), block_bytes);
      if (last) continue;
      const at::Tensor attn = model.layer_attention(qkv.q, keys.narrow(2, 0, n + seen), values.narrow(2, 0, n + seen));
      stream.narrow(1, r0, rows).copy_(model.layer_output(layer, x_rows, attn));
    }
  }
};

// The scores of every context token: the context and every replay chunk (none for FastKVzip) go
// through the model together, layer by layer, so only one layer's keys/values exist at a time. A
// layer's scores come from context_scorer (when given) and the replay blocks (KVzip's chunk scores,
// a running maximum). With `restore`, its tokens run through each layer right after the context.
// The context's keys/values come from run.captured_layer() when it has them.
at::Tensor scoring_pass(const SecondPassRun& run, const KVzipPress* press, const std::vector<KVzipReplayChunk>& chunks,
                        const detail::ContextScorer& context_scorer, int64_t query_chunk, KVzipMemory& memory,
                        RestoreStream* restore = nullptr) {
  const ModelView& model = run.model();
  const ModelShape c = model.shape();
  const at::Tensor& context_ids = run.context_ids();
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
    if (auto [captured_keys, captured_values] = run.captured_layer(li); captured_keys.defined()) {
      // The context's keys/values as its plain prefill computed them.
      layer_keys.narrow(2, 0, n).copy_(captured_keys);
      layer_values.narrow(2, 0, n).copy_(captured_values);
    } else {
      LayerQKV qkv = model.layer_qkv(li, x, context_rope);
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
      LayerQKV qkv = model.layer_qkv(li, restore->x, restore_rope, restore->adapter);
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
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      TORCH_CHECK(press != nullptr, "scoring_pass: replay chunks need the KVzipPress that scores them");
      ReplayLayer replay{*press, model, li, n, c.num_heads, layer_keys, layer_values, scores[li], last};
      replay.score_chunk(chunks[ci], streams[ci], query_chunk, [&](int64_t layer_kv, int64_t attention) {
        record_peak(memory, layer_kv, activation_bytes(), attention, bytes_of({&scores}));
      });
    }
  }
  return scores;
}

void check_query_chunk(const SecondPassRun& run, const KVzipRunOptions& options) {
  TORCH_CHECK(options.query_chunk > 0, run.op(), ": query_chunk must be > 0, got ", options.query_chunk);
}

// KVzip's prefill, with RestoreKV's restore tokens when `artifacts` is given.
KVzipPassResult replay_pass(const KVzipPress& press, SecondPassRun& run, const KVzipRunOptions& options,
                            const RestoreKVPress* restore_press) {
  KVzipPassResult result;
  result.memory.full_cache_bytes = detail::check_kvzip_context(run);
  check_query_chunk(run, options);
  const ModelView& model = run.model();
  const ModelShape c = model.shape();
  const int64_t n = run.context_ids().size(1);
  if (press.compression_ratio() == 0.0) {  // kvpress skips the replay (and RestoreKV's restore pass)
    run.prefill(nullptr);
    result.scores = at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat);
    return result;
  }

  std::optional<RestoreStream> restore;
  if (restore_press) {
    const RestoreKVPress::Restore& artifacts = restore_press->restore();
    TORCH_CHECK(artifacts.embeddings.size(1) == c.hidden_size, run.op(), ": the restore embeddings are [",
                artifacts.embeddings.size(0), ", ", artifacts.embeddings.size(1), "], the model's hidden size is ",
                c.hidden_size);
    model.check_adapter(artifacts.adapter, run.op());
    restore.emplace();
    restore->x = artifacts.embeddings.to(run.context_ids().device(), c.dtype).unsqueeze(0);
    restore->adapter = &artifacts.adapter;
  }
  const std::vector<KVzipReplayChunk> chunks = detail::framed_replay_chunks(press, run);
  result.scores =
      scoring_pass(run, &press, chunks, {}, options.query_chunk, result.memory, restore ? &*restore : nullptr);
  detail::prefill_selected(run, press,
                           detail::keep_masks_over_ranks(run.model(), result.scores, [&](const at::Tensor& scores) {
                             return press.keep_masks(scores);
                           }));
  if (restore) {
    // The restore tokens join every layer after the kept context tokens, never evicted; the next
    // token comes after them (kvpress's pipeline: position N + n).
    run.append(restore->keys, restore->values);
    result.restore_keys = at::cat(restore->keys, 0);
    result.restore_values = at::cat(restore->values, 0);
  }
  return result;
}

}  // namespace

at::Tensor detail::context_scores(const SecondPassRun& run, const ContextScorer& scorer, KVzipMemory& memory) {
  return scoring_pass(run, nullptr, {}, scorer, /*query_chunk=*/1, memory);
}

void KVzipPress::second_pass(SecondPassRun& run) const { run_second_pass(run, KVzipRunOptions{}); }

KVzipPassResult KVzipPress::run_second_pass(SecondPassRun& run, const KVzipRunOptions& options) const {
  return replay_pass(*this, run, options, nullptr);
}

KVzipPassResult RestoreKVPress::run_second_pass(SecondPassRun& run, const KVzipRunOptions& options) const {
  return replay_pass(*this, run, options, this);
}

at::Tensor KVzipPress::replay_scores(const SecondPassRun& run, const KVzipRunOptions& options) const {
  TORCH_CHECK(plain(this) != nullptr, run.op(), ": ", name(),
              " adds to KVzip's passes (restore tokens, gradients); run its whole prefill");
  KVzipMemory memory;
  detail::check_kvzip_context(run);
  check_query_chunk(run, options);
  return scoring_pass(run, this, detail::framed_replay_chunks(*this, run), {}, options.query_chunk, memory);
}

const KVzipPress* KVzipPress::of(const BasePress* press) { return dynamic_cast<const KVzipPress*>(press); }

const KVzipPress* KVzipPress::plain(const BasePress* press) {
  if (dynamic_cast<const RestoreKVPress*>(press) != nullptr || dynamic_cast<const KVgradPress*>(press) != nullptr)
    return nullptr;  // they add to KVzip's passes (restore tokens, gradients)
  return of(press);
}

void FastKVzipPress::second_pass(SecondPassRun& run) const { run_second_pass(run); }

KVzipPassResult FastKVzipPress::run_second_pass(SecondPassRun& run) const {
  KVzipPassResult result;
  result.memory.full_cache_bytes = detail::check_kvzip_context(run);
  const int64_t num_layers = run.model().shape().num_layers;
  const detail::ContextScorer gate = [&](int64_t layer, const LayerQKV& context) {
    LayerInputs in;
    in.keys = context.k;
    in.values = context.v;
    in.hidden_states = context.h;
    in.layer_idx = layer;
    in.num_layers = num_layers;
    in.kv_head_range = run.model().kv_head_range();  // the gates of a shard's heads
    return layer_scores(in);
  };
  result.scores = detail::context_scores(run, gate, result.memory);
  detail::prefill_selected(run, *this,
                           detail::keep_masks_over_ranks(run.model(), result.scores,
                                                         [&](const at::Tensor& scores) { return keep_masks(scores); }));
  return result;
}

}  // namespace kvpress
