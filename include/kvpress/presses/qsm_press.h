// QSMPress: stage I of CTR-Press (github.com/xiyuanyang-code/CTRPress, a kvpress fork;
// docs/PRESS_NOTES.md "QSMPress / CTRPress"). Query-aware scores, semantic weights from token
// text, forced keeps, and the value merge of evicted tokens into their nearest kept neighbour.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// CTR-Press's text heuristic (the reference's SemanticScoreConfig, same names and defaults).
struct SemanticWeightOptions {
  double digit_weight = 1.0;        // + when the text has a digit
  double capital_weight = 0.5;      // + when it has an uppercase letter
  double rare_weight = 0.3;         // + when the stripped text has >= rare_min_chars characters
  double punctuation_weight = 0.2;  // + when it has one of . ! ? ; : newline
  double code_weight = 0.4;         // + when it has one of _ . / = ( ) [ ] { } < > backslash
  double stopword_weight = 0.3;     // - when the stripped, lowercased text is one of 28 stopwords
  double whitespace_weight = 0.3;   // - when the text is blank
  int64_t rare_min_chars = 8;
  std::optional<int64_t> rare_token_id_threshold;  // + rare_weight again for ids >= this

  template <typename Self, typename Visit>
  static void for_each_field(Self& self, Visit&& visit) {
    visit(ParamSpec{"digit_weight", "w: token has a digit"}, self.digit_weight);
    visit(ParamSpec{"capital_weight", "w: token has an uppercase letter"}, self.capital_weight);
    visit(ParamSpec{"rare_weight", "w: token has >= rare_min_chars characters (or id >= rare_token_id_threshold)"},
          self.rare_weight);
    visit(ParamSpec{"punctuation_weight", "w: token has one of .!?;: or a newline"}, self.punctuation_weight);
    visit(ParamSpec{"code_weight", "w: token has a code symbol"}, self.code_weight);
    visit(ParamSpec{"stopword_weight", "w: minus, token is a stopword"}, self.stopword_weight);
    visit(ParamSpec{"whitespace_weight", "w: minus, token is blank"}, self.whitespace_weight);
    visit(ParamSpec{"rare_min_chars", "length of a rare token"}, self.rare_min_chars);
    visit(ParamSpec{"rare_token_id_threshold", "ids from this one up count as rare"}, self.rare_token_id_threshold);
  }
};

// The semantic weight w of one token. Characters are UTF-8 code points; digits, letters and
// case are ASCII's (the reference uses Python's Unicode classes: a non-ASCII digit or capital
// letter adds nothing here); strip() removes ASCII whitespace.
double semantic_weight(const std::string& text, int64_t token_id, const SemanticWeightOptions& options = {});

// How evicted tokens are weighted in the stage-I value merge.
enum class MergeWeighting {
  kScore,    // (clip(s_r / tau, 0, 1), 0 below merge_min_score_ratio) ^ merge_score_power
  kUniform,  // every evicted token weighs 1
};

struct QSMOptions {
  // Query span: the last query_length tokens when > 0 (the question, the reference's
  // set_runtime_state(query_length=...)); otherwise the pseudo-query of the last
  // min(pseudo_query_len, max(1, int(S * pseudo_query_max_fraction))) tokens.
  int64_t query_length = 0;
  int64_t pseudo_query_len = 128;
  double pseudo_query_max_fraction = 0.125;
  double qa_alpha = 0.5;  // s = alpha * mean_q A + (1 - alpha) * max_q A
  int64_t sink_tokens = 4;
  int64_t recent_tokens = 32;  // the last context tokens (before the explicit query, if any)
  bool keep_pseudo_query = true;
  bool use_query_aware = true;      // false: all-zero attention scores (forced keeps only)
  bool score_normalization = true;  // min-max to [0, 1] per (batch, head)
  // s *= 1 + lambda_sem * tanh(w) on non-forced tokens; needs input_ids and a TokenTextFn.
  bool use_semantic = true;
  double lambda_sem = 0.3;
  SemanticWeightOptions semantic;
  // Value merge (keys untouched): only with an explicit query or merge_in_pseudo_query.
  bool use_merge = true;
  bool merge_in_pseudo_query = false;
  double merge_alpha = 0.2;              // gamma
  std::string merge_target = "nearest";  // the reference's only target
  MergeWeighting merge_weighting = MergeWeighting::kScore;
  double merge_score_power = 4.0;
  double merge_min_score_ratio = 0.5;
  double merge_count_power = 0.75;  // p: the merged mass m enters as m^(1 - p)

