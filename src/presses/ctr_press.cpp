// CTRPress (CTR-Press stage II): entropy-adaptive budget and the rescue merge.
// docs/PRESS_NOTES.md "QSMPress / CTRPress" lists where this differs from the reference.
#include "kvpress/presses/ctr_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// -sum p ln p of softmax(x) per row, averaged over the rows (the reference's entropy.mean()).
double mean_softmax_entropy(const at::Tensor& x) {  // [B, N] float32
  const at::Tensor entropy = -(at::softmax(x, -1) * at::log_softmax(x, -1)).sum(-1);
  return entropy.mean().item<double>();
}

}  // namespace

double ctr_normalized_entropy(const at::Tensor& scores, const at::Tensor& forced, CTREntropy mode) {
  constexpr const char* op = "ctr_normalized_entropy";
  checks::check_rank(op, "scores", scores, 3, "[batch, kv_heads, seq_len]");
  checks::check_rank(op, "forced", forced, 1, "[seq_len]");
  TORCH_CHECK(forced.scalar_type() == at::kBool && forced.size(0) == scores.size(2), op, ": forced must be bool [",
              scores.size(2), "], got ", forced.scalar_type(), " ", checks::shape_str(forced));
  const int64_t seq = scores.size(2);
  if (mode == CTREntropy::kReference) {
    if (seq < 2) return -1.0;  // ln S <= 0: the reference leaves the budget alone
    // Head mean in float32 of scores whose forced entries are float max: with >= 2 KV heads it
    // overflows to inf (on CPU and GPU alike), the softmax gives NaN.
    const at::Tensor mean = at::nan_to_num(scores.to(at::kFloat), 0.0, 0.0, 0.0).mean(1);
    const double e = mean_softmax_entropy(mean) / std::log(static_cast<double>(seq));
    // Python's max(0.0, min(1.0, e)) returns 1.0 for NaN.
    return std::isnan(e) ? 1.0 : std::clamp(e, 0.0, 1.0);
  }
  const at::Tensor free_positions = forced.logical_not().nonzero().view(-1).to(scores.device());
  const int64_t n_free = free_positions.numel();
  if (n_free < 2) return -1.0;  // nothing to spread: the budget stays n
  const at::Tensor mean = scores.to(at::kFloat).index_select(2, free_positions).mean(1);  // [B, N]
  checks::check_finite_scores(op, mean);
  const double e = mean_softmax_entropy(mean) / std::log(static_cast<double>(n_free));
  return std::clamp(e, 0.0, 1.0);
}

at::Tensor ctr_rescue_scores(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& kept_indices) {
  constexpr const char* op = "ctr_rescue_scores";
  checks::check_keys(op, keys);
  checks::check_rank(op, "queries", queries, 4, "[batch, num_heads, seq_len, head_dim]");
  checks::check_float(op, "queries", queries);
  checks::check_same_device(op, "queries", queries, "keys", keys);
  checks::check_rank(op, "kept_indices", kept_indices, 3, "[batch, kv_heads, n_kept]");
  checks::check_same_device(op, "kept_indices", kept_indices, "keys", keys);
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  TORCH_CHECK(queries.size(0) == batch && queries.size(3) == dim, op, ": queries must be [", batch,
              ", num_heads, q_len, ", dim, "] to match keys, got ", checks::shape_str(queries));
  checks::check_gqa(op, queries.size(1), kv_heads);
  TORCH_CHECK(
      kept_indices.scalar_type() == at::kLong && kept_indices.size(0) == batch && kept_indices.size(1) == kv_heads, op,
      ": kept_indices must be int64 [", batch, ", ", kv_heads, ", n_kept], got ", kept_indices.scalar_type(), " ",
      checks::shape_str(kept_indices));
  const at::Tensor keep =
      at::zeros({batch, kv_heads, seq}, keys.options().dtype(at::kBool)).scatter_(2, kept_indices, true);
  at::Tensor rho = at::full({batch, kv_heads, seq}, -1.0, keys.options().dtype(at::kFloat));

  // Per KV head, only the evicted keys enter the matmul (the kept ones would be masked to -inf),
  // and the group's query rows go through in chunks of about 4 MiB of logits: softmax_ri =
  // exp(l_ri - lse_r), so the largest weight over the rows is exp of the column maximum of
  // l - lse (ops::rescue_column_max, fused per row), kept as a running maximum. Scratch is one
  // chunk, never [rows, S].
  const int64_t group = queries.size(1) / kv_heads, rows = group * queries.size(2);
  const double scale = std::sqrt(static_cast<double>(dim));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const at::Tensor evicted = keep[b][h].logical_not().nonzero().view(-1);  // [R]
      const int64_t n_evicted = evicted.numel();
      if (n_evicted == 0) continue;
      const at::Tensor evicted_keys_t = keys[b][h].index_select(0, evicted).to(at::kFloat).t();  // [D, R]
      const at::Tensor q = queries[b].narrow(0, h * group, group).to(at::kFloat).reshape({rows, dim});
      const int64_t chunk = std::clamp<int64_t>((int64_t{1} << 20) / n_evicted, 1, rows);
      at::Tensor column_max = at::full({n_evicted}, -std::numeric_limits<float>::infinity(), rho.options());
      at::Tensor logits = at::empty({chunk, n_evicted}, rho.options());
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t len = std::min(chunk, rows - r0);
        at::Tensor l = logits.narrow(0, 0, len);
        at::mm_out(l, q.narrow(0, r0, len), evicted_keys_t);
        at::maximum_out(column_max, column_max, ops::rescue_column_max(l, scale));
      }
      rho[b][h].index_put_({evicted}, column_max.exp_());
    }
  }
  return rho;
}

