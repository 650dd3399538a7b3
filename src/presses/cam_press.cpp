// CAMPress: running attention, merge-then-prune at DecodingPress's cadence (see
// include/kvpress/presses/cam_press.h and docs/PRESS_NOTES.md).
#include "kvpress/presses/cam_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/head_exchange.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kName = "CAMPress";

// The forward's last query's attention over the cache, averaged over each KV group: [B, Hkv, S]
// float32. From the forward's weights when given, else recomputed (q_proj, RoPE of the last row).
at::Tensor last_query_attention(const LayerInputs& in, const char* op) {
  const int64_t batch = in.keys.size(0), hkv = in.keys.size(1), s = in.keys.size(2), d = in.keys.size(3);
  if (in.attentions.defined()) {
    const at::Tensor last = in.attentions.select(2, in.attentions.size(2) - 1).to(at::kFloat);  // [B, Hq, S]
    return last.view({batch, hkv, -1, s}).mean(2);
  }
  const int64_t n = in.hidden_states.size(1);
  TORCH_CHECK(in.cos.defined() && in.sin.defined() && in.cos.size(0) == n, op,
              ": needs cos/sin [n, head_dim] of the forward's ", n, " tokens to rotate its last query");
  const at::Tensor q = ops::project_queries(in.hidden_states.narrow(1, n - 1, 1), in, op).to(at::kFloat);
  const at::Tensor cos = in.cos.narrow(0, n - 1, 1).to(q.device(), at::kFloat);
  const at::Tensor sin = in.sin.narrow(0, n - 1, 1).to(q.device(), at::kFloat);
  const at::Tensor rotated = (q * cos + ops::rotate_half(q) * sin).view({batch, hkv, -1, d});  // [B, Hkv, G, D]
  const at::Tensor logits = at::matmul(rotated, in.keys.to(at::kFloat).transpose(2, 3)) / std::sqrt(double(d));
  return at::softmax(logits, -1).mean(2);
}

// Which of the merge candidates merge: bernoulli(probability) [B, Hkv, k] from the default
// generator, as torch.bernoulli. On a tensor-parallel shard with global budgets, the rank holding
// the layer's first head draws for every head of the layer, as one process does, and the others
// take their rows of its draw (their default generators do not advance).
at::Tensor merge_draw(const LayerInputs& in, const at::Tensor& probability) {
  if (!in.head_exchange) return at::bernoulli(probability);
  const at::Tensor every_head = head_exchange::all_heads(in, probability.contiguous());
  const at::Tensor mine = in.kv_head_range.first == 0 ? at::bernoulli(every_head) : at::zeros_like(every_head);
  return head_exchange::own_kv_heads(in, head_exchange::max_over_ranks(in, mine));
}

}  // namespace

CAMPress::CAMPress(ScorerFactory make_press, int64_t compression_interval, int64_t target_size,
                   int64_t hidden_states_buffer_size, int64_t merge_budget)
    : DecodingPress(std::move(make_press), compression_interval, target_size, hidden_states_buffer_size, kName),
      merge_budget_(merge_budget) {
  checks::check_positive(kName, "merge_budget", merge_budget);
}

