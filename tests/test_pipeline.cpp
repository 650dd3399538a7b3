// kvpress::llama::answer_questions, kvpress's KVPressTextGenerationPipeline on the Llama runner.
//
// Pipeline.*        unit tests on the bundled TinyStories-656K: answers from one compressed cache
//                   equal those of separate runs (the cache is cut back between questions), the
//                   query-aware prefill holds the question, bad input.
// PipelineParity.*  against kvpress 0.5.5's pipeline on the same model, context, questions and
//                   press (fixtures: tests/reference/make_pipeline_fixtures.py, <fixtures>/pipeline;
//                   ctest entry parity.pipeline_kvpress): the answers' texts are identical.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/kvpress.h"
#include "kvpress/llama/llama.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::llama::Answer;
using kvpress::llama::answer_questions;
using kvpress::llama::LlamaModel;
using kvpress::llama::PipelineOptions;
using kvpress::llama::Tokenizer;
using kvpress::testing::expect_error;
using json = nlohmann::json;

// The bundled model and its tokenizer (tests/tiny_model.h).
struct TinyModel {
  const LlamaModel& model;
  const Tokenizer& tokenizer;
};

TinyModel tiny() { return {kvpress::testing::tiny_model(), kvpress::testing::tiny_tokenizer()}; }

// The first held-out story of at least 160 tokens: SnapKVPress at 0.5 keeps more than its window.
const std::string& story() {
  static const std::string s = [] {
    for (const std::string& text : kvpress::llama::read_stories(kvpress::llama::default_stories_path()))
      if (tiny().tokenizer.encode(text).size() >= 160) return text;
    throw std::runtime_error("no held-out story of 160 tokens");
  }();
  return s;
}

std::vector<std::string> texts(const std::vector<Answer>& answers) {
  std::vector<std::string> out;
  for (const Answer& a : answers) out.push_back(a.text);
  return out;
}

TEST(Pipeline, AnswersFromOneCacheEqualSeparateRuns) {
  const auto& [model, tok] = tiny();
  const std::vector<std::string> questions{"Who is in the story?", "What happened next?", ""};
  for (const char* name : {"SnapKVPress", "KeyRerotationPress", "AdaKVPress"}) {
    SCOPED_TRACE(name);
    const auto press = kvpress::make_press(name, 0.5);
    PipelineOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = 12;
    const std::vector<Answer> together = answer_questions(model, tok, story(), questions, opt);
    ASSERT_EQ(together.size(), questions.size());
    for (size_t i = 0; i < questions.size(); ++i) {
      const std::vector<Answer> alone = answer_questions(model, tok, story(), {questions[i]}, opt);
      EXPECT_EQ(together[i].tokens, alone[0].tokens) << "question " << i;
      EXPECT_EQ(together[i].cache_lengths, alone[0].cache_lengths);
      EXPECT_EQ(together[i].text, tok.decode(together[i].tokens));
    }
    // The context was compressed: every layer keeps about half of it.
    EXPECT_LT(together[0].cache_lengths[0], together[0].prefill_length);
  }
}

