// tokenizer.json reader: SentencePiece-style and byte-level BPE as the Python `tokenizers` library
// runs them.
//
// encode(text):
//   0. repair invalid UTF-8 (U+FFFD per maximal invalid subpart, as Python's errors="replace");
//   1. split the text on added tokens with normalized=false (leftmost-longest);
//   2. normalize every other piece, then split it on added tokens with normalized=true, matched
//      against their normalized form (with a Prepend("▁") normalizer "<|x|>" is found as "▁<|x|>");
//   3. pre-tokenize every remaining piece into words (none: the piece is one word, spaces included;
//      ByteLevel also maps each byte to its printable character);
//   4. run BPE on every word;
//   5. add the post_processor's special tokens (BOS).
// decode(ids): ids -> token strings (special ones dropped when asked), then the decoder chain.
#include "kvpress/llama/tokenizer.h"

#include "unicode.h"
#include "utf8.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "io/json_text.h"

#include <cstdio>
#include <fstream>
#include <queue>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace kvpress::llama {
namespace {

using json = nlohmann::json;

// ---- UTF-8 ------------------------------------------------------------------------------------

// Byte length of the UTF-8 sequence starting with `lead` (1 for invalid lead bytes, so that
// iteration always advances).
size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// ---- components ---------------------------------------------------------------------------------

struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kNFC } kind;
  std::string a, b;  // prepend: a; replace: a -> b
};

// GPT-2's byte-to-character table (tokenizers' bytes_char): the printable bytes ('!'..'~',
// 0xA1..0xAC, 0xAE..0xFF) stand for themselves, the other 68 for U+0100 onwards in byte order, so
// that every byte is one visible character of a BPE vocabulary (' ' is "Ġ", '\n' is "Ċ").
struct ByteLevelAlphabet {
  std::string of_byte[256];                           // byte -> its character, UTF-8
  std::unordered_map<uint32_t, unsigned char> bytes;  // character (code point) -> byte
  ByteLevelAlphabet() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
      // Code points below U+0800: one or two UTF-8 bytes.
      of_byte[b] = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                             : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      bytes.emplace(cp, static_cast<unsigned char>(b));
    }
  }
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// GPT-2's split pattern, which ByteLevel(use_regex=true) applies (tokenizers' byte_level.rs).
constexpr const char* kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreTokenizerStep {
  // kSplit: `regex`'s matches and the text between them become separate pieces (Split with
  // behavior Isolated; Digits: the \p{N} characters, one by one or in runs). kByteLevel: a space
  // before each piece that does not start with one (add_prefix_space), GPT-2's split (`regex`,
  // when use_regex), then every byte mapped to its ByteLevelAlphabet character.
  enum Kind { kSplit, kByteLevel } kind;
  std::shared_ptr<const UnicodeRegex> regex;  // null: ByteLevel without use_regex
  bool add_prefix_space = false;
};

struct DecoderStep {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip, kByteLevel } kind;
  std::string a, b;            // replace: a -> b; strip: a = the (one-character) content
  size_t start = 0, stop = 0;  // strip
};

struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool normalized = false;
  bool special = false;
};