KV CAMPress::merge_and_prune(const LayerInputs& in, const at::Tensor& attention_sums, int64_t merge_candidates) const {
  constexpr const char* op = "CAMPress.merge_and_prune";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), hkv = in.keys.size(1), s = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(attention_sums.defined() && attention_sums.sizes() == in.keys.sizes().slice(0, 3), op,
              ": attention_sums must be [", batch, ", ", hkv, ", ", s, "], got ",
              attention_sums.defined() ? checks::shape_str(attention_sums) : std::string("undefined"));
  const int64_t target = target_size(s);
  TORCH_CHECK(target < s, op, ": the cache (", s, " tokens) must exceed target_size (", target, ")");
  // 1. One selection for every head: the inner scores averaged over KV heads (on a tensor-parallel
  // shard with global budgets, over every rank's). kvpress passes the inner scorer no attention
  // weights here.
  LayerInputs scoring = in;
  scoring.attentions = at::Tensor();
  const at::Tensor head_sum = inner_scores_at(scoring, find_target_compression_ratio(s, target), op).sum(1);
  const at::Tensor mean_scores =
      head_exchange::sum_over_ranks(in, head_sum) / static_cast<double>(hkv * head_exchange::ranks(in));  // [B, S]
  const at::Tensor kept = ops::topk_indices(mean_scores.unsqueeze(1), target).squeeze(1);                 // [B, target]
  const at::Tensor evicted_mask = at::ones({batch, s}, kept.options().dtype(at::kBool)).scatter_(1, kept, false);
  const int64_t n_evict = s - target;
  const at::Tensor evicted =
      at::arange(s, kept.options()).expand({batch, s}).masked_select(evicted_mask).view({batch, n_evict});
  // 2. The k best scored of the evicted merge (ties: the later position first).
  const int64_t k = std::min(merge_candidates, n_evict);
  const at::Tensor order = std::get<1>(mean_scores.gather(1, evicted).flip(-1).sort(/*stable=*/true, -1, true));
  const at::Tensor merging = std::get<0>(evicted.gather(1, (n_evict - 1) - order.narrow(1, 0, k)).sort(-1));  // [B, k]
  // Each one's window: the merge_budget kept tokens after it (fewer at the end).
  const int64_t m = merge_budget_;
  const at::Tensor starts = at::searchsorted(kept, merging, /*out_int32=*/false, /*right=*/true);  // [B, k]
  at::Tensor window = starts.unsqueeze(-1) + at::arange(m, kept.options()).view({1, 1, m});        // [B, k, M]
  const at::Tensor valid = window < target;
  window.clamp_max_(target - 1);
  const at::Tensor targets = kept.gather(1, window.view({batch, -1})).view({batch, k, m});
  const at::Tensor budget = valid.sum(-1);  // [B, k]
  // 3. Merge with probability clamp(A_i / mean A over the window, 0, 1).
  const at::Tensor a = attention_sums.to(at::kFloat);
  const at::Tensor window_attention =
      a.gather(2, targets.view({batch, 1, -1}).expand({batch, hkv, k * m})).view({batch, hkv, k, m}) *
      valid.view({batch, 1, k, m});
  const at::Tensor mean_attention = window_attention.sum(-1) / budget.clamp_min(1).unsqueeze(1);
  at::Tensor probability = a.gather(2, merging.unsqueeze(1).expand({batch, hkv, k})) / mean_attention;
  probability = at::where(at::isnan(probability), at::zeros_like(probability), probability);
  probability = at::where(at::isinf(probability), at::ones_like(probability), probability).clamp(0, 1);
  const at::Tensor draw = merge_draw(in, probability);
  at::Tensor scale = (draw / budget.unsqueeze(1)).unsqueeze(-1);
  scale = at::where(budget.unsqueeze(1).unsqueeze(-1) == 0, at::zeros_like(scale), scale);
  const at::Tensor merged_values =
      in.values.gather(2, merging.view({batch, 1, k, 1}).expand({batch, hkv, k, d})).to(at::kFloat) * scale;
  const at::Tensor contributions =
      (merged_values.unsqueeze(3).expand({batch, hkv, k, m, d}) * valid.view({batch, 1, k, m, 1}))
          .reshape({batch, hkv, k * m, d});
  const at::Tensor values =
      in.values.to(at::kFloat)
          .scatter_add(2, targets.view({batch, 1, k * m, 1}).expand({batch, hkv, k * m, d}), contributions)
          .to(in.values.scalar_type());
  // 4. Prune.
  const at::Tensor kept_indices = kept.unsqueeze(1).expand({batch, hkv, target}).contiguous();
  KV out = ops::gather_kv(in.keys, values, kept_indices);
  out.kept_indices = kept_indices;
  return out;
}