CTRPress::CTRPress(double compression_ratio, QSMOptions qsm, CTROptions ctr, TokenTextFn token_text)
    : QSMPress(compression_ratio, std::move(qsm), std::move(token_text)), ctr_(ctr) {
  constexpr const char* op = "CTRPress";
  TORCH_CHECK(ctr_.rescue_ratio >= 0.0 && ctr_.rescue_ratio <= 1.0, op, ": rescue_ratio must be in [0, 1], got ",
              ctr_.rescue_ratio);
  TORCH_CHECK(std::isfinite(ctr_.entropy_beta) && ctr_.entropy_beta >= 0.0, op, ": entropy_beta must be >= 0, got ",
              ctr_.entropy_beta);
}

int64_t CTRPress::adaptive_kept_count(const QSMScores& st) const {
  const int64_t seq = st.scores.size(2);
  const int64_t n = kept_count(seq);
  if (!ctr_.use_layer_adaptive) return n;
  const double e = ctr_normalized_entropy(st.scores, st.forced, ctr_.entropy);
  if (e < 0.0) return n;
  const double scale = 1.0 + ctr_.entropy_beta * (1.0 - 2.0 * e);
  // Python's round(): half to even, which std::nearbyint does in the default rounding mode.
  const auto adjusted = static_cast<int64_t>(std::nearbyint(static_cast<double>(n) * scale));
  const int64_t floor =
      ctr_.entropy == CTREntropy::kNonForced ? std::max<int64_t>(1, st.forced.sum().item<int64_t>()) : 1;
  return std::clamp(adjusted, std::min(floor, seq), seq);
}

KV CTRPress::compress(const LayerInputs& inputs) const {
  const std::string op = name() + ".compress";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  if (compression_ratio() == 0.0) return budget::keep_all(inputs);  // the reference returns the cache untouched
  const int64_t seq = inputs.keys.size(2);
  const QSMScores st = stage_one_scores(inputs);
  // (The entropy spans every head: on a rank's share, every rank's scores.)
  QSMScores layer = st;
  if (ctr_.use_layer_adaptive) layer.scores = head_exchange::all_heads(inputs, st.scores);
  const int64_t n_kept = adaptive_kept_count(layer);
  KV kv = select_and_merge(inputs, st, n_kept);
  const int64_t evicted = seq - n_kept;
  if (ctr_.rescue_ratio <= 0.0 || evicted == 0) return kv;

  // Rescue: the evicted tokens every position's queries would miss most, merged back with
  // gamma' = 2 gamma and mass exponent 0.25 (count power 0.75).
  const at::Tensor queries = ops::window_queries(inputs, seq, op.c_str());  // [B, Hq, S, D]
  const at::Tensor rho = ctr_rescue_scores(queries, inputs.keys, kv.kept_indices);
  const int64_t n_rescue =
      std::min(evicted, std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(evicted) * ctr_.rescue_ratio)));
  const at::Tensor rescued = ops::topk_indices(rho, n_rescue);  // kept positions score -1 < any rho
  const at::Tensor picked = rho.gather(2, rescued);
  const at::Tensor weights = at::zeros_like(rho).scatter_(2, rescued, picked / picked.amax(-1, true).clamp_min(1e-6));
  kv.values =
      merge_into_nearest_kept(kv.values, inputs.values, kv.kept_indices, weights, 2.0 * options().merge_alpha, 0.75);
  return kv;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CTRPress",
                    PressKind::kScorer,
                    "CTR-Press: QSMPress with an entropy-adaptive budget and rescue merge of evicted tokens",
                    {{{{"queries"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}},
                     {},
                     {"input_ids"},
                     "input_ids and a token-text callback on the press enable its semantic weights"},
                    [](double r, ParamReader& p) {
                      QSMOptions qsm;
                      p.read_all(qsm);
                      CTROptions ctr;
                      p.read_all(ctr);
                      return std::make_unique<CTRPress>(r, std::move(qsm), std::move(ctr));
                    }};
});

}  // namespace

}  // namespace kvpress
