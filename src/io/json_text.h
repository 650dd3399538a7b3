// The one way the library parses JSON text it is given (model config, tokenizer, safetensors
// headers, artifact configs): nlohmann's parser with the nesting bounded, errors as c10::Error.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace kvpress::io {

// nlohmann parses iteratively, but dump() (error messages) and copies recurse: a text nesting a
// million arrays would overflow the stack. Real files nest at most 5 levels.
constexpr int kMaxJsonDepth = 64;

// Parses `text`. Raises c10::Error "<where>: <subject> is not valid JSON: <parser's message>" or
// "<where>: <subject> nests deeper than 64 levels"; subject "" reads "not valid JSON: ..." and
// "the JSON nests deeper ...". `where` names the reader and the file ("LlamaConfig: config.json").
nlohmann::json parse_json(const std::string& text, const std::string& where, const std::string& subject = "");

// The file's text parsed as above; raises "<where>: cannot open the file" when it cannot be read.
// `where` names the reader and the path.
nlohmann::json read_json_file(const std::string& path, const std::string& where);

}  // namespace kvpress::io
