// Name -> press factory with kvpress's parameter names and defaults. Each entry declares its
// parameters once, in its factory: every read (`p.get("window_size", SnapKVPress::kDefaultWindowSize,
// help)`) both parses the user's text and records the parameter, its type and its default, so the
// listing is made by running each factory once with no parameters.
#include "kvpress/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <set>
#include <system_error>

#include "kvpress/presses/adakv_press.h"
#include "kvpress/presses/block_press.h"
#include "kvpress/presses/cam_press.h"
#include "kvpress/presses/cap_press.h"
#include "kvpress/presses/chunk_press.h"
#include "kvpress/presses/chunkkv_press.h"
#include "kvpress/presses/compactor_press.h"
#include "kvpress/presses/composed_press.h"
#include "kvpress/presses/compression_ratio_decoding_press.h"
#include "kvpress/presses/critical_adakv_press.h"
#include "kvpress/presses/criticalkv_press.h"
#include "kvpress/presses/ctr_press.h"
#include "kvpress/presses/cur_press.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/presses/dms_press.h"
#include "kvpress/presses/duo_attention_press.h"
#include "kvpress/presses/entropy_gated_chunkkv_press.h"
#include "kvpress/presses/expected_attention_press.h"
#include "kvpress/presses/expected_attention_stats_press.h"
#include "kvpress/presses/fastkvzip_press.h"
#include "kvpress/presses/finch_press.h"
#include "kvpress/presses/key_rerotation_press.h"
#include "kvpress/presses/keydiff_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/kvcompose_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/presses/kvzap_press.h"
#include "kvpress/presses/kvzip_press.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/lukv_press.h"
#include "kvpress/presses/merging_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/presses/observed_attention_press.h"
#include "kvpress/presses/per_layer_compression_press.h"
#include "kvpress/presses/prefill_decoding_press.h"
#include "kvpress/presses/pyramidkv_press.h"
#include "kvpress/presses/qfilter_press.h"
#include "kvpress/presses/qsm_press.h"
#include "kvpress/presses/random_press.h"
#include "kvpress/presses/restorekv_press.h"
#include "kvpress/presses/simlayerkv_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "kvpress/presses/streaming_llm_press.h"
#include "kvpress/presses/think_press.h"
#include "kvpress/presses/tova_press.h"

