// How a press registers itself with the registry (private to the library: each press's .cpp and
// src/registry.cpp). A press's .cpp holds its one registration:
//
//   namespace {
//   const registration::Registration kRegistration([] {
//     return registration::PressEntry{"SnapKVPress", PressKind::kScorer, "one-line summary",
//                                     registration::window_attention_inputs(),
//                                     registration::from_params<SnapKVPress>};
//   });
//   }  // namespace
//
// from_params<T> builds T from its Params declaration (kvpress/press_params.h); a press whose
// parameters are more than fields (an inner press, a list of presses) writes its own factory with
// ParamReader. The registry runs each description on first use, not at library load, so no
// registration depends on another translation unit's statics.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/registry.h"

namespace kvpress::registration {

// Reads a press's text parameters ("window_size" -> "32") and records what the press declares
// (name, type, default, help), so that unknown parameters are refused and the registry lists them.
class ParamReader {
 public:
  ParamReader(std::string press, std::map<std::string, std::string> values)
      : press_(std::move(press)), values_(std::move(values)) {}

  // One declared member (ParamSpec): `member` holds the default and receives the given value.
  void read(const ParamSpec& spec, int64_t& member);
  void read(const ParamSpec& spec, double& member);
  void read(const ParamSpec& spec, bool& member);
  void read(const ParamSpec& spec, std::optional<int64_t>& member);
  void read(const ParamSpec& spec, std::optional<double>& member);
  void read(const ParamSpec& spec, std::string& member);
  template <typename Enum, typename = std::enable_if_t<std::is_enum_v<Enum>>>
  void read(const ParamSpec& spec, Enum& member) {
    member = static_cast<Enum>(read_choice(spec, static_cast<size_t>(member)));
  }

  // Every member of a Params struct, in its declared order.
  template <typename Params>
  void read_all(Params& params) {
    Params::for_each_field(params,
                           [reader = this](const ParamSpec& spec, auto& member) { reader->read(spec, member); });
  }

  // Free text, for factories whose parameter is more than a field (an inner press's name, a list).
  std::string get_text(const std::string& key, const std::string& fallback, const char* help);

  // Every parameter "<prefix><rest>" as rest -> value (the inner press's parameters of a wrapper).
  std::map<std::string, std::string> take_prefixed(const std::string& prefix);

  // A ratio given as text, e.g. ComposedPress's presses.<i>.compression_ratio.
  double ratio(const std::string& key, const std::string& text) const;

  const std::string& press_name() const { return press_; }
  const std::vector<PressParam>& declared() const { return declared_; }

  // Every given parameter must have been read by the factory.
  void check_all_used() const;

 private:
  size_t read_choice(const ParamSpec& spec, size_t default_index);
  void declare(const std::string& key, const char* type, std::string fallback, const char* help,
               std::string accepts = {});
  std::optional<std::string> take(const std::string& key);
  int64_t to_int(const std::string& key, const std::string& text) const;
  double to_double(const std::string& key, const std::string& text, const char* expected) const;
  bool to_bool(const std::string& key, const std::string& text) const;

