// GGUF files: the reader, the checkpoint conversion, and SmolLM2-135M-Instruct.
//
// Gguf.*           the reader on hand-made bytes: every malformation a c10::Error naming it; the
//                  checkpoint lookup (a .gguf file, a folder holding one).
// GgufParity.*     against tests/reference/make_gguf_fixtures.py (<fixtures>/gguf):
//   * every supported tensor type dequantises to the gguf package's float32 values bit for bit;
//   * small Llama (q/k permuted as llama.cpp writes them), Qwen2 and Qwen3 GGUF files give
//     transformers' logits (it loads the same files) within 1e-4;
//   * SmolLM2-135M-Instruct (Q4_1, installed by scripts/setup.sh): every tensor's dequantisation has
//     the checksum of the gguf package's, the logits at five positions of a 300-token prompt are
//     transformers' within 1e-4, and the tokenizer read from the file's metadata gives the ids and
//     text of a `tokenizers` BPE laid out as SmolLM2's tokenizer.json on 2,000 strings.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/io/gguf.h"
#include "kvpress/llama/chat.h"
#include "kvpress/llama/checkpoint.h"
#include "kvpress/llama/gguf.h"
#include "kvpress/llama/pipeline.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using kvpress::io::GgufFile;
using kvpress::io::parse_gguf;
using kvpress::testing::expect_error;

// ---- hand-made files ------------------------------------------------------------------------------

// Little-endian GGUF bytes, piece by piece.
struct Bytes {
  std::string s;
  template <typename T>
  Bytes& put(T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& text) {
    put<uint64_t>(text.size());
    s += text;
    return *this;
  }
};

// A v3 header with one UINT32 metadata entry and one F32 tensor [2, 32] at offset 0.
Bytes one_tensor_file(uint32_t type = 0, uint64_t dim0 = 32, uint64_t offset = 0, uint32_t version = 3) {
  Bytes b;
  b.s = "GGUF";
  b.put<uint32_t>(version).put<uint64_t>(1).put<uint64_t>(1);
  b.str("general.alignment").put<uint32_t>(4).put<uint32_t>(32);
  b.str("t").put<uint32_t>(2).put<uint64_t>(dim0).put<uint64_t>(2).put<uint32_t>(type).put<uint64_t>(offset);
  b.s.resize((b.s.size() + 31) / 32 * 32, '\0');
  for (int i = 0; i < 64; ++i) b.put<float>(static_cast<float>(i));
  return b;
}

TEST(Gguf, ReadsMetadataAndTensors) {
  const GgufFile f = parse_gguf(one_tensor_file().s, "x");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_int("general.alignment"), 32);
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.tensors()[0].shape, (std::vector<int64_t>{2, 32}));  // torch order: GGUF's [32, 2]
  const at::Tensor t = f.dequantize("t");
  EXPECT_TRUE(at::equal(t, at::arange(64, at::kFloat).view({2, 32})));
  expect_error([&] { f.get_string("general.alignment"); },
               {"GgufFile: x: metadata general.alignment must be a string, got an integer"});
  expect_error([&] { f.get_int("nope"); }, {"GgufFile: x: metadata nope is missing"});
  expect_error([&] { f.dequantize("u"); }, {"GgufFile::dequantize: x holds no tensor 'u'"});
}

