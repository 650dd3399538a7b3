// kvpress::llama — the Llama runner with presses in the loop.
//
// Llama.*            unit tests on the real TinyStories-656K checkpoint (no fixtures needed):
//                    config, tokenizer basics, KV cache, incremental decoding, batching, and every
//                    press of the registry running inside prefill.
// LlamaParity.*,     exactness against the pinned packages, from the fixtures written by
// Kvpress/LlamaPressRun.*   tests/reference/make_model_fixtures.py into <fixtures>/llama (one ctest
//                    entry, like parity.kvpress_0_5_5):
//   * tokenizer: ids of all 100 held-out stories and edge cases equal transformers', decodes equal;
//     a synthetic tokenizer with byte fallback equals `tokenizers`;
//   * logits of the prefill, the question and greedy decode steps equal transformers' (float32,
//     eager) within 1e-4, attention weights within 1e-5;
//   * for every press (ratio 0.5): the kept positions of every layer after prefill equal kvpress's
//     pipeline (exactly, or modulo near-ties at the selection threshold, as tests/test_parity.cpp
//     argues), the position the question gets equals the pipeline's (the compressed length after
//     KeyRerotationPress, else the prefix length), and the logits of the question and decode steps
//     over the compressed cache equal kvpress's within 1e-4. Where a tie made the kept sets differ,
//     the logits are compared by replaying kvpress's kept positions through the runner.
// FamilyParity.*,    the same logits/attentions and press runs on random-weight Llama 3, Qwen2 and
// Families/LlamaPressRun.*  Qwen3 models (tests/reference/make_family_fixtures.py, <fixtures>/families/*;
//                    ctest parity.families_kvpress).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/llama.h"
#include "kvpress/ops.h"
#include "kvpress/presses/key_rerotation_press.h"
#include "kvpress/presses/lukv_press.h"
#include "kvpress/registry.h"
#include "runnable_press.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::llama::ForwardOptions;
using kvpress::llama::KVCache;
using kvpress::llama::LlamaConfig;
using kvpress::llama::LlamaModel;
using kvpress::llama::PrefillOptions;
using kvpress::llama::PressAttentions;
using kvpress::llama::Tokenizer;
using kvpress::testing::expect_error;

constexpr double kLogitTol = 1e-4;
constexpr double kAttentionTol = 1e-5;

const std::string& model_dir() {
  static const std::string dir = kvpress::llama::resolve_model_dir("tinystories-656k");
  return dir;
}
using kvpress::testing::tiny_model;
using kvpress::testing::tiny_tokenizer;

at::Tensor ids_tensor(const std::vector<int64_t>& ids) {
  return at::tensor(at::ArrayRef<int64_t>(ids), at::kLong).unsqueeze(0);
}

const char* kStory =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, Lily saw a big red ball under a tree. She ran to the ball and kicked it very hard. The "
    "ball flew over the fence and into the garden of an old man. Lily was scared, but she went to the old man "
    "and said, \"I am sorry, can I have my ball back?\" The old man smiled and gave her the ball. They became "
    "good friends and played together every day.";

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

// ---- unit tests ---------------------------------------------------------------------------------

TEST(Llama, ConfigOfTinyStories) {
  const LlamaConfig& c = tiny_model().config();
  EXPECT_EQ(c.vocab_size, 2048);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 384);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
}

TEST(Llama, ConfigRefusesWhatItCannotRun) {
  const std::string base =
      R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1)";
  EXPECT_NO_THROW(LlamaConfig::from_json("{\"model_type\": \"llama\", " + base + "}"));
  const LlamaConfig v5 =
      LlamaConfig::from_json("{\"model_type\": \"llama\", " + base +
                             R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})");
  EXPECT_DOUBLE_EQ(v5.rope_theta, 500000.0);
  EXPECT_EQ(v5.head_dim, 4);
  expect_error([&] { LlamaConfig::from_json("{\"model_type\": \"gemma3\", " + base + "}", "x.json"); },
               {"LlamaConfig: x.json: unsupported model_type 'gemma3' (only \"llama\", \"mistral\", \"qwen2\" and "
                "\"qwen3\")"});
  // Each family's switches, as its attention module builds them (transformers' modeling_*.py).
  const auto family = [&](const std::string& type, const std::string& extra) {
    return LlamaConfig::from_json("{\"model_type\": \"" + type + "\", " + base + extra + "}");
  };
  const auto switches = [](const LlamaConfig& c) { return std::vector<bool>{c.qkv_bias, c.o_proj_bias, c.qk_norm}; };
  EXPECT_EQ(switches(family("llama", "")), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(switches(family("llama", R"(, "attention_bias": true)")), (std::vector<bool>{true, true, false}));
  EXPECT_EQ(switches(family("mistral", R"(, "attention_bias": true)")), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(switches(family("qwen2", "")), (std::vector<bool>{true, false, false}));
  EXPECT_EQ(switches(family("qwen3", "")), (std::vector<bool>{false, false, true}));
  EXPECT_EQ(switches(family("qwen3", R"(, "attention_bias": true)")), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(family("qwen3", "").head_dim, 128);  // Qwen3Config's default, not hidden_size / heads
  EXPECT_EQ(family("qwen3", "").model_type, "qwen3");
  expect_error([&] { family("qwen2", R"(, "use_sliding_window": true, "sliding_window": 4096)"); },
               {"use_sliding_window true is not supported (sliding-window layers)"});
  expect_error(
      [&] { family("qwen3", R"(, "layer_types": ["full_attention", "sliding_attention"])"); },
      {R"(layer_types must be a list of "full_attention" (sliding windows are not supported), got "sliding_attention")"});
  EXPECT_NO_THROW(
      family("qwen3", R"(, "use_sliding_window": false, "sliding_window": 4096, "layer_types": ["full_attention"])"));
  EXPECT_NO_THROW(LlamaConfig::from_json("{\"model_type\": \"mistral\", " + base + R"(, "sliding_window": null})"));
  expect_error(
      [&] { LlamaConfig::from_json("{\"model_type\": \"mistral\", " + base + R"(, "sliding_window": 4096})"); },
      {"sliding_window attention is not supported (sliding_window 4096; only null)"});
  // A llama config with `extra` fields must be refused with `message`.
  const auto refused = [&](const std::string& extra, const std::string& message) {
    expect_error([&] { LlamaConfig::from_json("{\"model_type\": \"llama\", " + base + ", " + extra + "}"); },
                 {message});
  };
  refused(R"("rope_scaling": {"rope_type": "yarn"})",
          "unsupported RoPE scaling 'yarn' (only default, linear and llama3)");
  // llama3 needs the four fields transformers reads, and high_freq_factor > low_freq_factor.
  refused(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})",
          "rope_scaling.low_freq_factor is missing (RoPE type 'llama3' needs it)");
  refused(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, )"
          R"("original_max_position_embeddings": 8192})",
          "rope_scaling.high_freq_factor (4) must be larger than low_freq_factor (4)");
  refused(R"("rope_parameters": {"rope_type": "linear", "factor": -2})",
          "rope_parameters.factor must be a finite number > 0, got -2");
  const LlamaConfig llama3 =
      LlamaConfig::from_json("{\"model_type\": \"llama\", " + base +
                             R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, )"
                             R"("high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})");
  EXPECT_EQ(llama3.rope_type, "llama3");
  EXPECT_EQ(llama3.rope_factor, 8.0);
  EXPECT_EQ(llama3.rope_original_max_position_embeddings, 8192);
  expect_error([&] { LlamaConfig::from_json("{\"model_type\": \"llama\", " + base + R"(, "hidden_act": "gelu"})"); },
               {"unsupported hidden_act 'gelu'"});
  expect_error([&] { LlamaConfig::from_json("{\"model_type\": \"llama\", " + base + R"(, "mlp_bias": true})"); },
               {"mlp_bias is not supported"});
  expect_error([&] { LlamaConfig::from_json("{\"model_type\": \"llama\"}"); }, {"vocab_size must be an integer"});
  expect_error([&] { LlamaConfig::from_json("{not json"); }, {"not valid JSON"});
  expect_error([&] { kvpress::llama::resolve_model_dir("/nonexistent/model"); },
               {"no config.json in '/nonexistent/model'"});
  EXPECT_EQ(kvpress::llama::resolve_model_dir(model_dir()), model_dir());
}

