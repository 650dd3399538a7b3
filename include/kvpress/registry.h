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

// True for wrappers (a "press", "presses", "prefilling_press" or "decoding_press" parameter names
// the inner press). Built by name alone they wrap KnormPress (PrefillDecodingPress: nothing), so
// default press lists (demo, eval) leave them out.
bool is_wrapper(const PressInfo& info);

// True for presses that compress during decoding (DecodingPress, CompressionRatioDecodingPress,
// PrefillDecodingPress: `needs` starts with "during decoding"). Engines run them through
// kvpress::decoding_press_of; their compress() is not a prefill compression at the registry ratio
// (a DecodingPress refuses any ratio but 0), so generic press loops leave them out.
bool is_decoding_press(const PressInfo& info);

// True for presses that cannot compress a layer on its own because they need the engine's second
// pass over the context (KVComposePress: its `needs` starts with "second pass"). Their compress()
// raises; kvpress::llama's runner runs them in prefill. Layer-level loops leave them out.
bool needs_second_pass(const PressInfo& info);

// Builds `name` with `compression_ratio` and parameters given as text ("window_size" -> "32").
// Raises c10::Error for an unknown press, an unknown parameter or an unparsable value.
std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params = {});

}  // namespace kvpress
