// Build presses by their kvpress class name and string parameters (used by kvpress-cli, the
// demo, benchmarks and tests).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvpress/presses/base_press.h"

namespace kvpress {

struct PressParam {
  std::string name;           // kvpress's parameter name, e.g. "window_size"
  std::string type;           // "int", "float", "bool", "int?" or "float?" (optional: "None" unsets)
  std::string default_value;  // as text, "None" for an unset optional
  std::string help;
};

struct PressInfo {
  std::string name;          // kvpress class name
  std::string summary;       // one line
  std::string needs;         // inputs beyond keys/values, e.g. "attentions | queries | hidden_states+q_proj+cos+sin"
  std::vector<PressParam> params;
};

// Every press the registry can build, in a stable order.
const std::vector<PressInfo>& list_presses();

// True for wrappers (a "press" or "presses" parameter names the inner press). Built by name alone
// they wrap KnormPress, so default press lists (demo, eval) leave them out.
bool is_wrapper(const PressInfo& info);

// Builds `name` with `compression_ratio` and parameters given as text ("window_size" -> "32").
// Raises c10::Error for an unknown press, an unknown parameter or an unparsable value.
std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params = {});

}  // namespace kvpress
