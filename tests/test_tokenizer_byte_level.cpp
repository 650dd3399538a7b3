// Byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2 layouts) and the UTF-8 repair they share.
//
// Utf8.*, ByteLevelTokenizer.*  unit tests (no fixtures): Unicode's maximal-subpart replacement
//                examples, bytes to characters and back, what the reader refuses and how it says
//                so, a backtracking pattern stopped at its limit.
// TokenizerParity.*  against tests/reference/make_tokenizer_fixtures.py: five tokenizer.json files
//                written by the Python `tokenizers` library and 10,000 strings (multilingual text,
//                emoji, digits, whitespace runs, code, added tokens, random code points, invalid
//                UTF-8); every string's ids (with and without special tokens) and decoded text
//                (with and without skip_special_tokens) must equal the library's, but for strings
//                holding code points newer than our regex tables' Unicode version (counted and
//                printed: the library's Oniguruma classifies them, PCRE2 10.42 cannot).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/tokenizer.h"
#include "llama/unicode.h"
#include "llama/utf8.h"
#include "test_util.h"

namespace {

using kvpress::llama::Tokenizer;
using kvpress::testing::expect_error;
using json = nlohmann::json;

// ---- UTF-8 repair --------------------------------------------------------------------------------

TEST(Utf8, LossyReplacesMaximalSubparts) {
  const std::string fffd = "\xEF\xBF\xBD";
  // Unicode 15, section 3.9, table 3-8: one U+FFFD per maximal subpart (as Python's
  // bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy give).
  EXPECT_EQ(kvpress::llama::utf8_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + fffd + fffd + fffd + "b" + fffd + "c" + fffd + fffd + "d");
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xE0\x80\x80"), fffd + fffd + fffd);             // overlong
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xED\xA0\x80"), fffd + fffd + fffd);             // surrogate
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xF0\x9F\x98"), fffd);                           // truncated
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xC0\xAF"), fffd + fffd);
  EXPECT_EQ(kvpress::llama::utf8_lossy("\xE2\x28\xA1"), fffd + "(" + fffd);
  const std::string valid = "caf\xC3\xA9 \xF0\x9F\x98\x80";
  EXPECT_EQ(kvpress::llama::utf8_lossy(valid), valid);
  EXPECT_TRUE(kvpress::llama::valid_utf8(valid));
  EXPECT_FALSE(kvpress::llama::valid_utf8("\xF0\x9F\x98"));
}

// ---- what the reader refuses ---------------------------------------------------------------------

// A byte-level tokenizer.json with the given pre_tokenizer: the 256 byte characters as its vocabulary.
std::string byte_level_json(const json& pre_tokenizer) {
  json vocab = json::object();
  int id = 0, next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    std::string ch = cp < 0x80
                         ? std::string(1, static_cast<char>(cp))
                         : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    vocab[ch] = id++;
  }
  json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
      {"pre_tokenizer", pre_tokenizer},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}}};
  return j.dump();
}

TEST(ByteLevelTokenizer, EncodesBytesAsTheirCharactersAndDecodesBack) {
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  const Tokenizer tok = Tokenizer::from_json(byte_level_json(byte_level));
  // No merges: one token per byte; ' ' is "Ġ" (U+0120), '\n' "Ċ" (U+010A), 'a' itself.
  const std::string text = "a b\n\xC3\xA9";
  const auto ids = tok.encode(text, false);
  ASSERT_EQ(ids.size(), 6u);
  EXPECT_EQ(tok.id_to_token(ids[1]), "\xC4\xA0");
  EXPECT_EQ(tok.id_to_token(ids[3]), "\xC4\x8A");
  EXPECT_EQ(tok.decode(ids), text);
  // Half of "é" decodes to U+FFFD, as from_utf8_lossy does.
  EXPECT_EQ(tok.decode({ids[4]}), "\xEF\xBF\xBD");
  // Invalid UTF-8 is encoded as its repair: the three bytes of U+FFFD.
  EXPECT_EQ(tok.encode("\xFF", false), tok.encode("\xEF\xBF\xBD", false));
}

TEST(ByteLevelTokenizer, RefusesWhatItDoesNotRun) {
  const json split_removed = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}, {"invert", false}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(split_removed)); },
               {"Tokenizer: tokenizer.json", "unsupported Split behavior (only Isolated)", "Removed"});
  const json split_inverted = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}, {"invert", true}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(split_inverted)); }, {"unsupported Split with invert"});
  const json bad_regex = {
      {"type", "Split"}, {"pattern", {{"Regex", "(\\p{L}"}}}, {"behavior", "Isolated"}, {"invert", false}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(bad_regex)); },
               {"Tokenizer: tokenizer.json: pre_tokenizer", "does not compile", "(PCRE2, at offset"});
  const json no_prefix_field = {{"type", "ByteLevel"}, {"use_regex", true}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(no_prefix_field)); },
               {"Tokenizer: tokenizer.json: pre_tokenizer.add_prefix_space is missing"});
  const json metaspace = {{"type", "Metaspace"}, {"replacement", "_"}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(metaspace)); }, {"unsupported pre_tokenizer", "Metaspace"});
  const json nested = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Whitespace"}}}}};
  expect_error([&] { Tokenizer::from_json(byte_level_json(nested)); }, {"unsupported pre_tokenizer", "Whitespace"});
}