KV CAMPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "CAMPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (in.keys.size(2) <= target_size(in.keys.size(2))) {
    KV out{in.keys, in.values,
           at::arange(in.keys.size(2), in.keys.options().dtype(at::kLong))
               .expand(in.keys.sizes().slice(0, 3))
               .contiguous()};
    return out;
  }
  TORCH_CHECK(in.attentions.defined() || in.hidden_states.defined(), op,
              ": needs attentions, or hidden_states with q_proj and cos/sin, for the last query's attention");
  return merge_and_prune(in, last_query_attention(in, op), 1);
}

std::optional<KV> CAMPress::step(const LayerInputs& forward, int64_t tokens_seen, DecodingState& state) const {
  constexpr const char* op = "CAMPress.step";
  TORCH_CHECK(forward.hidden_states.defined(), op, ": needs hidden_states (the forward's attention input), got none");
  checks::check_rank(op, "hidden_states", forward.hidden_states, 3, "[batch, n, hidden]");
  checks::check_kv(op, forward.keys, forward.values);
  TORCH_CHECK(forward.layer_idx >= 0, op, ": layer_idx must be >= 0, got ", forward.layer_idx);
  const auto layer = static_cast<size_t>(forward.layer_idx);
  const size_t layers = std::max<size_t>(layer + 1, static_cast<size_t>(std::max<int64_t>(forward.num_layers, 1)));
  if (state.hidden_states.size() < layers) state.hidden_states.resize(layers);
  if (state.steps.size() < layers) state.steps.resize(layers, 0);
  if (state.attention_sums.size() < layers) state.attention_sums.resize(layers);
  const int64_t n = forward.hidden_states.size(1), s = forward.keys.size(2);

  std::vector<at::Tensor>& buffer = state.hidden_states[layer];
  buffer.push_back(forward.hidden_states);
  // The running attention, grown by the tokens cached since the last step.
  const at::Tensor current = last_query_attention(forward, op);  // [B, Hkv, S]
  at::Tensor& sums = state.attention_sums[layer];
  if (!sums.defined()) {
    sums = current.clone();
  } else {
    TORCH_CHECK(sums.size(2) <= s, op, ": the cache shrank behind the press's back (", sums.size(2), " summed, ", s,
                " cached)");
    sums = at::constant_pad_nd(sums, {0, s - sums.size(2)}) + current;
  }
  const int64_t steps = ++state.steps[layer];

  std::optional<KV> out;
  const int64_t target = target_size(tokens_seen);
  if ((steps >= compression_interval() && s > target) || n >= target) {
    if (s > target) {
      LayerInputs in = forward;
      in.hidden_states = at::cat(buffer, 1);
      out = merge_and_prune(in, sums, steps);
      sums = sums.gather(2, out->kept_indices).contiguous();
    }
    state.steps[layer] = 0;
    buffer.clear();
  }
  if (hidden_states_buffer_size() == 0) {
    buffer.clear();
  } else if (static_cast<int64_t>(buffer.size()) > hidden_states_buffer_size()) {
    buffer.erase(buffer.begin(), buffer.end() - hidden_states_buffer_size());
  }
  return out;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "CAMPress",
      PressKind::kDecoding,
      "compresses during decoding like DecodingPress, first merging evicted values into their kept successors "
      "(Bernoulli by running attention)",
      {{}, {}, {}, "the inner press gets keys/values and queries of the buffered hidden states"},
      [](double, ParamReader& p) {
        ScorerFactory inner = scorer_factory(p, kDecodingInnerPressHelp);
        CAMPress::Params d;
        p.read_all(d);
        return std::make_unique<CAMPress>(inner, d.compression_interval, d.target_size, d.hidden_states_buffer_size,
                                          d.merge_budget);
      },
      "the budget is target_size"};
});

}  // namespace

}  // namespace kvpress
