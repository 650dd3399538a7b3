// Build presses by their kvpress class name and string parameters (used by kvpress-cli, the
// demo, benchmarks, tests and torch.ops.kvpress.press_compress).
//
// Thread safety: every function here may be called from any number of threads at once. The
// registry's tables are function-local statics built on first use (C++11 guarantees one
// initialisation, whichever thread comes first) and read-only afterwards; make_press() builds a new
// press each call.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvpress/presses/base_press.h"

namespace kvpress {

struct PressParam {
  std::string name;           // kvpress's parameter name, e.g. "window_size"
  std::string type;           // "int", "float", "bool", "str", "path" (a file the press reads; "" when
                              // not given), "int?" or "float?" (optional: "None" unsets)
  std::string default_value;  // as text, "None" for an unset optional
  std::string help;
  std::string accepts = {};  // the values the press accepts beyond the type ("> 0", "in [0, 1]",
                             // "max, mean or sum"; kvpress/press_params.h); "" when the type says it all
};

enum class PressKind {
  kScorer,      // a ScorerPress: scores the tokens of one layer (compress() keeps the best per head)
  kWrapper,     // builds on the presses its "press" / "presses" parameters name; by name alone it
                // wraps KnormPress, so default press lists (demo, eval) leave it out
  kDecoding,    // compresses while the model generates (kvpress::decoding_press_of); its compress()
                // is not a prefill compression at the registry ratio, so layer loops leave it out
  kSecondPass,  // runs the model again over the context (KVComposePress, KVzipPress); its compress()
                // raises and kvpress::llama's runner runs it at prefill
  kChannel,     // prunes key channels, not tokens (ThinKPress): compress() keeps every token and
                // zeroes channels; the registry ratio is the fraction of key channels pruned
  kLayer,       // decides per layer or head how many tokens to keep, without a ratio (SimLayerKVPress:
                // a "lazy" layer keeps its first and last tokens, any other every token;
                // DuoAttentionPress: a streaming head keeps its sink and recent tokens)
  kQueryAware,  // observes the user's question at the end of the prefill (FinchPress): it needs
                // LayerInputs::question_length > 0, so loops over a context alone leave it out
                // (kvpress::llama's answer_questions() runs it query-aware)
};

// A set of LayerInputs fields a press can work from, all needed together.
struct InputSet {
  std::vector<std::string> fields;  // LayerInputs field names (for_each_field), e.g. {"queries"}
  bool all_positions = false;       // queries / attentions must cover every position, not only the
                                    // last rows a window needs
};

// The LayerInputs a press reads beyond keys and values.
struct PressInputs {
  std::vector<InputSet> alternatives = {};  // any one suffices; none: keys and values are enough
  std::vector<std::string> required = {};   // needed whichever alternative is used (o_proj of CriticalKV)
  std::vector<std::string> optional = {};   // read when given (e.g. layer_idx, input_ids)
  std::string note = {};                    // what the fields do not say
};

struct PressInfo {
  std::string name;  // kvpress class name
  PressKind kind;
  std::string summary;  // one line
  PressInputs inputs;   // its own; wrappers and decoding presses also read their inner presses' inputs
  std::vector<PressParam> params;
  // Non-empty for a press without a compression ratio (DecodingPress: its target_size;
  // SimLayerKVPress: each layer decides): why. make_press then refuses any ratio but 0.
  std::string no_ratio = {};
};

// Every press the registry can build, in a stable order.
const std::vector<PressInfo>& list_presses();

// The entry named `name`, or nullptr.
const PressInfo* find_press(const std::string& name);

// True for a press that reads a file named by a parameter of type "path" (QFilterPress's filters,
// ExpectedAttentionStatsPress's statistics, KVzapPress's surrogate):
// built with its defaults, it cannot compress.
bool needs_file(const PressInfo& info);

// `compression_ratio` for a press that takes one, 0 for one that does not (PressInfo::no_ratio):
// for code that builds every press alike (benchmarks, tests).
double ratio_for(const PressInfo& info, double compression_ratio);

// What a press reads, as one line ("attentions | queries | hidden_states+q_proj+cos+sin"), for
// `kvpress-cli list` and the docs.
std::string describe_inputs(const PressInfo& info);

// True when the press named `name` can only work from attentions (every alternative holds them:
// ObservedAttentionPress), so a runner must compute eager attention weights for it.
bool needs_attentions(const std::string& name);

// The kind as text: "scorer", "wrapper", "decoding", "second_pass", "channel", "layer", "query_aware".
const char* press_kind_name(PressKind kind);

// Every press (name, kind, summary, inputs, parameters with types and defaults) and every LayerInputs
// field, as indented JSON: {"presses": [...], "layer_inputs": [...]}. `kvpress-cli list --json`
// prints it; torch.ops.kvpress.registry_json returns it (the Python package builds its press classes
// from it).
std::string registry_json();

// Builds `name` with `compression_ratio` and parameters given as text ("window_size" -> "32").
// Raises c10::Error for an unknown press, an unknown parameter or an unparsable value.
std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params = {});

// The one parser of numbers given as text (press parameters, ratios, CLI options, file metadata):
// the whole text must be the number; a leading '+' is accepted; doubles must be finite.
std::optional<int64_t> parse_int(std::string_view text);
std::optional<double> parse_double(std::string_view text);
// Comma-separated doubles ("0.25,0.5"), each as parse_double.
std::optional<std::vector<double>> parse_double_list(std::string_view text);
// The shortest text that parse_double reads back as `value` ("0.2", "0.0001", "4").
std::string format_double(double value);

}  // namespace kvpress