  std::string press_;
  // A copy, not a reference: list_presses() passes a temporary empty map.
  const std::map<std::string, std::string> values_;
  std::set<std::string> used_;
  std::vector<PressParam> declared_;
};

// Builds a press at `compression_ratio` from the parameters `reader` holds.
using Factory = std::function<std::unique_ptr<BasePress>(double compression_ratio, ParamReader& reader)>;

// What the registry knows of a press before building it (PressInfo less the parameters, which the
// factory declares as it reads them).
struct PressEntry {
  std::string name;  // kvpress class name; list_presses() checks that the built press's name() agrees
  PressKind kind;
  std::string summary;  // one line
  PressInputs inputs;
  Factory make;
  std::string no_ratio = {};  // PressInfo::no_ratio
};

// Adds `describe` to the registry's list at library load (a namespace-scope constant of the
// press's .cpp).
class Registration {
 public:
  explicit Registration(PressEntry (*describe)());
};

// Every registration, in load order (the registry sorts the entries).
const std::vector<PressEntry (*)()>& registrations();

// T built from its Params: T(compression_ratio, params), or T(params) for a press without a
// ratio; a press without parameters: T(compression_ratio).
template <typename T>
std::unique_ptr<BasePress> from_params(double compression_ratio, ParamReader& reader) {
  typename T::Params params;
  reader.read_all(params);
  if constexpr (std::is_constructible_v<T, double, typename T::Params>) {
    return std::make_unique<T>(compression_ratio, std::move(params));
  } else {
    return std::make_unique<T>(std::move(params));
  }
}
template <typename T>
std::unique_ptr<BasePress> without_params(double compression_ratio, ParamReader&) {
  return std::make_unique<T>(compression_ratio);
}

// ---- inner presses of wrappers ----

inline constexpr const char* kInnerPressHelp =
    "inner ScorerPress (kvpress requires one; its parameters as press.<name>)";
// The decoding presses' inner press, built at each compression's ratio.
inline constexpr const char* kDecodingInnerPressHelp =
    "inner ScorerPress (kvpress requires one; its parameters as press.<name>; its ratio is overridden)";

// `built` as a ScorerPress, or a c10::Error naming `outer` and `inner`.
std::shared_ptr<const ScorerPress> as_scorer(std::unique_ptr<BasePress> built, const std::string& outer,
                                             const std::string& inner);

// The inner ScorerPress of a wrapper: parameter `press` names it, `press.<param>` are its
// parameters, and it gets the wrapper's compression ratio. kvpress requires the inner press; the
// registry defaults it to KnormPress so that every registered press builds from its name alone.
std::shared_ptr<const ScorerPress> inner_scorer(ParamReader& p, double ratio, const char* help = kInnerPressHelp);

// A wrapper of one inner ScorerPress built from its Params: T(inner_scorer(...), params).
template <typename T>
std::unique_ptr<BasePress> wrapper_from_params(double compression_ratio, ParamReader& reader) {
  auto inner = inner_scorer(reader, compression_ratio);
  typename T::Params params;
  reader.read_all(params);
  return std::make_unique<T>(std::move(inner), params);
}

// A factory of the inner ScorerPress (`press`, `press.<param>`) for wrappers that need it at
// several ratios (PerLayerCompressionPress, the decoding presses; their constructors build it, so
// a bad name or parameter is reported by make_press).
ScorerFactory scorer_factory(ParamReader& p, const char* help);

// A press named by parameter `key` ("None" or empty: none), `<key>.<param>` its parameters and
// `<key>.compression_ratio` its ratio (default: `ratio`, or 0 for a press without one, such as
// a DecodingPress, whose budget is target_size).
std::shared_ptr<const BasePress> named_press(ParamReader& p, const std::string& key, const std::string& name,
                                             double ratio);

bool is_none(const std::string& text);  // "None" or "none": an unset optional

// False for a registered press without a compression ratio (PressEntry::no_ratio); true otherwise.
// Reads the entries only, so factories may call it while list_presses() builds its table.
bool takes_ratio(const std::string& name);

// ---- the LayerInputs several presses read (PressInputs) ----

// The last queries (ops::window_queries): given, or rebuilt from hidden_states + q_proj + RoPE.
PressInputs window_query_inputs();
// Attention of the last queries (ops::window_attention_mean): the given attentions, else those queries.
PressInputs window_attention_inputs();
// The pre-RoPE queries of every position and the RoPE frequencies of future positions
// (ExpectedAttentionPress, CapPress, LUKVPress's default inner press).
PressInputs pre_rope_query_inputs();
// The queries of every position (non-causal attention).
PressInputs all_query_inputs();

}  // namespace kvpress::registration