// Found by fuzzing (tests/fuzz, kvpress_fuzz_config), or sharing its cause: a config with zero
// layers loaded (the fuzzer's input), as did negative sizes, and a field of the wrong kind escaped
// as a JSON library exception. Each now raises a c10::Error naming the field.
TEST(Llama, ConfigRefusesMalformedFields) {
  const auto config = [](const std::string& overrides) {
    return R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, )" +
           overrides + "}";
  };
  const auto expect_refused = [](const std::string& json, const std::string& message) {
    expect_error([&] { LlamaConfig::from_json(json, "x.json"); }, {"LlamaConfig: x.json: " + message});
  };
  EXPECT_NO_THROW(LlamaConfig::from_json(config(R"("num_hidden_layers": 1)")));
  expect_refused(config(R"("num_hidden_layers": 0)"), "num_hidden_layers must be a positive integer, got 0");
  expect_refused(config(R"("num_hidden_layers": 1, "vocab_size": -3)"),
                 "vocab_size must be a positive integer, got -3");
  expect_refused(config(R"("num_hidden_layers": 18446744073709551615)"),
                 "num_hidden_layers must be a positive integer, got 18446744073709551615");
  expect_refused(config(R"("num_hidden_layers": 1, "model_type": 5)"), "model_type must be a string, got 5");
  expect_refused(config(R"("num_hidden_layers": 1, "rope_scaling": 3)"),
                 "rope_scaling must be an object or null, got 3");
  expect_refused(config(R"("num_hidden_layers": 1, "rope_scaling": {"type": 1})"),
                 "rope_scaling.type must be a string, got 1");
  expect_refused(config(R"("num_hidden_layers": 1, "rms_norm_eps": "x")"),
                 R"(rms_norm_eps must be a finite number, got "x")");
  expect_refused(config(R"("num_hidden_layers": 1, "rms_norm_eps": -1e-6)"),
                 "rms_norm_eps must be a finite number >= 0, got -1e-06");
  expect_refused(config(R"("num_hidden_layers": 1, "rope_theta": 0)"),
                 "rope_theta must be a finite number > 0, got 0.0");
  expect_refused(config(R"("num_hidden_layers": 1, "tie_word_embeddings": "true")"),
                 R"(tie_word_embeddings must be true or false, got "true")");
  expect_refused(config(R"("num_hidden_layers": 1, "max_position_embeddings": -1)"),
                 "max_position_embeddings must be an integer >= 0, got -1");
  expect_refused(R"({"model_type": "llama", "vocab_size": 2, "hidden_size": 2, "intermediate_size": 1,
                     "num_hidden_layers": 1, "num_attention_heads": 4})",
                 "head_dim must be positive and even, got 0");
  // A million nested arrays overflowed the stack when the error message printed the value.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  expect_refused(config(R"("num_hidden_layers": 1, "model_type": )" + deep), "the JSON nests deeper than 64 levels");
}

TEST(Llama, TokenizerBasics) {
  const Tokenizer& tok = tiny_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 2048);
  const std::vector<int64_t> ids = tok.encode("Once upon a time");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 1);  // <|start_story|>, from the post_processor
  EXPECT_EQ(tok.encode("Once upon a time", /*add_special_tokens=*/false),
            std::vector<int64_t>(ids.begin() + 1, ids.end()));
  EXPECT_EQ(tok.decode(ids), "Once upon a time");
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/false), "<|start_story|> Once upon a time");
  EXPECT_EQ(tok.encode(""), std::vector<int64_t>{1});
  EXPECT_EQ(tok.token_to_id("<|end_story|>"), std::optional<int64_t>(2));
  EXPECT_EQ(tok.id_to_token(80), "\xE2\x96\x81");  // "▁"
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(80));
  expect_error([&] { tok.id_to_token(5000); }, {"id 5000 is out of range"});
}

TEST(Llama, TokenizerRefusesUnsupportedComponents) {
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0}, "merges": []})";
  EXPECT_NO_THROW(Tokenizer::from_json("{" + model + "}"));
  expect_error([&] { Tokenizer::from_json("{" + model + R"(, "pre_tokenizer": {"type": "Metaspace"}})", "t.json"); },
               {"Tokenizer: t.json: unsupported pre_tokenizer", "Metaspace"});
  // A supported pre-tokenizer with a field tokenizers requires missing.
  expect_error([&] { Tokenizer::from_json("{" + model + R"(, "pre_tokenizer": {"type": "ByteLevel"}})", "t.json"); },
               {"Tokenizer: t.json: pre_tokenizer.add_prefix_space is missing"});
  expect_error([&] { Tokenizer::from_json("{" + model + R"(, "normalizer": {"type": "NFKC"}})"); },
               {"unsupported normalizer"});
  expect_error([&] { Tokenizer::from_json("{" + model + R"(, "decoder": {"type": "Metaspace"}})"); },
               {"unsupported decoder"});
  expect_error([&] { Tokenizer::from_json(R"({"model": {"type": "WordPiece", "vocab": {}}})"); },
               {"unsupported model type"});
  expect_error([&] { Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})"); },
               {"merge 'a b' uses tokens missing from the vocabulary"});
  // A character outside a vocabulary without unk_token or byte tokens is dropped, as tokenizers
  // drops it (BPE({"a": 0}).encode("aba").ids == [0, 0]).
  EXPECT_EQ(Tokenizer::from_json("{" + model + "}").encode("aba", false), (std::vector<int64_t>{0, 0}));
}

// Found by fuzzing (tests/fuzz, kvpress_fuzz_tokenizer), or sharing the cause of what it found: a
// field of the wrong kind escaped as a JSON library exception, ids out of range wrote outside the
// id table or sized it (4e9 -> 120 GB), an empty Strip character hung decode, and a template id
// past the vocabulary came out of encode. Each now raises a c10::Error naming the field, what it
// must be and what it is.
TEST(Llama, TokenizerRefusesMalformedFields) {
  const std::string bpe = R"("type": "BPE", "merges": [])";
  const std::string abc = bpe + R"(, "vocab": {"a": 0, "b": 1, " ": 2})";
  const auto tokenizer = [](const std::string& model, const std::string& rest = "") {
    return R"({"model": {)" + model + "}" + rest + "}";
  };
  const auto expect_refused = [](const std::string& json, const std::string& message) {
    expect_error([&] { Tokenizer::from_json(json, "t.json"); }, {"Tokenizer: t.json: " + message});
  };
  // The fuzzer's input: a Prepend step without its "prepend" (nlohmann out_of_range escaped).
  expect_refused(
      tokenizer(abc, R"(, "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "pre;end": "x"}]})"),
      "normalizer.normalizers[0].prepend is missing");
  expect_refused(tokenizer(bpe + R"(, "vocab": {"a": -1, "b": 0})"),
                 "model.vocab['a'] must be a token id in [0, 2) (ids count the vocabulary and added tokens), got -1");
  expect_refused(tokenizer(bpe + R"(, "vocab": {"a": 4000000000})"),
                 "model.vocab['a'] must be a token id in [0, 1) (ids count the vocabulary and added tokens), got "
                 "4000000000");
  expect_refused(tokenizer(bpe + R"(, "vocab": {"a": "0"})"),
                 R"(model.vocab['a'] must be an integer token id, got "0")");
  expect_refused(tokenizer(abc, R"(, "added_tokens": [{"id": -5, "content": "x"}])"),
                 "added_tokens[0].id must be a token id in [0, 4)");
  expect_refused(tokenizer(abc, R"(, "added_tokens": {"id": 1})"), R"(added_tokens must be an array, got {"id":1})");
  expect_refused(tokenizer(abc, R"(, "decoder": {"type": "Strip", "content": "", "start": 1})"),
                 R"(decoder.content must be one character, got "")");
  expect_refused(tokenizer(abc, R"(, "decoder": {"type": "Strip", "content": " ", "start": -1})"),
                 "decoder.start must be a non-negative integer, got -1");
  expect_refused(tokenizer(abc, R"(, "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "s"}}, {"Sequence": {"id": "A"}}], "special_tokens": {"s": {"ids": [99]}}})"),
                 "post_processor.special_tokens['s'].ids[0] must be a token id in [0, 3)");
  expect_refused(tokenizer(R"("type": "BPE", "vocab": {}, "merges": {"a": "b"})"),
                 R"(model.merges must be an array, got {"a":"b"})");
  expect_refused(tokenizer(abc + R"(, "fuse_unk": "yes")"), R"(model.fuse_unk must be true or false, got "yes")");
  expect_refused("[1, 2]", "tokenizer.json must be a JSON object, got array");
  // A million nested arrays overflowed the stack when the error message printed the value.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  expect_refused(tokenizer(bpe + R"(, "vocab": {"a": )" + deep + "}"), "the JSON nests deeper than 64 levels");
}

