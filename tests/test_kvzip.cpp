// KVzipPress, RestoreKVPress, KVgradPress, FastKVzipPress and kvpress::llama::kvzip_prefill.
//
// KVzip.*, FastKVzip.*, RestoreKV.*, Lora.*  unit tests (no fixtures): replay chunks, the global
//                selection and the chunk scores
//                against hand computations or a float64 reference; every error; the runner on
//                TinyStories-656K (the cache is the plain prefill's selected tokens, query-chunk
//                invariance, memory figures, ratio 0, LlamaModel::prefill's dispatch); RestoreKV's
//                restore tokens against the plain runner with the LoRA merged into the weights; PEFT
//                adapters' reading and refusals.
// KVzipParity.*  against tests/reference/make_kvzip_fixtures.py (kvpress's own KVzip, KVgrad,
//                RestoreKV and FastKVzip, the last two with the same artifacts, on the same model and
//                context): scores, kept tokens per head, restore tokens' keys/values, next-token logits.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/kvzip.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/fastkvzip_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/presses/kvzip_press.h"
#include "kvpress/presses/restorekv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::KVzipPress;
using kvpress::RestoreKVPress;
using kvpress::llama::KVCache;
using kvpress::llama::LlamaModel;
using kvpress::llama::PrefillOptions;
using kvpress::testing::expect_error;
using kvpress::testing::tiny_model;
using kvpress::testing::tiny_tokenizer;

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous().flatten();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

at::Tensor story_ids(int64_t n) {
  const auto ids = tiny_tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play "
      "outside in the park with her red ball. One day, she saw a big dog. The "
      "dog was sad because it lost its bone. Lily wanted to help the dog find it.");
  EXPECT_GE(static_cast<int64_t>(ids.size()), n);
  return at::tensor(std::vector<int64_t>(ids.begin(), ids.begin() + n), at::kLong).unsqueeze(0);
}

TEST(KVzip, ReplayChunks) {
  const std::vector<int64_t> ctx = {10, 11, 12, 13, 14, 15, 16};
  const auto chunks = KVzipPress(0.5, false, 4, false, 3).replay_chunks(ctx, {1, 2}, {3}, {9});
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].start, 0);
  EXPECT_EQ(chunks[0].end, 3);
  EXPECT_EQ(chunks[0].repeat_ids, (std::vector<int64_t>{1, 2, 9, 10, 11, 12}));
  // A later chunk: the next prompt, the previous chunk's last min(8, chunk_size) tokens, the suffix.
  EXPECT_EQ(chunks[1].repeat_ids, (std::vector<int64_t>{3, 10, 11, 12, 9, 13, 14, 15}));
  EXPECT_EQ(chunks[2].start, 6);
  EXPECT_EQ(chunks[2].end, 7);
  EXPECT_EQ(chunks[2].repeat_ids, (std::vector<int64_t>{3, 13, 14, 15, 9, 16}));
  // One chunk when the context fits.
  EXPECT_EQ(KVzipPress(0.5).replay_chunks(ctx, {1}, {3}, {9}).size(), 1u);
  // A chat template's first 2 tokens (its text before the user's message) are not replayed; the
  // chunks start after them, at absolute positions.
  const auto framed = KVzipPress(0.5, false, 4, false, 3).replay_chunks(ctx, {1, 2}, {3}, {9, 8}, 2);
  ASSERT_EQ(framed.size(), 2u);
  EXPECT_EQ(framed[0].start, 2);
  EXPECT_EQ(framed[0].end, 5);
  EXPECT_EQ(framed[0].repeat_ids, (std::vector<int64_t>{1, 2, 9, 8, 12, 13, 14}));
  EXPECT_EQ(framed[1].start, 5);
  EXPECT_EQ(framed[1].end, 7);
  EXPECT_EQ(framed[1].repeat_ids, (std::vector<int64_t>{3, 12, 13, 14, 9, 8, 15, 16}));
}

TEST(KVzip, KeepMasksGlobalAndLayerwise) {
  // Two layers, two heads, four tokens; n_sink = 1 (position 0 always kept).
  const at::Tensor scores = at::tensor({.9f, .1f, .2f, .3f, /**/ .5f, .6f, .05f, .7f,        // layer 0
                                        .01f, .02f, .8f, .03f, /**/ .4f, .04f, .06f, .07f},  // layer 1
                                       at::kFloat)
                                .view({2, 2, 4});
  // Global, ratio 0.5: int(16 * 0.5) = 8 go, the lowest outside the sinks (.01 is one):
  // .02 .03 .04 .05 .06 .07 .1 .2 -> layer 0 loses 3, layer 1 loses 5.
  const auto global = KVzipPress(0.5, false, 1).keep_masks(scores);
  ASSERT_EQ(global.size(), 2u);
  EXPECT_EQ(to_vector(global[0]), (std::vector<int64_t>{1, 0, 0, 1, 1, 1, 0, 1}));
  EXPECT_EQ(to_vector(global[1]), (std::vector<int64_t>{1, 0, 1, 0, 1, 0, 0, 0}));
  // Layerwise: int(8 * 0.5) = 4 per layer, across its heads (layer 0: .05 .1 .2 .3).
  const auto layerwise = KVzipPress(0.5, true, 1).keep_masks(scores);
  EXPECT_EQ(to_vector(layerwise[0]), (std::vector<int64_t>{1, 0, 0, 0, 1, 1, 0, 1}));
  EXPECT_EQ(to_vector(layerwise[1]), (std::vector<int64_t>{1, 0, 1, 0, 1, 0, 0, 1}));
  // Without sinks the lowest position may go; ratio 0 keeps everything.
  EXPECT_EQ(to_vector(KVzipPress(0.5, true, 0).keep_masks(scores)[1]), (std::vector<int64_t>{0, 0, 1, 0, 1, 0, 1, 1}));
  EXPECT_TRUE(KVzipPress(0.0).keep_masks(scores)[1].all().item<bool>());
  // Equal scores: the higher position (head-major) is evicted first.
  EXPECT_EQ(to_vector(KVzipPress(0.5, true, 0).keep_masks(at::ones({1, 2, 2}))[0]), (std::vector<int64_t>{1, 1, 0, 0}));
}

// float64 reference of KVzip's chunk scores, written from the definition.
at::Tensor reference_chunk_scores(const at::Tensor& q, const at::Tensor& sink, const at::Tensor& chunk,
                                  const at::Tensor& repeat, int64_t first_row, const at::Tensor& row_scale,
                                  const at::Tensor& column_scale) {
  const int64_t hq = q.size(1), hkv = chunk.size(1), g = hq / hkv, rows = q.size(2), s = sink.size(2);
  const int64_t c = chunk.size(2), d = q.size(3);
  at::Tensor out = at::zeros({1, hkv, c}, at::kDouble);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kv = h / g;
    for (int64_t i = 0; i < rows; ++i) {
      const at::Tensor keys =
          at::cat({sink[0][kv], chunk[0][kv], repeat[0][kv].narrow(0, 0, first_row + i + 1)}).to(at::kDouble);
      const at::Tensor w = at::softmax(at::mv(keys, q[0][h][i].to(at::kDouble)) / std::sqrt(double(d)), 0);
      at::Tensor col = w.narrow(0, s, c);
      if (row_scale.defined()) col = col * row_scale[0][i].item<double>() * column_scale[0][kv][h % g].to(at::kDouble);
      out[0][kv] = at::maximum(out[0][kv], col);
    }
  }
  return out;
}

