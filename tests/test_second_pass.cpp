// The second pass as an engine drives it (kvpress/model_view.h): a SecondPassRun written outside the
// library, with its own prefill over the model's layers and its own cache, runs every press that
// needs a second pass and keeps what the library's runner keeps.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/model_view.h"
#include "kvpress/presses/kvcompose_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/presses/kvzip_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::BasePress;
using kvpress::testing::expect_error;
using kvpress::testing::tiny_model;
using kvpress::testing::tiny_tokenizer;

// An engine's run: its cache is a list of dense layers, each with the mask of what its heads keep.
class EngineRun : public kvpress::SecondPassRun {
 public:
  EngineRun(const kvpress::ModelView& model, at::Tensor context_ids) : model_(model), ids_(std::move(context_ids)) {}

  const char* op() const override { return "EngineRun"; }
  const kvpress::ModelView& model() const override { return model_; }
  const at::Tensor& context_ids() const override { return ids_; }
  std::vector<int64_t> encode(const std::string& text) const override {
    return tiny_tokenizer().encode(text, /*add_special_tokens=*/false);
  }
  std::optional<kvpress::UserTurnFrame> user_turn_frame() const override { return std::nullopt; }

  // The engine's own prefill: layer by layer through the view, the press asked for each layer's mask.
  void prefill(const BasePress* press) override {
    const kvpress::ModelShape shape = model_.shape();
    keys_.clear();
    values_.clear();
    masks_.clear();
    at::Tensor x = model_.embed(ids_);
    const kvpress::RopeTables rope = model_.rope(0, ids_.size(1));
    for (int64_t li = 0; li < shape.num_layers; ++li) {
      const kvpress::LayerQKV qkv = model_.layer_qkv(li, x, rope);
      keys_.push_back(qkv.k);
      values_.push_back(qkv.v);
      x = model_.layer_output(li, x, model_.layer_attention(qkv.q, qkv.k, qkv.v));
      kvpress::LayerInputs in;
      in.keys = qkv.k;
      in.values = qkv.v;
      in.hidden_states = qkv.h;
      in.num_heads = shape.num_heads;
      in.layer_idx = li;
      in.num_layers = shape.num_layers;
      masks_.push_back(press ? press->keep_mask(in) : at::ones({1, shape.num_kv_heads, ids_.size(1)}, at::kBool));
    }
  }
  at::Tensor cached_keys(int64_t layer) const override { return keys_.at(static_cast<size_t>(layer)); }
  at::Tensor cached_values(int64_t layer) const override { return values_.at(static_cast<size_t>(layer)); }
  void store(const kvpress::LayerInputs& in, const kvpress::KV& kv) override {
    // Every head keeps the same count: the mask of the kept indices [B, Hkv, k].
    at::Tensor mask = at::zeros({in.keys.size(0), in.keys.size(1), in.keys.size(2)}, at::kBool);
    masks_.at(static_cast<size_t>(in.layer_idx)) = mask.scatter_(2, kv.kept_indices, true);
  }
  void store_ragged(const kvpress::LayerInputs& in, const kvpress::RaggedKV& kv) override {
    masks_.at(static_cast<size_t>(in.layer_idx)) = kv.keep_mask;
  }
  bool packs_ragged_layers() const override { return true; }
  void append(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&) override {
    TORCH_CHECK(false, "EngineRun: no restore tokens here");
  }

  const std::vector<at::Tensor>& masks() const { return masks_; }

 private:
  const kvpress::ModelView& model_;
  at::Tensor ids_;
  std::vector<at::Tensor> keys_, values_, masks_;
};

at::Tensor context_ids() {
  const auto ids = tiny_tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
      "red ball. One day, she saw a big dog.");
  return at::tensor(ids, at::kLong).unsqueeze(0);
}

// What the library's runner keeps per layer with `press`: each layer's [1, Hkv, N] mask.
std::vector<at::Tensor> runner_masks(const BasePress& press, const at::Tensor& ids) {
  const kvpress::llama::LlamaModel& model = tiny_model();
  kvpress::llama::KVCache cache = model.new_cache();
  kvpress::llama::PrefillOptions options;
  options.press = &press;
  options.tokenizer = &tiny_tokenizer();
  std::vector<at::Tensor> masks;
  options.on_compress = [&](const kvpress::LayerInputs& in, const kvpress::KV& kv) {
    at::Tensor mask = at::zeros({in.keys.size(0), in.keys.size(1), in.keys.size(2)}, at::kBool);
    masks.push_back(mask.scatter_(2, kv.kept_indices, true));
  };
  options.on_compress_ragged = [&](const kvpress::LayerInputs&, const kvpress::RaggedKV& kv) {
    masks.push_back(kv.keep_mask);
  };
  model.prefill(ids, cache, options);
  return masks;
}

TEST(SecondPass, AnEnginesOwnRunKeepsWhatTheRunnerKeeps) {
  const at::Tensor ids = context_ids();
  kvpress::KVComposeOptions unstructured;
  unstructured.structured = false;
  const std::vector<std::shared_ptr<const BasePress>> presses = {
      std::make_shared<kvpress::KVzipPress>(0.5),
      std::make_shared<kvpress::KVzipPress>(0.6, /*layerwise=*/true),
      std::make_shared<kvpress::KVgradPress>(0.5),
      std::make_shared<kvpress::KVComposePress>(0.5),  // structured: k_l tokens in every head
      std::make_shared<kvpress::KVComposePress>(0.4, unstructured),
  };
  for (const auto& press : presses) {
    SCOPED_TRACE(press->name());
    ASSERT_TRUE(press->needs_second_pass());
    EngineRun run(tiny_model(), ids);
    press->second_pass(run);
    const std::vector<at::Tensor> expected = runner_masks(*press, ids);
    ASSERT_EQ(run.masks().size(), expected.size());
    int64_t kept = 0, total = 0;
    for (size_t l = 0; l < expected.size(); ++l) {
      EXPECT_TRUE(at::equal(run.masks()[l], expected[l])) << "layer " << l;
      kept += run.masks()[l].sum().item<int64_t>();
      total += run.masks()[l].numel();
    }
    EXPECT_GT(kept, 0);
    EXPECT_LT(kept, total);  // the press compressed
  }
}

TEST(SecondPass, APressWithoutOneRefuses) {
  EngineRun run(tiny_model(), context_ids());
  expect_error([&] { kvpress::SnapKVPress(0.5).second_pass(run); },
               {"SnapKVPress.second_pass: SnapKVPress compresses layer by layer", "needs_second_pass() is false"});
}

}  // namespace