TEST(Gguf, RefusesMalformedFiles) {
  const auto refused = [](const std::string& bytes, const std::string& message) {
    expect_error([&] { parse_gguf(bytes, "x"); }, {"parse_gguf: x: " + message});
  };
  refused("GGML", "not a GGUF file");
  refused("GGU", "truncated: the magic needs 4 bytes");
  refused(one_tensor_file(0, 32, 0, 1).s, "unsupported GGUF version 1 (only 2 and 3)");
  refused(one_tensor_file().s.substr(0, 40), "truncated: a metadata key needs 17 bytes at offset 32, the file has 8");
  refused(one_tensor_file(0, 32, 16).s, "tensor 't' offset 16 is not a multiple of 32");
  refused(one_tensor_file(0, 32, 32).s, "tensor 't' (256 bytes at offset 32) lies beyond the data section (256 bytes)");
  refused(one_tensor_file(0, 0).s, "tensor 't' has a dimension of 0");
  // 2^62 float32 elements: 2^64 bytes, which a 64-bit size would wrap to 0 (found by the fuzzer).
  refused(one_tensor_file(0, uint64_t{1} << 61).s,
          "tensor 't' (4611686018427387904 elements of type F32) would take 2^64 bytes or more");
  refused(one_tensor_file(99).s, "tensor 't' has unknown ggml type 99");
  refused(one_tensor_file(2, 33).s,
          "tensor 't' of type Q4_0 has a first dimension of 33, not a multiple of its block of 32");
  // Counts that cannot fit are refused before anything is allocated for them.
  Bytes huge;
  huge.s = "GGUF";
  huge.put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(uint64_t{1} << 60);
  refused(huge.s, "metadata count 1152921504606846976 cannot fit in the file");
  Bytes array;
  array.s = "GGUF";
  array.put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  array.str("k").put<uint32_t>(9).put<uint32_t>(8).put<uint64_t>(uint64_t{1} << 40);
  refused(array.s, "metadata k: an array of 1099511627776 elements cannot fit in the 0 bytes left");
  Bytes twice;
  twice.s = "GGUF";
  twice.put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(2);
  twice.str("k").put<uint32_t>(7).put<uint8_t>(1).str("k").put<uint32_t>(7).put<uint8_t>(0);
  refused(twice.s, "metadata key k appears twice");
  Bytes bad_bool;
  bad_bool.s = "GGUF";
  bad_bool.put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  bad_bool.str("k").put<uint32_t>(7).put<uint8_t>(2);
  refused(bad_bool.s, "metadata k: a BOOL must be 0 or 1, got 2");
  // A type the file format has but this reader cannot dequantise: the file opens, that tensor raises.
  std::string iq = one_tensor_file(16 /* IQ2_XXS */, 256).s;
  iq.resize(iq.size() + 66 * 2 - 256, '\0');
  const GgufFile f = parse_gguf(iq, "x");
  expect_error([&] { f.dequantize("t"); },
               {"GgufFile::dequantize: x: tensor 't' has type IQ2_XXS, which this reader cannot dequantize (supported: "
                "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16)"});
  expect_error([&] { kvpress::io::load_gguf("/nonexistent.gguf"); },
               {"load_gguf: /nonexistent.gguf: cannot open file"});
}

TEST(Gguf, CheckpointsAreFoundByFileOrFolder) {
  const kvpress::testing::TempDir tmp;
  ASSERT_EQ(::mkdir((tmp.path + "/model").c_str(), 0700), 0);
  tmp.write("model/m.gguf", "GGUF");
  const std::string dir = tmp.path;
  EXPECT_EQ(kvpress::llama::resolve_model(dir + "/model"), dir + "/model/m.gguf");
  EXPECT_EQ(kvpress::llama::resolve_model(dir + "/model/m.gguf"), dir + "/model/m.gguf");
  expect_error([&] { kvpress::llama::load_checkpoint(dir + "/model/m.gguf"); },
               {"load_gguf: " + dir + "/model/m.gguf: truncated"});
  tmp.write("model/n.gguf", "GGUF");
  expect_error([&] { kvpress::llama::resolve_model(dir + "/model"); },
               {"resolve_model: " + dir + "/model holds 2 .gguf files and no config.json"});
  expect_error([&] { kvpress::llama::resolve_model(dir + "/none"); }, {"resolve_model: no checkpoint"});
}

// ---- against the gguf package and transformers ------------------------------------------------------

struct GgufFixtures {
  std::string dir, error;
  json manifest;
};
const GgufFixtures& gguf_fixtures() {
  static const GgufFixtures f = [] {
    GgufFixtures out;
    const std::string base = kvpress::testing::fixtures_dir();
    if (base.empty()) {
      out.error = std::string("KVPRESS_FIXTURES is not set; ") + kvpress::testing::fixtures_howto();
      return out;
    }
    out.dir = base + "/gguf";
    std::ifstream in(out.dir + "/manifest.json");
    if (!in) {
      out.error = "no " + out.dir +
                  "/manifest.json; generate it with tests/reference/make_gguf_fixtures.py (scripts/test.sh does)";
      return out;
    }
    in >> out.manifest;
    return out;
  }();
  return f;
}
#define REQUIRE_GGUF_FIXTURES()             \
  const GgufFixtures& fx = gguf_fixtures(); \
  ASSERT_TRUE(fx.error.empty()) << fx.error

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = gguf_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, path);
}