// Answers over pages (PipelineOptions::paged_kv_format): in full precision the dense pipeline's
// answers and kept counts, uniform and head-ragged presses alike, query-aware too; quantized pages
// keep the same tokens of the context (quantization drops none) and answer from them.
TEST(Pipeline, AnswersOverPagesInEachFormat) {
  const auto& [model, tok] = tiny();
  const std::string question = "Who is in the story?";
  for (const char* name : {"SnapKVPress", "AdaKVPress"}) {
    SCOPED_TRACE(name);
    const auto press = kvpress::make_press(name, 0.5);
    PipelineOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = 12;
    for (bool query_aware : {false, true}) {
      opt.query_aware = query_aware;
      opt.paged_kv_format.reset();
      const Answer dense = answer_questions(model, tok, story(), {question}, opt).at(0);
      opt.paged_kv_format = kvpress::KVFormat::kFull;
      const Answer paged = answer_questions(model, tok, story(), {question}, opt).at(0);
      EXPECT_EQ(paged.tokens, dense.tokens) << query_aware;
      EXPECT_EQ(paged.text, dense.text);
      EXPECT_EQ(paged.prefill_length, dense.prefill_length);
      EXPECT_EQ(paged.cache_lengths, dense.cache_lengths);
      EXPECT_NEAR(paged.kept_fraction, dense.kept_fraction, 1e-12);
      EXPECT_LT(paged.kept_fraction, 0.6);
      for (kvpress::KVFormat format : {kvpress::KVFormat::kInt8, kvpress::KVFormat::kFp8, kvpress::KVFormat::kInt4}) {
        opt.paged_kv_format = format;
        const Answer quantized = answer_questions(model, tok, story(), {question}, opt).at(0);
        EXPECT_EQ(quantized.cache_lengths, dense.cache_lengths) << kvpress::kv_format_name(format);
        EXPECT_NEAR(quantized.kept_fraction, dense.kept_fraction, 1e-12);
        EXPECT_FALSE(quantized.tokens.empty());
        EXPECT_EQ(quantized.text, tok.decode(quantized.tokens));
      }
    }
  }
}

// One captured prefill answered through by several presses (PipelineOptions::captured; kvpress-cli
// bench): the same answers and cache lengths as each press's own prefill.
TEST(Pipeline, CapturedPrefillGivesTheSameAnswers) {
  // References, not a structured binding: C++17 lambdas cannot capture those (clang refuses).
  const LlamaModel& model = tiny().model;
  const Tokenizer& tok = tiny().tokenizer;
  const std::vector<std::string> questions{"Who is in the story?", "What happened next?"};
  PipelineOptions plain;
  plain.max_new_tokens = 12;
  const std::vector<int64_t> ids = kvpress::llama::context_prefill_ids(model, tok, story(), plain);
  kvpress::llama::ForwardOptions last;
  last.last_logits_only = true;
  const kvpress::llama::CapturedPrefill captured = model.capture_prefill(at::tensor(ids).unsqueeze(0), last);
  for (const char* name : {"", "SnapKVPress", "KeyRerotationPress", "AdaKVPress", "CompressionRatioDecodingPress"}) {
    SCOPED_TRACE(name);
    const auto press = *name ? kvpress::make_press(name, 0.5) : nullptr;
    PipelineOptions opt = plain;
    opt.press = press.get();
    // A decoding press takes one question (it compresses the cache the next one would reuse).
    const bool decoding = press && press->name() == "CompressionRatioDecodingPress";
    const std::vector<std::string> asked = decoding ? std::vector<std::string>{questions[0]} : questions;
    const std::vector<Answer> own = answer_questions(model, tok, story(), asked, opt);
    opt.captured = &captured;
    const std::vector<Answer> shared = answer_questions(model, tok, story(), asked, opt);
    ASSERT_EQ(shared.size(), own.size());
    for (size_t i = 0; i < own.size(); ++i) {
      EXPECT_EQ(shared[i].tokens, own[i].tokens) << "question " << i;
      EXPECT_EQ(shared[i].cache_lengths, own[i].cache_lengths) << "question " << i;
      EXPECT_EQ(shared[i].prefill_length, own[i].prefill_length);
      EXPECT_EQ(shared[i].kept_fraction, own[i].kept_fraction);
    }
    // Uniform and head-ragged budgets alike keep int(S * 0.5) tokens per head on average.
    const double half = static_cast<double>(kvpress::ops::n_kept(own[0].prefill_length, 0.5)) /
                        static_cast<double>(own[0].prefill_length);
    if (press && (press->name() == "SnapKVPress" || press->name() == "AdaKVPress"))
      EXPECT_NEAR(own[0].kept_fraction, half, 1e-12);
    if (!press) EXPECT_EQ(own[0].kept_fraction, 1.0);
  }
  PipelineOptions opt = plain;
  opt.captured = &captured;
  expect_error([&] { answer_questions(model, tok, story() + " More.", questions, opt); },
               {"answer_questions: options.captured holds another prefill than this context's"});
  // Query-aware: the capture must be the prefill of the context and the one question asked.
  opt.query_aware = true;
  expect_error([&] { answer_questions(model, tok, story(), questions, opt); },
               {"answer_questions: a query-aware options.captured holds one question's prefill, got 2 questions"});
  expect_error([&] { answer_questions(model, tok, story(), {questions[0]}, opt); },
               {"answer_questions: options.captured holds another prefill than this context's"});
  // A query-aware press answers from a capture of its query-aware prefill as from its own: SnapKV's
  // (context and question as one text) and FinchPress's, which observes the question (the framed
  // context's tokens then the question's; the captured path passes its length on as prefill() does).
  const std::string asked = " " + questions[0];
  std::vector<std::vector<int64_t>> prefills;
  for (const char* name : {"SnapKVPress", "FinchPress"}) {
    SCOPED_TRACE(name);
    const auto press = kvpress::make_press(name, 0.5);
    PipelineOptions aware = plain;
    aware.query_aware = true;
    aware.press = press.get();
    prefills.push_back(kvpress::llama::context_prefill_ids(model, tok, story(), aware, asked));
    const kvpress::llama::CapturedPrefill capture =
        model.capture_prefill(at::tensor(prefills.back()).unsqueeze(0), last);
    const Answer own = answer_questions(model, tok, story(), {asked}, aware).at(0);
    aware.captured = &capture;
    const Answer shared = answer_questions(model, tok, story(), {asked}, aware).at(0);
    EXPECT_EQ(shared.tokens, own.tokens);
    EXPECT_EQ(shared.cache_lengths, own.cache_lengths);
    EXPECT_EQ(shared.kept_fraction, own.kept_fraction);
    EXPECT_EQ(own.prefill_length, static_cast<int64_t>(prefills.back().size()));
  }
  EXPECT_NE(prefills[0], prefills[1]);
  expect_error([&] { kvpress::llama::context_prefill_ids(model, tok, story(), plain, questions[0]); },
               {"context_prefill_ids: a question is part of the prefill only with query_aware"});
  opt.query_aware = false;
  const auto kvzip = kvpress::make_press("KVzipPress", 0.5);
  opt.press = kvzip.get();
  expect_error([&] { answer_questions(model, tok, story(), questions, opt); },
               {"LlamaModel::compress_captured: KVzipPress runs a second pass over the context"});
}

