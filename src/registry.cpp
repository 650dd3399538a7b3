// Name -> press factory with kvpress's parameter names and defaults.
#include "kvpress/registry.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <set>

#include "kvpress/presses/adakv_press.h"
#include "kvpress/presses/block_press.h"
#include "kvpress/presses/chunk_press.h"
#include "kvpress/presses/chunkkv_press.h"
#include "kvpress/presses/compactor_press.h"
#include "kvpress/presses/composed_press.h"
#include "kvpress/presses/compression_ratio_decoding_press.h"
#include "kvpress/presses/ctr_press.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/presses/critical_adakv_press.h"
#include "kvpress/presses/criticalkv_press.h"
#include "kvpress/presses/expected_attention_press.h"
#include "kvpress/presses/key_rerotation_press.h"
#include "kvpress/presses/keydiff_press.h"
#include "kvpress/presses/kvcompose_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/presses/observed_attention_press.h"
#include "kvpress/presses/per_layer_compression_press.h"
#include "kvpress/presses/prefill_decoding_press.h"
#include "kvpress/presses/pyramidkv_press.h"
#include "kvpress/presses/qsm_press.h"
#include "kvpress/presses/random_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "kvpress/presses/streaming_llm_press.h"
#include "kvpress/presses/tova_press.h"

namespace kvpress {
namespace {

// Typed access to text parameters; remembers which ones were read so leftovers can be refused.
class Params {
 public:
  Params(std::string press, const std::map<std::string, std::string>& values)
      : press_(std::move(press)), values_(values) {}

  int64_t get_int(const std::string& key, int64_t fallback) {
    const std::optional<std::string> text = take(key);
    if (!text) return fallback;
    return parse_int(key, *text);
  }

  std::optional<int64_t> get_optional_int(const std::string& key) {
    const std::optional<std::string> text = take(key);
    if (!text || *text == "None" || *text == "none") return std::nullopt;
    return parse_int(key, *text);
  }

  std::optional<double> get_optional_double(const std::string& key) {
    const std::optional<std::string> text = take(key);
    if (!text || *text == "None" || *text == "none") return std::nullopt;
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(text->c_str(), &end);
    TORCH_CHECK(!text->empty() && end && *end == '\0' && errno == 0 && std::isfinite(v), press_, ": parameter ", key,
                " must be a number or None, got '", *text, "'");
    return v;
  }

  bool get_bool(const std::string& key, bool fallback) {
    const std::optional<std::string> text = take(key);
    if (!text) return fallback;
    if (*text == "true" || *text == "True" || *text == "1") return true;
    if (*text == "false" || *text == "False" || *text == "0") return false;
    TORCH_CHECK(false, press_, ": parameter ", key, " must be true or false, got '", *text, "'");
  }

  std::optional<std::string> get_string(const std::string& key) { return take(key); }

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

  const std::string& press_name() const { return press_; }

  // Every given parameter must have been read by the factory.
  void check_all_used(const std::vector<PressParam>& known) const {
    for (const auto& [key, value] : values_) {
      if (used_.count(key)) continue;
      std::string names;
      for (const auto& p : known) names += (names.empty() ? "" : ", ") + p.name;
      TORCH_CHECK(false, press_, ": unknown parameter '", key, "' (known: ",
                  names.empty() ? std::string("none") : names, ")");
    }
  }

