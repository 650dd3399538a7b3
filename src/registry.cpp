// Name -> press factory with kvpress's parameter names and defaults.
#include "kvpress/registry.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <set>

#include "kvpress/presses/block_press.h"
#include "kvpress/presses/chunk_press.h"
#include "kvpress/presses/chunkkv_press.h"
#include "kvpress/presses/compactor_press.h"
#include "kvpress/presses/composed_press.h"
#include "kvpress/presses/expected_attention_press.h"
#include "kvpress/presses/key_rerotation_press.h"
#include "kvpress/presses/keydiff_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/presses/observed_attention_press.h"
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
         {"seed", "int?", "None", "seed of the leverage sketch's CPU generator"}}},
       [](double r, Params& p) {
         const int64_t start = p.get_int("sink_size_start", 8);
         const int64_t end = p.get_int("sink_size_end", 4);
         const int64_t chunk = p.get_int("chunk_size", 256);
         const int64_t sketch = p.get_int("sketch_dimension", 48);
         const std::optional<double> blending = p.get_optional_double("blending");
         return std::make_unique<CompactorPress>(r, start, end, chunk, sketch, blending, p.get_optional_int("seed"));
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
    if (p.name == "press" || p.name == "presses") return true;
  return false;
}

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
