// KVgradPress's second pass over a model view (kvpress/presses/kvgrad_press.h): KVzip's replay scored
// through the gradient of the last layer's outputs.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kvpress/presses/kvgrad_press.h"
#include "presses/kvzip_pass.h"
#include "presses/pass_memory.h"

namespace kvpress {
namespace {

using detail::bytes_of;
using detail::record_peak;

// The scores of every layer, filled chunk by chunk.
struct GradientScores {
  const KVgradPress& press;
  const ModelView& model;
  int64_t n;          // context tokens
  at::Tensor scores;  // [L, Hkv, N] float32

  // A chunk's scores in one layer: KVzip's chunk scores of the repeat's queries over the layer's
  // keys ([1, Hkv, N + P, D]: the context's, then the repeat's), the rows scaled by ||dPhi/da_p||
  // (output_grad [1, P, hidden]) and the columns by ||v W_O||.
  void score_layer(const KVzipReplayChunk& chunk, int64_t li, const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& queries, const at::Tensor& output_grad) {
    at::NoGradGuard no_grad;
    const int64_t len = chunk.end - chunk.start, sink = std::min(press.n_sink(), chunk.start);
    const at::Tensor gradient_norm = output_grad.to(at::kFloat).norm(2, {-1});  // [1, P]
    const at::Tensor value_norm = KVzipPress::value_output_norms(values.narrow(2, chunk.start, len), model.o_proj(li));
    scores[li]
        .narrow(1, chunk.start, len)
        .copy_(press.chunk_scores(queries, keys.narrow(2, 0, sink), keys.narrow(2, chunk.start, len),
                                  keys.narrow(2, n, keys.size(2) - n), 0, gradient_norm, value_norm)[0]);
  }
};

at::Tensor repeat_ids_of(const KVzipReplayChunk& chunk, const at::Tensor& context_ids) {
  return at::tensor(chunk.repeat_ids, at::kLong).unsqueeze(0).to(context_ids.device());  // [1, P]
}

// kvpress's way: the context's full cache (the plain prefill's), read by every chunk's forward with
// autograd through every layer and its backward.
void score_over_full_cache(SecondPassRun& run, const std::vector<KVzipReplayChunk>& chunks, GradientScores& out) {
  const ModelView& model = run.model();
  const int64_t num_layers = model.shape().num_layers, n = out.n;
  std::vector<at::Tensor> context_keys, context_values;  // per layer [1, Hkv, N, D]
  {
    at::NoGradGuard no_grad;
    run.prefill(nullptr);
  }
  for (int64_t li = 0; li < num_layers; ++li) {
    context_keys.push_back(run.cached_keys(li));
    context_values.push_back(run.cached_values(li));
  }
  for (const KVzipReplayChunk& chunk : chunks) {
    const RopeTables rope = model.rope(n, static_cast<int64_t>(chunk.repeat_ids.size()));
    at::Tensor x = model.embed(repeat_ids_of(chunk, run.context_ids())).detach().requires_grad_(true);
    std::vector<at::Tensor> outputs, queries, keys, values;  // per layer: a_l [1, P, hidden], q, [context | repeat]
    for (int64_t li = 0; li < num_layers; ++li) {
      const LayerQKV qkv = model.layer_qkv(li, x, rope);
      keys.push_back(at::cat({context_keys[li], qkv.k}, 2));
      values.push_back(at::cat({context_values[li], qkv.v}, 2));
      at::Tensor a = model.project_output(li, model.layer_attention(qkv.q, keys.back(), values.back()));
      a.retain_grad();
      outputs.push_back(a);
      queries.push_back(qkv.q.detach());
      x = model.layer_mlp(li, x + a);
    }
    x.to(at::kFloat).square().sum().backward();  // Phi = sum_p ||h_p^L||^2
    for (int64_t li = 0; li < num_layers; ++li)
      out.score_layer(chunk, li, keys[li].detach(), values[li].detach(), queries[li], outputs[li].grad());
  }
}

// No more than one layer's context keys/values at a time (KVgradRunOptions::recompute_context).
void score_recomputing_context(const SecondPassRun& run, const std::vector<KVzipReplayChunk>& chunks,
                               GradientScores& out, KVzipMemory& memory) {
  const ModelView& model = run.model();
  const int64_t num_layers = model.shape().num_layers, n = out.n;
  at::Tensor context_embedding;
  {
    at::NoGradGuard no_grad;
    context_embedding = model.embed(run.context_ids());
  }
  const RopeTables context_rope = model.rope(0, n);
  // The context's keys/values in `layer`, recomputed from its embeddings (layers before it run again).
  const auto context_kv = [&](int64_t layer) {
    at::NoGradGuard no_grad;
    at::Tensor x = context_embedding;
    for (int64_t j = 0;; ++j) {
      LayerQKV qkv = model.layer_qkv(j, x, context_rope);
      if (j == layer) return std::make_pair(qkv.k, qkv.v);
      x = model.layer_output(j, x, model.layer_attention(qkv.q, qkv.k, qkv.v));
    }
  };
  for (const KVzipReplayChunk& chunk : chunks) {
    const RopeTables rope = model.rope(n, static_cast<int64_t>(chunk.repeat_ids.size()));
    // Forward, the context alongside, one layer at a time: only the chunk's input to each layer stays.
    std::vector<at::Tensor> inputs;  // per layer [1, P, hidden]
    at::Tensor x;
    {
      at::NoGradGuard no_grad;
      at::Tensor xc = context_embedding;
      x = model.embed(repeat_ids_of(chunk, run.context_ids()));
      for (int64_t li = 0; li < num_layers; ++li) {
        inputs.push_back(x);
        LayerQKV context = model.layer_qkv(li, xc, context_rope);
        const LayerQKV qkv = model.layer_qkv(li, x, rope);
        const at::Tensor keys = at::cat({context.k, qkv.k}, 2), values = at::cat({context.v, qkv.v}, 2);
        context.k.reset();  // the layer's keys/values live on in `keys` and `values` only
        context.v.reset();
        record_peak(memory, bytes_of({&keys, &values}), bytes_of({&xc}) + bytes_of(inputs),
                    bytes_of({&context.q, &qkv.q}), bytes_of({&out.scores}));
        x = model.layer_output(li, x, model.layer_attention(qkv.q, keys, values));
        if (li + 1 < num_layers)
          xc = model.layer_output(li, xc,
                                  model.layer_attention(context.q, keys.narrow(2, 0, n), values.narrow(2, 0, n)));
      }
    }
    // Backward from Phi = sum_p ||h_p^L||^2, one layer at a time, its context keys/values recomputed.
    at::Tensor upstream = (2 * x.to(at::kFloat)).to(x.scalar_type());  // dPhi/dh^L
    for (int64_t li = num_layers - 1; li >= 0; --li) {
      auto [context_keys, context_values] = context_kv(li);
      const at::Tensor xin = inputs[static_cast<size_t>(li)].detach().requires_grad_(true);
      const LayerQKV qkv = model.layer_qkv(li, xin, rope);
      const at::Tensor keys = at::cat({context_keys, qkv.k}, 2), values = at::cat({context_values, qkv.v}, 2);
      context_keys.reset();
      context_values.reset();
      record_peak(memory, bytes_of({&keys, &values}), bytes_of(inputs) + bytes_of({&context_embedding, &upstream}),
                  bytes_of({&qkv.q}), bytes_of({&out.scores}));
      at::Tensor a = model.project_output(li, model.layer_attention(qkv.q, keys, values));
      a.retain_grad();
      model.layer_mlp(li, xin + a).backward(upstream);
      out.score_layer(chunk, li, keys.detach(), values.detach(), qkv.q.detach(), a.grad());
      upstream = xin.grad();
      inputs[static_cast<size_t>(li)].reset();
    }
  }
}

}  // namespace

KVzipPassResult KVgradPress::run_kvgrad_pass(SecondPassRun& run, const KVgradRunOptions& options) const {
  KVzipPassResult result;
  result.memory.full_cache_bytes = detail::check_kvzip_context(run);
  const ModelView& model = run.model();
  const ModelShape c = model.shape();
  const int64_t n = run.context_ids().size(1);
  if (compression_ratio() == 0.0) {  // kvpress skips the replay
    run.prefill(nullptr);
    result.scores = at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat);
    return result;
  }
  // Gradients need tensors made outside inference mode, with autograd on.
  c10::InferenceMode no_inference(false);
  at::AutoGradMode grad(true);

  const std::vector<KVzipReplayChunk> chunks = detail::framed_replay_chunks(*this, run);
  GradientScores gradient{*this, model, n, at::zeros({c.num_layers, c.num_kv_heads, n}, at::kFloat)};
  if (options.recompute_context)
    score_recomputing_context(run, chunks, gradient, result.memory);
  else
    score_over_full_cache(run, chunks, gradient);
  result.scores = gradient.scores;
  at::NoGradGuard no_grad;
  // The compressing prefill holds one full layer at a time (the full cache of the plain prefill, if
  // any, is replaced).
  detail::prefill_selected(run, *this,
                           detail::keep_masks_over_ranks(model, result.scores,
                                                         [&](const at::Tensor& scores) { return keep_masks(scores); }));
  return result;
}

KVzipPassResult KVgradPress::run_second_pass(SecondPassRun& run, const KVzipRunOptions&) const {
  return run_kvgrad_pass(run, KVgradRunOptions{});
}

}  // namespace kvpress