// Three Replace("a" -> 1000 x "a") normalizer steps in a 3 KB file made encode("a") run for minutes
// and take 12 GB; a chain that can grow a text more than 64x is refused at load (normalizer and
// decoder alike). SentencePiece's " " -> "▁" (3x) loads.
TEST(Llama, TokenizerRefusesReplaceChainsThatExplode) {
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0}, "merges": []})";
  const std::string grow =
      R"({"type": "Replace", "pattern": {"String": "a"}, "content": ")" + std::string(1000, 'a') + R"("})";
  expect_error(
      [&] {
        Tokenizer::from_json("{" + model + R"(, "normalizer": {"type": "Sequence", "normalizers": [)" + grow + "," +
                                 grow + "," + grow + "]}}",
                             "t.json");
      },
      {"Tokenizer: t.json: the normalizer's Replace steps can make a text 1e+09 times longer, more than the 64 "
       "allowed"});
  expect_error([&] { Tokenizer::from_json("{" + model + R"(, "decoder": )" + grow + "}"); },
               {"the decoder's Replace steps can make a text 1000 times longer"});
  const std::string metaspace = R"({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})";
  EXPECT_NO_THROW(Tokenizer::from_json("{" + model + R"(, "normalizer": )" + metaspace + "}"));
}

TEST(Llama, KVCacheAppendReplaceTruncate) {
  KVCache cache(2);
  EXPECT_EQ(cache.position(), 0);
  EXPECT_FALSE(cache.keys(0).defined());
  const at::Tensor k = at::arange(2 * 3 * 4, at::kFloat).view({1, 2, 3, 4});
  cache.append(0, k, -k);
  cache.append(0, k.narrow(2, 0, 1), -k.narrow(2, 0, 1));
  cache.advance(4);
  EXPECT_EQ(cache.length(0), 4);
  EXPECT_EQ(cache.length(1), 0);
  EXPECT_EQ(cache.position(), 4);
  EXPECT_TRUE(at::equal(cache.keys(0), at::cat({k, k.narrow(2, 0, 1)}, 2)));
  EXPECT_TRUE(at::equal(cache.values(0), -cache.keys(0)));
  cache.replace(0, k.narrow(2, 1, 2), -k.narrow(2, 1, 2));
  EXPECT_EQ(cache.length(0), 2);
  EXPECT_EQ(cache.position(), 4);  // compression never moves the position
  cache.append(0, k, -k);
  EXPECT_TRUE(at::equal(cache.keys(0), at::cat({k.narrow(2, 1, 2), k}, 2)));
  cache.truncate({2, 0}, 4);
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{2, 0}));
  expect_error([&] { cache.truncate({3, 0}, 4); }, {"layer 0 holds 2 tokens, cannot keep 3"});
  expect_error([&] { cache.append(0, at::zeros({1, 3, 1, 4}), at::zeros({1, 3, 1, 4})); }, {"do not match the cache"});
}

// Prefill of n tokens == prefill of a prefix + a multi-token forward + single-token steps.
TEST(Llama, IncrementalDecodingMatchesOneForward) {
  const LlamaModel& model = tiny_model();
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  ASSERT_GE(ids.size(), 60u);
  const at::Tensor all = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 60));
  KVCache full_cache = model.new_cache();
  const at::Tensor full = model.prefill(all, full_cache).logits;
  EXPECT_EQ(full_cache.position(), 60);

  KVCache cache = model.new_cache();
  std::vector<at::Tensor> parts{model.prefill(all.narrow(1, 0, 40), cache).logits,
                                model.forward(all.narrow(1, 40, 10), cache).logits};
  for (int64_t i = 50; i < 60; ++i) parts.push_back(model.forward(all.narrow(1, i, 1), cache).logits);
  EXPECT_EQ(cache.position(), 60);
  EXPECT_EQ(cache.length(1), 60);
  // Same math, other matmul shapes: summation order differs (logits are O(10)).
  EXPECT_LE(max_abs_diff(at::cat(parts, 1), full), 5e-5);

  KVCache c2 = model.new_cache();
  const at::Tensor only_last = model.prefill(all, c2, PrefillOptions()).logits;
  EXPECT_EQ(only_last.size(1), 60);
  KVCache c3 = model.new_cache();
  PrefillOptions p;
  p.last_logits_only = true;
  const at::Tensor l3 = model.prefill(all, c3, p).logits;
  ASSERT_EQ(l3.sizes(), at::IntArrayRef({1, 1, 2048}));
  EXPECT_LE(max_abs_diff(l3[0][0], full[0][59]), 2e-5);
  expect_error([&] { model.prefill(all, c3); }, {"prefill starts from an empty cache"});
  expect_error([&] { model.forward(all.to(at::kInt), c3); }, {"input_ids must be a non-empty int64"});
}

// PrefillOptions::compress_in_place (the default): each layer is compressed inside the buffer the
// prefill filled, which keeps its capacity; with it off the layer is replaced by a copy of the kept
// tokens. Same kept tokens and the same logits while decoding, for a selecting press and for one
// whose compression changes what it keeps (KeyRerotationPress: its result is copied into the front).
TEST(Llama, PrefillCompressesInPlace) {
  const LlamaModel& model = tiny_model();
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  ASSERT_GE(ids.size(), 74u);
  const int64_t s = 70;  // SnapKV's window is 64
  const at::Tensor prompt = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + s));
  const auto& c = model.config();
  const int64_t layer_bytes = 2 * c.num_kv_heads * s * c.head_dim * 4;  // K + V, float32
  for (const std::string name : {"KnormPress", "SnapKVPress", "KeyRerotationPress"}) {
    SCOPED_TRACE(name);
    const auto press = kvpress::make_press(name, 0.5);
    KVCache in_place = model.new_cache(), copied = model.new_cache();
    PrefillOptions p;
    p.press = press.get();
    const auto a = model.prefill(prompt, in_place, p);
    p.compress_in_place = false;
    const auto b = model.prefill(prompt, copied, p);
    const int64_t kept = kvpress::ops::n_kept(s, 0.5);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      EXPECT_TRUE(at::equal(a.kept_indices[l], b.kept_indices[l])) << "layer " << l;
      EXPECT_EQ(in_place.length(l), kept);
      EXPECT_TRUE(at::equal(in_place.keys(l), copied.keys(l))) << "layer " << l;
      EXPECT_TRUE(at::equal(in_place.values(l), copied.values(l))) << "layer " << l;
    }
    EXPECT_EQ(in_place.position(), copied.position());
    // The in-place cache keeps the prefill's buffers (capacity s), the copy holds the kept tokens.
    EXPECT_EQ(in_place.bytes(), c.num_layers * layer_bytes);
    EXPECT_EQ(copied.bytes(), c.num_layers * layer_bytes * kept / s);
    for (int64_t i = s; i < s + 4; ++i) {
      const at::Tensor token = ids_tensor({ids[static_cast<size_t>(i)]});
      EXPECT_TRUE(at::equal(model.forward(token, in_place).logits, model.forward(token, copied).logits));
    }
    // Appends filled the freed capacity: no reallocation.
    EXPECT_EQ(in_place.bytes(), c.num_layers * layer_bytes);
  }
}