TEST(KVzip, ChunkScoresMatchTheDefinition) {
  at::manual_seed(3);
  const int64_t hq = 4, hkv = 2, d = 8, rows = 5, first_row = 3;
  const at::Tensor q = at::randn({1, hq, rows, d}), sink = at::randn({1, hkv, 2, d});
  const at::Tensor chunk = at::randn({1, hkv, 6, d}), repeat = at::randn({1, hkv, first_row + rows, d});
  const KVzipPress press(0.5);
  const at::Tensor ours = press.chunk_scores(q, sink, chunk, repeat, first_row);
  EXPECT_TRUE(at::allclose(ours.to(at::kDouble), reference_chunk_scores(q, sink, chunk, repeat, first_row, {}, {}),
                           1e-6, 1e-7));
  // Rows in two blocks give the same maximum as one block (to float32 rounding: other matmul shapes).
  const at::Tensor a =
      press.chunk_scores(q.narrow(2, 0, 2), sink, chunk, repeat.narrow(2, 0, first_row + 2), first_row);
  const at::Tensor b = press.chunk_scores(q.narrow(2, 2, 3), sink, chunk, repeat, first_row + 2);
  EXPECT_TRUE(at::allclose(at::maximum(a, b), ours, 1e-6, 1e-7));
  // KVzip+: row and column scales.
  const at::Tensor o_proj = at::randn({12, hq * d});
  const at::Tensor values = at::randn({1, hkv, 6, d});
  const at::Tensor column = KVzipPress::value_output_norms(values, o_proj);
  const at::Tensor row = at::rand({1, rows}) + 0.5;
  EXPECT_TRUE(at::allclose(press.chunk_scores(q, sink, chunk, repeat, first_row, row, column).to(at::kDouble),
                           reference_chunk_scores(q, sink, chunk, repeat, first_row, row, column), 1e-6, 1e-7));
  // ||W_o v|| per query head, directly.
  for (int64_t h = 0; h < hq; ++h) {
    const at::Tensor w = o_proj.narrow(1, h * d, d);                              // [hidden, D]
    const at::Tensor direct = at::matmul(values[0][h / 2], w.t()).norm(2, {-1});  // [c]
    EXPECT_TRUE(at::allclose(column[0][h / 2][h % 2], direct, 1e-5, 1e-5)) << "head " << h;
  }
}

TEST(KVzip, Errors) {
  expect_error([] { KVzipPress(1.0); }, {"KVzipPress: compression_ratio must be in [0, 1), got 1"});
  expect_error([] { KVzipPress(0.5, false, -1); }, {"KVzipPress: n_sink must be >= 0, got -1"});
  expect_error([] { KVzipPress(0.5, false, 4, false, 0); }, {"KVzipPress: chunk_size must be > 0, got 0"});
  const KVzipPress press(0.5);
  kvpress::LayerInputs in;
  in.keys = in.values = at::randn({1, 2, 8, 4});
  expect_error([&] { press.compress(in); },
               {"KVzipPress.compress: KVzip cannot compress one layer on its own", "kvpress::llama::kvzip_prefill"});
  expect_error([&] { press.compress_ragged(in); }, {"KVzipPress.compress_ragged: KVzip cannot compress"});
  expect_error([&] { press.replay_chunks({}, {1}, {2}, {3}); },
               {"KVzipPress.replay_chunks: context_ids must be non-empty, got 0 tokens"});
  expect_error(
      [&] {
        press.replay_chunks({5, 6}, {1}, {2}, {3}, 2);
      },
      {"KVzipPress.replay_chunks: prefix_length must be in [0, 2) (the context's tokens before its text), got 2"});
  const at::Tensor q = at::randn({1, 4, 2, 4}), k = at::randn({1, 2, 3, 4});
  expect_error(
      [&] {
        press.chunk_scores(q, k, k, at::randn({1, 2, 5, 4}), 0);
      },
      {"KVzipPress.chunk_scores: repeat_keys must hold the repeat's keys 0 .. 1 (first_row + rows = 2), "
       "got 5"});
  expect_error(
      [&] {
        press.chunk_scores(q, k, k, at::randn({1, 2, 2, 4}), 0, at::ones({1, 2}));
      },
      {"KVzipPress.chunk_scores: row_scale and column_scale come together (KVzip+), got only row_scale"});
  expect_error(
      [&] {
        press.chunk_scores(at::randn({2, 4, 2, 4}), k, at::randn({2, 2, 3, 4}), k, 0);
      },
      {"KVzipPress.chunk_scores: batch must be 1 (as kvpress), got 2"});
  expect_error(
      [&] {
        press.keep_masks(at::ones({2, 3}));
      },
      {"KVzipPress.keep_masks: scores must be [num_layers, kv_heads, seq_len]"});
  expect_error(
      [&] {
        KVzipPress::value_output_norms(at::randn({1, 2, 3, 4}), at::randn({5, 7}));
      },
      {"KVzipPress.value_output_norms: o_proj must have a multiple of kv_heads * head_dim (8) columns, got "
       "[5, 7]"});

  // The runner's refusals.
  const LlamaModel& model = tiny_model();
  KVCache cache = model.new_cache();
  PrefillOptions opt;
  opt.press = &press;
  expect_error([&] { model.prefill(story_ids(16), cache, opt); },
               {"LlamaModel::prefill: KVzipPress prompts the model with text of its own", "PrefillOptions::tokenizer"});
  EXPECT_EQ(cache.position(), 0);
  expect_error(
      [&] {
        kvpress::llama::kvzip_prefill(model, story_ids(16).repeat({2, 1}), cache, press, tiny_tokenizer());
      },
      {"kvzip_prefill: context_ids must be a non-empty int64 [1, n] tensor (batch 1, as kvpress), got [2, 16]"});
  kvpress::llama::KVzipRunOptions run;
  run.query_chunk = 0;
  expect_error([&] { kvpress::llama::kvzip_prefill(model, story_ids(16), cache, press, tiny_tokenizer(), {}, run); },
               {"kvzip_prefill: query_chunk must be > 0, got 0"});
  kvpress::PagedKVCache paged = model.new_paged_cache(64, 16);
  const kvpress::SequenceId seq = paged.add_sequence();
  kvpress::llama::PagedPrefillOptions popt;
  popt.press = &press;
  expect_error(
      [&] {
        model.prefill_paged({{1, 2, 3}}, {seq}, paged, popt);
      },
      {"KVzipPress runs the model again over the context before compressing (use prefill())"});
}

