// The registry as JSON (kvpress-cli list --json, torch.ops.kvpress.registry_json, the Python
// package's press classes).
#include <nlohmann/json.hpp>

#include "kvpress/registry.h"
#include "kvpress/types.h"

namespace kvpress {

const char* press_kind_name(PressKind kind) {
  switch (kind) {
    case PressKind::kScorer: return "scorer";
    case PressKind::kWrapper: return "wrapper";
    case PressKind::kDecoding: return "decoding";
    case PressKind::kSecondPass: return "second_pass";
    case PressKind::kChannel: return "channel";
    case PressKind::kLayer: return "layer";
    case PressKind::kQueryAware: return "query_aware";
  }
  return "unknown";
}

std::string registry_json() {
  nlohmann::json presses = nlohmann::json::array();
  for (const auto& p : list_presses()) {
    nlohmann::json alternatives = nlohmann::json::array();
    for (const auto& set : p.inputs.alternatives)
      alternatives.push_back({{"fields", set.fields}, {"all_positions", set.all_positions}});
    nlohmann::json params = nlohmann::json::array();
    for (const auto& q : p.params)
      params.push_back(
          {{"name", q.name}, {"type", q.type}, {"default", q.default_value}, {"help", q.help}, {"accepts", q.accepts}});
    presses.push_back({{"name", p.name},
                       {"kind", press_kind_name(p.kind)},
                       {"summary", p.summary},
                       {"no_ratio", p.no_ratio},
                       {"needs", describe_inputs(p)},
                       {"inputs",
                        {{"alternatives", alternatives},
                         {"required", p.inputs.required},
                         {"optional", p.inputs.optional},
                         {"note", p.inputs.note}}},
                       {"params", params}});
  }
  nlohmann::json fields = nlohmann::json::array();
  for (const auto& f : layer_input_fields()) {
    fields.push_back(
        {{"name", f.name}, {"shape", f.shape}, {"help", f.help}, {"required", f.required}, {"integer", f.integer}});
  }
  return nlohmann::json{{"presses", presses}, {"layer_inputs", fields}}.dump(2);
}

}  // namespace kvpress