// One prefill compressed by many presses (LlamaModel::capture_prefill / compress_captured, what
// kvpress-cli bench uses): for every registry press a captured prefill can serve, the same cache as
// prefill() with that press (kept tokens, their order, the next position, the stored layout and what
// later tokens read); for the others, an error saying why.
TEST(Llama, CapturedPrefillCompressesAsPrefillDoes) {
  const LlamaModel& model = tiny_model();
  const auto& c = model.config();
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  const int64_t s = static_cast<int64_t>(ids.size()) - 2;
  ASSERT_GT(s, 64);  // SnapKVPress's window
  const at::Tensor prompt = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + s));
  const at::Tensor next = ids_tensor({ids[s], ids[s + 1]});
  const kvpress::llama::CapturedPrefill captured = model.capture_prefill(prompt);
  ASSERT_EQ(static_cast<int64_t>(captured.layers.size()), c.num_layers);
  EXPECT_EQ(captured.cache.position(), s);
  int served = 0, refused = 0;
  for (const kvpress::PressInfo& info : kvpress::list_presses()) {
    for (const auto layout : {PrefillOptions::RaggedLayout::kPacked, PrefillOptions::RaggedLayout::kMasked}) {
      SCOPED_TRACE(info.name + (layout == PrefillOptions::RaggedLayout::kMasked ? " (masked)" : ""));
      const auto press =
          kvpress::make_press(info.name, kvpress::ratio_for(info, 0.5),
                              kvpress::testing::runnable_params(
                                  info, {c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size}, ""));
      if (layout == PrefillOptions::RaggedLayout::kMasked && !press->head_ragged()) continue;
      PrefillOptions opt;
      opt.press = press.get();
      opt.ragged_layout = layout;
      if (press->observes_question()) opt.question_length = 4;  // the prompt's last 4 tokens are its question
      const std::string why = LlamaModel::why_not_captured(press.get(), opt.press_attentions);
      if (!why.empty()) {
        ++refused;
        expect_error([&] { model.compress_captured(captured, opt); }, {"LlamaModel::compress_captured: ", why});
        continue;
      }
      ++served;
      at::manual_seed(0);  // RandomPress and unseeded LeverageScorePress draw from the global generator
      KVCache expected = model.new_cache();
      opt.tokenizer = &tiny_tokenizer();
      const auto direct = model.prefill(prompt, expected, opt);
      at::manual_seed(0);
      kvpress::llama::ForwardOutput out;
      KVCache cache = model.compress_captured(captured, opt, &out);
      EXPECT_EQ(cache.position(), expected.position());
      ASSERT_EQ(out.kept_indices.size(), direct.kept_indices.size());
      ASSERT_EQ(out.keep_masks.size(), direct.keep_masks.size());
      for (size_t l = 0; l < out.kept_indices.size(); ++l)
        EXPECT_TRUE(at::equal(out.kept_indices[l], direct.kept_indices[l]));
      for (size_t l = 0; l < out.keep_masks.size(); ++l)
        EXPECT_TRUE(at::equal(out.keep_masks[l], direct.keep_masks[l]));
      for (int64_t l = 0; l < c.num_layers; ++l) {
        ASSERT_EQ(cache.is_ragged(l), expected.is_ragged(l)) << "layer " << l;
        EXPECT_EQ(cache.length(l), expected.length(l)) << "layer " << l;
        if (!cache.is_ragged(l)) {
          EXPECT_TRUE(at::equal(cache.keys(l), expected.keys(l))) << "layer " << l;
          EXPECT_TRUE(at::equal(cache.values(l), expected.values(l))) << "layer " << l;
        }
      }
      EXPECT_TRUE(at::equal(model.forward(next, cache).logits, model.forward(next, expected).logits));
    }
  }
  // The capture itself is untouched: every layer still holds the whole prompt.
  for (int64_t l = 0; l < c.num_layers; ++l) EXPECT_EQ(captured.cache.length(l), s);
  EXPECT_GT(served, 40);
  EXPECT_GT(refused, 3);  // KVzip's family and KVCompose (second pass), DMSPress, ObservedAttentionPress
  // A press that observes the question compresses the capture with its question_length; out of range refused.
  const auto finch = kvpress::make_press("FinchPress", 0.5);
  PrefillOptions opt;
  opt.press = finch.get();
  opt.question_length = s + 1;
  expect_error([&] { model.compress_captured(captured, opt); },
               {"LlamaModel::compress_captured: question_length must be in [0, ", "got "});
}

// kvpress-cli eval's protocol (include/kvpress/llama/eval.h); its parity with kvpress is
// tests/cli/test_eval_parity.py.
TEST(Llama, ScoreContinuation) {
  const LlamaModel& model = tiny_model();
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  const int64_t n = static_cast<int64_t>(ids.size()), prefix = 40;
  ASSERT_GE(n, 60);

  // Full cache: the NLL of tokens prefix+1 .. n-1 under one forward over the whole story.
  const kvpress::llama::ContinuationScore full = kvpress::llama::score_continuation(model, ids, prefix);
  EXPECT_EQ(full.scored, n - prefix - 1);
  KVCache cache = model.new_cache();
  const at::Tensor logits = model.prefill(ids_tensor(ids), cache).logits[0].narrow(0, prefix, n - prefix - 1);
  const at::Tensor targets = ids_tensor(ids)[0].narrow(0, prefix + 1, n - prefix - 1);
  const double want = -at::log_softmax(logits, -1).gather(1, targets.view({-1, 1})).mean().item<double>();
  EXPECT_NEAR(full.mean_nll, want, 1e-5);
  EXPECT_TRUE(at::equal(full.argmax, logits.argmax(-1)));
  EXPECT_DOUBLE_EQ(kvpress::llama::greedy_agreement(full, full), 1.0);

  // Ratio 0 keeps everything: the same figures. A real compression changes them.
  const auto keep_all = kvpress::make_press("KnormPress", 0.0);
  const auto same = kvpress::llama::score_continuation(model, ids, prefix, keep_all.get());
  EXPECT_NEAR(same.mean_nll, full.mean_nll, 1e-6);
  EXPECT_DOUBLE_EQ(kvpress::llama::greedy_agreement(same, full), 1.0);
  const auto press = kvpress::make_press("KnormPress", 0.75);
  const auto compressed = kvpress::llama::score_continuation(model, ids, prefix, press.get());
  EXPECT_NE(compressed.mean_nll, full.mean_nll);
  const double agree = kvpress::llama::greedy_agreement(compressed, full);
  EXPECT_GE(agree, 0.0);
  EXPECT_LT(agree, 1.0);

  EXPECT_EQ(kvpress::llama::prefix_length(100, 0, 0.5), 50);
  EXPECT_EQ(kvpress::llama::prefix_length(101, 0, 0.5), 50);
  EXPECT_EQ(kvpress::llama::prefix_length(100, 98, 0.5), 98);
  EXPECT_EQ(kvpress::llama::prefix_length(100, 99, 0.5), -1);  // one token left: nothing to score
  EXPECT_EQ(kvpress::llama::prefix_length(3, 0, 0.5), 1);
  EXPECT_EQ(kvpress::llama::prefix_length(2, 0, 0.5), -1);
  EXPECT_EQ(kvpress::llama::prefix_length(10, 0, 0.05), -1);  // empty prefix
  expect_error([&] { kvpress::llama::score_continuation(model, ids, n - 1); }, {"prefix must be in [1, "});
  expect_error([&] { kvpress::llama::greedy_agreement(full, kvpress::llama::ContinuationScore{}); },
               {"greedy_agreement: both scores must cover the same non-empty positions"});
}

TEST(Llama, BatchedForwardMatchesSingleSequences) {
  const LlamaModel& model = tiny_model();
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  const at::Tensor a = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 32));
  const at::Tensor b = ids_tensor(std::vector<int64_t>(ids.begin() + 32, ids.begin() + 64));
  KVCache ca = model.new_cache(), cb = model.new_cache(), cab = model.new_cache();
  const at::Tensor la = model.prefill(a, ca).logits, lb = model.prefill(b, cb).logits;
  const at::Tensor lab = model.prefill(at::cat({a, b}, 0), cab).logits;
  EXPECT_LE(max_abs_diff(lab[0], la[0]), 5e-5);
  EXPECT_LE(max_abs_diff(lab[1], lb[0]), 5e-5);
}

TEST(Llama, PressNeedsAttentions) {
  EXPECT_TRUE(kvpress::needs_attentions("ObservedAttentionPress"));
  EXPECT_FALSE(kvpress::needs_attentions("SnapKVPress"));
  EXPECT_FALSE(kvpress::needs_attentions("KnormPress"));
  EXPECT_FALSE(kvpress::needs_attentions("AdaKVPress"));  // its inner press decides
}

// bfloat16 weights and activations (the casts follow transformers'): same greedy choices as float32
// almost everywhere.
TEST(Llama, RunsInBfloat16) {
  const LlamaModel bf16 = LlamaModel::load(model_dir(), at::kBFloat16);
  EXPECT_EQ(bf16.dtype(), at::kBFloat16);
  const std::vector<int64_t> ids = tiny_tokenizer().encode(kStory);
  const at::Tensor prompt = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 60));
  KVCache c16 = bf16.new_cache(), c32 = tiny_model().new_cache();
  const auto press = kvpress::make_press("SnapKVPress", 0.5, {{"window_size", "16"}});
  PrefillOptions opt;
  opt.press = press.get();
  const at::Tensor l16 = bf16.prefill(prompt, c16, opt).logits;
  const at::Tensor l32 = tiny_model().prefill(prompt, c32, opt).logits;
  EXPECT_EQ(l16.scalar_type(), at::kBFloat16);
  EXPECT_EQ(c16.keys(0).scalar_type(), at::kBFloat16);
  EXPECT_EQ(c16.length(1), 30);
  const double agree = (l16.argmax(-1) == l32.argmax(-1)).to(at::kFloat).mean().item<double>();
  EXPECT_GE(agree, 0.8);
  EXPECT_TRUE(at::isfinite(bf16.forward(ids_tensor({ids[60]}), c16).logits.to(at::kFloat)).all().item<bool>());
}

