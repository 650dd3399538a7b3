#include "presses/registration.h"

#include <c10/util/Exception.h>

namespace kvpress::registration {

bool is_none(const std::string& text) { return text == "None" || text == "none"; }

// ---- ParamReader ----

namespace {
// PressParam::accepts of a number: its declared range ("any" for an unrestricted integer).
std::string accepted_number(const ParamSpec& spec, bool integer) {
  return integer && spec.range == ParamSpec::Range::kAny ? "any" : range_text(spec.range);
}
}  // namespace

void ParamReader::read(const ParamSpec& spec, int64_t& member) {
  declare(spec.name, "int", std::to_string(member), spec.help, accepted_number(spec, true));
  if (const auto text = take(spec.name)) member = to_int(spec.name, *text);
}

void ParamReader::read(const ParamSpec& spec, double& member) {
  declare(spec.name, "float", format_double(member), spec.help, accepted_number(spec, false));
  if (const auto text = take(spec.name)) member = to_double(spec.name, *text, "a number");
}

void ParamReader::read(const ParamSpec& spec, bool& member) {
  declare(spec.name, "bool", member ? "true" : "false", spec.help);
  if (const auto text = take(spec.name)) member = to_bool(spec.name, *text);
}

void ParamReader::read(const ParamSpec& spec, std::optional<int64_t>& member) {
  declare(spec.name, "int?", member ? std::to_string(*member) : "None", spec.help,
          accepted_number(spec, true) + " or None");
  const auto text = take(spec.name);
  if (text) member = is_none(*text) ? std::nullopt : std::optional<int64_t>(to_int(spec.name, *text));
}

void ParamReader::read(const ParamSpec& spec, std::optional<double>& member) {
  declare(spec.name, "float?", member ? format_double(*member) : "None", spec.help,
          accepted_number(spec, false) + " or None");
  const auto text = take(spec.name);
  if (text)
    member = is_none(*text) ? std::nullopt : std::optional<double>(to_double(spec.name, *text, "a number or None"));
}

void ParamReader::read(const ParamSpec& spec, std::string& member) {
  if (!spec.choices.empty()) {
    size_t index = 0;
    while (index < spec.choices.size() && member != spec.choices[index]) ++index;
    member = spec.choices[read_choice(spec, index)];
    return;
  }
  declare(spec.name, spec.path ? "path" : "str", member, spec.help);
  if (const auto text = take(spec.name)) member = *text;
}

size_t ParamReader::read_choice(const ParamSpec& spec, size_t default_index) {
  TORCH_CHECK(default_index < spec.choices.size(), press_, ": the default of ", spec.name,
              " is not one of its choices");
  std::string allowed;
  for (size_t i = 0; i < spec.choices.size(); ++i)
    allowed += (i == 0 ? "" : (i + 1 == spec.choices.size() ? " or " : ", ")) + std::string(spec.choices[i]);
  declare(spec.name, "str", spec.choices[default_index], spec.help, allowed);
  const auto text = take(spec.name);
  if (!text) return default_index;
  for (size_t i = 0; i < spec.choices.size(); ++i)
    if (*text == spec.choices[i]) return i;
  TORCH_CHECK(false, press_, ": parameter ", spec.name, " must be ", allowed, ", got '", *text, "'");
}

std::string ParamReader::get_text(const std::string& key, const std::string& fallback, const char* help) {
  declare(key, "str", fallback, help);
  return take(key).value_or(fallback);
}

std::map<std::string, std::string> ParamReader::take_prefixed(const std::string& prefix) {
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : values_) {
    if (key.rfind(prefix, 0) != 0) continue;
    used_.insert(key);
    out[key.substr(prefix.size())] = value;
  }
  return out;
}

double ParamReader::ratio(const std::string& key, const std::string& text) const {
  return to_double(key, text, "a number");
}