 private:
  std::optional<std::string> take(const std::string& key) {
    used_.insert(key);
    const auto it = values_.find(key);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  int64_t parse_int(const std::string& key, const std::string& text) const {
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    TORCH_CHECK(!text.empty() && end && *end == '\0' && errno == 0, press_, ": parameter ", key,
                " must be an integer, got '", text, "'");
    return static_cast<int64_t>(v);
  }

  std::string press_;
  const std::map<std::string, std::string>& values_;
  std::set<std::string> used_;
};

// The inner ScorerPress of a wrapper: parameter `press` names it, `press.<param>` are its
// parameters, and it gets the wrapper's compression ratio. kvpress requires the inner press; the
// registry defaults it to KnormPress so that every registered press builds from its name alone.
std::shared_ptr<const ScorerPress> inner_scorer(Params& p, double ratio) {
  const std::string inner = p.get_string("press").value_or("KnormPress");
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  std::shared_ptr<BasePress> built = make_press(inner, ratio, p.take_prefixed("press."));
  auto scorer = std::dynamic_pointer_cast<const ScorerPress>(std::shared_ptr<const BasePress>(built));
  TORCH_CHECK(scorer != nullptr, p.press_name(), ": press must be a ScorerPress, got ", inner);
  return scorer;
}

// ComposedPress's presses: `presses` = "A,B,..."; `presses.<i>.<param>` are press i's parameters
// and `presses.<i>.compression_ratio` its ratio (default: the ratio given to ComposedPress).
std::vector<std::shared_ptr<const BasePress>> composed_presses(Params& p, double ratio) {
  const std::optional<std::string> list = std::optional<std::string>(p.get_string("presses").value_or("KnormPress"));
  std::vector<std::shared_ptr<const BasePress>> out;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t comma = list->find(',', begin);
    const std::string name = list->substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    TORCH_CHECK(!name.empty(), "ComposedPress: presses must be comma-separated press names, got '", *list, "'");
    std::map<std::string, std::string> params = p.take_prefixed("presses." + std::to_string(i) + ".");
    double r = ratio;
    if (const auto it = params.find("compression_ratio"); it != params.end()) {
      char* end = nullptr;
      r = std::strtod(it->second.c_str(), &end);
      TORCH_CHECK(end && *end == '\0' && !it->second.empty(), "ComposedPress: parameter presses.", i,
                  ".compression_ratio must be a number, got '", it->second, "'");
      params.erase(it);
    }
    out.push_back(make_press(name, r, params));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

// PrefillDecodingPress's parts: `<key>` names a press ("None" or empty: none), `<key>.<param>` are
// its parameters and `<key>.compression_ratio` its ratio. The prefilling press gets the given ratio
// by default; the decoding press gets it only when it is a CompressionRatioDecodingPress (a
// DecodingPress's budget is its target_size, and its ratio must be 0).
std::shared_ptr<const BasePress> prefill_decoding_part(Params& p, const std::string& key, double ratio) {
  const std::string name = p.get_string(key).value_or("None");
  std::map<std::string, std::string> params = p.take_prefixed(key + ".");
  if (name.empty() || name == "None" || name == "none") {
    TORCH_CHECK(params.empty(), p.press_name(), ": parameters ", key, ".* given without ", key);
    return nullptr;
  }
  double r = key == "decoding_press" && name != "CompressionRatioDecodingPress" ? 0.0 : ratio;
  if (const auto it = params.find("compression_ratio"); it != params.end()) {
    char* end = nullptr;
    r = std::strtod(it->second.c_str(), &end);
    TORCH_CHECK(end && *end == '\0' && !it->second.empty(), p.press_name(), ": parameter ", key,
                ".compression_ratio must be a number, got '", it->second, "'");
    params.erase(it);
  }
  return std::shared_ptr<const BasePress>(make_press(name, r, params));
}

// A factory of the inner ScorerPress (`press`, `press.<param>`) for wrappers that need it at
// several ratios (PerLayerCompressionPress). Built once here so that a bad name or parameter is
// reported by make_press, not later.
ScorerFactory scorer_factory(Params& p) {
  const std::string inner = p.get_string("press").value_or("KnormPress");
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  const std::map<std::string, std::string> params = p.take_prefixed("press.");
  const std::string outer = p.press_name();
  ScorerFactory make = [inner, params, outer](double ratio) {
    std::shared_ptr<BasePress> built = make_press(inner, ratio, params);
    auto scorer = std::dynamic_pointer_cast<const ScorerPress>(std::shared_ptr<const BasePress>(built));
    TORCH_CHECK(scorer != nullptr, outer, ": press must be a ScorerPress, got ", inner);
    return scorer;
  };
  return make;
}

// PerLayerCompressionPress's `compression_ratios`: comma-separated numbers, one per layer; unset
// (or None) is the ratio given to make_press for every layer.
std::vector<double> ratio_list(Params& p, double ratio) {
  const std::optional<std::string> text = p.get_string("compression_ratios");
  if (!text || *text == "None" || *text == "none") return {ratio};
  std::vector<double> out;
  size_t begin = 0;
  while (true) {
    const size_t comma = text->find(',', begin);
    const std::string item = text->substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    TORCH_CHECK(!item.empty() && end && *end == '\0' && errno == 0 && std::isfinite(v), p.press_name(),
                ": parameter compression_ratios must be comma-separated numbers (one per layer), got '", *text, "'");
    out.push_back(v);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

// QSMPress / CTRPress (CTR-Press): the reference's parameter names and defaults.
std::vector<PressParam> qsm_params() {
  return {
      {"query_length", "int", "0", "explicit query: the last query_length tokens (0: the pseudo-query)"},
      {"pseudo_query_len", "int", "128", "longest pseudo-query (the last prompt tokens)"},
      {"pseudo_query_max_fraction", "float", "0.125", "longest pseudo-query as a fraction of the prompt"},
      {"qa_alpha", "float", "0.5", "weight of the mean (1 - qa_alpha: of the max) attention over the query span"},
      {"sink_tokens", "int", "4", "first tokens always kept"},
      {"recent_tokens", "int", "32", "last context tokens always kept"},
      {"keep_pseudo_query", "bool", "true", "always keep the pseudo-query span"},
      {"use_query_aware", "bool", "true", "query-aware attention scores (false: zeros)"},
      {"score_normalization", "bool", "true", "min-max normalise the scores per head"},
      {"use_semantic", "bool", "true", "factor 1 + lambda_sem * tanh(w), w from token text (input_ids + callback)"},
      {"lambda_sem", "float", "0.3", "strength of the semantic factor"},
      {"digit_weight", "float", "1", "w: token has a digit"},
      {"capital_weight", "float", "0.5", "w: token has an uppercase letter"},
      {"rare_weight", "float", "0.3", "w: token has >= rare_min_chars characters (or id >= rare_token_id_threshold)"},
      {"punctuation_weight", "float", "0.2", "w: token has one of .!?;: or a newline"},
      {"code_weight", "float", "0.4", "w: token has a code symbol"},
      {"stopword_weight", "float", "0.3", "w: minus, token is a stopword"},
      {"whitespace_weight", "float", "0.3", "w: minus, token is blank"},
      {"rare_min_chars", "int", "8", "length of a rare token"},
      {"rare_token_id_threshold", "int?", "None", "ids from this one up count as rare"},
      {"use_merge", "bool", "true", "merge evicted values into the nearest kept token (explicit query only)"},
      {"merge_in_pseudo_query", "bool", "false", "merge with the pseudo-query too"},
      {"merge_alpha", "float", "0.2", "gamma: strength of the value merge"},
      {"merge_target", "str", "nearest", "merge target (only nearest)"},
      {"merge_weighting", "str", "score", "score or uniform"},
      {"merge_score_power", "float", "4", "exponent of the relative score weights"},
      {"merge_min_score_ratio", "float", "0.5", "relative scores below this do not merge"},
      {"merge_count_power", "float", "0.75", "p: merged mass m enters as m^(1 - p)"},
  };
}

QSMOptions qsm_options(Params& p) {
  auto num = [&p](const char* key, double fallback) { return p.get_optional_double(key).value_or(fallback); };
  QSMOptions o;
  o.query_length = p.get_int("query_length", 0);
  o.pseudo_query_len = p.get_int("pseudo_query_len", 128);
  o.pseudo_query_max_fraction = num("pseudo_query_max_fraction", 0.125);
  o.qa_alpha = num("qa_alpha", 0.5);
  o.sink_tokens = p.get_int("sink_tokens", 4);
  o.recent_tokens = p.get_int("recent_tokens", 32);
  o.keep_pseudo_query = p.get_bool("keep_pseudo_query", true);
  o.use_query_aware = p.get_bool("use_query_aware", true);
  o.score_normalization = p.get_bool("score_normalization", true);
  o.use_semantic = p.get_bool("use_semantic", true);
  o.lambda_sem = num("lambda_sem", 0.3);
  o.semantic.digit_weight = num("digit_weight", 1.0);
  o.semantic.capital_weight = num("capital_weight", 0.5);
  o.semantic.rare_weight = num("rare_weight", 0.3);
  o.semantic.punctuation_weight = num("punctuation_weight", 0.2);
  o.semantic.code_weight = num("code_weight", 0.4);
  o.semantic.stopword_weight = num("stopword_weight", 0.3);
  o.semantic.whitespace_weight = num("whitespace_weight", 0.3);
  o.semantic.rare_min_chars = p.get_int("rare_min_chars", 8);
  o.semantic.rare_token_id_threshold = p.get_optional_int("rare_token_id_threshold");
  o.use_merge = p.get_bool("use_merge", true);
  o.merge_in_pseudo_query = p.get_bool("merge_in_pseudo_query", false);
  o.merge_alpha = num("merge_alpha", 0.2);
  const std::string target = p.get_string("merge_target").value_or("nearest");
  TORCH_CHECK(target == "nearest", p.press_name(), ": parameter merge_target must be nearest, got '", target, "'");
  const std::string weighting = p.get_string("merge_weighting").value_or("score");
  TORCH_CHECK(weighting == "score" || weighting == "uniform", p.press_name(),
              ": parameter merge_weighting must be score or uniform, got '", weighting, "'");
  o.merge_weighting = weighting == "score" ? MergeWeighting::kScore : MergeWeighting::kUniform;
  o.merge_score_power = num("merge_score_power", 4.0);
  o.merge_min_score_ratio = num("merge_min_score_ratio", 0.5);
  o.merge_count_power = num("merge_count_power", 0.75);
  return o;
}

std::vector<PressParam> ctr_params() {
  std::vector<PressParam> out = qsm_params();
  out.push_back({"rescue_ratio", "float", "0.1", "fraction of the evicted tokens rescued per head (0: none)"});
  out.push_back({"rescue_scoring", "str", "key_miss", "rescue score (only key_miss)"});
  out.push_back({"use_layer_adaptive", "bool", "true", "entropy-adaptive budget"});
  out.push_back({"entropy_beta", "float", "0.2", "beta: n' = round(n * (1 + beta * (1 - 2 E/E_max)))"});
  out.push_back({"entropy", "str", "non_forced",
                 "non_forced (E over the non-forced tokens) or reference (the reference's overflowing arithmetic)"});
  return out;
}

CTROptions ctr_options(Params& p) {
  CTROptions o;
  o.rescue_ratio = p.get_optional_double("rescue_ratio").value_or(0.1);
  const std::string scoring = p.get_string("rescue_scoring").value_or("key_miss");
  TORCH_CHECK(scoring == "key_miss", p.press_name(), ": parameter rescue_scoring must be key_miss, got '", scoring,
              "'");
  o.use_layer_adaptive = p.get_bool("use_layer_adaptive", true);
  o.entropy_beta = p.get_optional_double("entropy_beta").value_or(0.2);
  const std::string entropy = p.get_string("entropy").value_or("non_forced");
  TORCH_CHECK(entropy == "non_forced" || entropy == "reference", p.press_name(),
              ": parameter entropy must be non_forced or reference, got '", entropy, "'");
  o.entropy = entropy == "reference" ? CTREntropy::kReference : CTREntropy::kNonForced;
  return o;
}

using Factory = std::function<std::unique_ptr<BasePress>(double, Params&)>;

struct Entry {
  PressInfo info;
  Factory make;
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = {
      {{"RandomPress", "uniform random scores (baseline)", "keys",
        {{"seed", "int?", "None", "seed of the CPU generator; unset draws fresh scores each call"}}},
       [](double r, Params& p) { return std::make_unique<RandomPress>(r, p.get_optional_int("seed")); }},
      {{"KnormPress", "keep keys of smallest L2 norm", "keys", {}},
       [](double r, Params&) { return std::make_unique<KnormPress>(r); }},
      {{"StreamingLLMPress", "keep n_sink first and the most recent tokens", "keys",
        {{"n_sink", "int", "4", "number of initial tokens always kept"}}},
       [](double r, Params& p) { return std::make_unique<StreamingLLMPress>(r, p.get_int("n_sink", 4)); }},
      {{"KeyDiffPress", "keep keys least similar to the mean key direction", "keys", {}},
       [](double r, Params&) { return std::make_unique<KeyDiffPress>(r); }},
      {{"SnapKVPress", "attention of the last window_size queries, pooled",
        "attentions | queries | hidden_states+q_proj+cos+sin",
        {{"window_size", "int", "64", "number of trailing queries observed (always kept)"},
         {"kernel_size", "int", "5", "odd width of the average pooling"}}},
       [](double r, Params& p) {
         const int64_t window = p.get_int("window_size", 64);
         return std::make_unique<SnapKVPress>(r, window, p.get_int("kernel_size", 5));
       }},
      {{"LagKVPress", "lag-relative K/V statistics per partition", "keys+values",
        {{"n_sink", "int", "4", "number of initial tokens always kept"},
         {"lag_size", "int", "128", "partition length"},
         {"cross_scoring", "bool", "false", "compare raw scores across partitions instead of ranks"}}},
       [](double r, Params& p) {
         const int64_t n_sink = p.get_int("n_sink", 4);
         const int64_t lag = p.get_int("lag_size", 128);
         return std::make_unique<LagKVPress>(r, n_sink, lag, p.get_bool("cross_scoring", false));
       }},
      {{"TOVAPress", "last query's attention, averaged over all heads",
        "attentions | queries | hidden_states+q_proj+cos+sin", {}},
       [](double r, Params&) { return std::make_unique<TOVAPress>(r); }},
      {{"ObservedAttentionPress", "mean attention received (H2O-like)", "attentions (all rows)", {}},
       [](double r, Params&) { return std::make_unique<ObservedAttentionPress>(r); }},
      {{"LeverageScorePress", "ridge leverage of the pre-RoPE keys (Gaussian sketch), z-scored",
        "cos+sin | hidden_states+k_proj",
        {{"sketch_dimension", "int", "48", "columns of the right Gaussian sketch"},
         {"seed", "int?", "None", "seed of the sketch's CPU generator (kvpress: torch.manual_seed before score)"}}},
       [](double r, Params& p) {
         const int64_t sketch = p.get_int("sketch_dimension", 48);
         return std::make_unique<LeverageScorePress>(r, sketch, p.get_optional_int("seed"));
       }},
      {{"NonCausalAttnPress", "chunked non-causal attention received, x ||v||, pooled, z-scored",
        "queries (all positions) | hidden_states+q_proj+cos+sin",
        {{"chunk_size", "int", "256", "positions per non-causal attention chunk"}}},
       [](double r, Params& p) { return std::make_unique<NonCausalAttnPress>(r, p.get_int("chunk_size", 256)); }},
      {{"CompactorPress", "blending * z(leverage) + z(non-causal attention), sinks kept",
        "queries (all positions)+cos+sin | hidden_states+q_proj+k_proj+cos+sin",
        {{"sink_size_start", "int", "8", "first tokens always kept"},
         {"sink_size_end", "int", "4", "last tokens always kept"},
         {"chunk_size", "int", "256", "positions per non-causal attention chunk"},
         {"sketch_dimension", "int", "48", "columns of the leverage sketch"},
         {"blending", "float?", "None", "weight of the leverage scores; None = compression_ratio (paper: 0.3)"},
         {"seed", "int?", "None", "seed of the leverage sketch's CPU generator"},
         {"selection", "str", "per_head",
          "per_head (kvpress) or across_heads (the paper's global top-k; head budgets vary, head-ragged)"}}},
       [](double r, Params& p) {
         const int64_t start = p.get_int("sink_size_start", 8);
         const int64_t end = p.get_int("sink_size_end", 4);
         const int64_t chunk = p.get_int("chunk_size", 256);
         const int64_t sketch = p.get_int("sketch_dimension", 48);
         const std::optional<double> blending = p.get_optional_double("blending");
         const std::string selection = p.get_string("selection").value_or("per_head");
         TORCH_CHECK(selection == "per_head" || selection == "across_heads",
                     "CompactorPress: parameter selection must be per_head or across_heads, got ", selection);
         return std::make_unique<CompactorPress>(r, start, end, chunk, sketch, blending, p.get_optional_int("seed"),
                                                 selection == "per_head" ? TokenSelection::kPerHead
                                                                         : TokenSelection::kAcrossHeads);
       }},
      {{"ExpectedAttentionPress", "expected attention of future queries (query mean/covariance, averaged RoPE)",
        "hidden_states+q_proj(+inv_freq | cos+sin) | queries (all positions)+cos+sin",
        {{"n_future_positions", "int", "512", "future positions the RoPE is averaged over"},
         {"n_sink", "int", "4", "first tokens always kept and left out of the query statistics"},
         {"use_covariance", "bool", "true", "add the query covariance term"},
         {"use_vnorm", "bool", "true", "rescale by ||v||"},
         {"epsilon", "float", "0", "added to the scores before the ||v|| rescaling"}}},
       [](double r, Params& p) {
         const int64_t n_future = p.get_int("n_future_positions", 512);
         const int64_t n_sink = p.get_int("n_sink", 4);
         const bool cov = p.get_bool("use_covariance", true);
         const bool vnorm = p.get_bool("use_vnorm", true);
         return std::make_unique<ExpectedAttentionPress>(r, n_future, n_sink, cov, vnorm,
                                                         p.get_optional_double("epsilon").value_or(0.0));
       }},
      {{"KVComposePress", "global per-layer (structured) or per-head (unstructured) budgets from a second pass's attention",
        "second pass: a task prompt's attention to the context in every layer (kvpress::llama::kvcompose_prefill, "
        "or KVComposePress::start_session)",
        {{"structured", "bool", "true", "each layer keeps k_l tokens per head; false: per-(layer, head) budgets, head-ragged"},
         {"agg_task", "str", "max", "over the prompt's queries: max or mean"},
         {"agg_group", "str", "mean", "over a KV group's query heads: max or mean"},
         {"agg_head", "str", "mean", "over KV heads, of the sorted curves: max or mean"},
         {"add_v_norm", "bool", "false", "multiply scores by ||v||"},
         {"add_mean_across_heads", "bool", "true", "add the mean over KV heads to every head's scores"},
         {"keep_token_lower_bound", "int", "0", "minimum tokens per layer"}}},
       [](double r, Params& p) {
         KVComposeOptions o;
         o.structured = p.get_bool("structured", true);
         o.agg_task = p.get_string("agg_task").value_or("max");
         o.agg_group = p.get_string("agg_group").value_or("mean");
         o.agg_head = p.get_string("agg_head").value_or("mean");
         o.add_v_norm = p.get_bool("add_v_norm", false);
         o.add_mean_across_heads = p.get_bool("add_mean_across_heads", true);
         o.keep_token_lower_bound = p.get_int("keep_token_lower_bound", 0);
         return std::make_unique<KVComposePress>(r, std::move(o));
       }},
      {{"KeyRerotationPress", "inner scorer's selection, kept keys re-rotated to positions 0..n_kept-1",
        "the inner press's + inv_freq | cos+sin",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"}}},
       [](double r, Params& p) { return std::make_unique<KeyRerotationPress>(inner_scorer(p, r)); }},
      {{"ChunkKVPress", "inner scores averaged per chunk, best chunks kept whole", "the inner press's (no attentions)",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"chunk_length", "int", "20", "tokens per chunk"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<ChunkKVPress>(inner, p.get_int("chunk_length", 20));
       }},
      {{"ChunkPress", "inner press applied to each chunk independently", "the inner press's (no attentions)",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"chunk_length", "int", "1024", "tokens per chunk"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<ChunkPress>(inner, p.get_int("chunk_length", 1024));
       }},
      {{"BlockPress", "block-iterative selection with the inner scorer", "keys+values",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"block_size", "int", "128", "tokens per block"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<BlockPress>(inner, p.get_int("block_size", 128));
       }},
      {{"ComposedPress", "presses applied in order", "the first press's",
        {{"presses", "str", "KnormPress", "comma-separated press names; presses.<i>.<param> (and presses.<i>.compression_ratio)"}}},
       [](double r, Params& p) { return std::make_unique<ComposedPress>(composed_presses(p, r)); }},
      {{"DecodingPress", "compresses during decoding: every compression_interval steps, to target_size tokens",
        "during decoding: the inner press's (keys/values, queries of the buffered hidden states, attentions)",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>; its ratio is overridden)"},
         {"compression_interval", "int", "512", "decoding steps between compressions"},
         {"target_size", "int", "2048", "tokens kept per layer after a compression"},
         {"hidden_states_buffer_size", "int", "256", "decoding steps of hidden states kept for the inner press"}}},
       [](double r, Params& p) {
         TORCH_CHECK(r == 0.0, "DecodingPress: compression_ratio must be 0 (the budget is target_size; "
                               "CompressionRatioDecodingPress keeps a fraction), got ", r);
         ScorerFactory inner = scorer_factory(p);
         const int64_t interval = p.get_int("compression_interval", 512);
         const int64_t target = p.get_int("target_size", 2048);
         return std::make_unique<DecodingPress>(inner, interval, target, p.get_int("hidden_states_buffer_size", 256));
       }},
      {{"CompressionRatioDecodingPress",
        "compresses during decoding: every compression_interval steps, to (1 - ratio) of the tokens seen",
        "during decoding: the inner press's (keys/values, queries of the buffered hidden states, attentions)",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>; its ratio is overridden)"},
         {"compression_interval", "int", "512", "decoding steps between compressions"},
         {"hidden_states_buffer_size", "int", "256", "decoding steps of hidden states kept for the inner press"}}},
       [](double r, Params& p) {
         ScorerFactory inner = scorer_factory(p);
         const int64_t interval = p.get_int("compression_interval", 512);
         return std::make_unique<CompressionRatioDecodingPress>(inner, r, interval,
                                                                p.get_int("hidden_states_buffer_size", 256));
       }},
      {{"PrefillDecodingPress", "a prefill press and a decoding press under one name",
        "during decoding: the decoding press's; at prefill: the prefilling press's",
        {{"prefilling_press", "str", "None", "press applied at prefill (parameters as prefilling_press.<name>)"},
         {"decoding_press", "str", "None",
          "DecodingPress or CompressionRatioDecodingPress (parameters as decoding_press.<name>)"}}},
       [](double r, Params& p) {
         auto prefilling = prefill_decoding_part(p, "prefilling_press", r);
         auto decoding_part = prefill_decoding_part(p, "decoding_press", r);
         auto decoding = std::dynamic_pointer_cast<const DecodingPress>(decoding_part);
         TORCH_CHECK(!decoding_part || decoding, "PrefillDecodingPress: decoding_press must be DecodingPress or "
                                                 "CompressionRatioDecodingPress, got ", decoding_part->name());
         return std::make_unique<PrefillDecodingPress>(prefilling, decoding);
       }},
      {{"AdaKVPress", "inner scores, safeguarded, kept across heads (head budgets vary; head-ragged)",
        "the inner press's",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"alpha_safeguard", "float", "0.2", "fraction of n_kept every head keeps at least"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         return std::make_unique<AdaKVPress>(inner, p.get_optional_double("alpha_safeguard").value_or(0.20));
       }},
      {{"CriticalKVPress", "inner scores x ||v W_o||_1, the first stage's winners kept", "the inner press's + o_proj",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"epsilon", "float", "0.0001", "added to the inner scores before the rescaling"},
         {"first_stage_ratio", "float", "0.5", "fraction of the budget chosen by the inner scores alone"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         const double eps = p.get_optional_double("epsilon").value_or(1e-4);
         return std::make_unique<CriticalKVPress>(inner, eps, p.get_optional_double("first_stage_ratio").value_or(0.5));
       }},
      {{"CriticalAdaKVPress", "AdaKV head budgets with CriticalKV's two stages per head (head-ragged)",
        "the inner press's + o_proj",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"alpha_safeguard", "float", "0.2", "fraction of n_kept every head keeps at least"},
         {"epsilon", "float", "0.0001", "added to the inner scores before the rescaling"},
         {"first_stage_ratio", "float", "0.5", "fraction of each head's budget chosen by the inner scores alone"}}},
       [](double r, Params& p) {
         auto inner = inner_scorer(p, r);
         const double alpha = p.get_optional_double("alpha_safeguard").value_or(0.20);
         const double eps = p.get_optional_double("epsilon").value_or(1e-4);
         return std::make_unique<CriticalAdaKVPress>(inner, alpha, eps,
                                                     p.get_optional_double("first_stage_ratio").value_or(0.5));
       }},
      {{"PyramidKVPress", "SnapKV scores, budgets shrinking linearly from the first layer to the last",
        "attentions | queries | hidden_states+q_proj+cos+sin (and layer_idx, num_layers)",
        {{"window_size", "int", "64", "number of trailing queries observed (always kept)"},
         {"kernel_size", "int", "5", "odd width of the average pooling"},
         {"beta", "int", "20", "steepness of the pyramid (>= 1)"}}},
       [](double r, Params& p) {
         const int64_t window = p.get_int("window_size", 64);
         const int64_t kernel = p.get_int("kernel_size", 5);
         return std::make_unique<PyramidKVPress>(r, window, kernel, p.get_int("beta", 20));
       }},
      {{"PerLayerCompressionPress", "inner press with its own compression ratio in every layer",
        "the inner press's (and layer_idx, num_layers)",
        {{"press", "str", "KnormPress", "inner ScorerPress (its parameters as press.<name>)"},
         {"compression_ratios", "str", "None",
          "comma-separated ratios, one per layer; None = the given ratio in every layer"}}},
       [](double r, Params& p) {
         ScorerFactory make = scorer_factory(p);
         return std::make_unique<PerLayerCompressionPress>(make, ratio_list(p, r));
       }},
      {{"QSMPress", "CTR-Press stage I: query-span attention x semantic factor, forced keeps, value merge",
        "hidden_states+q_proj+cos+sin | queries (+ input_ids and a token-text callback for semantic weights)",
        qsm_params()},
       [](double r, Params& p) { return std::make_unique<QSMPress>(r, qsm_options(p)); }},
      {{"CTRPress", "CTR-Press: QSMPress with an entropy-adaptive budget and rescue merge of evicted tokens",
        "hidden_states+q_proj+cos+sin | queries (all positions) (+ input_ids and a token-text callback)",
        ctr_params()},
       [](double r, Params& p) {
         QSMOptions qsm = qsm_options(p);
         return std::make_unique<CTRPress>(r, std::move(qsm), ctr_options(p));
       }},
  };
  return table;
}

}  // namespace

const std::vector<PressInfo>& list_presses() {
  static const std::vector<PressInfo> infos = [] {
    std::vector<PressInfo> out;
    for (const auto& e : entries()) out.push_back(e.info);
    return out;
  }();
  return infos;
}

bool is_wrapper(const PressInfo& info) {
  for (const auto& p : info.params)
    if (p.name == "press" || p.name == "presses" || p.name == "prefilling_press" || p.name == "decoding_press")
      return true;
  return false;
}

bool is_decoding_press(const PressInfo& info) { return info.needs.rfind("during decoding", 0) == 0; }

bool needs_second_pass(const PressInfo& info) { return info.needs.rfind("second pass", 0) == 0; }

std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params) {
  for (const auto& e : entries()) {
    if (e.info.name != name) continue;
    Params p(name, params);
    std::unique_ptr<BasePress> press = e.make(compression_ratio, p);
    p.check_all_used(e.info.params);
    return press;
  }
  std::string names;
  for (const auto& e : entries()) names += (names.empty() ? "" : ", ") + e.info.name;
  TORCH_CHECK(false, "make_press: unknown press '", name, "' (known: ", names, ")");
}

}  // namespace kvpress