TEST(KVzip, RunnerKeepsThePlainPrefillsSelectedTokens) {
  const LlamaModel& model = tiny_model();
  const auto& c = model.config();
  const at::Tensor ids = story_ids(30);
  KVCache plain = model.new_cache();
  model.prefill(ids, plain);

  const KVzipPress press(0.6, false, 4, false, 12);  // three replay chunks
  KVCache cache = model.new_cache();
  const auto r = kvpress::llama::kvzip_prefill(model, ids, cache, press, tiny_tokenizer());
  ASSERT_EQ(r.prefill.keep_masks.size(), static_cast<size_t>(c.num_layers));
  int64_t kept = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    ASSERT_TRUE(cache.is_ragged(l));
    const at::Tensor mask = r.prefill.keep_masks[l];
    EXPECT_TRUE(mask.narrow(2, 0, 4).all().item<bool>()) << "the sinks are kept";
    kept += mask.sum().item<int64_t>();
    const auto expected = kvpress::HeadRaggedLayer::from_mask(plain.keys(l), plain.values(l), mask);
    EXPECT_TRUE(at::equal(cache.ragged(l).packed_keys(), expected.packed_keys())) << "layer " << l;
    EXPECT_TRUE(at::equal(cache.ragged(l).packed_values(), expected.packed_values())) << "layer " << l;
  }
  const int64_t total = c.num_layers * c.num_kv_heads * 30;
  EXPECT_EQ(kept, total - static_cast<int64_t>(total * 0.6));
  EXPECT_EQ(cache.position(), 30);

  // Query blocks of 5 rows score as blocks of 128 (float32 noise).
  kvpress::llama::KVzipRunOptions small;
  small.query_chunk = 5;
  KVCache other = model.new_cache();
  const auto r5 = kvpress::llama::kvzip_prefill(model, ids, other, press, tiny_tokenizer(), {}, small);
  EXPECT_LT((r5.scores - r.scores).abs().max().item<double>(), 1e-6);

  // Memory: the scoring pass held one layer's keys/values (context + the longest repeat), never the cache.
  const auto first = tiny_tokenizer().encode(KVzipPress::kFirstRepeatPrompt, false);
  const auto suffix = tiny_tokenizer().encode(KVzipPress::kRepeatSuffix, false);
  const auto next_prompt = tiny_tokenizer().encode(KVzipPress::kNextRepeatPrompt, false);
  const int64_t longest = static_cast<int64_t>(std::max(first.size(), next_prompt.size() + 8) + suffix.size()) + 12;
  const int64_t layer_kv = 2 * c.num_kv_heads * (30 + longest) * c.head_dim * 4;
  EXPECT_GE(r.memory.layer_kv_bytes, layer_kv);
  // + the queries being attended (the context's 30 rows at most)
  EXPECT_LE(r.memory.layer_kv_bytes, layer_kv + c.num_heads * std::max<int64_t>(30, longest) * c.head_dim * 4);
  EXPECT_EQ(r.memory.peak_bytes,
            r.memory.layer_kv_bytes + r.memory.activation_bytes + r.memory.attention_bytes + r.memory.scores_bytes);
  EXPECT_EQ(r.memory.full_cache_bytes, c.num_layers * 2 * c.num_kv_heads * 30 * c.head_dim * 4);

  // LlamaModel::prefill with the tokenizer runs the same; the masked layout keeps the same tokens.
  PrefillOptions opt;
  opt.press = &press;
  opt.tokenizer = &tiny_tokenizer();
  opt.ragged_layout = PrefillOptions::RaggedLayout::kMasked;
  KVCache masked = model.new_cache();
  const auto out = model.prefill(ids, masked, opt);
  for (int64_t l = 0; l < c.num_layers; ++l) EXPECT_TRUE(at::equal(out.keep_masks[l], r.prefill.keep_masks[l]));
  const at::Tensor next = story_ids(32).narrow(1, 30, 2);
  EXPECT_LT((model.forward(next, masked).logits - model.forward(next, cache).logits).abs().max().item<double>(), 1e-4);

  // Ratio 0: the plain prefill (kvpress skips the replay).
  KVCache zero = model.new_cache();
  kvpress::llama::kvzip_prefill(model, ids, zero, KVzipPress(0.0), tiny_tokenizer());
  EXPECT_FALSE(zero.is_ragged(0));
  EXPECT_TRUE(at::equal(zero.keys(1), plain.keys(1)));
}

// ---- RestoreKVPress and LoRA adapters -----------------------------------------------------------

// A seeded adapter on every projection of every layer of `model` (rank 3, scaling 0.7).
kvpress::LoraAdapter random_adapter(const LlamaModel& model, uint64_t seed) {
  const auto& c = model.config();
  const at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim, h = c.hidden_size;
  const std::map<std::string, std::pair<int64_t, int64_t>> in_out = {{"q_proj", {h, q}},
                                                                     {"k_proj", {h, kv}},
                                                                     {"v_proj", {h, kv}},
                                                                     {"o_proj", {q, h}},
                                                                     {"gate_proj", {h, c.intermediate_size}},
                                                                     {"up_proj", {h, c.intermediate_size}},
                                                                     {"down_proj", {c.intermediate_size, h}}};
  kvpress::LoraAdapter adapter;
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (const auto& [module, io] : in_out)
      adapter.add(l, module, {at::randn({3, io.first}, gen) * 0.2, at::randn({io.second, 3}, gen) * 0.2, 0.7});
  return adapter;
}

// One scoring pass serves every ratio (kvpress-cli bench): kvzip_scores are kvzip_prefill's scores,
// and kvzip_compress_captured cuts a captured plain prefill to the same cache kvzip_prefill leaves,
// bit for bit, at ratios the scores were not computed at.
TEST(KVzip, OneScoringPassServesEveryRatio) {
  const LlamaModel& model = tiny_model();
  const auto& c = model.config();
  const at::Tensor ids = story_ids(30);
  const kvpress::llama::CapturedPrefill captured = model.capture_prefill(ids);
  const at::Tensor scores =
      kvpress::llama::kvzip_scores(model, ids, KVzipPress(0.5, false, 4, false, 12), tiny_tokenizer());
  ASSERT_EQ(scores.sizes(), at::IntArrayRef({c.num_layers, c.num_kv_heads, 30}));
  // From the capture's keys/values instead of the context's own path through the layers: the same.
  const at::Tensor from_capture = kvpress::llama::kvzip_scores(model, ids, KVzipPress(0.5, false, 4, false, 12),
                                                               tiny_tokenizer(), nullptr, {}, &captured);
  EXPECT_TRUE(at::equal(from_capture, scores)) << (from_capture - scores).abs().max().item<double>();
  expect_error(
      [&] {
        kvpress::llama::kvzip_scores(model, story_ids(29), KVzipPress(0.5), tiny_tokenizer(), nullptr, {}, &captured);
      },
      {"kvzip_scores: captured holds another prefill than context_ids"});
  const at::Tensor next = story_ids(32).narrow(1, 30, 2);
  for (double ratio : {0.0, 0.25, 0.6, 0.9}) {
    SCOPED_TRACE(ratio);
    const KVzipPress press(ratio, false, 4, false, 12);
    KVCache own = model.new_cache();
    const auto r = kvpress::llama::kvzip_prefill(model, ids, own, press, tiny_tokenizer());
    if (ratio > 0) EXPECT_TRUE(at::equal(r.scores, scores));
    KVCache cut = kvpress::llama::kvzip_compress_captured(model, captured, press, scores);
    EXPECT_EQ(cut.position(), own.position());
    for (int64_t l = 0; l < c.num_layers; ++l) {
      ASSERT_EQ(cut.is_ragged(l), own.is_ragged(l)) << "layer " << l;
      if (own.is_ragged(l)) {
        EXPECT_TRUE(at::equal(cut.ragged(l).packed_keys(), own.ragged(l).packed_keys())) << "layer " << l;
        EXPECT_TRUE(at::equal(cut.ragged(l).packed_values(), own.ragged(l).packed_values())) << "layer " << l;
        EXPECT_TRUE(at::equal(cut.ragged(l).packed_positions(), own.ragged(l).packed_positions())) << "layer " << l;
      } else {
        EXPECT_TRUE(at::equal(cut.keys(l), own.keys(l))) << "layer " << l;
        EXPECT_TRUE(at::equal(cut.values(l), own.values(l))) << "layer " << l;
      }
    }
    EXPECT_TRUE(at::equal(model.forward(next, cut).logits, model.forward(next, own).logits));
  }
  // Only a plain KVzipPress, and scores of the captured context's shape.
  expect_error([&] { kvpress::llama::kvzip_scores(model, ids, RestoreKVPress(0.5), tiny_tokenizer()); },
               {"kvzip_scores: RestoreKVPress adds to KVzip's passes"});
  expect_error([&] { kvpress::llama::kvzip_scores(model, ids, kvpress::KVgradPress(0.5), tiny_tokenizer()); },
               {"kvzip_scores: KVgradPress adds to KVzip's passes"});
  expect_error(
      [&] { kvpress::llama::kvzip_compress_captured(model, captured, KVzipPress(0.5), scores.narrow(2, 0, 29)); },
      {"kvzip_compress_captured: scores must be [2, 4, 30]", "got [2, 4, 29]"});
}