// Every press of the registry compresses every layer of `model` inside prefill (attentions given
// only to the presses that need them), and decoding continues over the compressed cache. ids: the
// tokens of a story (the prompt is its first 100 at most).
void expect_every_press_runs_in_the_loop(const LlamaModel& model, const std::vector<int64_t>& ids) {
  const auto& c = model.config();
  const int64_t s = std::min<int64_t>(static_cast<int64_t>(ids.size()) - 2, 100);
  ASSERT_GT(s, 70);  // SnapKV's default window is 64
  const at::Tensor prompt = ids_tensor(std::vector<int64_t>(ids.begin(), ids.begin() + s));
  for (const kvpress::PressInfo& info : kvpress::list_presses()) {
    SCOPED_TRACE(info.name);
    if (info.kind == kvpress::PressKind::kDecoding) continue;  // they compress while decoding: tests/test_decoding.cpp
    if (info.kind == kvpress::PressKind::kSecondPass) continue;  // KVComposePress's prefill: tests/test_kvcompose.cpp
    const auto press =
        kvpress::make_press(info.name, kvpress::ratio_for(info, 0.5),
                            kvpress::testing::runnable_params(
                                info, {c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size}, ""));
    KVCache cache = model.new_cache();
    PrefillOptions opt;
    opt.press = press.get();
    // A query-aware press (FinchPress) observes a question: the prompt's last 8 tokens play it.
    const bool query_aware = info.kind == kvpress::PressKind::kQueryAware;
    if (query_aware) opt.question_length = 8;
    int calls = 0;
    opt.on_compress = [&](const kvpress::LayerInputs& in, const kvpress::KV& kv) {
      EXPECT_EQ(in.question_length, opt.question_length);
      EXPECT_EQ(in.layer_idx, calls++);
      EXPECT_EQ(in.keys.size(2), s);
      EXPECT_EQ(in.hidden_states.sizes(), at::IntArrayRef({1, s, c.hidden_size}));
      EXPECT_EQ(in.cos.sizes(), at::IntArrayRef({s, c.head_dim}));
      EXPECT_EQ(in.attentions.defined(), info.name == "ObservedAttentionPress");
    };
    opt.on_compress_ragged = [&](const kvpress::LayerInputs& in, const kvpress::RaggedKV&) {
      EXPECT_EQ(in.layer_idx, calls++);
    };
    kvpress::llama::ForwardOutput out;
    try {
      out = model.prefill(prompt, cache, opt);
    } catch (const c10::Error& e) {
      ADD_FAILURE() << "prefill raised: " << e.what_without_backtrace();
      continue;
    }
    EXPECT_EQ(calls, c.num_layers);
    if (press->head_ragged()) {
      // Heads keep different numbers of tokens; the layer keeps Hkv * n_kept (tests/test_ragged_presses.cpp).
      ASSERT_EQ(static_cast<int64_t>(out.keep_masks.size()), c.num_layers);
      const auto* lukv = dynamic_cast<const kvpress::LUKVPress*>(press.get());  // its curve's head budgets
      for (int64_t l = 0; l < c.num_layers; ++l) {
        const at::Tensor& mask = out.keep_masks[static_cast<size_t>(l)];
        if (lukv)
          EXPECT_TRUE(at::equal(mask.sum(-1)[0], lukv->head_budgets(l, c.num_kv_heads, s)));
        else if (info.kind == kvpress::PressKind::kLayer)  // DuoAttentionPress: no streaming head by default
          EXPECT_EQ(mask.sum().item<int64_t>(), c.num_kv_heads * s);
        else if (info.name == "DMSPress")  // its threshold decides; its window of 4 is always kept
          EXPECT_TRUE(mask.narrow(2, s - 4, 4).all().item<bool>());
        else
          EXPECT_EQ(mask.sum().item<int64_t>(), c.num_kv_heads * kvpress::ops::n_kept(s, 0.5));
      }
      EXPECT_TRUE(at::isfinite(model.forward(ids_tensor({ids[s], ids[s + 1]}), cache).logits).all().item<bool>());
      continue;
    }
    ASSERT_EQ(static_cast<int64_t>(out.kept_indices.size()), c.num_layers);
    // ChunkKVPress keeps whole chunks: its count is not n_kept and varies by layer (the remainder
    // chunk may or may not win; tests/test_wrappers.cpp). CTRPress's budget adapts per layer
    // (tests/test_ctr.cpp).
    // PyramidKVPress and PerLayerCompressionPress give each layer its own budget.
    const bool chunked = info.name == "ChunkKVPress" || info.name == "CTRPress" || info.name == "PyramidKVPress" ||
                         info.name == "PerLayerCompressionPress";
    // ThinKPress prunes channels; SimLayerKVPress's default threshold judges no layer.
    const bool keeps_all = info.kind == kvpress::PressKind::kChannel || info.kind == kvpress::PressKind::kLayer;
    const int64_t n_kept = chunked ? out.kept_indices[0].size(2) : keeps_all ? s : kvpress::ops::n_kept(s, 0.5);
    std::vector<int64_t> lengths;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const int64_t n_l = chunked ? out.kept_indices[l].size(2) : n_kept;
      lengths.push_back(n_l);
      EXPECT_EQ(cache.length(l), n_l);
      EXPECT_EQ(out.kept_indices[l].sizes(), at::IntArrayRef({1, c.num_kv_heads, n_l}));
    }
    // After KeyRerotationPress the keys sit at positions 0..n_kept-1 and decoding continues at n_kept
    // (kvpress's pipeline); after every other press, at s.
    const int64_t next_position = press->rerotates_keys() ? n_kept : s;
    EXPECT_EQ(cache.position(), next_position);
    const at::Tensor next = model.forward(ids_tensor({ids[s], ids[s + 1]}), cache).logits;
    EXPECT_TRUE(at::isfinite(next).all().item<bool>());
    EXPECT_EQ(cache.position(), next_position + 2);
    EXPECT_EQ(cache.length(0), n_kept + 2);

    if (query_aware) continue;  // generate_greedy prefills no question: answer_questions (tests/test_pipeline.cpp)
    kvpress::llama::GenerationOptions g;
    g.press = press.get();
    g.max_new_tokens = 4;
    g.stop_at_eos = false;
    const auto gen = kvpress::llama::generate_greedy(model, std::vector<int64_t>(ids.begin(), ids.begin() + s), {}, g);
    EXPECT_EQ(gen.tokens.size(), 4u);
    EXPECT_EQ(gen.cache_lengths, lengths);
  }
  // A press that needs attentions refuses to run without them.
  const auto observed = kvpress::make_press("ObservedAttentionPress", 0.5);
  KVCache cache = model.new_cache();
  PrefillOptions never;
  never.press = observed.get();
  never.press_attentions = PressAttentions::kNever;
  expect_error([&] { model.prefill(prompt, cache, never); }, {"ObservedAttentionPress", "attentions"});
}

TEST(Llama, EveryRegistryPressRunsInTheLoop) {
  expect_every_press_runs_in_the_loop(tiny_model(), tiny_tokenizer().encode(kStory));
}

// ---- fixtures -------------------------------------------------------------------------------------

using json = nlohmann::json;

// One set of model-level fixtures: TinyStories-656K's (make_model_fixtures.py) or a model family's
// (make_family_fixtures.py), with the model they were made with.
struct LlamaFixtures {
  std::string name;  // "llama" (TinyStories-656K), or the family: "llama3", "qwen2", "qwen3"
  std::string dir;
  json manifest;
  std::string error;
  // TinyStories-656K, or the family's random-weight model saved beside its fixtures (loaded once).
  const LlamaModel& model() const {
    if (name == "llama") return tiny_model();
    static std::map<std::string, std::unique_ptr<LlamaModel>> loaded;
    auto& slot = loaded[dir];
    if (!slot)
      slot = std::make_unique<LlamaModel>(LlamaModel::load(dir + "/" + manifest.at("model").get<std::string>()));
    return *slot;
  }
};

// The set in <fixtures>/<subdir>, which `script` writes when given --out <fixtures>/<script_out>.
LlamaFixtures load_fixture_set(const std::string& name, const std::string& subdir, const std::string& script,
                               const std::string& script_out) {
  LlamaFixtures out;
  out.name = name;
  const std::string base = kvpress::testing::fixtures_dir();
  if (base.empty()) {
    out.error = std::string("KVPRESS_FIXTURES is not set; ") + kvpress::testing::fixtures_howto();
    return out;
  }
  out.dir = base + "/" + subdir;
  std::ifstream in(out.dir + "/manifest.json");
  if (!in) {
    out.error = "no manifest at " + out.dir + "/manifest.json; generate it with tests/reference/" + script + " --out " +
                base + "/" + script_out + " (scripts/test.sh does)";
    return out;
  }
  try {
    in >> out.manifest;
  } catch (const std::exception& e) {
    out.error = std::string("malformed ") + out.dir + "/manifest.json: " + e.what();
  }
  return out;
}

