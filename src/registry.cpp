// Name -> press factory with kvpress's parameter names and defaults.
#include "kvpress/registry.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <set>

#include "kvpress/presses/compactor_press.h"
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