TEST(GgufParity, DequantizesEveryTypeAsTheGgufPackage) {
  REQUIRE_GGUF_FIXTURES();
  const GgufFile f = kvpress::io::load_gguf(fx.dir + "/types.gguf");
  for (const auto& type : fx.manifest.at("types")) {
    const std::string name = type.get<std::string>();
    SCOPED_TRACE(name);
    const at::Tensor ours = f.dequantize(name), expected = fixture("types.safetensors", name);
    ASSERT_EQ(ours.sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(ours, expected)) << "max |diff| " << (ours - expected).abs().max().item<double>();
  }
}

TEST(GgufParity, FamiliesGiveTransformersLogits) {
  REQUIRE_GGUF_FIXTURES();
  for (const auto& family : fx.manifest.at("families")) {
    const std::string name = family.get<std::string>();
    SCOPED_TRACE(name);
    const kvpress::llama::Checkpoint ckpt = kvpress::llama::load_checkpoint(fx.dir + "/" + name + ".gguf");
    EXPECT_EQ(ckpt.model.config().model_type, name);
    for (int n : {1, 100}) {
      const at::Tensor ids = fixture(name + ".safetensors", "ids_" + std::to_string(n));
      const at::Tensor expected = fixture(name + ".safetensors", "logits_" + std::to_string(n));
      auto cache = ckpt.model.new_cache();
      const double diff = (ckpt.model.prefill(ids, cache).logits - expected).abs().max().item<double>();
      EXPECT_LE(diff, 1e-4) << n << " tokens";
      std::cout << name << ".gguf, " << n << " tokens: max |ours - transformers| " << diff << "\n";
    }
  }
}

// The checksum make_gguf_fixtures.py computes: sum of bits_i * (2654435761 * (i + 1) mod 2^32) mod 2^64.
uint64_t checksum(const at::Tensor& values) {
  const at::Tensor c = values.contiguous();
  const auto* bits = reinterpret_cast<const uint32_t*>(c.data_ptr<float>());
  uint64_t sum = 0;
  for (int64_t i = 0; i < c.numel(); ++i)
    sum += static_cast<uint64_t>(bits[i]) * ((static_cast<uint64_t>(i + 1) * 2654435761u) & 0xFFFFFFFFu);
  return sum;
}

TEST(GgufParity, SmolLM2WeightsEqualTheGgufPackage) {
  REQUIRE_GGUF_FIXTURES();
  const json& smol = fx.manifest.at("smollm2");
  const GgufFile f = kvpress::io::load_gguf(smol.at("file").get<std::string>());
  int checked = 0;
  for (const auto& [name, sum] : smol.at("checksums").items()) {
    EXPECT_EQ(std::to_string(checksum(f.dequantize(name))), sum.get<std::string>()) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 272);
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  json j;
  in >> j;
  return j;
}

// SmolLM2-135M-Instruct, loaded once for the tests below.
const kvpress::llama::Checkpoint& smollm2() {
  static const kvpress::llama::Checkpoint ckpt =
      kvpress::llama::load_checkpoint(gguf_fixtures().manifest.at("smollm2").at("file").get<std::string>());
  return ckpt;
}