  // The reference's parameter names (QSMPress's, and the first part of CTRPress's); the range
  // checks are QSMPress's constructor's.
  template <typename Self, typename Visit>
  static void for_each_field(Self& self, Visit&& visit) {
    visit(ParamSpec{"query_length", "explicit query: the last query_length tokens (0: the pseudo-query)"},
          self.query_length);
    visit(ParamSpec{"pseudo_query_len", "longest pseudo-query (the last prompt tokens)"}, self.pseudo_query_len);
    visit(ParamSpec{"pseudo_query_max_fraction", "longest pseudo-query as a fraction of the prompt"},
          self.pseudo_query_max_fraction);
    visit(ParamSpec{"qa_alpha", "weight of the mean (1 - qa_alpha: of the max) attention over the query span"},
          self.qa_alpha);
    visit(ParamSpec{"sink_tokens", "first tokens always kept"}, self.sink_tokens);
    visit(ParamSpec{"recent_tokens", "last context tokens always kept"}, self.recent_tokens);
    visit(ParamSpec{"keep_pseudo_query", "always keep the pseudo-query span"}, self.keep_pseudo_query);
    visit(ParamSpec{"use_query_aware", "query-aware attention scores (false: zeros)"}, self.use_query_aware);
    visit(ParamSpec{"score_normalization", "min-max normalise the scores per head"}, self.score_normalization);
    visit(ParamSpec{"use_semantic", "factor 1 + lambda_sem * tanh(w), w from token text (input_ids + callback)"},
          self.use_semantic);
    visit(ParamSpec{"lambda_sem", "strength of the semantic factor"}, self.lambda_sem);
    SemanticWeightOptions::for_each_field(self.semantic, visit);
    visit(ParamSpec{"use_merge", "merge evicted values into the nearest kept token (explicit query only)"},
          self.use_merge);
    visit(ParamSpec{"merge_in_pseudo_query", "merge with the pseudo-query too"}, self.merge_in_pseudo_query);
    visit(ParamSpec{"merge_alpha", "gamma: strength of the value merge"}, self.merge_alpha);
    visit(ParamSpec{"merge_target", "merge target (only nearest)"}.one_of({"nearest"}), self.merge_target);
    visit(ParamSpec{"merge_weighting", "score or uniform"}.one_of({"score", "uniform"}), self.merge_weighting);
    visit(ParamSpec{"merge_score_power", "exponent of the relative score weights"}, self.merge_score_power);
    visit(ParamSpec{"merge_min_score_ratio", "relative scores below this do not merge"}, self.merge_min_score_ratio);
    visit(ParamSpec{"merge_count_power", "p: merged mass m enters as m^(1 - p)"}, self.merge_count_power);
  }
};

// Stage I scores of one layer.
struct QSMScores {
  at::Tensor base;    // [B, Hkv, S] float32: query-aware scores before the semantic factor, forced = float max
  at::Tensor scores;  // [B, Hkv, S] float32: after the semantic factor, forced = float max (selection)
  at::Tensor forced;  // [S] bool (keys' device): forced keeps
};

class QSMPress : public ScorerPress {
 public:
  using Params = QSMOptions;

  // Raises c10::Error naming the option when one is out of range.
  explicit QSMPress(double compression_ratio = 0.0, QSMOptions options = {}, TokenTextFn token_text = nullptr);