// The pipeline over a captured prefill with KVzip's scores answers as KVzipPress's own prefill does.
TEST(KVzip, PipelineAnswersFromTheScoredCapture) {
  const LlamaModel& model = tiny_model();
  const kvpress::llama::Tokenizer& tok = tiny_tokenizer();
  const std::string context =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her red "
      "ball. One day, she saw a big dog. The dog was sad because it lost its bone.";
  kvpress::llama::PipelineOptions plain;
  plain.max_new_tokens = 8;
  const std::vector<int64_t> ids = kvpress::llama::context_prefill_ids(model, tok, context, plain);
  const at::Tensor batch = at::tensor(ids).unsqueeze(0);
  kvpress::llama::ForwardOptions last;
  last.last_logits_only = true;
  const kvpress::llama::CapturedPrefill captured = model.capture_prefill(batch, last);
  const at::Tensor scores = kvpress::llama::kvzip_scores(model, batch, KVzipPress(0.5), tok);
  for (double ratio : {0.25, 0.75}) {
    SCOPED_TRACE(ratio);
    const KVzipPress press(ratio);
    kvpress::llama::PipelineOptions opt = plain;
    opt.press = &press;
    const auto own = kvpress::llama::answer_questions(model, tok, context, {"Who is sad?"}, opt).at(0);
    opt.captured = &captured;
    opt.kvzip_scores = &scores;
    const auto shared = kvpress::llama::answer_questions(model, tok, context, {"Who is sad?"}, opt).at(0);
    EXPECT_EQ(shared.tokens, own.tokens);
    EXPECT_EQ(shared.cache_lengths, own.cache_lengths);
    EXPECT_EQ(shared.kept_fraction, own.kept_fraction);
    EXPECT_LT(own.kept_fraction, 1.0);
  }
  const auto knorm = kvpress::make_press("KnormPress", 0.5);
  kvpress::llama::PipelineOptions opt = plain;
  opt.press = knorm.get();
  opt.kvzip_scores = &scores;
  expect_error([&] { kvpress::llama::answer_questions(model, tok, context, {"Q?"}, opt); },
               {"answer_questions: options.kvzip_scores compress options.captured, which is not given"});
  opt.captured = &captured;
  expect_error([&] { kvpress::llama::answer_questions(model, tok, context, {"Q?"}, opt); },
               {"answer_questions: options.kvzip_scores are for a KVzipPress, got KnormPress"});
}

TEST(Lora, LinearAddsTheScaledLowRankUpdate) {
  const at::Tensor x = at::randn({2, 5, 6}), w = at::randn({4, 6});
  const kvpress::LoraLinear u{at::randn({3, 6}), at::randn({4, 3}), 0.25};
  const at::Tensor expected = at::matmul(x.to(at::kDouble), (w + 0.25 * at::matmul(u.b, u.a)).to(at::kDouble).t());
  EXPECT_LT((kvpress::lora_linear(x, w, &u).to(at::kDouble) - expected).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(at::equal(kvpress::lora_linear(x, w, nullptr), at::linear(x, w)));
  kvpress::LoraAdapter a;
  expect_error([&] { a.add(0, "lm_head", u); }, {"LoraAdapter.add: module must be one of", "got 'lm_head'"});
  expect_error([&] { a.add(-1, "q_proj", u); }, {"LoraAdapter.add: layer must be >= 0, got -1"});
  expect_error(
      [&] {
        a.add(0, "q_proj", {u.a, at::randn({4, 2}), 1.0});
      },
      {"LoraAdapter.add: layer 0 q_proj: A must be [r, in] and B [out, r] with r > 0, got [3, 6] and [4, 2]"});
  a.add(1, "v_proj", u);
  ASSERT_NE(a.find(1, "v_proj"), nullptr);
  EXPECT_EQ(a.find(0, "v_proj"), nullptr);
  // The model checks an adapter against its weights.
  expect_error([&] { tiny_model().check_adapter(a, "op"); },
               {"op: the LoRA adapter's layer 1 v_proj needs A [r, ", "got A [3, 6] and B [4, 3]"});
  kvpress::LoraAdapter far;
  far.add(7, "q_proj", u);
  expect_error([&] { tiny_model().check_adapter(far, "op"); }, {"op: the LoRA adapter targets layer 7 (q_proj)"});
}

// A PEFT adapter folder written here: config + weights, for the refusals.
std::string write_peft(const std::string& name, const std::string& config,
                       const std::map<std::string, at::Tensor>& tensors) {
  const std::string dir = ::testing::TempDir() + "/kvzip_peft_" + name;
  std::remove((dir + "/adapter_config.json").c_str());
  EXPECT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
  FILE* f = std::fopen((dir + "/adapter_config.json").c_str(), "w");
  std::fputs(config.c_str(), f);
  std::fclose(f);
  kvpress::io::save_safetensors(dir + "/adapter_model.safetensors", tensors);
  return dir;
}

TEST(Lora, ReadsPeftAdaptersAndRefusesWhatItCannotApply) {
  const std::string prefix = "base_model.model.model.layers.1.self_attn.k_proj.";
  const std::map<std::string, at::Tensor> ab = {{prefix + "lora_A.weight", at::ones({4, 6})},
                                                {prefix + "lora_B.weight", at::ones({5, 4})}};
  const std::string ok = R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": false, "bias": "none",
                              "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": null})";
  const auto a = kvpress::LoraAdapter::load_peft(write_peft("ok", ok, ab));
  ASSERT_NE(a.find(1, "k_proj"), nullptr);
  EXPECT_DOUBLE_EQ(a.find(1, "k_proj")->scaling, 2.0);
  EXPECT_EQ(a.modules().size(), 1u);
  const auto rs = kvpress::LoraAdapter::load_peft(
      write_peft("rslora", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": true})", ab));
  EXPECT_DOUBLE_EQ(rs.find(1, "k_proj")->scaling, 4.0);  // alpha / sqrt(r)

  const auto refused = [&](const std::string& name, const std::string& config,
                           const std::map<std::string, at::Tensor>& tensors, const std::string& message) {
    SCOPED_TRACE(name);
    const std::string dir = write_peft(name, config, tensors);
    expect_error([&] { kvpress::LoraAdapter::load_peft(dir); }, {"LoraAdapter: " + dir, message});
  };
  refused("dora", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": true})", ab,
          "adapter_config.json: use_dora is not supported (got true)");
  refused("ia3", R"({"peft_type": "IA3", "r": 4, "lora_alpha": 8})", ab, "peft_type must be \"LORA\", got \"IA3\"");
  refused("no_r", R"({"peft_type": "LORA", "lora_alpha": 8})", ab, "r must be a positive integer");
  refused("bias", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "all"})", ab, "bias must be \"none\"");
  refused("alpha_pattern", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": 2}})", ab,
          "alpha_pattern is not supported");
  refused("not_json", "{r: 4", ab, "adapter_config.json: not valid JSON");
  refused("embedding", ok, {{"base_model.model.model.embed_tokens.lora_embedding_A", at::ones({4, 6})}},
          "adapter_model.safetensors: unsupported tensor 'base_model.model.model.embed_tokens.lora_embedding_A'");
  refused("half", ok, {{prefix + "lora_A.weight", at::ones({4, 6})}},
          "adapter_model.safetensors: layers.1 k_proj has lora_A but no lora_B");
  refused("chain", ok, {{prefix + "lora_A.weight", at::ones({4, 6})}, {prefix + "lora_B.weight", at::ones({5, 3})}},
          "A must be [r, in] and B [out, r] with r > 0, got [4, 6] and [5, 3]");
  expect_error([] { kvpress::LoraAdapter::load_peft("/nonexistent"); },
               {"LoraAdapter: /nonexistent/adapter_config.json: cannot open the file"});
}

