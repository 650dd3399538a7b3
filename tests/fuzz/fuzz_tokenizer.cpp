// libFuzzer target: kvpress::llama::Tokenizer::from_json, then encode/decode with any tokenizer that
// loads. Input: tokenizer.json text, optionally followed by a NUL byte and a text to encode (JSON
// text cannot hold a raw NUL). Every input either loads or raises a c10::Error; a loaded
// tokenizer encodes any bytes to ids in [0, vocab_size) (or raises for a character it cannot
// encode) and decodes any ids to valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kvpress/llama/tokenizer.h"
#include "utf8.h"  // src/llama

namespace {

using kvpress::llama::Tokenizer;
using kvpress::llama::valid_utf8;

// Texts every loaded tokenizer encodes: ASCII, spaces, control characters, multi-byte UTF-8,
// invalid UTF-8, special-token and byte-token look-alikes, SentencePiece's "▁".
const char* const kTexts[] = {
    "",
    "Once upon a time",
    "  two  spaces ",
    "a\nb\tc\r",
    "\xC3\xA9t\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80",
    "\xFF\xFE\xC3 invalid \xE2\x82",
    "<s></s><unk><|start_story|><|end_story|>",
    "<0x41><0xZZ>",
    "\xE2\x96\x81the\xE2\x96\x81",
};

void check_decode(const Tokenizer& tokenizer, const std::vector<int64_t>& ids) {
  for (bool skip_special : {true, false}) {
    const std::string text = tokenizer.decode(ids, skip_special);
    FUZZ_EXPECT(valid_utf8(text), "decode gave invalid UTF-8");
  }
}

void check_encode(const Tokenizer& tokenizer, const std::string& text) {
  for (bool add_special : {true, false}) {
    kvpress::fuzz::expect_success_or_error([&] {  // a character it cannot encode raises
      const std::vector<int64_t> ids = tokenizer.encode(text, add_special);
      for (int64_t id : ids)
        FUZZ_EXPECT(id >= 0 && id < tokenizer.vocab_size(), "encode gave id " + std::to_string(id));
      check_decode(tokenizer, ids);
    });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string json_text = input.substr(0, nul);
  kvpress::fuzz::expect_success_or_error([&] {
    const Tokenizer tokenizer = Tokenizer::from_json(json_text, "fuzz");
    const int64_t vocab_size = tokenizer.vocab_size();
    FUZZ_EXPECT(vocab_size >= 0, "negative vocab_size");
    for (const char* text : kTexts) check_encode(tokenizer, text);
    if (nul != std::string::npos) check_encode(tokenizer, input.substr(nul + 1));

    // Every id's token and flags, ids out of range dropped by decode.
    std::vector<int64_t> ids = {-1, vocab_size, std::numeric_limits<int64_t>::max(),
                                std::numeric_limits<int64_t>::min()};
    for (int64_t id = 0; id < vocab_size && id < 512; ++id) {
      const std::string& token = tokenizer.id_to_token(id);
      tokenizer.is_special(id);
      if (!token.empty()) FUZZ_EXPECT(tokenizer.token_to_id(token).has_value(), "token without an id: " + token);
      ids.push_back(id);
    }
    check_decode(tokenizer, ids);
  });
  return 0;
}
