// KVComposePress's second pass over a model view (kvpress/presses/kvcompose_press.h): the context's
// prefill, the task prompts layer by layer, global budgets and the compression of every layer.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"
#include "kvpress/model_view.h"
#include "kvpress/presses/kvcompose_press.h"
#include "presses/pass_memory.h"

namespace kvpress {
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

// One task prompt [B, P] through every layer, feeding the session; the cache is only read.
void prompt_pass(const SecondPassRun& run, const at::Tensor& prompt, int64_t query_chunk, KVComposeSession& session,
                 KVComposeMemory& memory) {
  const ModelView& model = run.model();
  const ModelShape c = model.shape();
  const int64_t batch = prompt.size(0), p = prompt.size(1), n = run.context_ids().size(1);
  const int64_t hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_dim, groups = hq / hkv;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t elt = static_cast<int64_t>(c10::elementSize(c.dtype));

  // [B, P, hidden]: the residual stream entering layer li. Chunk rows are overwritten with the
  // layer's output as soon as their chunk is done: a chunk reads only its own rows (earlier rows
  // live on as keys/values), so no second [B, P, hidden] buffer is needed.
  at::Tensor x = model.embed(prompt);
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const bool last = li + 1 == c.num_layers;  // its output feeds nothing the method reads
    const at::Tensor context_keys = run.cached_keys(li), context_values = run.cached_values(li);  // [B, Hkv, N, D]
    // The prompt's keys/values of this layer only, filled chunk by chunk (causal: a chunk needs
    // the earlier chunks' keys).
    at::Tensor prompt_keys = at::empty({batch, hkv, p, d}, x.options());
    at::Tensor prompt_values = at::empty({batch, hkv, p, d}, x.options());
    for (int64_t c0 = 0; c0 < p; c0 += query_chunk) {
      const int64_t rows = std::min(query_chunk, p - c0), seen = c0 + rows;
      const at::Tensor x_chunk = x.narrow(1, c0, rows);
      LayerQKV qkv = model.layer_qkv(li, x_chunk, model.rope(n + c0, rows));
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

void check_run(const SecondPassRun& run, const KVComposeRunOptions& options, bool structured) {
  const at::Tensor& ids = run.context_ids();
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) > 0 && ids.size(1) > 0 && ids.scalar_type() == at::kLong, run.op(),
              ": context_ids must be a non-empty int64 [batch, n] tensor, got ", checks::shape_str(ids), " ",
              ids.scalar_type());
  TORCH_CHECK(options.query_chunk > 0, run.op(), ": query_chunk must be > 0, got ", options.query_chunk);
  for (size_t i = 0; i < options.task_prompts.size(); ++i) {
    const at::Tensor& t = options.task_prompts[i];
    TORCH_CHECK(
        t.defined() && t.dim() == 2 && t.size(0) == ids.size(0) && t.size(1) > 0 && t.scalar_type() == at::kLong,
        run.op(), ": task_prompts[", i, "] must be a non-empty int64 [", ids.size(0), ", P] tensor, got ",
        t.defined() ? checks::shape_str(t) : std::string("undefined"));
  }
  TORCH_CHECK(structured || ids.size(0) == 1 || run.packs_ragged_layers(), run.op(),
              ": batch must be 1 for the unstructured variant with the masked layout, got ", ids.size(0));
}

// kvpress's figure for the same pass: every layer's prompt K/V stay in the cache until compression,
// and each layer's eager attention materialises [B, Hq, P, N + P] scores and probabilities.
int64_t kvpress_pass_bytes(const ModelShape& c, int64_t batch, int64_t n, const std::vector<at::Tensor>& prompts) {
  const int64_t elt = static_cast<int64_t>(c10::elementSize(c.dtype));
  int64_t peak = 0;
  for (const at::Tensor& prompt : prompts) {
    const int64_t p = prompt.size(1);
    peak = std::max(peak, c.num_layers * 2 * batch * c.num_kv_heads * p * c.head_dim * elt +
                              2 * batch * c.num_heads * p * (n + p) * elt);
  }
  return peak;
}

}  // namespace

void KVComposePress::second_pass(SecondPassRun& run) const { run_second_pass(run, KVComposeRunOptions{}); }

KVComposePassResult KVComposePress::run_second_pass(SecondPassRun& run, const KVComposeRunOptions& options) const {
  check_run(run, options, options_.structured);
  const ModelShape c = run.model().shape();
  const at::Tensor& context_ids = run.context_ids();
  const int64_t batch = context_ids.size(0), n = context_ids.size(1);

  // 1. The context's prefill, uncompressed (kvpress's hook skips the square attention).
  run.prefill(nullptr);

  // 2. The second pass.
  KVComposePassResult result;
  KVComposeSession session = start_session(c.num_layers, c.num_heads, c.num_kv_heads, n, run.cached_keys(0).device());
  if (run.model().head_exchange()) session.share_heads(run.model().kv_head_range(), run.model().head_exchange());
  const std::vector<at::Tensor> prompts =
      options.task_prompts.empty() ? std::vector<at::Tensor>{context_ids} : options.task_prompts;
  for (const at::Tensor& prompt : prompts) prompt_pass(run, prompt, options.query_chunk, session, result.memory);
  for (int64_t li = 0; li < c.num_layers; ++li) session.observe_values(li, run.cached_values(li));
  result.memory.kvpress_bytes = kvpress_pass_bytes(c, batch, n, prompts) + session.statistics_bytes();

  // 3. Budgets, then every layer of the cache.
  result.budgets = session.budgets();
  result.scores = session.scores();
  for (int64_t li = 0; li < c.num_layers; ++li) {
    LayerInputs in;
    in.keys = run.cached_keys(li);
    in.values = run.cached_values(li);
    in.num_heads = c.num_heads;
    in.layer_idx = li;
    in.num_layers = c.num_layers;
    if (options_.structured)
      run.store(in, session.compress(li, in.keys, in.values));
    else
      run.store_ragged(in, session.compress_ragged(li, in.keys, in.values));
  }
  return result;
}

}  // namespace kvpress