  std::string name() const override { return "QSMPress"; }
  const QSMOptions& options() const { return options_; }

  // The token text source of the semantic weights; unset, the press reads LayerInputs::token_text
  // (what an engine's prefill gives, as kvpress::llama's does from PrefillOptions::tokenizer).
  // Without either, or without LayerInputs::input_ids, w = 0 (the semantic factor is 1). Not
  // synchronised: set it before sharing the press; a shared press calls it from every thread that
  // compresses with it (kvpress/presses/base_press.h, thread safety).
  void set_token_text(TokenTextFn token_text) { token_text_ = std::move(token_text); }
  bool has_token_text() const { return static_cast<bool>(token_text_); }

  // [start, end) of the query span for a prompt of seq_len tokens (empty when its length is 0).
  std::pair<int64_t, int64_t> query_span(int64_t seq_len) const;
  // Sinks, recent tokens and the query span (pseudo-query only with keep_pseudo_query).
  at::Tensor forced_keep_mask(int64_t seq_len) const;  // -> [S] bool, CPU
  // Tokens kept per head: min(max(n_kept(S, ratio), #forced), S).
  int64_t kept_count(int64_t seq_len) const;

  // w per token from inputs.input_ids and the TokenTextFn (the press's, else inputs.token_text);
  // undefined when either is missing or use_semantic is off.
  at::Tensor semantic_weights(const LayerInputs& inputs) const;  // -> [B, S] float32 (keys' device)

  QSMScores stage_one_scores(const LayerInputs& inputs) const;
  at::Tensor score(const LayerInputs& inputs) const override;  // stage_one_scores(inputs).scores

  // Top kept_count(S) per head of score(); values merged when the merge is on.
  KV compress(const LayerInputs& inputs) const override;
  // Undefined: the merge changes the kept values, and CTRPress rescues tokens after the selection
  // (compress_in_place copies compress()'s result).
  at::Tensor kept_positions(const LayerInputs&) const override { return at::Tensor(); }

  // The stage-I merge weight of every position given this head's kept positions (kept ones: 0):
  // kUniform 1; kScore (clip(s / tau, 0, 1), 0 below merge_min_score_ratio) ^ merge_score_power
  // with s = st.base and tau the lowest st.base among the head's non-forced kept tokens (1 when
  // there is none; at least 1e-6).
  at::Tensor merge_weights(const QSMScores& st,
                           const at::Tensor& kept_indices) const;  // [B, Hkv, n] -> [B, Hkv, S] float32

 protected:
  // Keys gathered at the top-n_kept positions of st.scores; values merged when the merge is on.
  KV select_and_merge(const LayerInputs& inputs, const QSMScores& st, int64_t n_kept) const;
  bool merge_enabled() const;

 private:
  QSMOptions options_;
  TokenTextFn token_text_;
};

// Merges tokens into their nearest kept neighbour, per KV head: evicted position r (not in that
// head's kept_indices) goes to the kept position closest to it (the lower one on a tie) with
// weight weights[b, h, r] >= 0; slot j with merged mass m_j = sum of its weights > 0 becomes
//   (V_j + alpha * m_j^(1 - count_power) * (sum_r w_r V_r) / m_j) / (1 + alpha * m_j^(1 - count_power)),
// where V_j is kept_values' row (m_j is clamped below at the dtype's epsilon in the division, as in
// the reference). Other slots keep kept_values. Computed in float32, returned in values' dtype.
at::Tensor merge_into_nearest_kept(const at::Tensor& kept_values,      // [B, Hkv, n, D]
                                   const at::Tensor& values,           // [B, Hkv, S, D]
                                   const at::Tensor& kept_indices,     // [B, Hkv, n] int64, ascending
                                   const at::Tensor& weights,          // [B, Hkv, S] float (kept positions ignored)
                                   double alpha, double count_power);  // -> [B, Hkv, n, D]

}  // namespace kvpress
