// KVComposePress and its per-context session: incremental attention statistics, global budgets,
// per-layer compression (see include/kvpress/presses/kvcompose_press.h and docs/PRESS_NOTES.md).
#include "kvpress/presses/kvcompose_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kPress = "KVComposePress";

// Combines a new [.., N] statistic into a running one (max, or sum for the mean).
void accumulate(at::Tensor& running, const at::Tensor& incoming, KVComposeAggregation agg) {
  if (agg == KVComposeAggregation::kMax) {
    running.copy_(at::maximum(running, incoming));
  } else {
    running.add_(incoming);
  }
}

// Aggregates dimension 2 of x [A, B, M, N] into [A, B, N], one slice after the other, as kvpress's
// aggregators do with one partial_fit per slice (so the float32 sums round the same way).
at::Tensor aggregate_slices(const at::Tensor& x, KVComposeAggregation agg) {
  const int64_t m = x.size(2);
  at::Tensor acc = agg == KVComposeAggregation::kMax ? at::full({x.size(0), x.size(1), x.size(3)},
                                                                -std::numeric_limits<double>::infinity(), x.options())
                                                     : at::zeros({x.size(0), x.size(1), x.size(3)}, x.options());
  for (int64_t j = 0; j < m; ++j) accumulate(acc, x.select(2, j), agg);
  if (agg == KVComposeAggregation::kMean) acc = acc / at::full({}, static_cast<double>(m), x.options());
  return acc;
}

// How many of the n_keep largest entries of `curves` [R, N] fall in each row. Ties at the threshold
// go to the lower rows (kvpress's torch.topk breaks them arbitrarily).
at::Tensor budget_counts(const at::Tensor& curves, int64_t n_keep) {
  const int64_t rows = curves.size(0), n = curves.size(1);
  if (n_keep >= rows * n) return at::full({rows}, n, curves.options().dtype(at::kLong));
  const at::Tensor flat = curves.reshape(-1);
  // The n_keep-th largest value is the (R*N - n_keep + 1)-th smallest.
  const at::Tensor threshold = std::get<0>(at::kthvalue(flat, rows * n - n_keep + 1));
  const at::Tensor above = curves.gt(threshold).sum(1);  // [R]
  const at::Tensor at_threshold = curves.eq(threshold).sum(1);
  const at::Tensor remaining = n_keep - above.sum();  // filled from the tied entries, lower rows first
  const at::Tensor before = at_threshold.cumsum(0) - at_threshold;
  const at::Tensor tied_taken = at::minimum(at::clamp_min(remaining - before, 0), at_threshold);
  return above + tied_taken;
}

}  // namespace

KVComposeAggregation parse_kvcompose_aggregation(const std::string& what, const std::string& text) {
  if (text == "max") return KVComposeAggregation::kMax;
  if (text == "mean") return KVComposeAggregation::kMean;
  TORCH_CHECK(false, what, " must be \"max\" or \"mean\", got \"", text, "\"");
}

// ---- KVComposePress ---------------------------------------------------------------------------------

KVComposePress::KVComposePress(double compression_ratio, KVComposeOptions options)
    : compression_ratio_(compression_ratio), options_(std::move(options)) {
  checks::check_ratio(kPress, compression_ratio);
  parse_kvcompose_aggregation("KVComposePress: agg_task", options_.agg_task);
  parse_kvcompose_aggregation("KVComposePress: agg_group", options_.agg_group);
  parse_kvcompose_aggregation("KVComposePress: agg_head", options_.agg_head);
  check_params(kPress, options_);
}

KV KVComposePress::compress(const LayerInputs&) const {
  TORCH_CHECK(false,
              "KVComposePress.compress: KVCompose cannot compress one layer on its own; it needs the engine's "
              "second pass over the context (a task prompt's attention to every layer, then global budgets): "
              "use kvpress::llama::kvcompose_prefill, or KVComposePress::start_session with observe(), "
              "budgets() and compress()");
}

RaggedKV KVComposePress::compress_ragged(const LayerInputs& inputs) const {
  compress(inputs);  // raises with the explanation above
  return {};
}

KVComposeSession KVComposePress::start_session(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads,
                                               int64_t context_len, at::Device device) const {
  return KVComposeSession(compression_ratio_, options_, num_layers, num_heads, num_kv_heads, context_len, device);
}

// ---- KVComposeSession ---------------------------------------------------------------------------------