const LlamaFixtures& llama_fixtures() {
  static const LlamaFixtures f = load_fixture_set("llama", "llama", "make_model_fixtures.py", "llama");
  return f;
}

// The families of tests/reference/make_family_fixtures.py.
const std::vector<LlamaFixtures>& family_fixtures() {
  static const std::vector<LlamaFixtures> f = [] {
    std::vector<LlamaFixtures> out;
    for (const std::string family : {"llama3", "qwen2", "qwen3"})
      out.push_back(load_fixture_set(family, "families/" + family, "make_family_fixtures.py", "families"));
    return out;
  }();
  return f;
}

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  json j;
  in >> j;
  return j;
}

at::Tensor fixture_tensor(const LlamaFixtures& fx, const std::string& file, const std::string& key) {
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(fx.dir + "/" + file), key, file);
}
at::Tensor fixture_tensor(const std::string& file, const std::string& key) {
  return fixture_tensor(llama_fixtures(), file, key);
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous().flatten();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Figures gathered for the summary printed after the run.
struct RunFigures {
  std::string kept;  // "exact", "modulo N near-ties", ...
  double logits = 0, scores_rel = 0;
  bool replayed = false;
};
std::map<std::string, RunFigures>& figures() {
  static std::map<std::string, RunFigures> f;
  return f;
}
std::map<std::string, double>& model_figures() {
  static std::map<std::string, double> f;
  return f;
}

class LlamaSummary : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!model_figures().empty()) {
      std::cout << "[ llama    ] transformers parity, max |diff|:";
      for (const auto& [k, v] : model_figures()) std::cout << "  " << k << " " << std::setprecision(3) << v;
      std::cout << "\n";
    }
    for (const auto& [name, f] : figures())
      std::cout << "[ llama    ] " << std::left << std::setw(44) << name << std::right << " kept " << std::setw(22)
                << f.kept << "  max |d logits| " << std::setprecision(3) << std::setw(9) << f.logits
                << (f.replayed ? " (kvpress's kept positions replayed)" : "") << "  max rel |d score| " << f.scores_rel
                << "\n";
  }
};
[[maybe_unused]] ::testing::Environment* const kLlamaSummary = ::testing::AddGlobalTestEnvironment(new LlamaSummary);

#define REQUIRE_FIXTURE_SET(set)                                           \
  const LlamaFixtures& fx = (set);                                         \
  ASSERT_TRUE(fx.error.empty()) << fx.error;                               \
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5") \
      << "fixtures in " << fx.dir << " were made with another kvpress; regenerate them"
#define REQUIRE_FIXTURES() REQUIRE_FIXTURE_SET(llama_fixtures())

void check_tokenizer_cases(const Tokenizer& tok, const json& cases) {
  int n = 0;
  for (const auto& c : cases) {
    const std::vector<int64_t> ids = c.at("ids").get<std::vector<int64_t>>();
    if (!c.at("text").is_null()) {
      const std::string text = c.at("text").get<std::string>();
      EXPECT_EQ(tok.encode(text), ids) << c.at("name") << ": " << text;
    }
    EXPECT_EQ(tok.decode(ids, true), c.at("decoded").get<std::string>()) << c.at("name");
    EXPECT_EQ(tok.decode(ids, false), c.at("decoded_with_special").get<std::string>()) << c.at("name");
    ++n;
  }
  EXPECT_GT(n, 0);
}

TEST(LlamaParity, TokenizerMatchesTransformers) {
  REQUIRE_FIXTURES();
  const json cases = read_json(fx.dir + "/" + fx.manifest.at("tokenizer_cases").get<std::string>());
  int stories = 0;
  for (const auto& c : cases) stories += c.at("name").get<std::string>().rfind("story", 0) == 0;
  EXPECT_EQ(stories, 100);
  check_tokenizer_cases(tiny_tokenizer(), cases);
}

TEST(LlamaParity, SyntheticTokenizerMatchesTokenizers) {
  REQUIRE_FIXTURES();
  const Tokenizer tok = Tokenizer::load(fx.dir + "/" + fx.manifest.at("synthetic_tokenizer").get<std::string>());
  check_tokenizer_cases(tok, read_json(fx.dir + "/" + fx.manifest.at("synthetic_tokenizer_cases").get<std::string>()));
}

struct Prompt {
  std::string name, file;
  at::Tensor prefix, question;
  int64_t prefix_len = 0;
};
Prompt prompt_of(const LlamaFixtures& fx, const json& p) {
  Prompt out;
  out.name = p.at("name").get<std::string>();
  out.file = p.at("file").get<std::string>();
  out.prefix_len = p.at("prefix_len").get<int64_t>();
  const at::Tensor ids = fixture_tensor(fx, out.file, "input_ids");
  out.prefix = ids.narrow(1, 0, out.prefix_len);
  out.question = ids.narrow(1, out.prefix_len, p.at("question_len").get<int64_t>());
  return out;
}

// The question (one forward) then the reference's decode tokens fed one at a time (teacher
// forcing keeps the comparison meaningful after a differing argmax). Returns the question logits
// [q, V] and the decode logits [steps, V].
std::pair<at::Tensor, at::Tensor> continue_decoding(const LlamaModel& model, KVCache& cache, const Prompt& p,
                                                    const at::Tensor& decode_tokens) {
  const at::Tensor q = model.forward(p.question, cache).logits[0];
  std::vector<at::Tensor> steps;
  for (int64_t i = 0; i < decode_tokens.size(0); ++i)
    steps.push_back(model.forward(decode_tokens.narrow(0, i, 1).view({1, 1}), cache).logits[0][0]);
  return {q, at::stack(steps)};
}

// Greedy decoding agrees: every argmax of ours equals the reference's next token, unless the
// reference's top two logits are within the logit tolerance (an honest tie).
void expect_greedy_agrees(const at::Tensor& q_logits, const at::Tensor& d_logits, const at::Tensor& ref_q,
                          const at::Tensor& ref_d, const at::Tensor& tokens) {
  const at::Tensor ours = at::cat({q_logits.narrow(0, q_logits.size(0) - 1, 1), d_logits}, 0);
  const at::Tensor ref = at::cat({ref_q.narrow(0, ref_q.size(0) - 1, 1), ref_d}, 0);
  for (int64_t i = 0; i + 1 < ours.size(0); ++i) {
    const int64_t want = i < tokens.size(0) ? tokens[i].item<int64_t>() : ref[i].argmax().item<int64_t>();
    const at::Tensor top2 = std::get<0>(ref[i].topk(2));
    if ((top2[0] - top2[1]).item<double>() <= 2 * kLogitTol) continue;
    EXPECT_EQ(ours[i].argmax().item<int64_t>(), want) << "greedy step " << i;
  }
}

// The prefill's logits and attention weights, then the question and decode steps' logits, against
// transformers on every prompt of a fixture set.
void expect_logits_and_attentions_match(const LlamaFixtures& fx) {
  const LlamaModel& model = fx.model();
  for (const auto& jp : fx.manifest.at("prompts")) {
    const Prompt p = prompt_of(fx, jp);
    SCOPED_TRACE(fx.name + " " + p.name);
    KVCache cache = model.new_cache();
    PrefillOptions opt;
    opt.return_attentions = true;
    const auto out = model.prefill(p.prefix, cache, opt);
    const double dl = max_abs_diff(out.logits, fixture_tensor(fx, p.file, "prefill_logits"));
    EXPECT_LE(dl, kLogitTol) << "prefill logits";
    double da = 0;
    ASSERT_EQ(static_cast<int64_t>(out.attentions.size()), model.config().num_layers);
    for (size_t l = 0; l < out.attentions.size(); ++l)
      da =
          std::max(da, max_abs_diff(out.attentions[l], fixture_tensor(fx, p.file, "attentions_l" + std::to_string(l))));
    EXPECT_LE(da, kAttentionTol) << "attention weights";

    const at::Tensor tokens = fixture_tensor(fx, p.file, "decode_tokens");
    const auto [q, d] = continue_decoding(model, cache, p, tokens);
    const at::Tensor ref_q = fixture_tensor(fx, p.file, "question_logits");
    const at::Tensor ref_d = fixture_tensor(fx, p.file, "decode_logits");
    const double dq = max_abs_diff(q, ref_q), dd = max_abs_diff(d, ref_d);
    EXPECT_LE(dq, kLogitTol) << "question logits";
    EXPECT_LE(dd, kLogitTol) << "decode logits";
    expect_greedy_agrees(q, d, ref_q, ref_d, tokens);
    auto& mf = model_figures();
    const std::string prefix = fx.name == "llama" ? "" : fx.name + ":";
    mf[prefix + "prefill_logits"] = std::max(mf[prefix + "prefill_logits"], dl);
    mf[prefix + "attentions"] = std::max(mf[prefix + "attentions"], da);
    mf[prefix + "question+decode_logits"] = std::max(mf[prefix + "question+decode_logits"], std::max(dq, dd));
  }
}