TEST(ByteLevelTokenizer, ABacktrackingPatternStopsAtItsLimit) {
  // Nested quantifiers with no possible match: exponential backtracking, stopped by PCRE2's match
  // limit with an error instead of an encode that never returns.
  const json catastrophic = {
      {"type", "Split"}, {"pattern", {{"Regex", "(\\p{L}+\\p{L}+)+\\d"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const Tokenizer tok = Tokenizer::from_json(byte_level_json(catastrophic));
  EXPECT_EQ(tok.encode("ab1", false).size(), 3u);
  expect_error(
      [&] { tok.encode(std::string(40, 'a'), false); },
      {"Tokenizer: tokenizer.json: pre_tokenizer", "the pattern failed on a text of 40 bytes", "match limit exceeded"});
}

// ---- against the tokenizers library --------------------------------------------------------------

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("no " + path + "; generate it with tests/reference/make_tokenizer_fixtures.py");
  return json::parse(in);
}

// A text readable in a failure message: printable ASCII as is, other bytes as \xNN.
std::string escaped(const std::string& s) {
  std::ostringstream out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F) {
      out << c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out << buf;
    }
  }
  return out.str();
}

TEST(TokenizerParity, ByteLevelTokenizersMatchTheTokenizersLibrary) {
  const std::string dir = kvpress::testing::fixtures_dir();
  ASSERT_FALSE(dir.empty()) << "KVPRESS_FIXTURES is not set; " << kvpress::testing::fixtures_howto();
  const json strings_json = read_json(dir + "/tokenizers/strings.json");
  std::vector<std::string> strings;
  for (const json& hex : strings_json.at("strings_hex")) strings.push_back(from_hex(hex.get<std::string>()));
  ASSERT_GE(strings.size(), 10000u);
  const kvpress::llama::UnicodeRegex unassigned("\\p{Cn}", false, "TokenizerParity");
  for (const char* name : {"gpt2", "smollm2", "llama3", "qwen2", "prefixed"}) {
    SCOPED_TRACE(name);
    const std::string folder = dir + "/tokenizers/" + name;
    const Tokenizer tok = Tokenizer::load(folder + "/tokenizer.json");
    const json expected = read_json(folder + "/expected.json");
    const json& cases = expected.at("cases");
    ASSERT_EQ(cases.size(), strings.size());
    size_t mismatches = 0, newer_unicode_mismatches = 0, newer_unicode_strings = 0;
    for (size_t i = 0; i < strings.size(); ++i) {
      const json& c = cases[i];
      const auto ids = c.at("ids").get<std::vector<int64_t>>();
      const auto ids_plain = c.at("ids_plain").get<std::vector<int64_t>>();
      const bool same = tok.encode(strings[i], true) == ids && tok.encode(strings[i], false) == ids_plain &&
                        tok.decode(ids, false) == c.at("decoded").get<std::string>() &&
                        tok.decode(ids, true) == c.at("decoded_skip").get<std::string>();
      // The one known difference: a code point that our regex tables (PCRE2's Unicode version)
      // hold unassigned while the library's Oniguruma knows it (e.g. U+13980, an Egyptian
      // hieroglyph of Unicode 16, is \p{L} there and \p{Cn} here) may split a word elsewhere.
      const bool newer_unicode = !unassigned.find_all(kvpress::llama::utf8_lossy(strings[i])).empty();
      newer_unicode_strings += newer_unicode;
      if (!same && newer_unicode) {
        ++newer_unicode_mismatches;
        continue;
      }
      if (!same && ++mismatches <= 5) {
        ADD_FAILURE() << name << " string " << i << " \"" << escaped(strings[i]) << "\": ids "
                      << ::testing::PrintToString(tok.encode(strings[i], true)) << " vs tokenizers' "
                      << ::testing::PrintToString(ids) << "; decoded \"" << escaped(tok.decode(ids, false))
                      << "\" vs \"" << escaped(c.at("decoded").get<std::string>()) << "\"";
      }
    }
    EXPECT_EQ(mismatches, 0u) << name << ": " << mismatches << " of " << strings.size()
                              << " strings differ from tokenizers " << strings_json.at("tokenizers_version");
    std::cout << name << ": " << strings.size() - mismatches - newer_unicode_mismatches << " of " << strings.size()
              << " strings equal; " << newer_unicode_mismatches << " of the " << newer_unicode_strings
              << " holding code points unassigned in " << kvpress::llama::unicode_tables_version() << " differ\n";
  }
}

}  // namespace