KVComposeSession::KVComposeSession(double compression_ratio, KVComposeOptions options, int64_t num_layers,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t context_len, at::Device device)
    : compression_ratio_(compression_ratio),
      options_(std::move(options)),
      agg_task_(parse_kvcompose_aggregation("KVComposeSession: agg_task", options_.agg_task)),
      agg_group_(parse_kvcompose_aggregation("KVComposeSession: agg_group", options_.agg_group)),
      agg_head_(parse_kvcompose_aggregation("KVComposeSession: agg_head", options_.agg_head)),
      num_layers_(num_layers),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      context_len_(context_len) {
  constexpr const char* op = "KVComposeSession";
  checks::check_ratio(op, compression_ratio);
  checks::check_non_negative(op, "keep_token_lower_bound", options_.keep_token_lower_bound);
  checks::check_positive(op, "num_layers", num_layers);
  checks::check_gqa(op, num_heads, num_kv_heads);
  checks::check_positive(op, "context_len", context_len);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  task_ = agg_task_ == KVComposeAggregation::kMax
              ? at::full({num_layers, num_heads, context_len}, -std::numeric_limits<double>::infinity(), opts)
              : at::zeros({num_layers, num_heads, context_len}, opts);
  rows_.assign(static_cast<size_t>(num_layers), 0);
  has_values_.assign(static_cast<size_t>(num_layers), false);
  if (options_.add_v_norm) value_norms_ = at::zeros({num_layers, num_kv_heads, context_len}, opts);
}

void KVComposeSession::check_layer(const char* op, int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers_, op, ": layer must be in [0, ", num_layers_, "), got ", layer);
}

void KVComposeSession::check_open(const char* op) const {
  TORCH_CHECK(!has_budgets_, op,
              ": the budgets were already computed; statistics can no longer change "
              "(start a new session for another context)");
}

void KVComposeSession::check_budgets(const char* op) const {
  TORCH_CHECK(has_budgets_, op, ": call budgets() first (after observing every layer)");
}

void KVComposeSession::observe(int64_t layer, const at::Tensor& attentions) {
  constexpr const char* op = "KVComposeSession.observe";
  check_open(op);
  check_layer(op, layer);
  checks::check_rank(op, "attentions", attentions, 4, "[batch, num_heads, q_len, seq_len]");
  TORCH_CHECK(at::isFloatingType(attentions.scalar_type()), op, ": attentions must be floating, got ",
              attentions.scalar_type());
  TORCH_CHECK(attentions.size(0) > 0 && attentions.size(1) == num_heads_ && attentions.size(2) > 0 &&
                  attentions.size(3) >= context_len_,
              op, ": attentions must be [batch, ", num_heads_, ", q_len, seq_len >= ", context_len_,
              "] (non-empty), got ", checks::shape_str(attentions));
  const at::Tensor context = attentions.narrow(3, 0, context_len_);  // the prompt's own keys are ignored
  // kvpress reduces in the attention dtype, then combines in float32.
  const at::Tensor stat =
      agg_task_ == KVComposeAggregation::kMax ? context.amax({0, 2}) : context.sum(at::IntArrayRef{0, 2});
  at::Tensor running = task_[layer];
  accumulate(running, stat.to(task_.device(), at::kFloat), agg_task_);
  rows_[static_cast<size_t>(layer)] += attentions.size(0) * attentions.size(2);
}

void KVComposeSession::observe_statistics(int64_t layer, const at::Tensor& statistics, int64_t rows) {
  constexpr const char* op = "KVComposeSession.observe_statistics";
  check_open(op);
  check_layer(op, layer);
  checks::check_rank(op, "statistics", statistics, 2, "[num_heads, context_len]");
  TORCH_CHECK(statistics.size(0) == num_heads_ && statistics.size(1) == context_len_, op, ": statistics must be [",
              num_heads_, ", ", context_len_, "], got ", checks::shape_str(statistics));
  TORCH_CHECK(at::isFloatingType(statistics.scalar_type()), op, ": statistics must be floating, got ",
              statistics.scalar_type());
  checks::check_positive(op, "rows", rows);
  at::Tensor running = task_[layer];
  accumulate(running, statistics.to(task_.device(), at::kFloat), agg_task_);
  rows_[static_cast<size_t>(layer)] += rows;
}

void KVComposeSession::observe_values(int64_t layer, const at::Tensor& values) {
  constexpr const char* op = "KVComposeSession.observe_values";
  check_open(op);
  check_layer(op, layer);
  if (!options_.add_v_norm) return;  // nothing to record
  checks::check_rank(op, "values", values, 4, "[batch, kv_heads, seq_len, head_dim]");
  TORCH_CHECK(values.size(0) > 0 && values.size(1) == num_kv_heads_ && values.size(2) >= context_len_, op,
              ": values must be [batch, ", num_kv_heads_, ", seq_len >= ", context_len_, ", head_dim], got ",
              checks::shape_str(values));
  // kvpress: ||v|| of batch row 0 in the value dtype, then a float32 product.
  const at::Tensor norms = at::norm(values[0].narrow(1, 0, context_len_), 2, {-1});
  value_norms_[layer].copy_(norms.to(value_norms_.device(), at::kFloat));
  has_values_[static_cast<size_t>(layer)] = true;
}