namespace kvpress {

std::optional<int64_t> parse_int(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> parse_double(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
    return std::nullopt;
  return value;
}

std::optional<std::vector<double>> parse_double_list(std::string_view text) {
  std::vector<double> out;
  while (true) {
    const size_t comma = text.find(',');
    const auto value = parse_double(text.substr(0, comma));
    if (!value) return std::nullopt;
    out.push_back(*value);
    if (comma == std::string_view::npos) return out;
    text.remove_prefix(comma + 1);
  }
}

std::string format_double(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

namespace {

bool is_none(const std::string& text) { return text == "None" || text == "none"; }

// Reads a press's text parameters and records what it declares (name, type, default, help), so
// that unknown parameters can be refused and the registry can list them.
class Params {
 public:
  Params(std::string press, std::map<std::string, std::string> values)
      : press_(std::move(press)), values_(std::move(values)) {}

  int64_t get(const std::string& key, int64_t fallback, const char* help) {
    declare(key, "int", std::to_string(fallback), help);
    const auto text = take(key);
    return text ? to_int(key, *text) : fallback;
  }

  double get(const std::string& key, double fallback, const char* help) {
    declare(key, "float", format_double(fallback), help);
    const auto text = take(key);
    return text ? to_double(key, *text, "a number") : fallback;
  }

  bool get(const std::string& key, bool fallback, const char* help) {
    declare(key, "bool", fallback ? "true" : "false", help);
    const auto text = take(key);
    if (!text) return fallback;
    if (*text == "true" || *text == "True" || *text == "1") return true;
    if (*text == "false" || *text == "False" || *text == "0") return false;
    TORCH_CHECK(false, press_, ": parameter ", key, " must be true or false, got '", *text, "'");
  }

  // Unset, or "None": nullopt.
  std::optional<int64_t> get_optional_int(const std::string& key, const char* help) {
    declare(key, "int?", "None", help);
    const auto text = take(key);
    if (!text || is_none(*text)) return std::nullopt;
    return to_int(key, *text);
  }

  std::optional<double> get_optional_double(const std::string& key, const char* help) {
    declare(key, "float?", "None", help);
    const auto text = take(key);
    if (!text || is_none(*text)) return std::nullopt;
    return to_double(key, *text, "a number or None");
  }

  // One of `choices`; the first is the default.
  std::string get_choice(const std::string& key, std::initializer_list<const char*> choices, const char* help) {
    const std::string fallback = *choices.begin();
    declare(key, "str", fallback, help);
    const std::string text = take(key).value_or(fallback);
    std::string allowed;
    for (const char* c : choices) {
      if (text == c) return text;
      allowed += (allowed.empty() ? "" : (c == *(choices.end() - 1) ? " or " : ", ")) + std::string(c);
    }
    TORCH_CHECK(false, press_, ": parameter ", key, " must be ", allowed, ", got '", text, "'");
  }

  std::string get_text(const std::string& key, const std::string& fallback, const char* help) {
    declare(key, "str", fallback, help);
    return take(key).value_or(fallback);
  }

  // A file the press reads (QFilterPress's filters); "" when not given.
  std::string get_path(const std::string& key, const char* help) {
    declare(key, "path", "", help);
    return take(key).value_or("");
  }

  // Every parameter "<prefix><rest>" as rest -> value (the inner press's parameters of a wrapper).
  std::map<std::string, std::string> take_prefixed(const std::string& prefix) {
    std::map<std::string, std::string> out;
    for (const auto& [key, value] : values_) {
      if (key.rfind(prefix, 0) != 0) continue;
      used_.insert(key);
      out[key.substr(prefix.size())] = value;
    }
    return out;
  }

  // A ratio given as text, e.g. ComposedPress's presses.<i>.compression_ratio.
  double ratio(const std::string& key, const std::string& text) const { return to_double(key, text, "a number"); }

  const std::string& press_name() const { return press_; }
  const std::vector<PressParam>& declared() const { return declared_; }

  // Every given parameter must have been read by the factory.
  void check_all_used() const {
    for (const auto& [key, value] : values_) {
      if (used_.count(key)) continue;
      std::string names;
      for (const auto& p : declared_) names += (names.empty() ? "" : ", ") + p.name;
      TORCH_CHECK(false, press_, ": unknown parameter '", key, "' (known: ", names.empty() ? "none" : names, ")");
    }
  }

 private:
  void declare(const std::string& key, const char* type, std::string fallback, const char* help) {
    declared_.push_back({key, type, std::move(fallback), help});
  }

  std::optional<std::string> take(const std::string& key) {
    used_.insert(key);
    const auto it = values_.find(key);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  int64_t to_int(const std::string& key, const std::string& text) const {
    const auto value = parse_int(text);
    TORCH_CHECK(value, press_, ": parameter ", key, " must be an integer, got '", text, "'");
    return *value;
  }

  double to_double(const std::string& key, const std::string& text, const char* expected) const {
    const auto value = parse_double(text);
    TORCH_CHECK(value, press_, ": parameter ", key, " must be ", expected, ", got '", text, "'");
    return *value;
  }

  std::string press_;
  // A copy, not a reference: list_presses() passes a temporary empty map.
  const std::map<std::string, std::string> values_;
  std::set<std::string> used_;
  std::vector<PressParam> declared_;
};

// ---- inner presses of wrappers --------------------------------------------------------------

constexpr const char* kInnerPressHelp = "inner ScorerPress (its parameters as press.<name>)";

std::shared_ptr<const ScorerPress> as_scorer(std::unique_ptr<BasePress> built, const std::string& outer,
                                             const std::string& inner) {
  auto scorer = std::dynamic_pointer_cast<const ScorerPress>(std::shared_ptr<const BasePress>(std::move(built)));
  TORCH_CHECK(scorer != nullptr, outer, ": press must be a ScorerPress, got ", inner);
  return scorer;
}

// The inner ScorerPress of a wrapper: parameter `press` names it, `press.<param>` are its
// parameters, and it gets the wrapper's compression ratio. kvpress requires the inner press; the
// registry defaults it to KnormPress so that every registered press builds from its name alone.
std::shared_ptr<const ScorerPress> inner_scorer(Params& p, double ratio, const char* help = kInnerPressHelp) {
  const std::string inner = p.get_text("press", "KnormPress", help);
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  return as_scorer(make_press(inner, ratio, p.take_prefixed("press.")), p.press_name(), inner);
}

// A factory of the inner ScorerPress (`press`, `press.<param>`) for wrappers that need it at
// several ratios (PerLayerCompressionPress, the decoding presses; their constructors build it, so
// a bad name or parameter is reported by make_press).
ScorerFactory scorer_factory(Params& p, const char* help) {
  const std::string inner = p.get_text("press", "KnormPress", help);
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  const std::map<std::string, std::string> params = p.take_prefixed("press.");
  const std::string outer = p.press_name();
  ScorerFactory make = [inner, params, outer](double ratio) {
    return as_scorer(make_press(inner, ratio, params), outer, inner);
  };
  return make;
}

bool takes_ratio(const std::string& name);  // false for a known press without a ratio (no_ratio)

// A press named by parameter `key` ("None" or empty: none), `<key>.<param>` its parameters and
// `<key>.compression_ratio` its ratio (default: `ratio`, or 0 for a press without one, such as
// a DecodingPress, whose budget is target_size).
std::shared_ptr<const BasePress> named_press(Params& p, const std::string& key, const std::string& name, double ratio) {
  std::map<std::string, std::string> params = p.take_prefixed(key + ".");
  if (name.empty() || is_none(name)) {
    TORCH_CHECK(params.empty(), p.press_name(), ": parameters ", key, ".* given without ", key);
    return nullptr;
  }
  if (!takes_ratio(name)) ratio = 0.0;
  if (const auto it = params.find("compression_ratio"); it != params.end()) {
    ratio = p.ratio(key + ".compression_ratio", it->second);
    params.erase(it);
  }
  return make_press(name, ratio, params);
}

// ComposedPress's presses: `presses` = "A,B,..."; press i is configured as `presses.<i>`.
std::vector<std::shared_ptr<const BasePress>> composed_presses(Params& p, double ratio) {
  const std::string list = p.get_text(
      "presses", "KnormPress", "comma-separated press names; presses.<i>.<param> (and presses.<i>.compression_ratio)");
  std::vector<std::shared_ptr<const BasePress>> out;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t comma = list.find(',', begin);
    const std::string name = list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    TORCH_CHECK(!name.empty() && !is_none(name), "ComposedPress: presses must be comma-separated press names, got '",
                list, "'");
    out.push_back(named_press(p, "presses." + std::to_string(i), name, ratio));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

// PerLayerCompressionPress's `compression_ratios`: comma-separated numbers, one per layer; unset
// (or None) is the ratio given to make_press for every layer.
std::vector<double> ratio_list(Params& p, double ratio) {
  const std::string text = p.get_text("compression_ratios", "None",
                                      "comma-separated ratios, one per layer; None = the given ratio in every layer");
  if (is_none(text)) return {ratio};
  std::optional<std::vector<double>> ratios = parse_double_list(text);
  TORCH_CHECK(ratios, p.press_name(),
              ": parameter compression_ratios must be comma-separated numbers (one per layer), got '", text, "'");
  return *ratios;
}

// ---- QSMPress / CTRPress (CTR-Press): the reference's names; defaults from the option structs ---

QSMOptions qsm_options(Params& p) {
  QSMOptions o;
  SemanticWeightOptions& w = o.semantic;
  o.query_length =
      p.get("query_length", o.query_length, "explicit query: the last query_length tokens (0: the pseudo-query)");
  o.pseudo_query_len = p.get("pseudo_query_len", o.pseudo_query_len, "longest pseudo-query (the last prompt tokens)");
  o.pseudo_query_max_fraction = p.get("pseudo_query_max_fraction", o.pseudo_query_max_fraction,
                                      "longest pseudo-query as a fraction of the prompt");
  o.qa_alpha =
      p.get("qa_alpha", o.qa_alpha, "weight of the mean (1 - qa_alpha: of the max) attention over the query span");
  o.sink_tokens = p.get("sink_tokens", o.sink_tokens, "first tokens always kept");
  o.recent_tokens = p.get("recent_tokens", o.recent_tokens, "last context tokens always kept");
  o.keep_pseudo_query = p.get("keep_pseudo_query", o.keep_pseudo_query, "always keep the pseudo-query span");
  o.use_query_aware = p.get("use_query_aware", o.use_query_aware, "query-aware attention scores (false: zeros)");
  o.score_normalization = p.get("score_normalization", o.score_normalization, "min-max normalise the scores per head");
  o.use_semantic = p.get("use_semantic", o.use_semantic,
                         "factor 1 + lambda_sem * tanh(w), w from token text (input_ids + callback)");
  o.lambda_sem = p.get("lambda_sem", o.lambda_sem, "strength of the semantic factor");
  w.digit_weight = p.get("digit_weight", w.digit_weight, "w: token has a digit");
  w.capital_weight = p.get("capital_weight", w.capital_weight, "w: token has an uppercase letter");
  w.rare_weight = p.get("rare_weight", w.rare_weight,
                        "w: token has >= rare_min_chars characters (or id >= rare_token_id_threshold)");
  w.punctuation_weight = p.get("punctuation_weight", w.punctuation_weight, "w: token has one of .!?;: or a newline");
  w.code_weight = p.get("code_weight", w.code_weight, "w: token has a code symbol");
  w.stopword_weight = p.get("stopword_weight", w.stopword_weight, "w: minus, token is a stopword");
  w.whitespace_weight = p.get("whitespace_weight", w.whitespace_weight, "w: minus, token is blank");
  w.rare_min_chars = p.get("rare_min_chars", w.rare_min_chars, "length of a rare token");
  w.rare_token_id_threshold = p.get_optional_int("rare_token_id_threshold", "ids from this one up count as rare");
  o.use_merge =
      p.get("use_merge", o.use_merge, "merge evicted values into the nearest kept token (explicit query only)");
  o.merge_in_pseudo_query = p.get("merge_in_pseudo_query", o.merge_in_pseudo_query, "merge with the pseudo-query too");
  o.merge_alpha = p.get("merge_alpha", o.merge_alpha, "gamma: strength of the value merge");
  p.get_choice("merge_target", {"nearest"}, "merge target (only nearest)");
  o.merge_weighting = p.get_choice("merge_weighting", {"score", "uniform"}, "score or uniform") == "score"
                          ? MergeWeighting::kScore
                          : MergeWeighting::kUniform;
  o.merge_score_power = p.get("merge_score_power", o.merge_score_power, "exponent of the relative score weights");
  o.merge_min_score_ratio =
      p.get("merge_min_score_ratio", o.merge_min_score_ratio, "relative scores below this do not merge");
  o.merge_count_power = p.get("merge_count_power", o.merge_count_power, "p: merged mass m enters as m^(1 - p)");
  return o;
}

CTROptions ctr_options(Params& p) {
  CTROptions o;
  o.rescue_ratio = p.get("rescue_ratio", o.rescue_ratio, "fraction of the evicted tokens rescued per head (0: none)");
  p.get_choice("rescue_scoring", {"key_miss"}, "rescue score (only key_miss)");
  o.use_layer_adaptive = p.get("use_layer_adaptive", o.use_layer_adaptive, "entropy-adaptive budget");
  o.entropy_beta = p.get("entropy_beta", o.entropy_beta, "beta: n' = round(n * (1 + beta * (1 - 2 E/E_max)))");
  o.entropy = p.get_choice("entropy", {"non_forced", "reference"},
                           "non_forced (E over the non-forced tokens) or reference (the reference's overflowing "
                           "arithmetic)") == "reference"
                  ? CTREntropy::kReference
                  : CTREntropy::kNonForced;
  return o;
}

// ExpectedAttentionPress's parameters, shared by ExpectedAttentionStatsPress.
struct ExpectedAttentionOptions {
  int64_t n_future, n_sink;
  bool cov, vnorm;
  double eps;
};

ExpectedAttentionOptions expected_attention_options(Params& p) {
  using EA = ExpectedAttentionPress;
  ExpectedAttentionOptions o;
  o.n_future = p.get("n_future_positions", EA::kDefaultNFuturePositions, "future positions the RoPE is averaged over");
  o.n_sink = p.get("n_sink", EA::kDefaultNSink, "first tokens always kept and left out of the query statistics");
  o.cov = p.get("use_covariance", EA::kDefaultUseCovariance, "add the query covariance term");
  o.vnorm = p.get("use_vnorm", EA::kDefaultUseVnorm, "rescale by ||v||");
  o.eps = p.get("epsilon", EA::kDefaultEpsilon, "added to the scores before the ||v|| rescaling");
  return o;
}

// ---- the table ----------------------------------------------------------------------------

using Factory = std::function<std::unique_ptr<BasePress>(double, Params&)>;

struct Entry {
  std::string name;
  PressKind kind;
  std::string summary;
  PressInputs inputs;
  Factory make;
  std::string no_ratio = {};  // PressInfo::no_ratio
};

// Where the last queries come from (ops::window_queries), and attention-based presses their
// attention (ops::window_attention_mean: the given attentions, else those queries).
const std::vector<InputSet> kWindowQuerySources{{{"queries"}}, {{"hidden_states", "q_proj", "cos", "sin"}}};
const PressInputs kWindowQueryInputs{kWindowQuerySources};
const PressInputs kWindowAttentionInputs{[] {
  std::vector<InputSet> sets{{{"attentions"}}};
  sets.insert(sets.end(), kWindowQuerySources.begin(), kWindowQuerySources.end());
  return sets;
}()};
// Presses that need the pre-RoPE queries of every position (ExpectedAttentionPress, CapPress) and the
// RoPE frequencies of the future positions.
const PressInputs kPreRopeQueryInputs{{{{"hidden_states", "q_proj", "inv_freq"}},
                                       {{"hidden_states", "q_proj", "cos", "sin"}},
                                       {{"queries", "cos", "sin"}, true}}};
// Presses that need the queries of every position (non-causal attention).
const PressInputs kAllQueriesInputs{{{{"queries"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}};
constexpr const char* kSemanticNote = "input_ids and a token-text callback on the press enable its semantic weights";

// Scorers of the cached keys and values, or of the attention of the last queries.
std::vector<Entry> scorer_entries() {
  using K = PressKind;
  return {
      {"RandomPress",
       K::kScorer,
       "uniform random scores (baseline)",
       {},
       [](double r, Params& p) {
         return std::make_unique<RandomPress>(
             r, p.get_optional_int("seed", "seed of the CPU generator; unset draws fresh scores each call"));
       }},
      {"KnormPress",
       K::kScorer,
       "keep keys of smallest L2 norm",
       {},
       [](double r, Params&) { return std::make_unique<KnormPress>(r); }},
      {"StreamingLLMPress",
       K::kScorer,
       "keep n_sink first and the most recent tokens",
       {},
       [](double r, Params& p) {
         return std::make_unique<StreamingLLMPress>(
             r, p.get("n_sink", StreamingLLMPress::kDefaultNSink, "number of initial tokens always kept"));
       }},
      {"KeyDiffPress",
       K::kScorer,
       "keep keys least similar to the mean key direction",
       {},
       [](double r, Params&) { return std::make_unique<KeyDiffPress>(r); }},
      {"SnapKVPress", K::kScorer, "attention of the last window_size queries, pooled", kWindowAttentionInputs,
       [](double r, Params& p) {
         const int64_t window =
             p.get("window_size", SnapKVPress::kDefaultWindowSize, "number of trailing queries observed (always kept)");
         const int64_t kernel =
             p.get("kernel_size", SnapKVPress::kDefaultKernelSize, "odd width of the average pooling");
         return std::make_unique<SnapKVPress>(r, window, kernel);
       }},
      {"FinchPress",
       K::kQueryAware,
       "SnapKV-style attention of the question (the prefill's last question_length tokens), re-rotated",
       {kWindowAttentionInputs.alternatives,
        {"question_length"},
        {"inv_freq"},
        "rerotate_keys needs inv_freq or cos/sin; kvpress marks the question with a delimiter token"},
       [](double r, Params& p) {
         const std::optional<int64_t> chunk =
             p.get_optional_int("chunk_length", "select the best of every chunk_length positions; None = whole layer");
         const bool normalize = p.get("normalize_scores", FinchPress::kDefaultNormalizeScores,
                                      "weigh each question row's attention by its position");
         const bool rerotate = p.get("rerotate_keys", FinchPress::kDefaultRerotateKeys,
                                     "re-rotate the kept keys to positions 0..n_kept-1");
         return std::make_unique<FinchPress>(r, chunk, normalize, rerotate);
       }},
      {"LagKVPress",
       K::kScorer,
       "lag-relative K/V statistics per partition",
       {},
       [](double r, Params& p) {
         const int64_t n_sink = p.get("n_sink", LagKVPress::kDefaultNSink, "number of initial tokens always kept");
         const int64_t lag = p.get("lag_size", LagKVPress::kDefaultLagSize, "partition length");
         const bool cross = p.get("cross_scoring", LagKVPress::kDefaultCrossScoring,
                                  "compare raw scores across partitions instead of ranks");
         return std::make_unique<LagKVPress>(r, n_sink, lag, cross);
       }},
      {"TOVAPress", K::kScorer, "last query's attention, averaged over all heads", kWindowAttentionInputs,
       [](double r, Params&) { return std::make_unique<TOVAPress>(r); }},
      {"ObservedAttentionPress",
       K::kScorer,
       "mean attention received (H2O-like)",
       {{{{"attentions"}, true}}},
       [](double r, Params&) { return std::make_unique<ObservedAttentionPress>(r); }},
      {"QFilterPress",
       K::kScorer,
       "Q-Filters: -(filter · k), one filter per layer and KV head from a local file",
       {{}, {}, {"layer_idx"}, "the filters come from the file named by q_filters"},
       [](double r, Params& p) {
         const std::string path =
             p.get_path("q_filters", "safetensors file with q_filters [num_layers, num_kv_heads, head_dim]");
         return std::make_unique<QFilterPress>(r, path.empty() ? at::Tensor() : QFilterPress::load_filters(path));
       }},
      {"KVzapPress",
       K::kScorer,
       "KVzap: a per-layer surrogate model predicts each token's score from its hidden state (from a local folder)",
       {{{{"hidden_states"}}}, {}, {"layer_idx"}},
       [](double r, Params& p) {
         using P = KVzapPress;
         const P::ModelType type =
             p.get_choice("model_type", {"mlp", "linear"}, "the surrogate: mlp or linear") == "mlp"
                 ? P::ModelType::kMlp
                 : P::ModelType::kLinear;
         const std::string folder =
             p.get_path("kvzap_model", "folder of a KVzap surrogate as kvpress's KVzapModel.save_pretrained writes it");
         return std::make_unique<P>(r, type, folder.empty() ? P::Surrogate{} : P::load_surrogate(folder));
       }},
      {"CURPress",
       K::kScorer,
       "CurDKV: key and value leverage (squared norms), window-normalised, combined",
       {},
       [](double r, Params& p) {
         using Type = CURPress::LeverageType;
         const int64_t sinks = p.get("num_sinks", CURPress::kDefaultNumSinks, "initial tokens always kept");
         const std::string type = p.get_choice("leverage_type", {"kv_product", "key", "value", "kv_avg"},
                                               "which leverage scores the ranking uses");
         const bool random = p.get("use_random_leverage", CURPress::kDefaultUseRandomLeverage,
                                   "project K and V onto 20 random Gaussian directions first");
         const bool local = p.get("use_local_approximation", CURPress::kDefaultUseLocalApproximation,
                                  "normalise the scores within windows of local_window_size tokens");
         const int64_t window = p.get("local_window_size", CURPress::kDefaultLocalWindowSize, "window length");
         const std::optional<int64_t> seed = p.get_optional_int(
             "seed", "seed of the random projection's CPU generator (C++ only; unset: torch's global generator)");
         const Type t = type == "key"      ? Type::kKey
                        : type == "value"  ? Type::kValue
                        : type == "kv_avg" ? Type::kKvAvg
                                           : Type::kKvProduct;
         return std::make_unique<CURPress>(r, sinks, t, random, local, window, seed);
       }},
  };
}

// Scorers that rebuild the pre-RoPE keys or the queries of every position.
std::vector<Entry> rebuilding_scorer_entries() {
  using K = PressKind;
  return {
      {"LeverageScorePress",
       K::kScorer,
       "ridge leverage of the pre-RoPE keys (Gaussian sketch), z-scored",
       {{{{"cos", "sin"}}, {{"hidden_states", "k_proj"}}}},
       [](double r, Params& p) {
         const int64_t sketch = p.get("sketch_dimension", LeverageScorePress::kDefaultSketchDimension,
                                      "columns of the right Gaussian sketch");
         return std::make_unique<LeverageScorePress>(
             r, sketch,
             p.get_optional_int("seed",
                                "seed of the sketch's CPU generator (kvpress: torch.manual_seed before score)"));
       }},
      {"NonCausalAttnPress", K::kScorer, "chunked non-causal attention received, x ||v||, pooled, z-scored",
       kAllQueriesInputs,
       [](double r, Params& p) {
         return std::make_unique<NonCausalAttnPress>(
             r, p.get("chunk_size", NonCausalAttnPress::kDefaultChunkSize, "positions per non-causal attention chunk"));
       }},
      {"CompactorPress",
       K::kScorer,
       "blending * z(leverage) + z(non-causal attention), sinks kept",
       {{{{"queries", "cos", "sin"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}},
       [](double r, Params& p) {
         const int64_t start =
             p.get("sink_size_start", CompactorPress::kDefaultSinkSizeStart, "first tokens always kept");
         const int64_t end = p.get("sink_size_end", CompactorPress::kDefaultSinkSizeEnd, "last tokens always kept");
         const int64_t chunk =
             p.get("chunk_size", CompactorPress::kDefaultChunkSize, "positions per non-causal attention chunk");
         const int64_t sketch =
             p.get("sketch_dimension", CompactorPress::kDefaultSketchDimension, "columns of the leverage sketch");
         const auto blending =
             p.get_optional_double("blending", "weight of the leverage scores; None = compression_ratio (paper: 0.3)");
         const auto seed = p.get_optional_int("seed", "seed of the leverage sketch's CPU generator");
         const std::string selection = p.get_choice(
             "selection", {"per_head", "across_heads"},
             "per_head (kvpress) or across_heads (the paper's global top-k; head budgets vary, head-ragged)");
         return std::make_unique<CompactorPress>(
             r, start, end, chunk, sketch, blending, seed,
             selection == "per_head" ? TokenSelection::kPerHead : TokenSelection::kAcrossHeads);
       }},
      {"ExpectedAttentionPress", K::kScorer,
       "expected attention of future queries (query mean/covariance, averaged RoPE)", kPreRopeQueryInputs,
       [](double r, Params& p) {
         const ExpectedAttentionOptions o = expected_attention_options(p);
         return std::make_unique<ExpectedAttentionPress>(r, o.n_future, o.n_sink, o.cov, o.vnorm, o.eps);
       }},
      {"ExpectedAttentionStatsPress",
       K::kScorer,
       "expected attention from query statistics computed once for the model (read from stats_folder)",
       {{{{"inv_freq"}}, {{"cos", "sin"}}}, {}, {"layer_idx"}},
       [](double r, Params& p) {
         using P = ExpectedAttentionStatsPress;
         const ExpectedAttentionOptions o = expected_attention_options(p);
         const int64_t seq_len = p.get("sample_seq_len", P::kDefaultSampleSeqLen,
                                       "characters of each calibration sample (names kvpress's hub statistics)");
         const int64_t samples =
             p.get("num_samples", P::kDefaultNumSamples, "calibration samples (names kvpress's hub statistics)");
         const std::string dataset =
             p.get_text("dataset_name", P::kDefaultDatasetName, "calibration dataset (names kvpress's hub statistics)");
         const std::string folder =
             p.get_path("stats_folder", "kvpress's statistics folder: model.safetensors with query_mean and query_cov");
         return std::make_unique<P>(r, folder.empty() ? P::Statistics{} : P::load_statistics(folder), o.n_future,
                                    o.n_sink, o.cov, o.vnorm, o.eps, seq_len, samples, dataset);
       }},
      {"CapPress", K::kScorer,
       "CAPKV: capacity leverage of the values under query relevance (averaged-RoPE query anchor)", kPreRopeQueryInputs,
       [](double r, Params& p) {
         const double tau = p.get("tau", CapPress::kDefaultTau, "temperature of the query-key alignment weights");
         const int64_t n_future = p.get("n_future_positions", CapPress::kDefaultNFuturePositions,
                                        "future positions the RoPE is averaged over");
         const int64_t n_sink =
             p.get("n_sink", CapPress::kDefaultNSink, "first tokens always kept and left out of the query anchor");
         const double eps = p.get("epsilon", CapPress::kDefaultEpsilon, "added to the weights in the capacity matrix");
         return std::make_unique<CapPress>(r, tau, n_future, n_sink, eps);
       }},
  };
}

// Presses that prune key channels instead of tokens.
std::vector<Entry> channel_entries() {
  return {
      {"ThinKPress", PressKind::kChannel,
       "ThinK: zeroes the key channels the last queries use least (ratio = fraction of key channels; every token kept)",
       kWindowQueryInputs,
       [](double r, Params& p) {
         const int64_t window = p.get("window_size", ThinKPress::kDefaultWindowSize,
                                      "last queries whose channel magnitudes score the key channels");
         return std::make_unique<ThinKPress>(r, window);
       }},
  };
}

// Presses that decide per layer how many tokens to keep.
std::vector<Entry> layer_entries() {
  return {
      {"SimLayerKVPress",
       PressKind::kLayer,
       "SimLayerKV: a layer whose last queries attend mostly to its first and last tokens keeps only those",
       {kWindowAttentionInputs.alternatives,
        {},
        {},
        "read only where a layer is judged (lazy_threshold < 1, S > n_initial + n_recent + n_last)"},
       [](double, Params& p) {
         using P = SimLayerKVPress;
         const double threshold =
             p.get("lazy_threshold", P::kDefaultLazyThreshold, "a layer is lazy above this attention share (1: never)");
         const int64_t last = p.get("n_last", P::kDefaultNLast, "last queries whose attention decides");
         const int64_t recent =
             p.get("n_recent", P::kDefaultNRecent, "recent tokens a lazy layer keeps (their last n_recent - n_last)");
         const int64_t initial = p.get("n_initial", P::kDefaultNInitial, "initial (sink) tokens a lazy layer keeps");
         return std::make_unique<P>(threshold, last, recent, initial);
       },
       "each layer keeps every token or only its initial and recent ones, by lazy_threshold"},
      {"DuoAttentionPress",
       PressKind::kLayer,
       "DuoAttention: streaming KV heads (lowest pattern scores) keep only sink and recent tokens; head-ragged",
       {{}, {}, {"layer_idx"}, "the pattern comes from the folder named by attention_pattern; layer_idx picks its row"},
       [](double, Params& p) {
         const double ratio =
             p.get("head_compression_ratio", 0.0, "fraction of the model's KV heads made streaming heads");
         const bool on_the_fly = p.get("on_the_fly_scoring", false,
                                       "kvpress: estimate the pattern at run time (here: make it offline, see "
                                       "attention_pattern)");
         TORCH_CHECK(!on_the_fly,
                     "DuoAttentionPress: on_the_fly_scoring needs the model and a dataset at run time; "
                     "compute the pattern offline (scripts/make_artifact.py duo-attention, kvpress's on-the-fly "
                     "recipe) and give attention_pattern=FOLDER");
         const std::string folder =
             p.get_path("attention_pattern", "DuoAttention pattern folder: config.json and full_attention_heads.tsv");
         return std::make_unique<DuoAttentionPress>(
             ratio, folder.empty() ? DuoAttentionPress::Pattern{} : DuoAttentionPress::load_pattern(folder));
       },
       "each KV head keeps its whole cache or only sink and recent tokens, by the pattern and head_compression_ratio"},
  };
}

// Presses that need the engine's second pass over the context.
// The KVzip family's parameters (KVzipPress, RestoreKVPress, KVgradPress: no KVzip+ there).
struct KVzipParams {
  bool layerwise = KVzipPress::kDefaultLayerwise;
  int64_t n_sink = KVzipPress::kDefaultNSink;
  bool plus = KVzipPress::kDefaultKVzipPlusNormalization;
  int64_t chunk_size = KVzipPress::kDefaultChunkSize;
};
KVzipParams kvzip_params(Params& p, int64_t default_chunk_size, bool with_plus) {
  KVzipParams k;
  k.layerwise = p.get("layerwise", k.layerwise, "the same ratio in every layer (else global)");
  k.n_sink = p.get("n_sink", k.n_sink, "first tokens always kept");
  if (with_plus)
    k.plus = p.get("kvzip_plus_normalization", k.plus, "KVzip+: weights divided by ||h|| and multiplied by ||W_o v||");
  k.chunk_size = p.get("chunk_size", default_chunk_size, "context tokens repeated per replay pass");
  return k;
}

std::vector<Entry> second_pass_entries() {
  using K = PressKind;
  return {
      {"KVComposePress",
       K::kSecondPass,
       "global per-layer (structured) or per-head (unstructured) budgets from a second pass's attention",
       {{},
        {},
        {},
        "a task prompt's attention to the context in every layer (kvpress::llama::kvcompose_prefill, "
        "or KVComposePress::start_session)"},
       [](double r, Params& p) {
         KVComposeOptions o;
         o.structured = p.get("structured", o.structured,
                              "each layer keeps k_l tokens per head; false: per-(layer, head) budgets, head-ragged");
         o.agg_task = p.get_text("agg_task", o.agg_task, "over the prompt's queries: max or mean");
         o.agg_group = p.get_text("agg_group", o.agg_group, "over a KV group's query heads: max or mean");
         o.agg_head = p.get_text("agg_head", o.agg_head, "over KV heads, of the sorted curves: max or mean");
         o.add_v_norm = p.get("add_v_norm", o.add_v_norm, "multiply scores by ||v||");
         o.add_mean_across_heads = p.get("add_mean_across_heads", o.add_mean_across_heads,
                                         "add the mean over KV heads to every head's scores");
         o.keep_token_lower_bound =
             p.get("keep_token_lower_bound", o.keep_token_lower_bound, "minimum tokens per layer");
         return std::make_unique<KVComposePress>(r, std::move(o));
       }},
      {"KVzipPress",
       K::kSecondPass,
       "tokens scored by how much the model attends to them while repeating the context; evicted globally over "
       "layers and heads",
       {{},
        {},
        {},
        "the context replayed after a repeat prompt through the model (kvpress::llama::kvzip_prefill, or "
        "KVzipPress::replay_chunks, chunk_scores and keep_masks)"},
       [](double r, Params& p) {
         const KVzipParams k = kvzip_params(p, KVzipPress::kDefaultChunkSize, /*with_plus=*/true);
         return std::make_unique<KVzipPress>(r, k.layerwise, k.n_sink, k.plus, k.chunk_size);
       }},
      {"RestoreKVPress",
       K::kSecondPass,
       "KVzip plus learned restore tokens: run once over the full cache with a LoRA adapter, they take the place of "
       "as many evicted tokens per head",
       {{},
        {},
        {},
        "the context replayed after a repeat prompt, and the restore tokens' pass with the adapter "
        "(kvpress::llama::kvzip_prefill)"},
       [](double r, Params& p) {
         const KVzipParams k = kvzip_params(p, RestoreKVPress::kDefaultChunkSize, /*with_plus=*/true);
         const std::string dir =
             p.get_path("restore",
                        "folder with restore_embeddings.safetensors and a PEFT LoRA adapter (the authors' "
                        "higokri/RestoreKV-<model>[_plus], or scripts/make_artifact.py restorekv)");
         return std::make_unique<RestoreKVPress>(
             r, k.layerwise, k.n_sink, k.plus, k.chunk_size,
             dir.empty() ? RestoreKVPress::Restore{} : RestoreKVPress::load_restore(dir));
       }},
      {"KVgradPress",
       K::kSecondPass,
       "KVzip's replay weighted by ||v W_O|| and by the gradient of the final hidden states (one backward per "
       "chunk); evicted globally over layers and heads",
       {{},
        {},
        {},
        "the context replayed after a repeat prompt, with a backward pass per chunk (kvpress::llama::kvgrad_prefill)"},
       [](double r, Params& p) {
         const KVzipParams k = kvzip_params(p, KVgradPress::kDefaultChunkSize, /*with_plus=*/false);
         return std::make_unique<KVgradPress>(r, k.layerwise, k.n_sink, k.chunk_size);
       }},
      {"FastKVzipPress",
       K::kSecondPass,
       "KVzip's importance predicted by a trained gate per layer from the attention input; evicted globally over "
       "layers and heads (layerwise: per layer)",
       {{{{"hidden_states"}}},
        {},
        {"layer_idx"},
        "every layer's gate scores before the global selection (kvpress::llama::fast_kvzip_prefill); layerwise=true "
        "compresses one layer alone"},
       [](double r, Params& p) {
         using P = FastKVzipPress;
         const bool layerwise = p.get("layerwise", P::kDefaultLayerwise, "per-layer budgets (else global)");
         const int64_t n_sink = p.get("n_sink", P::kDefaultNSink, "first tokens always kept");
         const int64_t window_size =
             p.get("window_size", P::kDefaultWindowSize, "trailing tokens kept from 32000 tokens on");
         const double window_ratio =
             p.get("window_ratio", P::kDefaultWindowRatio, "fraction of a shorter context kept at its end");
         const std::string gates = p.get_path(
             "gates", "the model's gates, safetensors (scripts/make_artifact.py fastkvzip or fastkvzip-convert)");
         return std::make_unique<P>(r, layerwise, n_sink, window_size, window_ratio,
                                    gates.empty() ? P::Gates{} : P::load_gates(gates));
       }},
  };
}

// kvpress's wrappers around an inner scorer (or several presses).
std::vector<Entry> wrapper_entries() {
  using K = PressKind;
  return {
      {"KeyRerotationPress",
       K::kWrapper,
       "inner scorer's selection, kept keys re-rotated to positions 0..n_kept-1",
       {{{{"inv_freq"}}, {{"cos", "sin"}}}},
       [](double r, Params& p) { return std::make_unique<KeyRerotationPress>(inner_scorer(p, r)); }},
      {"ChunkKVPress",
       K::kWrapper,
       "inner scores averaged per chunk, best chunks kept whole",
       {{}, {}, {}, "no attentions (kvpress refuses them)"},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<ChunkKVPress>(
             inner, p.get("chunk_length", ChunkKVPress::kDefaultChunkLength, "tokens per chunk"));
       }},
      {"EntropyGatedChunkKVPress",
       K::kWrapper,
       "ChunkKV whose important low-entropy chunks keep only their best tokens",
       {{}, {}, {}, "no attentions (kvpress refuses them)"},
       [](double r, Params& p) {
         using P = EntropyGatedChunkKVPress;
         auto inner = inner_scorer(p, r);
         const int64_t length = p.get("chunk_length", P::kDefaultChunkLength, "tokens per chunk");
         const int64_t low = p.get("low_entropy_chunk_length", P::kDefaultLowEntropyChunkLength,
                                   "tokens kept from an important chunk whose scores are spiky");
         return std::make_unique<P>(inner, length, low);
       }},
      {"ChunkPress",
       K::kWrapper,
       "inner press applied to each chunk independently",
       {{}, {}, {}, "no attentions (kvpress refuses them)"},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<ChunkPress>(
             inner, p.get("chunk_length", ChunkPress::kDefaultChunkLength, "tokens per chunk"));
       }},
      {"BlockPress",
       K::kWrapper,
       "block-iterative selection with the inner scorer",
       {{}, {}, {}, "the inner press sees keys and values only"},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<BlockPress>(inner,
                                             p.get("block_size", BlockPress::kDefaultBlockSize, "tokens per block"));
       }},
      {"ComposedPress",
       K::kWrapper,
       "presses applied in order",
       {{}, {}, {}, "later presses see keys and values only"},
       [](double r, Params& p) { return std::make_unique<ComposedPress>(composed_presses(p, r)); }},
  };
}

// The parameters every decoding press declares, in this order: the inner scorer, the interval,
// the target (unless the budget is a ratio) and the hidden-state buffer.
struct DecodingParams {
  ScorerFactory inner;
  int64_t interval = 0, target = 0, buffer = 0;
};
DecodingParams decoding_params(Params& p, bool with_target) {
  DecodingParams d;
  d.inner = scorer_factory(p, "inner ScorerPress (its parameters as press.<name>; its ratio is overridden)");
  d.interval =
      p.get("compression_interval", DecodingPress::kDefaultCompressionInterval, "decoding steps between compressions");
  if (with_target)
    d.target = p.get("target_size", DecodingPress::kDefaultTargetSize, "tokens kept per layer after a compression");
  d.buffer = p.get("hidden_states_buffer_size", DecodingPress::kDefaultHiddenStatesBufferSize,
                   "decoding steps of hidden states kept for the inner press");
  return d;
}

// Presses that compress while the model generates.
std::vector<Entry> decoding_entries() {
  using K = PressKind;
  return {
      {"DecodingPress",
       K::kDecoding,
       "compresses during decoding: every compression_interval steps, to target_size tokens",
       {{}, {}, {}, "the inner press gets keys/values, queries of the buffered hidden states and attentions"},
       [](double r, Params& p) {
         const DecodingParams d = decoding_params(p, true);
         return std::make_unique<DecodingPress>(d.inner, d.interval, d.target, d.buffer);
       },
       "the budget is target_size; CompressionRatioDecodingPress keeps a fraction"},
      {"CAMPress",
       K::kDecoding,
       "compresses during decoding like DecodingPress, first merging evicted values into their kept successors "
       "(Bernoulli by running attention)",
       {{}, {}, {}, "the inner press gets keys/values and queries of the buffered hidden states"},
       [](double r, Params& p) {
         const DecodingParams d = decoding_params(p, true);
         const int64_t merge_budget =
             p.get("merge_budget", CAMPress::kDefaultMergeBudget, "kept successors each merged value spreads over");
         return std::make_unique<CAMPress>(d.inner, d.interval, d.target, d.buffer, merge_budget);
       },
       "the budget is target_size"},
      {"CompressionRatioDecodingPress",
       K::kDecoding,
       "compresses during decoding: every compression_interval steps, to (1 - ratio) of the tokens seen",
       {{}, {}, {}, "the inner press gets keys/values, queries of the buffered hidden states and attentions"},
       [](double r, Params& p) {
         const DecodingParams d = decoding_params(p, false);
         return std::make_unique<CompressionRatioDecodingPress>(d.inner, r, d.interval, d.buffer);
       }},
      {"PrefillDecodingPress",
       K::kDecoding,
       "a prefill press and a decoding press under one name",
       {{}, {}, {}, "at prefill: the prefilling press's; while decoding: the decoding press's"},
       [](double r, Params& p) {
         const std::string prefilling_name =
             p.get_text("prefilling_press", "None", "press applied at prefill (parameters as prefilling_press.<name>)");
         auto prefilling = named_press(p, "prefilling_press", prefilling_name, r);
         const std::string decoding_name =
             p.get_text("decoding_press", "None",
                        "DecodingPress or CompressionRatioDecodingPress (parameters as decoding_press.<name>)");
         auto decoding_part = named_press(p, "decoding_press", decoding_name, r);
         auto decoding = std::dynamic_pointer_cast<const DecodingPress>(decoding_part);
         TORCH_CHECK(!decoding_part || decoding,
                     "PrefillDecodingPress: decoding_press must be DecodingPress or "
                     "CompressionRatioDecodingPress, got ",
                     decoding_part->name());
         return std::make_unique<PrefillDecodingPress>(prefilling, decoding);
       }},
  };
}

// Presses that give heads or layers their own budgets.
std::vector<Entry> budget_entries() {
  using K = PressKind;
  return {
      {"AdaKVPress",
       K::kWrapper,
       "inner scores, safeguarded, kept across heads (head budgets vary; head-ragged)",
       {},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<AdaKVPress>(inner, p.get("alpha_safeguard", AdaKVPress::kDefaultAlphaSafeguard,
                                                          "fraction of n_kept every head keeps at least"));
       }},
      {"DMSPress",
       K::kWrapper,
       "tokens leaving a sliding window evicted per head where the inner score is below a threshold (prefill, and "
       "with decoding=true while generating; head-ragged)",
       {{}, {}, {}, "the inner press gets no attention weights (kvpress passes none)"},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, 0.0);
         const std::optional<double> threshold =
             p.get_optional_double("threshold", "evict a token whose inner score is below it (must be set)");
         const int64_t window =
             p.get("sliding_window_size", DMSPress::kDefaultSlidingWindowSize, "most recent tokens never evicted");
         const bool decoding = p.get("decoding", DMSPress::kDefaultDecoding, "also evict while generating");
         return std::make_unique<DMSPress>(inner, threshold, window, decoding);
       },
       "the threshold and the content set how much is evicted"},
      {"MergingPress",
       K::kWrapper,
       "inner scorer's selection; each evicted value folded into its most key-similar kept token",
       {},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         const double threshold = p.get("similarity_threshold", MergingPress::kDefaultSimilarityThreshold,
                                        "least cosine similarity for a merge");
         const double fraction = p.get("merge_fraction", MergingPress::kDefaultMergeFraction,
                                       "fraction of the evicted tokens merged (the most similar)");
         return std::make_unique<MergingPress>(std::move(inner), threshold, fraction);
       }},
      {"LUKVPress",
       K::kWrapper,
       "LU-KV: head budgets from a precomputed budget curve (read from budget_curves) around an inner scorer; "
       "head-ragged",
       {kPreRopeQueryInputs.alternatives,
        {},
        {"layer_idx"},
        "the inputs of its default inner press, ExpectedAttentionPress (another inner press reads its own); the curve "
        "comes from the file named by budget_curves, its row from layer_idx; the ratio is LU-KV's own"},
       [](double r, Params& p) {
         // kvpress's default inner press is ExpectedAttentionPress(epsilon=2e-2), scoring only (ratio 0).
         const std::string inner =
             p.get_text("press", "ExpectedAttentionPress",
                        "inner ScorerPress (its parameters as press.<name>; an "
                        "ExpectedAttentionPress gets epsilon=0.02 unless press.epsilon is given)");
         std::map<std::string, std::string> inner_params = p.take_prefixed("press.");
         double inner_ratio = 0.0;
         if (const auto it = inner_params.find("compression_ratio"); it != inner_params.end()) {
           inner_ratio = p.ratio("press.compression_ratio", it->second);
           inner_params.erase(it);
         }
         if (inner == "ExpectedAttentionPress" && !inner_params.count("epsilon")) inner_params["epsilon"] = "0.02";
         auto scorer = as_scorer(make_press(inner, inner_ratio, inner_params), p.press_name(), inner);
         const std::string path =
             p.get_path("budget_curves", "safetensors file with budget_curves [99, num_layers, num_kv_heads]");
         const int64_t sink = p.get("sink", LUKVPress::kDefaultSink, "first tokens always kept");
         const int64_t window = p.get("window", LUKVPress::kDefaultWindow, "last tokens always kept");
         return std::make_unique<LUKVPress>(
             std::move(scorer), r, path.empty() ? at::Tensor() : LUKVPress::load_budget_curves(path), sink, window);
       }},
      {"CriticalKVPress",
       K::kWrapper,
       "inner scores x ||v W_o||_1, the first stage's winners kept",
       {{}, {"o_proj"}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         const double eps =
             p.get("epsilon", CriticalKVPress::kDefaultEpsilon, "added to the inner scores before the rescaling");
         const double first = p.get("first_stage_ratio", CriticalKVPress::kDefaultFirstStageRatio,
                                    "fraction of the budget chosen by the inner scores alone");
         return std::make_unique<CriticalKVPress>(inner, eps, first);
       }},
      {"CriticalAdaKVPress",
       K::kWrapper,
       "AdaKV head budgets with CriticalKV's two stages per head (head-ragged)",
       {{}, {"o_proj"}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         const double alpha = p.get("alpha_safeguard", CriticalAdaKVPress::kDefaultAlphaSafeguard,
                                    "fraction of n_kept every head keeps at least");
         const double eps =
             p.get("epsilon", CriticalAdaKVPress::kDefaultEpsilon, "added to the inner scores before the rescaling");
         const double first = p.get("first_stage_ratio", CriticalAdaKVPress::kDefaultFirstStageRatio,
                                    "fraction of each head's budget chosen by the inner scores alone");
         return std::make_unique<CriticalAdaKVPress>(inner, alpha, eps, first);
       }},
      {"PyramidKVPress",
       K::kScorer,
       "SnapKV scores, budgets shrinking linearly from the first layer to the last",
       {kWindowAttentionInputs.alternatives, {}, {"layer_idx", "num_layers"}},
       [](double r, Params& p) {
         const int64_t window = p.get("window_size", PyramidKVPress::kDefaultWindowSize,
                                      "number of trailing queries observed (always kept)");
         const int64_t kernel =
             p.get("kernel_size", PyramidKVPress::kDefaultKernelSize, "odd width of the average pooling");
         const int64_t beta = p.get("beta", PyramidKVPress::kDefaultBeta, "steepness of the pyramid (>= 1)");
         return std::make_unique<PyramidKVPress>(r, window, kernel, beta);
       }},
      {"PerLayerCompressionPress",
       K::kWrapper,
       "inner press with its own compression ratio in every layer",
       {{}, {}, {"layer_idx", "num_layers"}},
       [](double r, Params& p) {
         ScorerFactory make = scorer_factory(p, kInnerPressHelp);
         return std::make_unique<PerLayerCompressionPress>(make, ratio_list(p, r));
       }},
  };
}

// CTR-Press (the CTRPress kvpress fork).
std::vector<Entry> ctr_entries() {
  using K = PressKind;
  return {
      {"QSMPress",
       K::kScorer,
       "CTR-Press stage I: query-span attention x semantic factor, forced keeps, value merge",
       {{{{"queries"}}, {{"hidden_states", "q_proj", "cos", "sin"}}}, {}, {"input_ids"}, kSemanticNote},
       [](double r, Params& p) { return std::make_unique<QSMPress>(r, qsm_options(p)); }},
      {"CTRPress",
       K::kScorer,
       "CTR-Press: QSMPress with an entropy-adaptive budget and rescue merge of evicted tokens",
       {{{{"queries"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}, {}, {"input_ids"}, kSemanticNote},
       [](double r, Params& p) {
         QSMOptions qsm = qsm_options(p);
         return std::make_unique<CTRPress>(r, std::move(qsm), ctr_options(p));
       }},
  };
}

// Every press, in the order of list_presses().
const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = [] {
    std::vector<Entry> all;
    for (auto group : {scorer_entries, rebuilding_scorer_entries, channel_entries, layer_entries, second_pass_entries,
                       wrapper_entries, decoding_entries, budget_entries, ctr_entries}) {
      std::vector<Entry> entries = group();
      all.insert(all.end(), std::make_move_iterator(entries.begin()), std::make_move_iterator(entries.end()));
    }
    return all;
  }();
  return table;
}

const Entry* find_entry(const std::string& name) {
  for (const auto& e : entries())
    if (e.name == name) return &e;
  return nullptr;
}

bool takes_ratio(const std::string& name) {
  const Entry* entry = find_entry(name);
  return entry == nullptr || entry->no_ratio.empty();
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

}  // namespace

const std::vector<PressInfo>& list_presses() {
  static const std::vector<PressInfo> infos = [] {
    std::vector<PressInfo> out;
    for (const auto& e : entries()) {
      Params declared(e.name, {});
      e.make(0.0, declared);  // every factory declares its parameters as it reads them
      out.push_back(PressInfo{e.name, e.kind, e.summary, e.inputs, declared.declared(), e.no_ratio});
    }
    return out;
  }();
  return infos;
}

const PressInfo* find_press(const std::string& name) {
  for (const auto& info : list_presses())
    if (info.name == name) return &info;
  return nullptr;
}

bool needs_file(const PressInfo& info) {
  return std::any_of(info.params.begin(), info.params.end(), [](const PressParam& p) { return p.type == "path"; });
}

double ratio_for(const PressInfo& info, double compression_ratio) {
  return info.no_ratio.empty() ? compression_ratio : 0.0;
}

std::string describe_inputs(const PressInfo& info) {
  const PressInputs& in = info.inputs;
  if (info.kind == PressKind::kSecondPass) return "second pass: " + in.note;
  std::vector<std::string> alternatives;
  for (const InputSet& set : in.alternatives)
    alternatives.push_back(join(set.fields, "+") + (set.all_positions ? " (all positions)" : ""));
  std::string text = join(alternatives, " | ");
  if (!in.required.empty()) text += (text.empty() ? "" : ", with ") + join(in.required, "+");
  if (info.kind == PressKind::kWrapper || info.kind == PressKind::kDecoding) {
    if (alternatives.size() > 1) text = "(" + text + ")";
    text = text.empty() ? "the inner press's" : "the inner press's + " + text;
  }
  if (text.empty()) text = "keys, values";
  if (!in.optional.empty()) text += "; uses " + join(in.optional, ", ") + " when given";
  if (!in.note.empty()) text += "; " + in.note;
  return info.kind == PressKind::kDecoding ? "during decoding: " + text : text;
}

bool needs_attentions(const std::string& name) {
  const PressInfo* info = find_press(name);
  if (info == nullptr || info->inputs.alternatives.empty()) return false;
  for (const InputSet& set : info->inputs.alternatives)
    if (std::find(set.fields.begin(), set.fields.end(), "attentions") == set.fields.end()) return false;
  return true;
}

std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params) {
  const Entry* entry = find_entry(name);
  if (entry == nullptr) {
    std::vector<std::string> names;
    for (const auto& e : entries()) names.push_back(e.name);
    TORCH_CHECK(false, "make_press: unknown press '", name, "' (known: ", join(names, ", "), ")");
  }
  TORCH_CHECK(entry->no_ratio.empty() || compression_ratio == 0.0, name, ": compression_ratio must be 0 (",
              entry->no_ratio, "), got ", compression_ratio);
  Params p(name, params);
  std::unique_ptr<BasePress> press = entry->make(compression_ratio, p);
  p.check_all_used();
  return press;
}

}  // namespace kvpress