TEST(RestoreKV, RestoreTokensAreThePlainRunnersWithTheLoraMerged) {
  const LlamaModel& model = tiny_model();
  const auto& c = model.config();
  const int64_t n = 30, n_restore = 5;
  const at::Tensor ids = story_ids(n);
  // Restore embeddings that are token embeddings, so the plain runner can forward them as tokens.
  const at::Tensor restore_ids = at::tensor(std::vector<int64_t>{7, 300, 12, 45, 1000}, at::kLong).unsqueeze(0);
  RestoreKVPress::Restore artifacts;
  artifacts.embeddings = model.embed(restore_ids)[0];
  artifacts.adapter = random_adapter(model, 5);
  const RestoreKVPress press(0.5, false, 4, false, 12, artifacts);  // three replay chunks
  EXPECT_EQ(press.num_restore_tokens(), n_restore);
  EXPECT_DOUBLE_EQ(press.eviction_ratio(n), 0.5 + 5.0 / 30.0);
  EXPECT_DOUBLE_EQ(press.eviction_ratio(6), 1.0);
  KVCache cache = model.new_cache();
  const auto r = kvpress::llama::kvzip_prefill(model, ids, cache, press, tiny_tokenizer());

  // Reference: the context's plain prefill, then the restore tokens forwarded as tokens by a model
  // whose projections hold W + scaling * B A.
  auto weights =
      kvpress::io::load_safetensors(kvpress::llama::resolve_model_dir("tinystories-656k") + "/model.safetensors")
          .tensors;
  for (const auto& [key, u] : artifacts.adapter.modules()) {
    const std::string part =
        key.second == "gate_proj" || key.second == "up_proj" || key.second == "down_proj" ? "mlp" : "self_attn";
    at::Tensor& w = weights.at("model.layers." + std::to_string(key.first) + "." + part + "." + key.second + ".weight");
    w = w.to(at::kFloat) + u.scaling * at::matmul(u.b, u.a);
  }
  const LlamaModel merged(c, weights);
  KVCache full = model.new_cache();
  model.prefill(ids, full);
  merged.forward(restore_ids, full);
  const at::Tensor ref_keys = at::cat(
      [&] {
        std::vector<at::Tensor> k;
        for (int64_t l = 0; l < c.num_layers; ++l) k.push_back(full.keys(l).narrow(2, n, n_restore));
        return k;
      }(),
      0);
  ASSERT_EQ(r.restore_keys.sizes(), ref_keys.sizes());
  EXPECT_LT((r.restore_keys - ref_keys).abs().max().item<double>(), 1e-5);

  // The cache: each head's kept context tokens, then the restore tokens; the budget matched.
  KVCache plain = model.new_cache();
  model.prefill(ids, plain);
  int64_t kept = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    ASSERT_TRUE(cache.is_ragged(l));
    const at::Tensor mask = r.prefill.keep_masks[l];
    kept += mask.sum().item<int64_t>();
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      const at::Tensor head_keys = cache.ragged(l).keys(0, h);  // [len, D]
      const int64_t k = mask[0][h].sum().item<int64_t>();
      ASSERT_EQ(head_keys.size(0), k + n_restore);
      EXPECT_TRUE(at::equal(head_keys.narrow(0, 0, k), plain.keys(l)[0][h].index({mask[0][h]})));
      EXPECT_TRUE(at::equal(head_keys.narrow(0, k, n_restore), r.restore_keys[l][h]));
    }
  }
  const int64_t total = c.num_layers * c.num_kv_heads * n;
  EXPECT_EQ(kept, total - static_cast<int64_t>(total * (0.5 + 5.0 / 30.0)));
  EXPECT_EQ(cache.position(), n + n_restore);

  // Memory: the scoring pass is KVzip's plus the restore tokens' stream and keys/values (one layer's
  // buffers as KVzip's: the longest repeat is longer than the 5 restore tokens).
  KVCache kvzip_cache = model.new_cache();
  const auto kvzip =
      kvpress::llama::kvzip_prefill(model, ids, kvzip_cache, KVzipPress(0.5, false, 4, false, 12), tiny_tokenizer());
  EXPECT_EQ(r.memory.layer_kv_bytes, kvzip.memory.layer_kv_bytes);
  EXPECT_GT(r.memory.activation_bytes, kvzip.memory.activation_bytes);
  const int64_t restore_bytes = (c.num_layers * 2 * c.num_kv_heads * c.head_dim + c.hidden_size) * n_restore * 4;
  EXPECT_LE(r.memory.activation_bytes, kvzip.memory.activation_bytes + restore_bytes);
  EXPECT_EQ(r.memory.full_cache_bytes, kvzip.memory.full_cache_bytes);

  // LlamaModel::prefill runs the same, in either layout; the next tokens see the same cache.
  PrefillOptions opt;
  opt.press = &press;
  opt.tokenizer = &tiny_tokenizer();
  opt.ragged_layout = PrefillOptions::RaggedLayout::kMasked;
  KVCache masked = model.new_cache();
  model.prefill(ids, masked, opt);
  EXPECT_EQ(masked.position(), n + n_restore);
  EXPECT_EQ(masked.length(0), n + n_restore);
  const at::Tensor next = story_ids(32).narrow(1, 30, 2);
  EXPECT_LT((model.forward(next, masked).logits - model.forward(next, cache).logits).abs().max().item<double>(), 1e-4);

  // Ratio 0: the plain prefill, no restore tokens (kvpress skips both).
  KVCache zero = model.new_cache();
  kvpress::llama::kvzip_prefill(model, ids, zero, RestoreKVPress(0.0, false, 4, false, 12, artifacts),
                                tiny_tokenizer());
  EXPECT_EQ(zero.position(), n);
  EXPECT_EQ(zero.length(0), n);
}

TEST(RestoreKV, Errors) {
  const LlamaModel& model = tiny_model();
  const at::Tensor ids = story_ids(20);
  KVCache cache = model.new_cache();
  expect_error([&] { kvpress::llama::kvzip_prefill(model, ids, cache, RestoreKVPress(0.5), tiny_tokenizer()); },
               {"RestoreKVPress: no restore artifacts: give restore=DIR", "higokri/RestoreKV-<model>"});
  expect_error([&] { RestoreKVPress(0.5, false, 4, true).restore(); }, {"higokri/RestoreKV-<model>_plus"});
  RestoreKVPress::Restore wrong;
  wrong.embeddings = at::randn({3, model.config().hidden_size + 1});
  expect_error(
      [&] {
        kvpress::llama::kvzip_prefill(model, ids, cache, RestoreKVPress(0.5, false, 4, false, 2048, wrong),
                                      tiny_tokenizer());
      },
      {"kvzip_prefill: the restore embeddings are [3, "});
  EXPECT_EQ(cache.position(), 0);
  wrong.embeddings = at::randn({3});
  expect_error([&] { RestoreKVPress(0.5, false, 4, false, 2048, wrong); },
               {"RestoreKVPress: restore embeddings must be a non-empty floating [n, hidden] tensor, got [3]"});
  wrong.embeddings = at::full({2, 4}, NAN);
  expect_error([&] { RestoreKVPress(0.5, false, 4, false, 2048, wrong); },
               {"RestoreKVPress: restore embeddings must be finite"});
  expect_error([] { RestoreKVPress::load_restore("/nonexistent"); }, {"/nonexistent/restore_embeddings.safetensors"});
  // Budget matching can evict every context token: the selection allows ratio 1 (and no more).
  const auto masks = kvpress::kvzip_evict_lowest(at::rand({2, 2, 5}), 1.0, false, "op");
  for (const auto& m : masks) EXPECT_FALSE(m.any().item<bool>());
  expect_error(
      [] {
        kvpress::kvzip_evict_lowest(at::rand({2, 2, 5}), 1.5, false, "op");
      },
      {"op: compression_ratio must be in [0, 1], got 1.5"});
}