TEST(LlamaParity, LogitsAndAttentionsMatchTransformers) {
  REQUIRE_FIXTURES();
  expect_logits_and_attentions_match(fx);
}

TEST(FamilyParity, LogitsAndAttentionsMatchTransformers) {
  for (const LlamaFixtures& set : family_fixtures()) {
    REQUIRE_FIXTURE_SET(set);
    EXPECT_EQ(fx.model().config().model_type, fx.manifest.at("family").get<std::string>());
    expect_logits_and_attentions_match(fx);
  }
}

// The families share TinyStories-656K's vocabulary, so its tokenizer gives their prompts.
TEST(FamilyParity, EveryRegistryPressRunsInTheLoop) {
  for (const LlamaFixtures& set : family_fixtures()) {
    REQUIRE_FIXTURE_SET(set);
    SCOPED_TRACE(fx.name);
    expect_every_press_runs_in_the_loop(fx.model(), tiny_tokenizer().encode(kStory));
  }
}

TEST(LlamaParity, EveryRegistryPressHasARun) {
  REQUIRE_FIXTURES();
  std::map<std::string, int> runs;
  for (const auto& p : fx.manifest.at("prompts"))
    for (const auto& r : p.at("runs")) ++runs[r.at("press").get<std::string>()];
  // These wrappers (configured with an inner scorer) and the decoding presses have their
  // model-loop runs against kvpress's pipeline in tests/reference/make_decoding_fixtures.py
  // (tests/test_decoding.cpp, DecodingParity.*), besides layer-level runs (tests/test_parity.cpp).
  // KeyRerotationPress has runs here too (it moves the positions the question continues at).
  const std::set<std::string> wrappers{
      "ChunkKVPress", "EntropyGatedChunkKVPress", "ChunkPress", "BlockPress", "ComposedPress", "MergingPress"};
  // Presses kvpress 0.5.5 lacks have no kvpress run to compare: QSMPress/CTRPress are checked against
  // the CTRPress fork (tests/test_ctr.cpp), DropKVPress against its definition and the proposed
  // kvpress pull request (tests/presses/dropkv_press_test.cpp, docs/PRESS_NOTES.md).
  std::set<std::string> kvpress_presses;
  for (const auto& name : fx.manifest.at("kvpress_presses")) kvpress_presses.insert(name.get<std::string>());
  ASSERT_GE(kvpress_presses.size(), 44u) << "the manifest lists fewer press classes than kvpress 0.5.5 has";
  // DMSPress acts in the prefill and the decoding with one window: its model-loop runs follow kvpress's
  // pipeline in tests/reference/make_dms_fixtures.py (DMSParity.* in tests/test_dms.cpp).
  const std::set<std::string> own_fixtures{"DMSPress"};
  // Presses with head/layer budgets: their model-loop runs are in tests/reference/make_ragged_fixtures.py
  // (SDPA model: kvpress's AdaKV refuses eager; RaggedParity.ModelRuns in tests/test_ragged_presses.cpp).
  const std::set<std::string> ragged_fixtures{"AdaKVPress",       "CriticalKVPress",          "CriticalAdaKVPress",
                                              "PyramidKVPress",   "PerLayerCompressionPress", "LUKVPress",
                                              "DuoAttentionPress"};
  for (const auto& info : kvpress::list_presses())
    // KVComposePress has its own fixtures (tests/reference/make_kvcompose_fixtures.py); a query-aware
    // press (FinchPress) runs in kvpress's question-answering pipeline
    // (tests/reference/make_pipeline_fixtures.py, PipelineParity.* in tests/test_pipeline.cpp).
    if (!wrappers.count(info.name) && kvpress_presses.count(info.name) && !ragged_fixtures.count(info.name) &&
        !own_fixtures.count(info.name) && info.kind != kvpress::PressKind::kDecoding &&
        info.kind != kvpress::PressKind::kSecondPass && info.kind != kvpress::PressKind::kQueryAware)
      EXPECT_GT(runs[info.name], 0) << info.name << " has no run in tests/reference/make_model_fixtures.py's PRESSES";
}

// ---- per press ---------------------------------------------------------------------------------------

// Replays kvpress's kept positions: isolates the runner's compressed-cache mechanics from selection
// ties.
class ReplayPress : public kvpress::BasePress {
 public:
  explicit ReplayPress(std::vector<at::Tensor> kept) : kept_(std::move(kept)) {}
  std::string name() const override { return "ReplayPress"; }
  double compression_ratio() const override { return 0.5; }
  kvpress::KV compress(const kvpress::LayerInputs& in) const override {
    const at::Tensor& idx = kept_.at(static_cast<size_t>(in.layer_idx));
    kvpress::KV kv = kvpress::ops::gather_kv(in.keys, in.values, idx);
    kv.kept_indices = idx;
    return kv;
  }

 private:
  std::vector<at::Tensor> kept_;
};

// Scores 1 at kvpress's kept positions and 0 elsewhere: inside a KeyRerotationPress it replays
// kvpress's selection through our re-rotation.
class ReplayScorer : public kvpress::ScorerPress {
 public:
  ReplayScorer(std::vector<at::Tensor> kept, double compression_ratio)
      : ScorerPress(compression_ratio), kept_(std::move(kept)) {}
  std::string name() const override { return "ReplayScorer"; }
  at::Tensor score(const kvpress::LayerInputs& in) const override {
    const at::Tensor& idx = kept_.at(static_cast<size_t>(in.layer_idx));
    return at::zeros({in.keys.size(0), in.keys.size(1), in.keys.size(2)}, at::kFloat).scatter_(2, idx, 1.0);
  }

 private:
  std::vector<at::Tensor> kept_;
};

// The press that replays kvpress's kept positions `ref_kept` in place of `press`.
std::unique_ptr<kvpress::BasePress> replay_of(const kvpress::BasePress& press, std::vector<at::Tensor> ref_kept) {
  if (press.rerotates_keys())
    return std::make_unique<kvpress::KeyRerotationPress>(
        std::make_shared<ReplayScorer>(std::move(ref_kept), press.compression_ratio()));
  return std::make_unique<ReplayPress>(std::move(ref_kept));
}

// The scorer whose scores select the kept positions: the press itself, or KeyRerotationPress's
// inner press (kvpress's fixtures record the inner press's scores for it).
const kvpress::ScorerPress* selection_scorer(const kvpress::BasePress& press) {
  if (const auto* rerotation = dynamic_cast<const kvpress::KeyRerotationPress*>(&press))
    return rerotation->press().get();
  return dynamic_cast<const kvpress::ScorerPress*>(&press);
}

// Kept sets equal, or differing only at positions whose kvpress score is within `allowed` of the
// selection threshold (the argument of tests/test_parity.cpp's KeptSetsAgreeModuloNearTies: if we keep
// p and drop q while kvpress keeps q and drops p, both scores lie within e_p + e_q of the threshold).
// Returns the number of positions kept by one side only; adds a failure for any other difference.
int64_t compare_kept(const at::Tensor& ours, const at::Tensor& ref, const at::Tensor& ref_scores,
                     const at::Tensor& allowed, const std::string& what) {
  const int64_t seq =
      ref_scores.defined() ? ref_scores.size(-1) : std::max(ours.max().item<int64_t>(), ref.max().item<int64_t>()) + 1;
  auto mask = [&](const at::Tensor& kept) {
    const at::Tensor rows = kept.reshape({-1, kept.size(-1)});
    return at::zeros({rows.size(0), seq}, at::kBool).scatter_(1, rows, true);
  };
  EXPECT_EQ(ours.sizes(), ref.sizes()) << what;
  if (ours.sizes() != ref.sizes()) return -1;
  const at::Tensor ref_mask = mask(ref), diff = mask(ours).logical_xor(ref_mask);
  const int64_t n_diff = diff.sum().item<int64_t>();
  if (n_diff == 0) return 0;
  if (!ref_scores.defined()) {
    ADD_FAILURE() << what << ": " << n_diff << " positions kept by one side only (no scores to explain ties)";
    return n_diff;
  }
  const at::Tensor scores = ref_scores.reshape({-1, seq}), e = allowed.reshape({-1, seq});
  const at::Tensor threshold = scores.gather(1, ref.reshape({-1, ref.size(-1)})).amin(1, true);
  const at::Tensor e_max = at::where(diff, e, at::zeros_like(e)).amax(1, true);
  const at::Tensor bad = diff.logical_and((scores - threshold).abs() > e + e_max);
  EXPECT_FALSE(bad.any().item<bool>()) << what << ": " << bad.sum().item<int64_t>() << " of " << n_diff
                                       << " positions kept by one side only have a kvpress score far from the "
                                          "selection threshold";
  return n_diff;
}

