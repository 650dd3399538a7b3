// KVCompose's second pass on the Llama runner (include/kvpress/llama/kvcompose.h).
#include "kvpress/llama/kvcompose.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <sstream>

#include "kvpress/cache.h"
#include "tensor_bytes.h"

namespace kvpress::llama {
namespace {

using detail::bytes_of;

// Keeps the largest footprint seen, with the breakdown of that moment.
void record_peak(KVComposeMemory& m, int64_t hidden, int64_t prompt_kv, int64_t attention, int64_t statistics) {
  const int64_t total = hidden + prompt_kv + attention + statistics;
  if (total <= m.peak_bytes) return;
  m.peak_bytes = total;
  m.hidden_bytes = hidden;
  m.prompt_kv_bytes = prompt_kv;
  m.attention_bytes = attention;
  m.statistics_bytes = statistics;
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// One task prompt through every layer, feeding the session; the cache is only read.
void second_pass(const LlamaModel& model, const at::Tensor& prompt, const KVCache& cache, int64_t context_len,
                 int64_t query_chunk, KVComposeSession& session, KVComposeMemory& memory) {
  const LlamaConfig& c = model.config();
  const int64_t batch = prompt.size(0), p = prompt.size(1), n = context_len;
  const int64_t hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_dim, groups = hq / hkv;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t elt = static_cast<int64_t>(c10::elementSize(model.dtype()));

  // [B, P, hidden]: the residual stream entering layer li. Chunk rows are overwritten with the
  // layer's output as soon as their chunk is done: a chunk reads only its own rows (earlier rows
  // live on as keys/values), so no second [B, P, hidden] buffer is needed.
  at::Tensor x = model.embed(prompt);
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const bool last = li + 1 == c.num_layers;  // its output feeds nothing the method reads
    const at::Tensor context_keys = cache.keys(li), context_values = cache.values(li);  // [B, Hkv, N, D] views
    // The prompt's keys/values of this layer only, filled chunk by chunk (causal: a chunk needs
    // the earlier chunks' keys).
    at::Tensor prompt_keys = at::empty({batch, hkv, p, d}, x.options());
    at::Tensor prompt_values = at::empty({batch, hkv, p, d}, x.options());
    for (int64_t c0 = 0; c0 < p; c0 += query_chunk) {
      const int64_t rows = std::min(query_chunk, p - c0), seen = c0 + rows;
      const at::Tensor x_chunk = x.narrow(1, c0, rows);
      LlamaModel::LayerQKV qkv = model.layer_qkv(li, x_chunk, model.rope(n + c0, rows));
      prompt_keys.narrow(2, c0, rows).copy_(qkv.k);
      prompt_values.narrow(2, c0, rows).copy_(qkv.v);
      qkv.k.reset();
      qkv.v.reset();
      // Scores of the chunk's queries over [context | prompt keys 0 .. seen), GQA rows folded.
      const at::Tensor qg = qkv.q.reshape({batch, hkv, groups * rows, d});
      // In place from here on: at most the scores and the probabilities exist at once.
      at::Tensor scores = at::cat({at::matmul(qg, context_keys.transpose(2, 3)),
                                   at::matmul(qg, prompt_keys.narrow(2, 0, seen).transpose(2, 3))},
                                  -1);  // [B, Hkv, G * rows, N + seen]
      scores.mul_(scaling);
      scores = scores.view({batch, hkv, groups, rows, n + seen});
      // Prompt query c0 + r sees prompt keys <= c0 + r, i.e. columns <= N + c0 + r.
      const at::Tensor row = at::arange(rows, at::kLong).unsqueeze(1) + (n + c0);
      const at::Tensor col = at::arange(n + seen, at::kLong).unsqueeze(0);
      scores.masked_fill_(col > row, -std::numeric_limits<double>::infinity());
      const at::Tensor probs = at::softmax(scores, -1, at::kFloat);  // float32
      at::Tensor weights = probs.to(qkv.q.scalar_type());            // eager attention's dtype
      const int64_t hidden_now = bytes_of({&x});
      const int64_t kv_now = bytes_of({&prompt_keys, &prompt_values, &qkv.q});
      record_peak(memory, hidden_now, kv_now,
                  bytes_of({&scores, &probs}) + (weights.is_same(probs) ? 0 : static_cast<int64_t>(weights.nbytes())),
                  session.statistics_bytes());
      scores.reset();
      session.observe(li, weights.view({batch, hq, rows, n + seen}));
      if (last) continue;
      const at::Tensor w = weights.view({batch, hkv, groups * rows, n + seen});
      const at::Tensor attn = at::matmul(w.narrow(-1, 0, n), context_values) +
                              at::matmul(w.narrow(-1, n, seen), prompt_values.narrow(2, 0, seen));
      weights.reset();
      const at::Tensor attn_out = attn.view({batch, hq, rows, d}).transpose(1, 2).reshape({batch, rows, hq * d});
      // layer_output holds about three [B, rows, intermediate] activations of the MLP.
      const int64_t mlp = 3 * batch * rows * c.intermediate_size * elt;
      record_peak(memory, hidden_now, kv_now, bytes_of({&attn, &attn_out}) + mlp, session.statistics_bytes());
      x.narrow(1, c0, rows).copy_(model.layer_output(li, x_chunk, attn_out));
    }
  }
}

}  // namespace

KVComposeResult kvcompose_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                                  const KVComposePress& press, const KVComposeRunOptions& run,
                                  const PrefillOptions& prefill) {
  constexpr const char* op = "kvcompose_prefill";
  const LlamaConfig& c = model.config();
  TORCH_CHECK(context_ids.dim() == 2 && context_ids.size(0) > 0 && context_ids.size(1) > 0 &&
                  context_ids.scalar_type() == at::kLong,
              op, ": context_ids must be a non-empty int64 [batch, n] tensor, got ", shape_str(context_ids), " ",
              context_ids.scalar_type());
  TORCH_CHECK(run.query_chunk > 0, op, ": query_chunk must be > 0, got ", run.query_chunk);
  for (size_t i = 0; i < run.task_prompts.size(); ++i) {
    const at::Tensor& t = run.task_prompts[i];
    TORCH_CHECK(t.defined() && t.dim() == 2 && t.size(0) == context_ids.size(0) && t.size(1) > 0 &&
                    t.scalar_type() == at::kLong,
                op, ": task_prompts[", i, "] must be a non-empty int64 [", context_ids.size(0), ", P] tensor, got ",
                t.defined() ? shape_str(t) : std::string("undefined"));
  }
  const int64_t batch = context_ids.size(0), n = context_ids.size(1), hkv = c.num_kv_heads;
  TORCH_CHECK(
      press.options().structured || batch == 1 || prefill.ragged_layout == PrefillOptions::RaggedLayout::kPacked, op,
      ": batch must be 1 for the unstructured variant with the masked layout, got ", batch);

  // A failure part-way leaves the cache as it was (see LlamaModel::run).
  KVCache before = cache;
  try {
    // 1. The context's prefill, uncompressed (kvpress's hook skips the square attention).
    PrefillOptions plain;
    static_cast<ForwardOptions&>(plain) = static_cast<const ForwardOptions&>(prefill);
    plain.press = nullptr;  // the forward's settings, not its press
    plain.press_state = nullptr;
    KVComposeResult result;
    result.prefill = model.prefill(context_ids, cache, plain);
    result.prefill.kept_indices.clear();
    result.prefill.keep_masks.clear();

    // 2. The second pass.
    KVComposeSession session = press.start_session(c.num_layers, c.num_heads, hkv, n, cache.keys(0).device());
    const std::vector<at::Tensor> prompts =
        run.task_prompts.empty() ? std::vector<at::Tensor>{context_ids} : run.task_prompts;
    for (const at::Tensor& prompt : prompts)
      second_pass(model, prompt, cache, n, run.query_chunk, session, result.memory);
    for (int64_t li = 0; li < c.num_layers; ++li) session.observe_values(li, cache.values(li));

    // kvpress's figure for the same pass: every layer's prompt K/V stay in the cache until compression,
    // and each layer's eager attention materialises [B, Hq, P, N + P] scores and probabilities.
    const int64_t elt = static_cast<int64_t>(c10::elementSize(model.dtype()));
    int64_t kvpress_peak = 0;
    for (const at::Tensor& prompt : prompts) {
      const int64_t p = prompt.size(1);
      kvpress_peak = std::max(kvpress_peak, c.num_layers * 2 * batch * hkv * p * c.head_dim * elt +
                                                2 * batch * c.num_heads * p * (n + p) * elt);
    }
    result.memory.kvpress_bytes = kvpress_peak + session.statistics_bytes();

    // 3. Budgets, then every layer of the cache.
    result.budgets = session.budgets();
    result.scores = session.scores();
    for (int64_t li = 0; li < c.num_layers; ++li) {
      LayerInputs in;
      in.keys = cache.keys(li);
      in.values = cache.values(li);
      in.num_heads = c.num_heads;
      in.layer_idx = li;
      in.num_layers = c.num_layers;
      if (press.options().structured) {
        const KV kv = session.compress(li, in.keys, in.values);
        cache.replace(li, kv.keys, kv.values);
        result.prefill.kept_indices.push_back(kv.kept_indices);
        if (prefill.on_compress) prefill.on_compress(in, kv);
      } else {
        const RaggedKV kv = session.compress_ragged(li, in.keys, in.values);
        if (prefill.ragged_layout == PrefillOptions::RaggedLayout::kPacked) {
          cache.replace_ragged(li, HeadRaggedLayer::from_ragged(kv, n));
        } else {
          cache.set_keep_mask(li, kv.keep_mask);
        }
        result.prefill.keep_masks.push_back(kv.keep_mask);
        if (prefill.on_compress_ragged) prefill.on_compress_ragged(in, kv);
      }
    }
    return result;
  } catch (...) {
    cache = std::move(before);
    throw;
  }
}

}  // namespace kvpress::llama
