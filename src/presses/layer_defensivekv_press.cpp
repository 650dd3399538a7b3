// LayerDefensiveKVPress (include/kvpress/presses/layer_defensivekv_press.h, docs/PRESS_NOTES.md).
#include "kvpress/presses/layer_defensivekv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checks.h"
#include "kvpress/model_view.h"
#include "kvpress/ops.h"
#include "presses/kvzip_pass.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kOp = "LayerDefensiveKVPress";

[[noreturn]] void refuse_one_layer(const char* op) {
  TORCH_CHECK(false, op,
              ": the selection spans every layer, so one layer's inputs are not enough: it needs a second pass "
              "over the model (kvpress::llama's prefill() or generate_greedy(), or keep_masks() of every layer's "
              "DefensiveKVPress scores)");
}

}  // namespace

LayerDefensiveKVPress::LayerDefensiveKVPress(double compression_ratio, const Params& params)
    : layer_press_([&] {
        // Checked under this press's name before the per-layer press is built.
        checks::check_ratio(kOp, compression_ratio);
        check_params(kOp, params);
        return DefensiveKVPress(compression_ratio, params);
      }()) {}

std::vector<at::Tensor> LayerDefensiveKVPress::keep_masks(const at::Tensor& scores) const {
  constexpr const char* op = "LayerDefensiveKVPress.keep_masks";
  checks::check_rank(op, "scores", scores, 3, "[num_layers, kv_heads, seq_len]");
  checks::check_finite_scores(op, scores);
  const int64_t layers = scores.size(0), heads = scores.size(1), n = scores.size(2);
  const auto kept = static_cast<int64_t>(static_cast<double>(n) * (1.0 - compression_ratio()) *
                                         static_cast<double>(heads) * static_cast<double>(layers));
  // (layer, head) pairs as the "heads" of one row: ties go to the lower layer, head, position.
  const at::Tensor mask =
      ops::topk_mask_across_heads(scores.to(at::kFloat).reshape({1, layers * heads, n}), kept).view({layers, heads, n});
  std::vector<at::Tensor> masks;
  for (int64_t l = 0; l < layers; ++l) masks.push_back(mask[l].unsqueeze(0));
  return masks;
}

void LayerDefensiveKVPress::second_pass(SecondPassRun& run) const {
  KVzipMemory memory;
  detail::check_kvzip_context(run);  // batch 1, as the authors' code
  if (compression_ratio() == 0.0) {
    run.prefill(nullptr);
    return;
  }
  const ModelView& model = run.model();
  const ModelShape shape = model.shape();
  const detail::ContextScorer scorer = [&](int64_t layer, const LayerQKV& context) {
    LayerInputs in;
    in.keys = context.k;
    in.values = context.v;
    in.queries = context.q;
    in.o_proj = model.o_proj(layer);
    in.num_heads = shape.num_heads;
    in.layer_idx = layer;
    in.num_layers = shape.num_layers;
    in.kv_head_range = model.kv_head_range();  // a shard's heads and, with global budgets, the others'
    in.head_exchange = model.head_exchange();
    return layer_press_.score(in);
  };
  const at::Tensor scores = detail::context_scores(run, scorer, memory);
  detail::prefill_selected(
      run, *this, detail::keep_masks_over_ranks(model, scores, [&](const at::Tensor& all) { return keep_masks(all); }));
}

KV LayerDefensiveKVPress::compress(const LayerInputs&) const { refuse_one_layer("LayerDefensiveKVPress.compress"); }

at::Tensor LayerDefensiveKVPress::keep_mask(const LayerInputs&) const {
  refuse_one_layer("LayerDefensiveKVPress.keep_mask");
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"LayerDefensiveKVPress",
                    PressKind::kSecondPass,
                    "DefensiveKVPress's scores in every layer, selected across layers and heads (head-ragged; not in "
                    "kvpress 0.5.5)",
                    {{}, {}, {}, "every layer's queries, keys, values and o_proj, from a pass over the model"},
                    from_params<LayerDefensiveKVPress>};
});

}  // namespace

}  // namespace kvpress