TEST(KVgrad, RunsThroughThePrefillAndUnderInferenceMode) {
  const LlamaModel& model = tiny_model();
  const kvpress::KVgradPress press(0.5, false, 4, 12);
  EXPECT_EQ(press.name(), "KVgradPress");
  EXPECT_EQ(press.chunk_size(), 12);
  EXPECT_FALSE(press.kvzip_plus_normalization());
  const at::Tensor ids = story_ids(30);
  KVCache direct = model.new_cache();
  const auto r = kvpress::llama::kvgrad_prefill(model, ids, direct, press, tiny_tokenizer());
  // Scores differ from KVzip's (the gradient and value norms weigh them) but select as many tokens.
  KVCache zip = model.new_cache();
  const auto z = kvpress::llama::kvzip_prefill(model, ids, zip, KVzipPress(0.5, false, 4, false, 12), tiny_tokenizer());
  EXPECT_FALSE(at::allclose(r.scores, z.scores));
  // LlamaModel::prefill dispatches to it; eval's score_continuation runs under InferenceMode.
  PrefillOptions opt;
  opt.press = &press;
  opt.tokenizer = &tiny_tokenizer();
  KVCache via = model.new_cache();
  const auto out = model.prefill(ids, via, opt);
  for (size_t l = 0; l < out.keep_masks.size(); ++l) EXPECT_TRUE(at::equal(out.keep_masks[l], r.prefill.keep_masks[l]));
  const auto story = tiny_tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play "
      "outside in the park with her red ball.");
  const auto scored = kvpress::llama::score_continuation(model, story, 8, &press, &tiny_tokenizer());
  EXPECT_TRUE(std::isfinite(scored.mean_nll));

  // recompute_context: the same scores and kept tokens, one layer's context keys/values at a time
  // (120 tokens in 40-token chunks: three replay passes, each shorter than the context).
  at::manual_seed(11);
  const at::Tensor context = at::randint(3, 2048, {1, 120}, at::kLong);
  const kvpress::KVgradPress chunked(0.5, false, 4, 40);
  KVCache held = model.new_cache(), recomputed = model.new_cache();
  const auto full = kvpress::llama::kvgrad_prefill(model, context, held, chunked, tiny_tokenizer());
  kvpress::llama::KVgradRunOptions low;
  low.recompute_context = true;
  const auto lean = kvpress::llama::kvgrad_prefill(model, context, recomputed, chunked, tiny_tokenizer(), {}, low);
  EXPECT_LT(((lean.scores - full.scores).abs().max() / full.scores.abs().max()).item<double>(), 1e-5);
  for (size_t l = 0; l < full.prefill.keep_masks.size(); ++l)
    EXPECT_TRUE(at::equal(lean.prefill.keep_masks[l], full.prefill.keep_masks[l])) << "layer " << l;
  // Its peak holds one layer's keys/values (the context's joined with the longest repeat's): less
  // than the full cache.
  const auto& c = model.config();
  int64_t longest = 0;
  for (const auto& chunk : chunked.replay_chunks(
           std::vector<int64_t>(context.data_ptr<int64_t>(), context.data_ptr<int64_t>() + context.numel()),
           tiny_tokenizer().encode(KVzipPress::kFirstRepeatPrompt, false),
           tiny_tokenizer().encode(KVzipPress::kNextRepeatPrompt, false),
           tiny_tokenizer().encode(KVzipPress::kRepeatSuffix, false)))
    longest = std::max<int64_t>(longest, static_cast<int64_t>(chunk.repeat_ids.size()));
  const int64_t element = 4, layer = 2 * c.num_kv_heads * c.head_dim * element;
  EXPECT_EQ(lean.memory.layer_kv_bytes, layer * (120 + longest));
  EXPECT_LT(lean.memory.layer_kv_bytes, lean.memory.full_cache_bytes);
  EXPECT_EQ(lean.memory.peak_bytes, lean.memory.layer_kv_bytes + lean.memory.activation_bytes +
                                        lean.memory.attention_bytes + lean.memory.scores_bytes);
}

// ---- FastKVzipPress ----------------------------------------------------------------------------------

kvpress::FastKVzipPress::Gates random_gates(int64_t layers, int64_t hkv, int64_t groups, int64_t hidden, int64_t sink,
                                            uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t o = 16;
  return {at::randn({layers, hkv * groups * o, hidden}, gen),
          at::randn({layers, hkv * groups * o}, gen),
          at::randn({layers, hkv * o, hidden}, gen),
          at::rand({layers, o}, gen) + 0.5,
          at::rand({layers, o}, gen) + 0.5,
          at::randn({layers, hkv, sink, o}, gen),
          at::randn({layers, hkv, groups}, gen)};
}

// The gate of layer l on h [S, hidden], from its definition, in float64: [Hkv, S].
at::Tensor reference_gate(const kvpress::FastKVzipPress::Gates& g, int64_t l, const at::Tensor& h) {
  const int64_t hkv = g.k_base.size(1), sink = g.k_base.size(2), groups = g.b.size(2), o = 16, s = h.size(0);
  const auto norm = [](const at::Tensor& x, const at::Tensor& w) {
    return w * x / at::sqrt(x.pow(2).mean(-1, true) + 1e-6);
  };
  const at::Tensor hd = h.to(at::kDouble);
  const at::Tensor q = norm(
      at::linear(hd, g.q_proj_weight[l].to(at::kDouble), g.q_proj_bias[l].to(at::kDouble)).view({s, hkv, groups, o}),
      g.q_norm[l].to(at::kDouble));
  const at::Tensor k =
      norm(at::linear(hd, g.k_proj_weight[l].to(at::kDouble)).view({s, hkv, o}), g.k_norm[l].to(at::kDouble));
  at::Tensor out = at::zeros({hkv, s}, at::kDouble);
  for (int64_t h_ = 0; h_ < hkv; ++h_)
    for (int64_t t = 0; t < s; ++t) {
      double sum = 0;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const at::Tensor qg = q[t][h_][gi];
        const double logit = (k[t][h_] * qg).sum().item<double>() / 4 + g.b[l][h_][gi].item<double>();
        double denominator = 1;
        for (int64_t j = 0; j < sink; ++j)
          denominator += std::exp((g.k_base[l][h_][j].to(at::kDouble) * qg).sum().item<double>() / 4 - logit);
        sum += 1 / denominator;
      }
      out[h_][t] = sum / static_cast<double>(groups);
    }
  return out;
}

TEST(FastKVzip, GateScoresMatchTheDefinition) {
  const auto gates = random_gates(2, 2, 2, 8, 3, 11);
  const kvpress::FastKVzipPress press(0.5, false, 2, 4096, 0.1, gates);
  kvpress::LayerInputs in;
  in.keys = in.values = at::randn({1, 2, 40, 4});
  in.hidden_states = at::randn({1, 40, 8});
  in.layer_idx = 1;
  const at::Tensor ours = press.layer_scores(in)[0];
  at::Tensor ref = reference_gate(gates, 1, in.hidden_states[0]);
  ref.narrow(1, 0, 2).fill_(1.0);   // n_sink
  ref.narrow(1, 36, 4).fill_(1.0);  // int(40 * 0.1) trailing positions
  EXPECT_TRUE(at::allclose(ours.to(at::kDouble), ref, 1e-5, 1e-6)) << (ours - ref).abs().max();
  // Blocks of 4096 positions give the scores of one pass; from 32000 positions on the window is window_size.
  const kvpress::FastKVzipPress long_press(0.5, false, 0, 7, 0.5, gates);
  in.keys = in.values = at::zeros({1, 2, 32000, 4});
  in.hidden_states = at::randn({1, 32000, 8});
  const at::Tensor long_scores = long_press.layer_scores(in)[0];
  EXPECT_TRUE(long_scores.narrow(1, 32000 - 7, 7).eq(1).all().item<bool>());
  EXPECT_TRUE(long_scores.narrow(1, 0, 32000 - 7).lt(1).all().item<bool>());
  for (int64_t t0 : {4090, 8190}) {
    const at::Tensor part = reference_gate(gates, 1, in.hidden_states[0].narrow(0, t0, 10));
    EXPECT_TRUE(at::allclose(long_scores.narrow(1, t0, 10).to(at::kDouble), part, 1e-5, 1e-6)) << t0;
  }
}