TEST(GgufParity, SmolLM2LogitsAndTokenizer) {
  REQUIRE_GGUF_FIXTURES();
  const json& smol = fx.manifest.at("smollm2");
  const kvpress::llama::Checkpoint& ckpt = smollm2();
  const auto& c = ckpt.model.config();
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_NE(ckpt.chat_template.find("<|im_start|>"), std::string::npos);

  const at::Tensor ids = fixture("smollm2/logits.safetensors", "ids");
  const at::Tensor positions = fixture("smollm2/logits.safetensors", "positions");
  auto cache = ckpt.model.new_cache();
  const at::Tensor logits = ckpt.model.prefill(ids, cache).logits[0].index_select(0, positions);
  const double diff = (logits - fixture("smollm2/logits.safetensors", "logits")).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4);
  std::cout << "SmolLM2-135M-Instruct Q4_1, 300 tokens: max |ours - transformers| " << diff << "\n";

  const json cases = read_json(fx.dir + "/smollm2/tokenizer_cases.json");
  int n = 0;
  for (const auto& k : cases) {
    const std::string hex = k.at("hex").get<std::string>();
    std::string text;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) text += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
    const auto ids_expected = k.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(ckpt.tokenizer.encode(text, false), ids_expected) << "string " << n << ": " << text;
    EXPECT_EQ(ckpt.tokenizer.decode(ids_expected, false), k.at("decoded").get<std::string>()) << "string " << n;
    ++n;
  }
  EXPECT_EQ(n, smol.at("tokenizer_strings").get<int>());
  std::cout << "SmolLM2 tokenizer from GGUF metadata: " << n << " strings equal to tokenizers' (transformers' GGUF "
            << "tokenizer, which drops the Digits step, differs on " << smol.at("transformers_tokenizer_differs")
            << ")\n";
}

// Conversations rendered through SmolLM2's template as transformers renders them (jinja2).
TEST(GgufParity, SmolLM2ChatTemplate) {
  REQUIRE_GGUF_FIXTURES();
  const kvpress::llama::Checkpoint& ckpt = smollm2();
  const auto chat = kvpress::llama::chat_template_of(ckpt);
  EXPECT_EQ(chat.name(), "smollm2");
  int n = 0;
  for (const auto& c : read_json(fx.dir + "/smollm2/chat_cases.json")) {
    std::vector<kvpress::llama::ChatMessage> messages;
    for (const auto& m : c.at("messages")) messages.push_back({m.at("role"), m.at("content")});
    const std::string text = chat.apply(messages, c.at("add_generation_prompt").get<bool>());
    EXPECT_EQ(text, c.at("text").get<std::string>()) << "case " << n;
    EXPECT_EQ(ckpt.tokenizer.encode(text, false), c.at("ids").get<std::vector<int64_t>>()) << "case " << n;
    ++n;
  }
  EXPECT_EQ(n, 12);
  expect_error([&] { kvpress::llama::ChatTemplate::recognize(ckpt.chat_template + " ", "x"); },
               {"ChatTemplate::recognize: x: its chat template is not one this library renders (smollm2, qwen2.5, "
                "qwen3, llama3, llama3.1, llama3.2)"});
  expect_error([&] { kvpress::llama::ChatTemplate::recognize("", "x"); },
               {"ChatTemplate::recognize: x has no chat template"});
}

// kvpress's KVPressTextGenerationPipeline on SmolLM2 with its chat template, with and without presses:
// KVzipPress replays the context inside the template's user turn, and query-aware FinchPress takes
// the question after the context in the user's message.
TEST(GgufParity, SmolLM2PipelineWithChatTemplateMatchesKvpress) {
  REQUIRE_GGUF_FIXTURES();
  const kvpress::llama::Checkpoint& ckpt = smollm2();
  const auto chat = kvpress::llama::chat_template_of(ckpt);
  const json p = read_json(fx.dir + "/smollm2/pipeline.json");
  const auto questions = p.at("questions").get<std::vector<std::string>>();
  for (const auto& c : p.at("cases")) {
    const std::string name = c.at("press").is_null() ? "" : c.at("press").get<std::string>();
    SCOPED_TRACE(name.empty() ? "no press" : name);
    const auto press = name.empty() ? nullptr : kvpress::make_press(name, c.at("compression_ratio").get<double>());
    kvpress::llama::PipelineOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = p.at("max_new_tokens").get<int64_t>();
    opt.chat_template = &chat;
    opt.query_aware = c.at("query_aware").get<bool>();
    const auto answers = kvpress::llama::answer_questions(ckpt.model, ckpt.tokenizer,
                                                          p.at("context").get<std::string>(), questions, opt);
    const auto expected = c.at("answers").get<std::vector<std::string>>();
    ASSERT_EQ(answers.size(), expected.size());
    for (size_t i = 0; i < answers.size(); ++i) EXPECT_EQ(answers[i].text, expected[i]) << "question " << i;
  }
}

}  // namespace