TEST(Pipeline, QueryAwarePrefillHoldsTheQuestion) {
  const auto& [model, tok] = tiny();
  const std::string question = " Where did they go?";
  const int64_t bos = model.config().bos_token_id;
  const int64_t context_tokens = static_cast<int64_t>(tok.encode(tok.id_to_token(bos) + story(), false).size());
  const auto finch = kvpress::make_press("FinchPress", 0.5);
  PipelineOptions opt;
  opt.press = finch.get();
  opt.max_new_tokens = 4;
  opt.query_aware = true;
  const Answer a = answer_questions(model, tok, story(), {question}, opt).at(0);
  // FinchPress: the question tokenized on its own after the context (kvpress's delimiter splits them).
  EXPECT_EQ(a.prefill_length, context_tokens + static_cast<int64_t>(tok.encode(question, false).size()));
  EXPECT_EQ(a.cache_lengths[0], kvpress::ops::n_kept(a.prefill_length, 0.5));
  // Other presses: context and question as one text.
  const auto snapkv = kvpress::make_press("SnapKVPress", 0.5);
  opt.press = snapkv.get();
  EXPECT_EQ(answer_questions(model, tok, story(), {question}, opt).at(0).prefill_length,
            static_cast<int64_t>(tok.encode(tok.id_to_token(bos) + story() + question, false).size()));
  // max_context_length cuts the prefill (the question's end first, as kvpress cuts its context text).
  const auto knorm = kvpress::make_press("KnormPress", 0.5);
  opt.press = knorm.get();
  opt.max_context_length = 40;
  EXPECT_EQ(answer_questions(model, tok, story(), {question}, opt).at(0).prefill_length, 40);
}