TEST(FastKVzip, LayerwiseCompressesOneLayerGlobalRefuses) {
  const auto gates = random_gates(2, 2, 2, 8, 3, 12);
  kvpress::LayerInputs in;
  in.keys = in.values = at::randn({1, 2, 50, 4});
  in.hidden_states = at::randn({1, 50, 8});
  in.layer_idx = 0;
  const kvpress::FastKVzipPress layerwise(0.6, true, 4, 4096, 0.02, gates);
  EXPECT_FALSE(layerwise.needs_second_pass());
  const at::Tensor mask = layerwise.keep_mask(in);
  EXPECT_EQ(mask.sum().item<int64_t>(), 100 - static_cast<int64_t>(100 * 0.6));
  EXPECT_TRUE(at::equal(mask, layerwise.keep_masks(layerwise.layer_scores(in)[0].unsqueeze(0))[0]));
  EXPECT_TRUE(mask.narrow(2, 0, 4).all().item<bool>());   // sinks
  EXPECT_TRUE(mask.narrow(2, 49, 1).all().item<bool>());  // the window: max(1, int(50 * 0.02))
  const auto ragged = layerwise.compress_ragged(in);
  EXPECT_EQ(ragged.keep_mask.sum().item<int64_t>(), mask.sum().item<int64_t>());
  const kvpress::FastKVzipPress global(0.6, false, 4, 4096, 0.02, gates);
  EXPECT_TRUE(global.needs_second_pass());
  expect_error([&] { global.keep_mask(in); },
               {"FastKVzipPress.keep_mask: with layerwise=false the selection is global", "second pass"});
  expect_error([&] { kvpress::FastKVzipPress(0.5).layer_scores(in); },
               {"FastKVzipPress.layer_scores: no gates: give gates=FILE"});
  expect_error([] { kvpress::FastKVzipPress(0.5, false, 4, 0); }, {"FastKVzipPress: window_size must be > 0, got 0"});
  expect_error([] { kvpress::FastKVzipPress(0.5, false, 4, 8, 1.5); },
               {"FastKVzipPress: window_ratio must be in [0, 1], got 1.5"});
  auto bad = gates;
  bad.b = at::zeros({2, 3, 2});
  expect_error([&] { kvpress::FastKVzipPress(0.5, false, 4, 8, 0.1, bad); }, {"FastKVzipPress: gate shapes disagree"});
  in.hidden_states = at::randn({1, 50, 9});
  expect_error([&] { layerwise.layer_scores(in); },
               {"FastKVzipPress.layer_scores: the gates take hidden size 8, hidden_states have 9"});
}

TEST(FastKVzip, LoadsTheAuthorsLayoutAndRefusesOthers) {
  const auto gates = random_gates(2, 2, 2, 8, 3, 13);
  std::map<std::string, at::Tensor> file;
  for (int64_t l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    file[p + "q_proj.weight"] = gates.q_proj_weight[l];
    file[p + "q_proj.bias"] = gates.q_proj_bias[l];
    file[p + "k_proj.weight"] = gates.k_proj_weight[l];
    file[p + "q_norm.weight"] = gates.q_norm[l];
    file[p + "k_norm.weight"] = gates.k_norm[l];
    file[p + "k_base"] = gates.k_base[l].unsqueeze(1);  // [Hkv, 1, sink, 16], as the authors save it
    file[p + "b"] = gates.b[l].unsqueeze(1);            // [Hkv, 1, G]
  }
  const std::string path = ::testing::TempDir() + "kvpress_fastkvzip_gates.safetensors";
  kvpress::io::save_safetensors(path, file);
  const auto loaded = kvpress::FastKVzipPress::load_gates(path);
  EXPECT_TRUE(at::equal(loaded.k_base, gates.k_base));
  EXPECT_TRUE(at::equal(loaded.b, gates.b));
  EXPECT_TRUE(at::equal(loaded.q_proj_weight, gates.q_proj_weight));
  const auto built = kvpress::make_press("FastKVzipPress", 0.5, {{"gates", path}, {"layerwise", "true"}});
  EXPECT_FALSE(built->needs_second_pass());
  file.erase("layers.1.k_base");
  kvpress::io::save_safetensors(path, file);
  expect_error([&] { kvpress::FastKVzipPress::load_gates(path); }, {"layers.1.k_base"});
  std::remove(path.c_str());
}

TEST(FastKVzip, RunnerKeepsThePlainPrefillsSelectedTokens) {
  const LlamaModel& model = tiny_model();
  const auto& c = model.config();
  const auto gates = random_gates(c.num_layers, c.num_kv_heads, c.num_heads / c.num_kv_heads, c.hidden_size, 16, 14);
  const kvpress::FastKVzipPress press(0.5, false, 4, 4096, 0.02, gates);
  const at::Tensor ids = story_ids(30);
  KVCache plain = model.new_cache();
  model.prefill(ids, plain);
  KVCache cache = model.new_cache();
  const auto r = kvpress::llama::fast_kvzip_prefill(model, ids, cache, press);
  int64_t kept = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const at::Tensor mask = r.prefill.keep_masks[l];
    kept += mask.sum().item<int64_t>();
    const auto expected = kvpress::HeadRaggedLayer::from_mask(plain.keys(l), plain.values(l), mask);
    EXPECT_TRUE(at::equal(cache.ragged(l).packed_keys(), expected.packed_keys())) << "layer " << l;
  }
  const int64_t total = c.num_layers * c.num_kv_heads * 30;
  EXPECT_EQ(kept, total - static_cast<int64_t>(total * 0.5));
  // The scores are the gates' on each layer's attention input (the plain prefill's, seen by a press).
  PrefillOptions seen;
  std::vector<at::Tensor> expected_scores;
  seen.on_compress = [&](const kvpress::LayerInputs& in, const kvpress::KV&) {
    expected_scores.push_back(press.layer_scores(in)[0]);
  };
  const kvpress::KnormPress observer(0.0);
  seen.press = &observer;
  KVCache observed = model.new_cache();
  model.prefill(ids, observed, seen);
  ASSERT_EQ(expected_scores.size(), static_cast<size_t>(c.num_layers));
  EXPECT_LT((r.scores - at::stack(expected_scores)).abs().max().item<double>(), 1e-5);
  // Only one layer's keys/values existed during the scoring pass.
  EXPECT_LE(r.memory.layer_kv_bytes, 2 * c.num_kv_heads * 30 * c.head_dim * 4 + c.num_heads * 30 * c.head_dim * 4);
  // LlamaModel::prefill dispatches to it.
  PrefillOptions opt;
  opt.press = &press;
  KVCache via_prefill = model.new_cache();
  const auto out = model.prefill(ids, via_prefill, opt);
  for (int64_t l = 0; l < c.num_layers; ++l) EXPECT_TRUE(at::equal(out.keep_masks[l], r.prefill.keep_masks[l]));
}

// ---- parity with kvpress 0.5.5 ----------------------------------------------------------------------