struct Merge {
  int32_t rank;
  int32_t new_id;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// "<0x0A>" for byte 10, as tokenizers spells byte-fallback tokens.
std::string byte_token(unsigned char b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
  return buf;
}

bool has(const json& object, const char* key) { return object.contains(key) && !object[key].is_null(); }

// A JSON value in an error message: its text, cut to a readable length.
std::string excerpt(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  std::vector<AddedToken> added;
  // Added tokens as split patterns: raw (normalized=false) and normalized (their normalized form).
  std::vector<std::pair<std::string, int64_t>> raw_patterns, normalized_patterns;
  // Post-processor template for a single sequence: ids before and after the text.
  std::vector<int64_t> prefix_ids, suffix_ids;

  std::unordered_map<std::string, int32_t> vocab;  // BPE model vocabulary
  std::vector<std::string> id_to_token;            // model vocabulary + added tokens
  std::vector<bool> special;                       // per id
  std::unordered_map<uint64_t, Merge> merges;      // (left id, right id) -> rank, merged id
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;

  std::string normalize(const std::string& s) const {
    std::string out = s;
    for (const auto& step : normalizer) {
      if (step.kind == NormalizerStep::kPrepend) {
        if (!out.empty()) out = step.a + out;
      } else if (step.kind == NormalizerStep::kNFC) {
        out = nfc(out);
      } else {
        out = replace_all(out, step.a, step.b);
      }
    }
    return out;
  }

  // Splits `text` on the given patterns (leftmost-longest): pieces as (text, added token id or -1).
  static void split_on(const std::string& text, const std::vector<std::pair<std::string, int64_t>>& patterns,
                       std::vector<std::pair<std::string, int64_t>>& out) {
    size_t pos = 0, piece_start = 0;
    while (pos < text.size()) {
      size_t best_len = 0;
      int64_t best_id = -1;
      for (const auto& [pattern, id] : patterns) {
        if (pattern.size() > best_len && text.compare(pos, pattern.size(), pattern) == 0) {
          best_len = pattern.size();
          best_id = id;
        }
      }
      if (best_len == 0) {
        ++pos;
        continue;
      }
      if (pos > piece_start) out.emplace_back(text.substr(piece_start, pos - piece_start), -1);
      out.emplace_back(std::string(), best_id);
      pos += best_len;
      piece_start = pos;
    }
    if (piece_start < text.size()) out.emplace_back(text.substr(piece_start), -1);
  }

  // The pre-tokenizer's words of one normalized piece (empty pieces dropped, as tokenizers does).
  std::vector<std::string> pre_tokenize(const std::string& piece) const {
    std::vector<std::string> pieces{piece};
    for (const auto& step : pre_tokenizer) {
      std::vector<std::string> next;
      for (std::string& p : pieces) {
        if (step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space && p.compare(0, 1, " ") != 0)
          p.insert(0, " ");
        if (!step.regex) {
          next.push_back(std::move(p));
          continue;
        }
        size_t last = 0;
        for (const auto& [begin, end] : step.regex->find_all(p)) {
          if (begin > last) next.push_back(p.substr(last, begin - last));
          next.push_back(p.substr(begin, end - begin));
          last = end;
        }
        if (last < p.size()) next.push_back(p.substr(last));
      }
      if (step.kind == PreTokenizerStep::kByteLevel) {
        const ByteLevelAlphabet& alphabet = byte_level_alphabet();
        for (std::string& p : next) {
          std::string mapped;
          mapped.reserve(2 * p.size());
          for (unsigned char b : p) mapped += alphabet.of_byte[b];
          p = std::move(mapped);
        }
      }
      pieces = std::move(next);
    }
    return pieces;
  }

  // BPE on one word: characters (or byte-fallback tokens, or <unk>), then merges by rank.
  void bpe(const std::string& word, std::vector<int64_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      if (const auto it = vocab.find(word); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int32_t prev, next;
      bool removed;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    auto add = [&](int32_t id) {
      const auto n = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, n - 1, -1, false});
      if (n > 0) symbols[n - 1].next = n;
    };
    bool pending_unk = false;  // a fused <unk> run not yet emitted
    for (size_t i = 0; i < word.size();) {
      const size_t len = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
      const std::string ch = word.substr(i, len);
      i += len;
      if (const auto it = vocab.find(ch); it != vocab.end()) {
        if (pending_unk) add(unk_id), pending_unk = false;
        add(it->second);
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : ch) {
          const auto it = vocab.find(byte_token(b));
          if (it == vocab.end()) break;
          bytes.push_back(it->second);
        }
        if (bytes.size() == ch.size()) {
          // tokenizers emits byte tokens without flushing a pending <unk> first.
          for (int32_t id : bytes) add(id);
          continue;
        }
      }
      // No unk_token: tokenizers drops the character (a byte-level vocabulary without the bytes
      // that valid UTF-8 of assigned code points never has, e.g. SmolLM2's).
      if (unk_id < 0) continue;
      if (pending_unk && !fuse_unk) add(unk_id);
      pending_unk = true;
    }
    if (pending_unk) add(unk_id);