TEST(Pipeline, RefusesBadInput) {
  // References, not a structured binding: C++17 lambdas cannot capture those (clang refuses).
  const LlamaModel& model = tiny().model;
  const Tokenizer& tok = tiny().tokenizer;
  PipelineOptions opt;
  expect_error([&] { answer_questions(model, tok, story(), {}, opt); },
               {"answer_questions", "questions must hold at least one question"});
  opt.max_new_tokens = 0;
  expect_error([&] { answer_questions(model, tok, story(), {"Q?"}, opt); },
               {"answer_questions", "max_new_tokens must be >= 1", "got 0"});
  opt.max_new_tokens = 4;
  opt.max_context_length = -1;
  expect_error([&] { answer_questions(model, tok, story(), {"Q?"}, opt); },
               {"answer_questions", "max_context_length must be >= 0", "got -1"});
  opt.max_context_length = 0;
  const auto finch = kvpress::make_press("FinchPress", 0.5);
  opt.press = finch.get();
  expect_error([&] { answer_questions(model, tok, story(), {"Q?"}, opt); },
               {"answer_questions", "FinchPress observes the question", "query_aware"});
  opt.query_aware = true;
  opt.paged_kv_format = kvpress::KVFormat::kInt8;
  expect_error([&] { answer_questions(model, tok, story(), {"Q?"}, opt); },
               {"answer_questions", "FinchPress observes the question, which prefill_paged does not give a press"});
  opt.query_aware = false;
  opt.press = nullptr;
  const kvpress::llama::CapturedPrefill captured;
  opt.captured = &captured;
  expect_error([&] { answer_questions(model, tok, story(), {"Q?"}, opt); },
               {"answer_questions", "options.captured is a dense prefill"});
  opt.captured = nullptr;
  opt.paged_kv_format.reset();
  const auto decoding = kvpress::make_press("DecodingPress", 0.0);
  opt.press = decoding.get();
  expect_error(
      [&] {
        answer_questions(model, tok, story(), {"Q?", "R?"}, opt);
      },
      {"answer_questions", "DecodingPress", "single question", "got 2"});
  EXPECT_EQ(answer_questions(model, tok, story(), {"Q?"}, opt).size(), 1u);
}

// ---- against kvpress's pipeline ----------------------------------------------------------------

TEST(PipelineParity, AnswersMatchKvpressPipeline) {
  const std::string dir = kvpress::testing::fixtures_dir();
  ASSERT_FALSE(dir.empty()) << "KVPRESS_FIXTURES is not set; " << kvpress::testing::fixtures_howto();
  std::ifstream in(dir + "/pipeline/pipeline.json");
  ASSERT_TRUE(in.good()) << "no " << dir << "/pipeline/pipeline.json; generate it with "
                         << "tests/reference/make_pipeline_fixtures.py --out " << dir
                         << "/pipeline (scripts/test.sh does)";
  const json fx = json::parse(in);
  ASSERT_EQ(fx.at("kvpress_version").get<std::string>(), "0.5.5");
  const auto& [model, tok] = tiny();
  const std::string context = fx.at("context").get<std::string>();
  ASSERT_FALSE(fx.at("cases").empty());
  for (const json& c : fx.at("cases")) {
    const std::vector<std::string> questions = c.at("questions").get<std::vector<std::string>>();
    const double ratio = c.at("compression_ratio").get<double>();
    std::unique_ptr<kvpress::BasePress> press;
    if (!c.at("press").is_null()) {
      const std::string name = c.at("press").get<std::string>();
      // Artifact paths (RestoreKVPress's folder) are relative to the fixture folder.
      press =
          kvpress::make_press(name, ratio,
                              kvpress::testing::with_artifact_paths(
                                  name, c.at("params").get<std::map<std::string, std::string>>(), dir + "/pipeline"));
    }
    SCOPED_TRACE(c.dump());
    PipelineOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = fx.at("max_new_tokens").get<int64_t>();
    opt.query_aware = c.at("query_aware").get<bool>();
    const std::vector<Answer> answers = answer_questions(model, tok, context, questions, opt);
    EXPECT_EQ(texts(answers), c.at("answers").get<std::vector<std::string>>());
  }
}

}  // namespace