const kvpress::testing::FolderFixtures& kvzip_fixtures() {
  static const auto f = kvpress::testing::load_folder_fixtures("kvzip", "make_kvzip_fixtures.py");
  return f;
}

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = kvzip_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, path);
}

std::map<std::string, std::string>& parity_summary() {
  static std::map<std::string, std::string> s;
  return s;
}
class KVzipSummary : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [name, line] : parity_summary())
      std::cout << "[ kvzip ] " << std::left << std::setw(28) << name << line << "\n";
  }
};
[[maybe_unused]] ::testing::Environment* const kSummary = ::testing::AddGlobalTestEnvironment(new KVzipSummary);

// Keeps, in every layer, the tokens a reference selection kept ([L, Hkv, N] bool).
class ReplayedMasks : public kvpress::BasePress {
 public:
  explicit ReplayedMasks(at::Tensor masks) : masks_(std::move(masks)) {}
  std::string name() const override { return "ReplayedMasks"; }
  double compression_ratio() const override { return 0.0; }
  bool head_ragged() const override { return true; }
  kvpress::KV compress(const kvpress::LayerInputs&) const override { refuse_uniform_compress(); }
  at::Tensor keep_mask(const kvpress::LayerInputs& in) const override { return masks_[in.layer_idx].unsqueeze(0); }

 private:
  at::Tensor masks_;
};

TEST(KVzipParity, MatchesKvpress) {
  const auto& fx = kvzip_fixtures();
  ASSERT_TRUE(fx.error.empty()) << fx.error;
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5");
  const LlamaModel& model = tiny_model();
  const at::Tensor context = fixture(fx.manifest.at("inputs").get<std::string>(), "context_ids");
  const int64_t n = context.size(1), num_layers = model.config().num_layers;
  ASSERT_EQ(n, fx.manifest.at("context_len").get<int64_t>());
  ASSERT_GE(fx.manifest.at("runs").size(), 19u);

  for (const auto& jr : fx.manifest.at("runs")) {
    const std::string name = jr.at("name").get<std::string>(), file = jr.at("file").get<std::string>();
    const std::string press_name = jr.at("press").get<std::string>();
    SCOPED_TRACE(name);
    const auto press =
        kvpress::make_press(press_name, jr.at("compression_ratio").get<double>(),
                            kvpress::testing::with_artifact_paths(
                                press_name, jr.at("params").get<std::map<std::string, std::string>>(), fx.dir));
    KVCache cache = model.new_cache();
    const auto* fast = dynamic_cast<const kvpress::FastKVzipPress*>(press.get());
    const auto* restore = dynamic_cast<const RestoreKVPress*>(press.get());
    // kvzip_prefill runs KVzipPress, RestoreKVPress and (handing it on) KVgradPress.
    const auto r = fast ? kvpress::llama::fast_kvzip_prefill(model, context, cache, *fast)
                        : kvpress::llama::kvzip_prefill(model, context, cache, dynamic_cast<const KVzipPress&>(*press),
                                                        tiny_tokenizer());
    if (dynamic_cast<const kvpress::KVgradPress*>(press.get())) {  // the recomputing mode scores alike
      KVCache lean_cache = model.new_cache();
      kvpress::llama::KVgradRunOptions low;
      low.recompute_context = true;
      const auto lean = kvpress::llama::kvgrad_prefill(
          model, context, lean_cache, dynamic_cast<const kvpress::KVgradPress&>(*press), tiny_tokenizer(), {}, low);
      EXPECT_LT(((lean.scores - r.scores).abs().max() / r.scores.abs().max()).item<double>(), 1e-5);
      for (int64_t l = 0; l < num_layers; ++l)
        EXPECT_TRUE(at::equal(lean.prefill.keep_masks[l], r.prefill.keep_masks[l])) << "layer " << l;
    }
    double restore_diff = 0;
    if (restore) {  // the restore tokens' keys/values after the LoRA-adapted pass over the full cache
      const at::Tensor ref_keys = fixture(file, "restore_keys"), ref_values = fixture(file, "restore_values");
      ASSERT_EQ(r.restore_keys.sizes(), ref_keys.sizes());
      restore_diff = std::max((r.restore_keys - ref_keys).abs().max().item<double>(),
                              (r.restore_values - ref_values).abs().max().item<double>());
      EXPECT_LT(restore_diff, 1e-4);
      EXPECT_EQ(cache.position(), n + restore->num_restore_tokens());
    }
    if (fast && fast->layerwise()) {
      // Layerwise, the ordinary prefill compresses layer by layer from LayerInputs: the same tokens.
      KVCache direct = model.new_cache();
      PrefillOptions opt;
      opt.press = fast;
      const auto out = model.prefill(context, direct, opt);
      for (int64_t l = 0; l < num_layers; ++l)
        EXPECT_TRUE(at::equal(out.keep_masks[l], r.prefill.keep_masks[l])) << "layer " << l;
    }

    // 1. Scores within float32 noise (our replay runs layer by layer in query blocks; kvpress runs
    // whole forwards).
    const at::Tensor ref_scores = fixture(file, "scores"), ref_mask = fixture(file, "keep_mask");
    const double scores_rel = ((r.scores - ref_scores).abs().max() / ref_scores.abs().max()).item<double>();
    EXPECT_LT(scores_rel, 1e-5);
    // 2. Kept tokens per head; where they differ, only at near-ties of kvpress's scores with the
    // layer's selection threshold (the selection is global: a layer's threshold is its lowest kept score).
    int64_t n_diff = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor diff = r.prefill.keep_masks[l][0].logical_xor(ref_mask[l]);
      n_diff += diff.sum().item<int64_t>();
      if (!diff.any().item<bool>()) continue;
      const at::Tensor s = ref_scores[l];
      const double threshold = at::where(ref_mask[l], s, at::full_like(s, INFINITY)).min().item<double>();
      const at::Tensor far = diff.logical_and((s - threshold).abs() > 1e-5 * ref_scores.abs().max());
      EXPECT_FALSE(far.any().item<bool>()) << "layer " << l << ": " << far.sum().item<int64_t>()
                                           << " positions kept by one side only, far from the threshold";
    }
    // 3. Next-token logits over the compressed cache (kvpress: its masked attention), one per forward.
    // Where a tie was broken the other way, over a cache holding kvpress's kept tokens instead (its
    // layer-0 gate scores repeated tokens alike: their attention input is their embedding).
    if (n_diff > 0) {
      const ReplayedMasks replayed(ref_mask);
      cache = model.new_cache();
      PrefillOptions opt;
      opt.press = &replayed;
      model.prefill(context, cache, opt);
      if (restore) {
        for (int64_t l = 0; l < num_layers; ++l)
          cache.append(l, r.restore_keys.narrow(0, l, 1), r.restore_values.narrow(0, l, 1));
        cache.advance(restore->num_restore_tokens());
      }
    }
    const at::Tensor tokens = fixture(file, "decode_tokens"), ref_logits = fixture(file, "decode_logits");
    double max_diff = 0;
    for (int64_t i = 0; i < tokens.size(0); ++i) {
      const auto out = model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache);
      max_diff = std::max(max_diff, (out.logits[0][0] - ref_logits[i]).abs().max().item<double>());
    }
    EXPECT_LT(max_diff, 1e-4);
    std::ostringstream line;
    line << "kept " << (n_diff == 0 ? std::string("exact") : "modulo " + std::to_string(n_diff) + " near-ties")
         << ", max rel |d score| " << std::setprecision(3) << scores_rel << ", max |d logits| " << max_diff
         << (restore ? ", max |d restore k/v| " : "");
    if (restore) line << restore_diff;
    line << (n_diff > 0 ? " (kvpress's kept tokens replayed)" : "");
    parity_summary()[name] = line.str();
  }
}

}  // namespace
