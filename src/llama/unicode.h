// The Unicode services the byte-level tokenizers need, from maintained libraries rather than
// hand-written tables: regular expressions with Unicode properties (PCRE2, in UTF + UCP mode, for
// the pre-tokenizers' split patterns such as GPT-2's and Llama 3's) and NFC normalization
// (utf8proc, for Qwen2's normalizer).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvpress::llama {

// A compiled pattern, immutable after construction: one object may be matched from any number of
// threads at once (each call allocates its own match data).
class UnicodeRegex {
 public:
  // Compiles `pattern` (Oniguruma/Perl syntax as the tokenizers library writes it: \p{L}, \s,
  // (?i:...), (?!...)); a pattern PCRE2 refuses raises c10::Error naming `origin` and the offset.
  // `literal`: the pattern is a plain string (a Split pre-tokenizer's {"String": ...}).
  UnicodeRegex(const std::string& pattern, bool literal, const std::string& origin);

  // The non-overlapping matches in `text` (valid UTF-8), left to right, as byte ranges
  // [begin, end). After an empty match the search resumes one character later, as Oniguruma's
  // find_iter does.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& text) const;

 private:
  struct Compiled;
  std::shared_ptr<const Compiled> compiled_;
};

// Canonical composition (NFC) of valid UTF-8 text.
std::string nfc(const std::string& text);

// The Unicode version of PCRE2's and utf8proc's character tables ("PCRE2 10.42 (Unicode 14.0.0),
// utf8proc 2.8.0 (Unicode 15.0.0)"): characters newer than these are classified as unassigned.
std::string unicode_tables_version();

}  // namespace kvpress::llama
