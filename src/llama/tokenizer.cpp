// tokenizer.json reader: SentencePiece-style BPE as the Python `tokenizers` library runs it.
//
// encode(text):
//   1. split the raw text on added tokens with normalized=false (leftmost-longest);
//   2. normalize every other piece, then split it on added tokens with normalized=true, matched
//      against their normalized form (with a Prepend("▁") normalizer "<|x|>" is found as "▁<|x|>");
//   3. run BPE on every remaining piece (no pre-tokenizer: a piece is one word, spaces included);
//   4. add the post_processor's special tokens (BOS).
// decode(ids): ids -> token strings (special ones dropped when asked), then the decoder chain.
#include "kvpress/llama/tokenizer.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

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

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      n = 2, cp = c & 0x1F;
    } else if ((c >> 4) == 0xE) {
      n = 3, cp = c & 0x0F;
    } else if ((c >> 3) == 0x1E) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong encodings, surrogates and values past U+10FFFF are invalid (Rust's from_utf8).
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
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

// The String pattern of a Replace normalizer/decoder ({"String": "..."}); Regex patterns are not
// supported.
std::string string_pattern(const json& step, const std::string& origin) {
  const json& p = step.at("pattern");
  TORCH_CHECK(p.is_object() && p.contains("String"), "Tokenizer: ", origin, ": unsupported Replace pattern ", p.dump(),
              " (only {\"String\": ...})");
  return p["String"].get<std::string>();
}

// ---- components ---------------------------------------------------------------------------------

struct NormalizerStep {
  enum Kind { kPrepend, kReplace } kind;
  std::string a, b;  // prepend: a; replace: a -> b
};

struct DecoderStep {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip } kind;
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

// The steps of a normalizer/decoder: its `list_key` array when it is a Sequence, else itself.
std::vector<json> sequence_steps(const json& step, const char* list_key) {
  if (step.value("type", "") != "Sequence") return {step};
  return step.at(list_key).get<std::vector<json>>();
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::vector<NormalizerStep> normalizer;
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
      TORCH_CHECK(unk_id >= 0, "Tokenizer: ", origin, ": character '", ch,
                  "' is not in the vocabulary and the model has no unk_token");
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

  [[noreturn]] void unsupported(const char* what, const json& value) const {
    TORCH_CHECK(false, "Tokenizer: ", origin, ": unsupported ", what, " ", value.dump().substr(0, 200));
  }

  // Model: BPE (vocabulary, merges, unknown-token and byte-fallback options). Ids run up to the
  // largest of the vocabulary and the added tokens.
  void load_model(const json& model, const json& added_tokens) {
    if (model.value("type", "") != "BPE") unsupported("model type", model.value("type", json()));
    if (has(model, "continuing_subword_prefix") || has(model, "end_of_word_suffix"))
      unsupported("BPE option (continuing_subword_prefix / end_of_word_suffix)", model["continuing_subword_prefix"]);
    if (has(model, "dropout") && model["dropout"].get<double>() != 0.0) unsupported("BPE dropout", model["dropout"]);
    fuse_unk = model.value("fuse_unk", false);
    byte_fallback = model.value("byte_fallback", false);
    ignore_merges = model.value("ignore_merges", false);
    int64_t max_id = -1;
    for (const auto& [token, id] : model.at("vocab").items()) {
      vocab[token] = id.get<int32_t>();
      max_id = std::max<int64_t>(max_id, id.get<int64_t>());
    }
    for (const auto& a : added_tokens) max_id = std::max(max_id, a.at("id").get<int64_t>());
    id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    special.assign(static_cast<size_t>(max_id + 1), false);
    for (const auto& [token, id] : vocab) id_to_token[static_cast<size_t>(id)] = token;
    if (has(model, "unk_token")) {
      const auto it = vocab.find(model["unk_token"].get<std::string>());
      TORCH_CHECK(it != vocab.end(), "Tokenizer: ", origin, ": unk_token is not in the vocabulary");
      unk_id = it->second;
    }
    int32_t rank = 0;
    for (const auto& m : model.at("merges")) {
      std::string left, right;
      if (m.is_string()) {  // "left right"
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        TORCH_CHECK(space != std::string::npos, "Tokenizer: ", origin, ": malformed merge '", s, "'");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {  // ["left", "right"]
        left = m.at(0).get<std::string>();
        right = m.at(1).get<std::string>();
      }
      const auto l = vocab.find(left), r = vocab.find(right), merged = vocab.find(left + right);
      TORCH_CHECK(l != vocab.end() && r != vocab.end() && merged != vocab.end(), "Tokenizer: ", origin, ": merge '",
                  left, " ", right, "' uses tokens missing from the vocabulary");
      merges.emplace(pair_key(l->second, r->second), Merge{rank++, merged->second});
    }
  }

  // Normalizer: Prepend / Replace(String), alone or in a Sequence.
  void load_normalizer(const json& n) {
    for (const json& s : sequence_steps(n, "normalizers")) {
      const std::string type = s.value("type", "");
      if (type == "Prepend") {
        normalizer.push_back({NormalizerStep::kPrepend, s.at("prepend").get<std::string>(), ""});
      } else if (type == "Replace") {
        normalizer.push_back({NormalizerStep::kReplace, string_pattern(s, origin), s.at("content").get<std::string>()});
      } else {
        unsupported("normalizer", s);
      }
    }
  }

  // Added tokens keep their own ids; special ones are dropped by decode(skip_special_tokens). They
  // split the text before BPE: raw ones as written, normalized ones in their normalized form.
  void load_added_tokens(const json& added_tokens) {
    for (const auto& a : added_tokens) {
      AddedToken t;
      t.id = a.at("id").get<int64_t>();
      t.content = a.at("content").get<std::string>();
      t.normalized = a.value("normalized", false);
      t.special = a.value("special", false);
      if (a.value("single_word", false) || a.value("lstrip", false) || a.value("rstrip", false))
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

  // Post-processor: TemplateProcessing of a single sequence (ids before and after the text).
  void load_post_processor(const json& p) {
    if (p.value("type", "") != "TemplateProcessing") unsupported("post_processor", p);
    bool after = false;
    for (const auto& item : p.at("single")) {
      if (item.contains("Sequence")) {
        TORCH_CHECK(!after, "Tokenizer: ", origin, ": post_processor template with two sequences");
        after = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].at("id").get<std::string>();
        for (const auto& id : p.at("special_tokens").at(name).at("ids"))
          (after ? suffix_ids : prefix_ids).push_back(id.get<int64_t>());
      } else {
        unsupported("post_processor template item", item);
      }
    }
  }

  // Decoder: Replace(String) / ByteFallback / Fuse / Strip, alone or in a Sequence.
  void load_decoder(const json& d) {
    for (const json& s : sequence_steps(d, "decoders")) {
      const std::string type = s.value("type", "");
      DecoderStep step{DecoderStep::kFuse, "", "", 0, 0};
      if (type == "Replace") {
        step = {DecoderStep::kReplace, string_pattern(s, origin), s.at("content").get<std::string>(), 0, 0};
      } else if (type == "ByteFallback") {
        step.kind = DecoderStep::kByteFallback;
      } else if (type == "Fuse") {
        step.kind = DecoderStep::kFuse;
      } else if (type == "Strip") {
        step = {DecoderStep::kStrip, s.at("content").get<std::string>(), "", s.value("start", size_t{0}),
                s.value("stop", size_t{0})};
      } else {
        unsupported("decoder", s);
      }
      decoder.push_back(step);
    }
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
  json j;
  try {
    j = json::parse(json_text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Tokenizer: ", origin, ": not valid JSON: ", e.what());
  }
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  TORCH_CHECK(j.contains("model") && j["model"].is_object(), "Tokenizer: ", origin, ": no model");
  const json added_tokens = j.value("added_tokens", json::array());
  impl->load_model(j["model"], added_tokens);
  if (has(j, "normalizer")) impl->load_normalizer(j["normalizer"]);
  if (has(j, "pre_tokenizer")) impl->unsupported("pre_tokenizer (only none)", j["pre_tokenizer"]);
  impl->load_added_tokens(added_tokens);  // after the normalizer: normalized ones match normalized text
  if (has(j, "post_processor")) impl->load_post_processor(j["post_processor"]);
  if (has(j, "decoder")) impl->load_decoder(j["decoder"]);
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  // 1. Added tokens in the raw text.
  std::vector<std::pair<std::string, int64_t>> raw_pieces;
  Impl::split_on(text, t.raw_patterns, raw_pieces);
  // 2. Normalize the rest and find normalized added tokens; 3. BPE on what remains.
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
      } else {
        t.bpe(word, ids);
      }
    }
  }
  // 4. Post-processor.
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