void KVComposeSession::share_heads(const KVHeadRange& range, std::shared_ptr<const HeadExchange> exchange) {
  constexpr const char* op = "KVComposeSession.share_heads";
  check_open(op);
  TORCH_CHECK(exchange != nullptr, op, ": exchange must be set");
  TORCH_CHECK(range.first >= 0 && range.first + num_kv_heads_ <= range.layer_kv_heads, op, ": the session's ",
              num_kv_heads_, " KV heads from head ", range.first, " must lie within the layer's ",
              range.layer_kv_heads);
  range_ = range;
  exchange_ = std::move(exchange);
}

int64_t KVComposeSession::observed_rows(int64_t layer) const {
  check_layer("KVComposeSession.observed_rows", layer);
  return rows_[static_cast<size_t>(layer)];
}

const KVComposeBudgets& KVComposeSession::budgets() {
  constexpr const char* op = "KVComposeSession.budgets";
  if (has_budgets_) return budgets_;
  for (int64_t l = 0; l < num_layers_; ++l) {
    TORCH_CHECK(rows_[static_cast<size_t>(l)] > 0, op, ": layer ", l,
                " has no observed attention; run the second pass (observe) on every layer first");
    TORCH_CHECK(!options_.add_v_norm || has_values_[static_cast<size_t>(l)], op, ": add_v_norm needs layer ", l,
                "'s values (observe_values)");
  }
  const int64_t n = context_len_, lb = options_.keep_token_lower_bound;
  const int64_t groups = num_heads_ / num_kv_heads_;

  // 1. Per-(layer, query head) task statistic: the running max, or sum / count.
  at::Tensor task = task_;
  if (agg_task_ == KVComposeAggregation::kMean) {
    std::vector<float> counts(rows_.begin(), rows_.end());
    task = task_ / at::tensor(counts, task_.options()).view({num_layers_, 1, 1});
  }
  // 2. Per KV head: aggregate its group's query heads (query head g * G + j belongs to KV head g).
  at::Tensor scores = aggregate_slices(task.view({num_layers_, num_kv_heads_, groups, n}), agg_group_);
  TORCH_CHECK(at::isfinite(scores).all().item<bool>(), op, ": the attention statistics hold NaN or Inf values");
  // 3. Enhancements. A rank's heads (share_heads) take the mean over every rank's heads.
  const bool shared = exchange_ != nullptr;
  const int64_t all_kv_heads = shared ? range_.layer_kv_heads : num_kv_heads_;
  for (int64_t l = 0; l < num_layers_; ++l) {
    at::Tensor layer_scores = scores[l];  // [Hkv, N] view
    if (options_.add_v_norm) layer_scores.mul_(value_norms_[l]);
    if (options_.add_mean_across_heads && !shared) layer_scores.add_(layer_scores.mean(0, /*keepdim=*/true));
  }
  if (options_.add_mean_across_heads && shared)
    scores.add_(exchange_->sum_over_ranks(scores.sum(1, /*keepdim=*/true)).div_(static_cast<double>(all_kv_heads)));
  scores_ = scores;

  // 4. Composite tokens: each head's curve sorted descending; per layer, the heads' curves aggregated
  // (over every rank's heads for a rank's session).
  const at::Tensor sorted = std::get<0>(at::sort(scores, /*dim=*/-1, /*descending=*/true));  // [L, Hkv, N]
  at::Tensor per_head_curves = sorted.clone();
  at::Tensor per_layer_curves;  // [L, N]
  if (!shared) {
    per_layer_curves = aggregate_slices(sorted.unsqueeze(0), agg_head_).squeeze(0);
  } else if (agg_head_ == KVComposeAggregation::kMax) {
    per_layer_curves = exchange_->max_over_ranks(std::get<0>(sorted.max(1)));
  } else {
    at::Tensor partial = at::zeros({num_layers_, n}, sorted.options());
    for (int64_t g = 0; g < num_kv_heads_; ++g) partial.add_(sorted.select(1, g));
    per_layer_curves = exchange_->sum_over_ranks(partial).div_(static_cast<double>(all_kv_heads));
  }
  const int64_t bound = std::min(lb, n);
  if (bound > 0) {
    per_head_curves.narrow(-1, 0, bound).add_(1e9);
    per_layer_curves.narrow(-1, 0, bound).add_(1e9);
  }
  // Layer 0 gets the largest curve (so the largest budget).
  per_layer_curves[0].copy_(std::get<0>(per_layer_curves.max(0)));

  // 5. Global budgets.
  const at::Tensor layer_counts =
      at::clamp_min(budget_counts(per_layer_curves, ops::n_kept(num_layers_ * n, compression_ratio_)),
                    std::max<int64_t>(1, lb))
          .cpu();
  budgets_.per_layer.assign(layer_counts.data_ptr<int64_t>(), layer_counts.data_ptr<int64_t>() + num_layers_);
  // Per-head budgets rank every head's curve of every layer: a rank's session gathers the others'.
  const at::Tensor all_curves = shared ? exchange_->gather_heads(per_head_curves) : per_head_curves;
  budgets_.per_head = budget_counts(all_curves.reshape({num_layers_ * all_kv_heads, n}),
                                    ops::n_kept(num_layers_ * all_kv_heads * n, compression_ratio_))
                          .view({num_layers_, all_kv_heads})
                          .narrow(1, shared ? range_.first : 0, num_kv_heads_)
                          .cpu()
                          .contiguous();
  has_budgets_ = true;
  return budgets_;
}