    // Lowest rank first, leftmost on equal rank; entries made stale by earlier merges are skipped
    // (tokenizers' Word::merge_all).
    using Entry = std::tuple<int32_t, int32_t, int32_t>;  // rank, position, merged id
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
    for (size_t p = 0; p + 1 < symbols.size(); ++p) {
      if (const auto it = merges.find(pair_key(symbols[p].id, symbols[p + 1].id)); it != merges.end())
        queue.emplace(it->second.rank, static_cast<int32_t>(p), it->second.new_id);
    }
    while (!queue.empty()) {
      const auto [rank, pos, new_id] = queue.top();
      queue.pop();
      Symbol& cur = symbols[pos];
      if (cur.removed || cur.next < 0) continue;
      const int32_t right = cur.next;
      const auto it = merges.find(pair_key(cur.id, symbols[right].id));
      if (it == merges.end() || it->second.new_id != new_id) continue;
      cur.id = new_id;
      cur.next = symbols[right].next;
      symbols[right].removed = true;
      if (cur.next >= 0) symbols[cur.next].prev = pos;
      if (cur.prev >= 0) {
        if (const auto m = merges.find(pair_key(symbols[cur.prev].id, cur.id)); m != merges.end())
          queue.emplace(m->second.rank, cur.prev, m->second.new_id);
      }
      if (cur.next >= 0) {
        if (const auto m = merges.find(pair_key(cur.id, symbols[cur.next].id)); m != merges.end())
          queue.emplace(m->second.rank, pos, m->second.new_id);
      }
    }
    for (const auto& s : symbols)
      if (!s.removed) out.push_back(s.id);
  }

  std::vector<std::string> run_decoder(std::vector<std::string> tokens) const {
    for (const auto& step : decoder) {
      std::vector<std::string> next;
      switch (step.kind) {
        case DecoderStep::kReplace:
          for (auto& t : tokens) next.push_back(replace_all(t, step.a, step.b));
          break;
        case DecoderStep::kFuse: {
          std::string all;
          for (auto& t : tokens) all += t;
          next.push_back(std::move(all));
          break;
        }
        case DecoderStep::kByteFallback: {
          std::string bytes;
          size_t n_bytes = 0;
          auto flush = [&] {
            if (n_bytes == 0) return;
            if (valid_utf8(bytes)) {
              next.push_back(bytes);
            } else {
              for (size_t k = 0; k < n_bytes; ++k) next.emplace_back("\xEF\xBF\xBD");  // U+FFFD
            }
            bytes.clear();
            n_bytes = 0;
          };
          for (auto& t : tokens) {
            unsigned value = 0;
            char tail = 0;
            if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
                std::sscanf(t.c_str() + 3, "%2x%c", &value, &tail) == 2 && tail == '>') {
              bytes.push_back(static_cast<char>(value));
              ++n_bytes;
            } else {
              flush();
              next.push_back(std::move(t));
            }
          }
          flush();
          break;
        }
        case DecoderStep::kByteLevel: {
          // Each token's characters back to bytes (a token with a character outside the alphabet,
          // e.g. an added token, as its own UTF-8), then the whole as from_utf8_lossy.
          const ByteLevelAlphabet& alphabet = byte_level_alphabet();
          std::string bytes;
          for (const auto& t : tokens) {
            std::string token_bytes;
            bool mapped = true;
            size_t invalid = 0;
            for (size_t i = 0; i < t.size() && mapped;) {
              const size_t n = utf8_sequence_length(t, i, invalid);
              const auto it = n > 0 ? alphabet.bytes.find(utf8_code_point(t, i, n)) : alphabet.bytes.end();
              mapped = it != alphabet.bytes.end();
              if (mapped) token_bytes.push_back(static_cast<char>(it->second));
              i += n;
            }
            bytes += mapped ? token_bytes : t;
          }
          next.push_back(utf8_lossy(bytes));
          break;
        }
        case DecoderStep::kStrip:
          for (auto& t : tokens) {
            size_t begin = 0, end = t.size();
            for (size_t k = 0; k < step.start && t.compare(begin, step.a.size(), step.a) == 0; ++k)
              begin += step.a.size();
            for (size_t k = 0; k < step.stop && end >= begin + step.a.size() &&
                               t.compare(end - step.a.size(), step.a.size(), step.a) == 0;
                 ++k)
              end -= step.a.size();
            next.push_back(t.substr(begin, end - begin));
          }
          break;
      }
      tokens = std::move(next);
    }
    return tokens;
  }

  // ---- loading tokenizer.json, one section at a time --------------------------------------------
  // Every field is read checked: a value of the wrong kind raises
  // "Tokenizer: <origin>: <path> must be <expected>, got <value>" (never a JSON library exception).

  [[noreturn]] void unsupported(const char* what, const json& value) const {
    TORCH_CHECK(false, "Tokenizer: ", origin, ": unsupported ", what, " ", value.dump().substr(0, 200));
  }

  [[noreturn]] void malformed(const std::string& path, const char* expected, const json& value) const {
    TORCH_CHECK(false, "Tokenizer: ", origin, ": ", path, " must be ", expected, ", got ", excerpt(value));
  }

  const json& object(const json& value, const std::string& path) const {
    if (!value.is_object()) malformed(path, "an object", value);
    return value;
  }

  const json& array(const json& value, const std::string& path) const {
    if (!value.is_array()) malformed(path, "an array", value);
    return value;
  }

  std::string string(const json& value, const std::string& path) const {
    if (!value.is_string()) malformed(path, "a string", value);
    return value.get<std::string>();
  }

  // A member of an object that must be there (and not null).
  const json& member(const json& object, const std::string& path, const char* key) const {
    TORCH_CHECK(has(object, key), "Tokenizer: ", origin, ": ", path, ".", key, " is missing");
    return object[key];
  }

  std::string string_or(const json& object, const std::string& path, const char* key,
                        const std::string& fallback) const {
    return has(object, key) ? string(object[key], path + "." + key) : fallback;
  }

  bool required_bool(const json& object, const std::string& path, const char* key) const {
    member(object, path, key);
    return bool_or(object, path, key, false);
  }

  bool bool_or(const json& object, const std::string& path, const char* key, bool fallback) const {
    if (!has(object, key)) return fallback;
    if (!object[key].is_boolean()) malformed(path + "." + key, "true or false", object[key]);
    return object[key].get<bool>();
  }

  // A token id: an integer in [0, n_ids), n_ids being the number of vocabulary and added tokens
  // (ids index one table, so a file cannot make it larger than itself).
  int64_t token_id(const json& value, const std::string& path, int64_t n_ids) const {
    if (!value.is_number_integer()) malformed(path, "an integer token id", value);
    const bool in_range = value.is_number_unsigned() ? value.get<uint64_t>() < static_cast<uint64_t>(n_ids)
                                                     : value.get<int64_t>() >= 0 && value.get<int64_t>() < n_ids;
    TORCH_CHECK(in_range, "Tokenizer: ", origin, ": ", path, " must be a token id in [0, ", n_ids,
                ") (ids count the vocabulary and added tokens), got ", excerpt(value));
    return value.get<int64_t>();
  }

  // The String pattern of a Replace normalizer/decoder ({"String": "..."}); Regex patterns are not
  // supported.
  std::string string_pattern(const json& step, const std::string& path) const {
    const json& p = member(step, path, "pattern");
    if (!p.is_object() || !p.contains("String")) unsupported("Replace pattern (only {\"String\": ...})", p);
    return string(p["String"], path + ".pattern.String");
  }

  // The steps of a normalizer/decoder, with their paths: its `list_key` array when it is a
  // Sequence, else itself.
  std::vector<std::pair<const json*, std::string>> sequence_steps(const json& step, const std::string& path,
                                                                  const char* list_key) const {
    object(step, path);
    if (string_or(step, path, "type", "") != "Sequence") return {{&step, path}};
    const std::string list_path = path + "." + list_key;
    std::vector<std::pair<const json*, std::string>> steps;
    for (const json& s : array(member(step, path, list_key), list_path)) {
      const std::string step_path = list_path + "[" + std::to_string(steps.size()) + "]";
      steps.emplace_back(&object(s, step_path), step_path);
    }
    return steps;
  }

  // Model: BPE (vocabulary, merges, unknown-token and byte-fallback options). Ids run up to the
  // largest of the vocabulary and the added tokens.
  void load_model(const json& model, const json& added_tokens) {
    const std::string type = string_or(model, "model", "type", "");
    if (type != "BPE") unsupported("model type", model.value("type", json()));
    if (has(model, "continuing_subword_prefix") || has(model, "end_of_word_suffix"))
      unsupported("BPE option (continuing_subword_prefix / end_of_word_suffix)", model["continuing_subword_prefix"]);
    if (has(model, "dropout")) {
      if (!model["dropout"].is_number()) malformed("model.dropout", "a number or null", model["dropout"]);
      if (model["dropout"].get<double>() != 0.0) unsupported("BPE dropout", model["dropout"]);
    }
    fuse_unk = bool_or(model, "model", "fuse_unk", false);
    byte_fallback = bool_or(model, "model", "byte_fallback", false);
    ignore_merges = bool_or(model, "model", "ignore_merges", false);
    const json& vocab_json = object(member(model, "model", "vocab"), "model.vocab");
    const auto n_ids = static_cast<int64_t>(vocab_json.size() + added_tokens.size());
    int64_t max_id = -1;
    for (const auto& [token, id] : vocab_json.items()) {
      const int64_t checked = token_id(id, "model.vocab['" + token + "']", n_ids);
      vocab[token] = static_cast<int32_t>(checked);
      max_id = std::max(max_id, checked);
    }
    for (size_t i = 0; i < added_tokens.size(); ++i) {
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      max_id = std::max(max_id, token_id(member(object(added_tokens[i], path), path, "id"), path + ".id", n_ids));
    }
    id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    special.assign(static_cast<size_t>(max_id + 1), false);
    for (const auto& [token, id] : vocab) id_to_token[static_cast<size_t>(id)] = token;
    if (has(model, "unk_token")) {
      const auto it = vocab.find(string(model["unk_token"], "model.unk_token"));
      TORCH_CHECK(it != vocab.end(), "Tokenizer: ", origin, ": unk_token is not in the vocabulary");
      unk_id = it->second;
    }
    int32_t rank = 0;
    const json& merges_json = array(member(model, "model", "merges"), "model.merges");
    for (size_t i = 0; i < merges_json.size(); ++i) {
      const json& m = merges_json[i];
      const std::string path = "model.merges[" + std::to_string(i) + "]";
      std::string left, right;
      if (m.is_string()) {  // "left right"
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        TORCH_CHECK(space != std::string::npos, "Tokenizer: ", origin, ": malformed merge '", s, "'");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {  // ["left", "right"]
        if (!m.is_array() || m.size() != 2) malformed(path, "\"left right\" or [\"left\", \"right\"]", m);
        left = string(m[0], path + "[0]");
        right = string(m[1], path + "[1]");
      }
      const auto l = vocab.find(left), r = vocab.find(right), merged = vocab.find(left + right);
      TORCH_CHECK(l != vocab.end() && r != vocab.end() && merged != vocab.end(), "Tokenizer: ", origin, ": merge '",
                  left, " ", right, "' uses tokens missing from the vocabulary");
      merges.emplace(pair_key(l->second, r->second), Merge{rank++, merged->second});
    }
  }

  // Normalizer: Prepend / Replace(String), alone or in a Sequence.
  void load_normalizer(const json& n) {
    for (const auto& [s, path] : sequence_steps(n, "normalizer", "normalizers")) {
      const std::string type = string_or(*s, path, "type", "");
      if (type == "Prepend") {
        normalizer.push_back({NormalizerStep::kPrepend, string(member(*s, path, "prepend"), path + ".prepend"), ""});
      } else if (type == "Replace") {
        normalizer.push_back({NormalizerStep::kReplace, string_pattern(*s, path),
                              string(member(*s, path, "content"), path + ".content")});
      } else if (type == "NFC") {
        normalizer.push_back({NormalizerStep::kNFC, "", ""});
      } else {
        unsupported("normalizer", *s);
      }
    }
    check_growth("normalizer", normalizer);
  }

  // Replace steps multiply a text's length by up to |content| / |pattern| each, so a chain of a few
  // could turn one byte into gigabytes (three "a" -> 1000 x "a" steps: 12 GB for "a"). The
  // SentencePiece-style files this reader is for grow a text 3x (" " -> "▁").
  static constexpr double kMaxReplaceGrowth = 64;
  template <typename Step>
  void check_growth(const char* what, const std::vector<Step>& steps) const {
    double growth = 1;
    for (const Step& step : steps) {
      if (step.kind == Step::kReplace && step.b.size() > step.a.size() && !step.a.empty())
        growth *= static_cast<double>(step.b.size()) / static_cast<double>(step.a.size());
    }
    TORCH_CHECK(growth <= kMaxReplaceGrowth, "Tokenizer: ", origin, ": the ", what, "'s Replace steps can make a text ",
                growth, " times longer, more than the ", kMaxReplaceGrowth, " allowed");
  }

  // Added tokens keep their own ids; special ones are dropped by decode(skip_special_tokens). They
  // split the text before BPE: raw ones as written, normalized ones in their normalized form.
  // load_model has checked that each is an object with an id in range.
  void load_added_tokens(const json& added_tokens) {
    for (size_t i = 0; i < added_tokens.size(); ++i) {
      const json& a = added_tokens[i];
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      AddedToken t;
      t.id = a["id"].get<int64_t>();
      t.content = string(member(a, path, "content"), path + ".content");
      t.normalized = bool_or(a, path, "normalized", false);
      t.special = bool_or(a, path, "special", false);
      if (bool_or(a, path, "single_word", false) || bool_or(a, path, "lstrip", false) ||
          bool_or(a, path, "rstrip", false))
        unsupported("added token option (single_word / lstrip / rstrip)", a);
      id_to_token[static_cast<size_t>(t.id)] = t.content;
      special[static_cast<size_t>(t.id)] = t.special;
      added.push_back(t);
      if (t.normalized) {
        normalized_patterns.emplace_back(normalize(t.content), t.id);
      } else {
        raw_patterns.emplace_back(t.content, t.id);
      }
    }
  }

  // Post-processor: TemplateProcessing of a single sequence (ids before and after the text) and
  // ByteLevel (it trims offsets, which this reader does not report: no change to the ids), alone or
  // in a Sequence.
  void load_post_processor(const json& p) {
    bool has_template = false;
    for (const auto& [step, path] : sequence_steps(p, "post_processor", "processors")) {
      const std::string type = string_or(*step, path, "type", "");
      if (type == "TemplateProcessing") {
        TORCH_CHECK(!has_template, "Tokenizer: ", origin, ": unsupported post_processor: two TemplateProcessing steps");
        has_template = true;
        load_template(*step, path);
      } else if (type != "ByteLevel") {
        unsupported("post_processor", *step);
      }
    }
  }

  void load_template(const json& p, const std::string& template_path) {
    bool after = false;
    const json& single = array(member(p, template_path, "single"), template_path + ".single");
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string path = template_path + ".single[" + std::to_string(i) + "]";
      const json& item = object(single[i], path);
      if (item.contains("Sequence")) {
        TORCH_CHECK(!after, "Tokenizer: ", origin, ": post_processor template with two sequences");
        after = true;
      } else if (item.contains("SpecialToken")) {
        const std::string token_path = path + ".SpecialToken";
        const std::string name =
            string(member(object(item["SpecialToken"], token_path), token_path, "id"), token_path + ".id");
        const std::string tokens_path = template_path + ".special_tokens";
        const json& tokens = object(member(p, template_path, "special_tokens"), tokens_path);
        const std::string name_path = tokens_path + "['" + name + "']";
        const json& ids = array(member(object(member(tokens, tokens_path, name.c_str()), name_path), name_path, "ids"),
                                name_path + ".ids");
        for (size_t k = 0; k < ids.size(); ++k)
          (after ? suffix_ids : prefix_ids)
              .push_back(token_id(ids[k], name_path + ".ids[" + std::to_string(k) + "]",
                                  static_cast<int64_t>(id_to_token.size())));
      } else {
        unsupported("post_processor template item", item);
      }
    }
  }

  // Pre-tokenizer: Split (Regex or String pattern, Isolated, not inverted), Digits and ByteLevel,
  // alone or in a Sequence. The fields tokenizers requires are required here too.
  void load_pre_tokenizer(const json& p) {
    for (const auto& [step, path] : sequence_steps(p, "pre_tokenizer", "pretokenizers")) {
      const std::string type = string_or(*step, path, "type", "");
      const std::string where = "Tokenizer: " + origin + ": " + path;
      PreTokenizerStep split{PreTokenizerStep::kSplit, nullptr, false};
      if (type == "Split") {
        const json& pattern = object(member(*step, path, "pattern"), path + ".pattern");
        const std::string behavior = string(member(*step, path, "behavior"), path + ".behavior");
        if (behavior != "Isolated") unsupported("Split behavior (only Isolated)", (*step)["behavior"]);
        if (bool_or(*step, path, "invert", false)) unsupported("Split with invert", *step);
        if (pattern.contains("Regex")) {
          split.regex = std::make_shared<UnicodeRegex>(string(pattern["Regex"], path + ".pattern.Regex"), false, where);
        } else if (pattern.contains("String")) {
          split.regex =
              std::make_shared<UnicodeRegex>(string(pattern["String"], path + ".pattern.String"), true, where);
        } else {
          unsupported("Split pattern (only {\"Regex\": ...} or {\"String\": ...})", pattern);
        }
      } else if (type == "Digits") {
        // Rust's char::is_numeric is the N categories (Nd, Nl, No): \p{N}.
        split.regex = std::make_shared<UnicodeRegex>(
            required_bool(*step, path, "individual_digits") ? "\\p{N}" : "\\p{N}+", false, where);
      } else if (type == "ByteLevel") {
        split.kind = PreTokenizerStep::kByteLevel;
        split.add_prefix_space = required_bool(*step, path, "add_prefix_space");
        if (bool_or(*step, path, "use_regex", true))
          split.regex = std::make_shared<UnicodeRegex>(kGpt2SplitPattern, false, where);
      } else {
        unsupported("pre_tokenizer", *step);
      }
      pre_tokenizer.push_back(split);
    }
  }

  // Decoder: Replace(String) / ByteFallback / Fuse / Strip / ByteLevel, alone or in a Sequence.
  void load_decoder(const json& d) {
    for (const auto& [s, path] : sequence_steps(d, "decoder", "decoders")) {
      const std::string type = string_or(*s, path, "type", "");
      DecoderStep step{DecoderStep::kFuse, "", "", 0, 0};
      if (type == "Replace") {
        step = {DecoderStep::kReplace, string_pattern(*s, path), string(member(*s, path, "content"), path + ".content"),
                0, 0};
      } else if (type == "ByteFallback") {
        step.kind = DecoderStep::kByteFallback;
      } else if (type == "ByteLevel") {
        step.kind = DecoderStep::kByteLevel;
      } else if (type == "Fuse") {
        step.kind = DecoderStep::kFuse;
      } else if (type == "Strip") {
        // One character (as tokenizers' `char`): an empty one would strip nothing forever.
        const std::string content = string(member(*s, path, "content"), path + ".content");
        if (content.empty() || utf8_length(static_cast<unsigned char>(content[0])) != content.size())
          malformed(path + ".content", "one character", (*s)["content"]);
        step = {DecoderStep::kStrip, content, "", count_or(*s, path, "start"), count_or(*s, path, "stop")};
      } else {
        unsupported("decoder", *s);
      }
      decoder.push_back(step);
    }
    check_growth("decoder", decoder);
  }

  // A non-negative integer member, 0 when absent (Strip's start and stop).
  size_t count_or(const json& object, const std::string& path, const char* key) const {
    if (!has(object, key)) return 0;
    const json& v = object[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      malformed(path + "." + key, "a non-negative integer", v);
    return v.get<size_t>();
  }
};

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "Tokenizer: cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& origin) {
  const json j = io::parse_json(json_text, "Tokenizer: " + origin);
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  TORCH_CHECK(j.is_object(), "Tokenizer: ", origin, ": tokenizer.json must be a JSON object, got ", j.type_name());
  TORCH_CHECK(has(j, "model") && j["model"].is_object(), "Tokenizer: ", origin, ": no model");
  const json no_added_tokens = json::array();
  const json& added_tokens = has(j, "added_tokens") ? impl->array(j["added_tokens"], "added_tokens") : no_added_tokens;
  impl->load_model(j["model"], added_tokens);
  if (has(j, "normalizer")) impl->load_normalizer(j["normalizer"]);
  if (has(j, "pre_tokenizer")) impl->load_pre_tokenizer(j["pre_tokenizer"]);
  impl->load_added_tokens(added_tokens);  // after the normalizer: normalized ones match normalized text
  if (has(j, "post_processor")) impl->load_post_processor(j["post_processor"]);
  if (has(j, "decoder")) impl->load_decoder(j["decoder"]);
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  // 0. Valid UTF-8 (the regexes and NFC need it); 1. added tokens in the raw text.
  std::vector<std::pair<std::string, int64_t>> raw_pieces;
  Impl::split_on(utf8_lossy(text), t.raw_patterns, raw_pieces);
  // 2. Normalize the rest and find normalized added tokens; 3. pre-tokenize; 4. BPE on the words.
  std::vector<int64_t> ids = add_special_tokens ? t.prefix_ids : std::vector<int64_t>{};
  for (const auto& [piece, id] : raw_pieces) {
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    std::vector<std::pair<std::string, int64_t>> pieces;
    Impl::split_on(t.normalize(piece), t.normalized_patterns, pieces);
    for (const auto& [word, word_id] : pieces) {
      if (word_id >= 0) {
        ids.push_back(word_id);
      } else if (t.pre_tokenizer.empty()) {
        t.bpe(word, ids);
      } else {
        for (const std::string& w : t.pre_tokenize(word)) t.bpe(w, ids);
      }
    }
  }
  // 5. Post-processor.
  if (add_special_tokens) ids.insert(ids.end(), t.suffix_ids.begin(), t.suffix_ids.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(t.id_to_token.size())) continue;
    const std::string& token = t.id_to_token[static_cast<size_t>(id)];
    if (token.empty()) continue;  // an id no token uses
    if (skip_special_tokens && t.special[static_cast<size_t>(id)]) continue;
    tokens.push_back(token);
  }
  std::string out;
  for (const auto& piece : t.run_decoder(std::move(tokens))) out += piece;
  return out;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  if (const auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::id_to_token(int64_t id) const {
  TORCH_CHECK(id >= 0 && id < vocab_size(), "Tokenizer::id_to_token: id ", id, " is out of range [0, ", vocab_size(),
              ")");
  return impl_->id_to_token[static_cast<size_t>(id)];
}

bool Tokenizer::is_special(int64_t id) const {
  return id >= 0 && id < vocab_size() && impl_->special[static_cast<size_t>(id)];
}

}  // namespace kvpress::llama