struct PressRunParam {
  const LlamaFixtures* fixtures = nullptr;
  const json* prompt = nullptr;
  const json* run = nullptr;
  // "<run>" for TinyStories-656K's, "<family>__<run>" for a family's.
  std::string name() const {
    const std::string run_name = run ? run->at("name").get<std::string>() : "?";
    return fixtures && fixtures->name != "llama" ? fixtures->name + "__" + run_name : run_name;
  }
};
void PrintTo(const PressRunParam& p, std::ostream* os) { *os << p.name(); }

std::vector<PressRunParam> press_runs(const LlamaFixtures& fx) {
  std::vector<PressRunParam> out;
  if (!fx.error.empty()) return out;
  for (const auto& p : fx.manifest.at("prompts"))
    for (const auto& r : p.at("runs")) out.push_back({&fx, &p, &r});
  return out;
}
std::vector<PressRunParam> family_press_runs() {
  std::vector<PressRunParam> out;
  for (const LlamaFixtures& fx : family_fixtures())
    for (const PressRunParam& run : press_runs(fx)) out.push_back(run);
  return out;
}

class LlamaPressRun : public ::testing::TestWithParam<PressRunParam> {};

TEST_P(LlamaPressRun, MatchesKvpressPipeline) {
  REQUIRE_FIXTURE_SET(*GetParam().fixtures);
  const json& jr = *GetParam().run;
  const Prompt p = prompt_of(fx, *GetParam().prompt);
  const std::string run = GetParam().name();
  const std::string file = jr.at("file").get<std::string>();
  const std::string press_name = jr.at("press").get<std::string>();
  const auto& infos = kvpress::list_presses();
  if (std::none_of(infos.begin(), infos.end(), [&](const auto& i) { return i.name == press_name; }))
    FAIL() << press_name << " has kvpress fixtures but is not in the C++ registry";
  const auto press =
      kvpress::make_press(press_name, jr.at("compression_ratio").get<double>(),
                          kvpress::testing::with_artifact_paths(
                              press_name, jr.at("params").get<std::map<std::string, std::string>>(), fx.dir));
  const kvpress::ScorerPress* scorer = selection_scorer(*press);
  const LlamaModel& model = fx.model();
  const int64_t num_layers = model.config().num_layers;
  RunFigures fig;

  // 1. Prefill with the press, attentions given as kvpress's eager model gives them.
  std::vector<at::Tensor> our_scores(num_layers);
  auto run_prefill = [&](PressAttentions attentions, KVCache& cache, bool record_scores) {
    PrefillOptions opt;
    opt.press = press.get();
    opt.press_attentions = attentions;
    opt.on_compress = [&](const kvpress::LayerInputs& in, const kvpress::KV&) {
      if (record_scores && scorer) our_scores[in.layer_idx] = scorer->score(in);
    };
    return model.prefill(p.prefix, cache, opt);
  };
  KVCache cache = model.new_cache();
  const auto out = run_prefill(PressAttentions::kAlways, cache, true);
  // Where kvpress's pipeline puts the question: the compressed length after KeyRerotationPress.
  const int64_t context_length = jr.at("context_length").get<int64_t>();
  EXPECT_EQ(cache.position(), context_length) << "position after prefill";

  // 2. Kept positions per layer.
  const bool has_scores = jr.at("has_scores").get<bool>();
  std::vector<at::Tensor> ref_kept, ref_scores, allowed;
  for (int64_t l = 0; l < num_layers; ++l) {
    ref_kept.push_back(fixture_tensor(fx, file, "kept_l" + std::to_string(l)));
    ref_scores.push_back(has_scores ? fixture_tensor(fx, file, "scores_l" + std::to_string(l)) : at::Tensor());
    if (has_scores) {
      // float32 scores from inputs that agree to ~1e-6: 1e-4 relative to each score and to the
      // layer's largest score magnitude.
      const at::Tensor& s = ref_scores.back();
      allowed.push_back(s.abs() * 1e-4 + 1e-4 * s.abs().max());
      if (press_name == "LagKVPress" && !jr.at("params").contains("cross_scoring")) {
        // LagKV scores ranks / lag_size within each partition. Our fused kernel sums the
        // statistic in another order than ATen, so two tokens whose statistics agree to rounding
        // may swap adjacent ranks: allow one rank step (the kept sets and logits are still
        // compared below; tests/test_parity.cpp bounds the rank moves on the statistic itself).
        const auto params = jr.at("params").get<std::map<std::string, std::string>>();
        const double lag_size = params.count("lag_size") ? std::stod(params.at("lag_size")) : 128.0;
        allowed.back() = allowed.back() + 1.0 / lag_size;
      }
      if (our_scores[l].defined()) {
        const double rel = ((our_scores[l] - s).abs() / (s.abs() + s.abs().max())).max().item<double>();
        fig.scores_rel = std::max(fig.scores_rel, rel);
        EXPECT_TRUE(((our_scores[l] - s).abs() <= allowed.back()).all().item<bool>())
            << "layer " << l << " scores differ from kvpress's by up to " << rel << " (relative)";
      }
    } else {
      allowed.emplace_back();
    }
  }
  int64_t n_diff = 0;
  for (int64_t l = 0; l < num_layers; ++l)
    n_diff += compare_kept(out.kept_indices[l], ref_kept[l], ref_scores[l], allowed[l], "layer " + std::to_string(l));
  fig.kept = n_diff == 0 ? "exact" : "modulo " + std::to_string(n_diff) + " near-ties";

  // 3. Logits over the compressed cache: ours when the kept sets agree, else kvpress's replayed.
  const at::Tensor tokens = fixture_tensor(fx, file, "decode_tokens");
  const at::Tensor ref_q = fixture_tensor(fx, file, "question_logits"),
                   ref_d = fixture_tensor(fx, file, "decode_logits");
  at::Tensor q, d;
  if (n_diff == 0) {
    std::tie(q, d) = continue_decoding(model, cache, p, tokens);
  } else {
    const auto replay = replay_of(*press, ref_kept);
    KVCache replay_cache = model.new_cache();
    PrefillOptions opt;
    opt.press = replay.get();
    const auto replayed = model.prefill(p.prefix, replay_cache, opt);
    for (int64_t l = 0; l < num_layers; ++l)
      EXPECT_TRUE(at::equal(replayed.kept_indices[l], ref_kept[l])) << "replayed layer " << l;
    EXPECT_EQ(replay_cache.position(), context_length) << "position after the replayed prefill";
    std::tie(q, d) = continue_decoding(model, replay_cache, p, tokens);
    fig.replayed = true;
  }
  fig.logits = std::max(max_abs_diff(q, ref_q), max_abs_diff(d, ref_d));
  EXPECT_LE(fig.logits, kLogitTol) << "logits over the compressed cache";
  expect_greedy_agrees(q, d, ref_q, ref_d, tokens);

  // 4. Presses that can do without attention weights (they compute their attention from the
  //    prefill's queries, as kvpress on non-eager models does from hidden_states + q_proj + RoPE)
  //    keep the same tokens.
  if (!kvpress::needs_attentions(press->name())) {
    KVCache c2 = model.new_cache();
    const auto out2 = run_prefill(PressAttentions::kNever, c2, false);
    for (int64_t l = 0; l < num_layers; ++l)
      compare_kept(out2.kept_indices[l], ref_kept[l], ref_scores[l], allowed[l],
                   "without attentions, layer " + std::to_string(l));
  }
  figures()[run] = fig;
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

INSTANTIATE_TEST_SUITE_P(Kvpress, LlamaPressRun, ::testing::ValuesIn(press_runs(llama_fixtures())),
                         [](const ::testing::TestParamInfo<PressRunParam>& info) {
                           return sanitize(info.param.name());
                         });
INSTANTIATE_TEST_SUITE_P(Families, LlamaPressRun, ::testing::ValuesIn(family_press_runs()),
                         [](const ::testing::TestParamInfo<PressRunParam>& info) {
                           return sanitize(info.param.name());
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(LlamaPressRun);

}  // namespace