const at::Tensor& KVComposeSession::scores() const {
  check_budgets("KVComposeSession.scores");
  return scores_;
}

std::vector<int64_t> KVComposeSession::kept_counts(int64_t layer) const {
  constexpr const char* op = "KVComposeSession.kept_counts";
  check_budgets(op);
  check_layer(op, layer);
  std::vector<int64_t> out(static_cast<size_t>(num_kv_heads_));
  for (int64_t g = 0; g < num_kv_heads_; ++g) {
    const int64_t k = options_.structured ? budgets_.per_layer[static_cast<size_t>(layer)]
                                          : budgets_.per_head[layer][g].item<int64_t>();
    out[static_cast<size_t>(g)] = std::min(k, context_len_);  // keep_token_lower_bound may exceed N
  }
  return out;
}

at::Tensor KVComposeSession::keep_mask(int64_t layer) const {
  constexpr const char* op = "KVComposeSession.keep_mask";
  check_budgets(op);
  check_layer(op, layer);
  const std::vector<int64_t> counts = kept_counts(layer);
  // Each head's k best tokens by score; a stable descending sort gives ties to the lower position.
  const at::Tensor order = std::get<1>(at::sort(scores_[layer], /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  const at::Tensor k = at::tensor(counts, at::kLong).to(order.device()).view({num_kv_heads_, 1});
  const at::Tensor rank_kept = at::arange(context_len_, order.options()).view({1, context_len_}).lt(k);
  return at::zeros({num_kv_heads_, context_len_}, order.options().dtype(at::kBool)).scatter_(1, order, rank_kept);
}

void KVComposeSession::check_cache(const char* op, const at::Tensor& keys, const at::Tensor& values) const {
  checks::check_kv(op, keys, values);
  TORCH_CHECK(keys.size(1) == num_kv_heads_ && keys.size(2) == context_len_, op, ": keys must be [batch, ",
              num_kv_heads_, ", ", context_len_, ", head_dim] (the context's cache), got ", checks::shape_str(keys));
}

KV KVComposeSession::compress(int64_t layer, const at::Tensor& keys, const at::Tensor& values) const {
  constexpr const char* op = "KVComposeSession.compress";
  check_budgets(op);
  check_layer(op, layer);
  TORCH_CHECK(options_.structured, op,
              ": the unstructured variant keeps a different number of tokens per head; "
              "use compress_ragged()");
  check_cache(op, keys, values);
  const int64_t k = kept_counts(layer)[0];
  const at::Tensor indices = ops::topk_indices(scores_[layer].unsqueeze(0).to(keys.device()), k)
                                 .expand({keys.size(0), num_kv_heads_, k})
                                 .contiguous();
  KV kv = ops::gather_kv(keys, values, indices);
  kv.kept_indices = indices;
  return kv;
}

RaggedKV KVComposeSession::compress_ragged(int64_t layer, const at::Tensor& keys, const at::Tensor& values) const {
  constexpr const char* op = "KVComposeSession.compress_ragged";
  check_budgets(op);
  check_layer(op, layer);
  check_cache(op, keys, values);
  const at::Tensor mask = keep_mask(layer).to(keys.device()).unsqueeze(0).expand({keys.size(0), -1, -1}).contiguous();
  return ops::gather_ragged(keys, values, mask);
}

int64_t KVComposeSession::statistics_bytes() const {
  int64_t bytes = static_cast<int64_t>(task_.nbytes());
  if (value_norms_.defined()) bytes += static_cast<int64_t>(value_norms_.nbytes());
  return bytes;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"KVComposePress",
                    PressKind::kSecondPass,
                    "global per-layer (structured) or per-head (unstructured) budgets from a second pass's attention",
                    {{},
                     {},
                     {},
                     "a task prompt's attention to the context in every layer (kvpress::llama::kvcompose_prefill, "
                     "or KVComposePress::start_session)"},
                    from_params<KVComposePress>};
});

}  // namespace

}  // namespace kvpress
