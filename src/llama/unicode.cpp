#include "unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <c10/util/Exception.h>
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>

namespace kvpress::llama {

// A pattern from a file must not make encode() unbounded: a catastrophically backtracking one
// stops at these limits with an error (real tokenizers' patterns take tens of steps per match).
constexpr uint32_t kMatchLimit = 1000000;      // backtracking steps per match attempt
constexpr uint32_t kHeapLimitKiB = 64 * 1024;  // backtracking memory per match attempt

struct UnicodeRegex::Compiled {
  pcre2_code* code = nullptr;
  pcre2_match_context* limits = nullptr;  // read-only once made: shared by concurrent matches
  std::string origin;                     // who compiled it, for error messages
  ~Compiled() {
    pcre2_match_context_free(limits);
    pcre2_code_free(code);
  }
};

UnicodeRegex::UnicodeRegex(const std::string& pattern, bool literal, const std::string& origin) {
  auto compiled = std::make_shared<Compiled>();
  compiled->origin = origin;
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2 refuses UCP with LITERAL (a literal has no character classes to widen).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  compiled->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                                 &error_offset, nullptr);
  if (compiled->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    TORCH_CHECK(false, origin, ": the pattern '", pattern.substr(0, 200), "' does not compile (PCRE2, at offset ",
                error_offset, "): ", reinterpret_cast<const char*>(message));
  }
  compiled->limits = pcre2_match_context_create(nullptr);
  TORCH_CHECK(compiled->limits != nullptr, origin, ": out of memory compiling a pattern");
  pcre2_set_match_limit(compiled->limits, kMatchLimit);
  pcre2_set_heap_limit(compiled->limits, kHeapLimitKiB);
  // JIT where the platform has it (several times faster); the interpreter gives the same matches.
  pcre2_jit_compile(compiled->code, PCRE2_JIT_COMPLETE);
  compiled_ = std::move(compiled);
}

std::vector<std::pair<size_t, size_t>> UnicodeRegex::find_all(const std::string& text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> data(
      pcre2_match_data_create_from_pattern(compiled_->code, nullptr), pcre2_match_data_free);
  TORCH_CHECK(data != nullptr, "UnicodeRegex::find_all: out of memory");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // The text was checked once by the caller (the tokenizer makes it valid UTF-8 first).
    const int rc =
        pcre2_match(compiled_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), compiled_->limits);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      TORCH_CHECK(false, compiled_->origin, ": the pattern failed on a text of ", text.size(),
                  " bytes: ", reinterpret_cast<const char*>(message), " (limits: ", kMatchLimit, " steps, ",
                  kHeapLimitKiB, " KiB)");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {
      // An empty match: next search one character further (UTF-8 continuation bytes skipped).
      start = begin + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
  return matches;
}

std::string nfc(const std::string& text) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  TORCH_CHECK(n >= 0, "nfc: utf8proc failed: ", utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

std::string unicode_tables_version() {
  char pcre2_version[64] = {0};
  pcre2_config(PCRE2_CONFIG_VERSION, pcre2_version);
  char pcre2_unicode[64] = {0};
  pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, pcre2_unicode);
  return std::string("PCRE2 ") + pcre2_version + " (Unicode " + pcre2_unicode + "), utf8proc " + utf8proc_version() +
         " (Unicode " + utf8proc_unicode_version() + ")";
}

}  // namespace kvpress::llama
