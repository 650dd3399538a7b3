// Bounded JSON parsing (src/io/json_text.h).
#include "json_text.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

namespace kvpress::io {

nlohmann::json parse_json(const std::string& text, const std::string& where, const std::string& subject) {
  struct TooDeep {};  // thrown by the parse callback to stop at the first level too deep
  try {
    return nlohmann::json::parse(text, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxJsonDepth) throw TooDeep{};
      return true;
    });
  } catch (const TooDeep&) {
    TORCH_CHECK(false, where, ": ", subject.empty() ? "the JSON" : subject, " nests deeper than ", kMaxJsonDepth,
                " levels");
  } catch (const nlohmann::json::exception& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 5: ..." (or
    // out_of_range.406 "number overflow parsing '1e999'"): keep what follows the tag.
    std::string message = e.what();
    const auto tag_end = message.find("] ");
    if (tag_end != std::string::npos) message = message.substr(tag_end + 2);
    TORCH_CHECK(false, where, ": ", subject.empty() ? "" : subject + " is ", "not valid JSON: ", message);
  }
}

nlohmann::json read_json_file(const std::string& path, const std::string& where) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), where, ": cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK(!in.bad(), where, ": cannot read the file");
  return parse_json(text.str(), where);
}

}  // namespace kvpress::io
