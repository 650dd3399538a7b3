// Chat templates (kvpress/llama/chat.h) against transformers: every known template text
// (tests/data/chat_templates) renders the conversations of tests/reference/make_chat_fixtures.py as
// transformers' render_jinja_template does, and the texts encode to the same ids as `tokenizers`
// encodes them with the family's fixture tokenizer.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/chat.h"
#include "kvpress/llama/tokenizer.h"
#include "test_util.h"

namespace {

using kvpress::llama::ChatMessage;
using kvpress::llama::ChatOptions;
using kvpress::llama::ChatTemplate;
using kvpress::testing::expect_error;

const std::string kTemplates = std::string(KVPRESS_TEST_DATA_DIR) + "/chat_templates/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<ChatMessage> messages_of(const nlohmann::json& j) {
  std::vector<ChatMessage> out;
  for (const auto& m : j) out.push_back({m.at("role"), m.at("content")});
  return out;
}

#define REQUIRE_CHAT_FIXTURES()                                                              \
  const kvpress::testing::FolderFixtures fx =                                                \
      kvpress::testing::load_folder_fixtures("chat", "make_chat_fixtures.py", "cases.json"); \
  ASSERT_TRUE(fx.error.empty()) << fx.error

TEST(ChatParity, EveryKnownTemplateRendersAsTransformers) {
  REQUIRE_CHAT_FIXTURES();
  std::map<std::string, kvpress::llama::Tokenizer> tokenizers;
  for (const char* name : {"qwen2", "llama3"})
    tokenizers.emplace(name, kvpress::llama::Tokenizer::load(fx.dir + "/../tokenizers/" + name + "/tokenizer.json"));
  const std::string today = fx.manifest.at("today");
  std::map<std::string, int> per_file;
  int dated_today = 0, skipped_other_day = 0;
  for (const auto& c : fx.manifest.at("cases")) {
    const std::string file = c.at("file");
    const bool llama = c.at("tokenizer") == "llama3";
    const ChatTemplate chat =
        ChatTemplate::recognize(read_file(kTemplates + file), file, llama ? "<|begin_of_text|>" : "");
    EXPECT_EQ(chat.name(), c.at("family").get<std::string>()) << file;
    ChatOptions options;
    const auto& o = c.at("options");
    if (o.contains("enable_thinking")) options.enable_thinking = o.at("enable_thinking");
    if (o.contains("date_string")) options.date_string = o.at("date_string").get<std::string>();
    const std::string text = chat.apply(messages_of(c.at("messages")), c.at("add_generation_prompt"), options);
    const std::string expected = c.at("text");
    if (chat.name() == "llama3.2" && !options.date_string) {
      // Today's date by default: comparable only on the day the fixtures were made.
      if (text.find("Today Date: " + today + "\n") == std::string::npos) {
        ++skipped_other_day;
        continue;
      }
      ++dated_today;
    }
    ++per_file[file];
    const int n = per_file[file];
    ASSERT_EQ(text, expected) << file << ", case " << n;
    EXPECT_EQ(tokenizers.at(c.at("tokenizer")).encode(text, /*add_special_tokens=*/false),
              c.at("ids").get<std::vector<int64_t>>())
        << file << ", case " << n;
  }
  EXPECT_EQ(per_file.size(), 10u);
  std::cout << "chat templates: " << per_file.size() << " texts of " << ChatTemplate::known().size()
            << " families, each conversation equal to transformers' rendering and its ids to tokenizers'";
  if (skipped_other_day > 0)
    std::cout << " (" << skipped_other_day << " Llama 3.2 renderings without a date_string not compared: the fixtures "
              << "hold " << today << ", another day than today)";
  std::cout << "\n";
  EXPECT_GT(dated_today + skipped_other_day, 0);
}

TEST(ChatTemplates, UnknownEmptyAndUnsupportedAreRefused) {
  const std::string qwen3 = read_file(kTemplates + "qwen3.jinja");
  expect_error([&] { ChatTemplate::recognize(qwen3 + "\n", "x"); },
               {"ChatTemplate::recognize: x: its chat template is not one this library renders (smollm2, qwen2.5, "
                "qwen3, llama3, llama3.1, llama3.2); rendering another would be a guess"});
  expect_error([&] { ChatTemplate::recognize("", "x"); }, {"ChatTemplate::recognize: x has no chat template"});
  expect_error([&] { ChatTemplate::recognize(read_file(kTemplates + "llama3_1.jinja"), "x"); },
               {"ChatTemplate::recognize: x: the llama3.1 chat template writes the BOS token first; pass bos_token"});
  const ChatTemplate chat = ChatTemplate::recognize(qwen3, "x");
  expect_error([&] { chat.apply({}, true); },
               {"ChatTemplate::apply: messages must hold at least one message, got none"});
  expect_error(
      [&] {
        chat.apply({{"user", "hi"}, {"tool", "42"}}, true);
      },
      {"ChatTemplate::apply: messages[1].role must be system, user or assistant, got \"tool\""});
}

}  // namespace