void ParamReader::check_all_used() const {
  for (const auto& [key, value] : values_) {
    if (used_.count(key)) continue;
    std::string names;
    for (const auto& p : declared_) names += (names.empty() ? "" : ", ") + p.name;
    TORCH_CHECK(false, press_, ": unknown parameter '", key, "' (known: ", names.empty() ? "none" : names, ")");
  }
}

void ParamReader::declare(const std::string& key, const char* type, std::string fallback, const char* help,
                          std::string accepts) {
  declared_.push_back({key, type, std::move(fallback), help, std::move(accepts)});
}

std::optional<std::string> ParamReader::take(const std::string& key) {
  used_.insert(key);
  const auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

int64_t ParamReader::to_int(const std::string& key, const std::string& text) const {
  const auto value = parse_int(text);
  TORCH_CHECK(value, press_, ": parameter ", key, " must be an integer, got '", text, "'");
  return *value;
}

double ParamReader::to_double(const std::string& key, const std::string& text, const char* expected) const {
  const auto value = parse_double(text);
  TORCH_CHECK(value, press_, ": parameter ", key, " must be ", expected, ", got '", text, "'");
  return *value;
}

bool ParamReader::to_bool(const std::string& key, const std::string& text) const {
  if (text == "true" || text == "True" || text == "1") return true;
  if (text == "false" || text == "False" || text == "0") return false;
  TORCH_CHECK(false, press_, ": parameter ", key, " must be true or false, got '", text, "'");
}

// ---- the registrations ----

namespace {
std::vector<PressEntry (*)()>& mutable_registrations() {
  static std::vector<PressEntry (*)()> list;
  return list;
}
}  // namespace

Registration::Registration(PressEntry (*describe)()) { mutable_registrations().push_back(describe); }

const std::vector<PressEntry (*)()>& registrations() { return mutable_registrations(); }

// ---- inner presses of wrappers ----

std::shared_ptr<const ScorerPress> as_scorer(std::unique_ptr<BasePress> built, const std::string& outer,
                                             const std::string& inner) {
  auto scorer = std::dynamic_pointer_cast<const ScorerPress>(std::shared_ptr<const BasePress>(std::move(built)));
  TORCH_CHECK(scorer != nullptr, outer, ": press must be a ScorerPress, got ", inner);
  return scorer;
}

std::shared_ptr<const ScorerPress> inner_scorer(ParamReader& p, double ratio, const char* help) {
  const std::string inner = p.get_text("press", "KnormPress", help);
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  return as_scorer(make_press(inner, ratio, p.take_prefixed("press.")), p.press_name(), inner);
}

ScorerFactory scorer_factory(ParamReader& p, const char* help) {
  const std::string inner = p.get_text("press", "KnormPress", help);
  TORCH_CHECK(!inner.empty(), p.press_name(), ": parameter press (the inner press's name) must not be empty");
  const std::map<std::string, std::string> params = p.take_prefixed("press.");
  const std::string outer = p.press_name();
  ScorerFactory make = [inner, params, outer](double ratio) {
    return as_scorer(make_press(inner, ratio, params), outer, inner);
  };
  return make;
}

std::shared_ptr<const BasePress> named_press(ParamReader& p, const std::string& key, const std::string& name,
                                             double ratio) {
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

// ---- inputs ----

namespace {
std::vector<InputSet> window_query_sources() { return {{{"queries"}}, {{"hidden_states", "q_proj", "cos", "sin"}}}; }
}  // namespace

PressInputs window_query_inputs() { return {window_query_sources()}; }

PressInputs window_attention_inputs() {
  std::vector<InputSet> sets{{{"attentions"}}};
  const std::vector<InputSet> queries = window_query_sources();
  sets.insert(sets.end(), queries.begin(), queries.end());
  return {sets};
}

PressInputs pre_rope_query_inputs() {
  return {{{{"hidden_states", "q_proj", "inv_freq"}},
           {{"hidden_states", "q_proj", "cos", "sin"}},
           {{"queries", "cos", "sin"}, true}}};
}

PressInputs all_query_inputs() { return {{{{"queries"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}}; }

}  // namespace kvpress::registration
