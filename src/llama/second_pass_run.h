// The Llama runner's side of a press's second pass (kvpress/model_view.h): one prefill of LlamaModel
// taken over by a press that needs_second_pass().
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvpress/llama/model.h"
#include "kvpress/model_view.h"

namespace kvpress::llama::detail {

class LlamaSecondPassRun final : public SecondPassRun {
 public:
  // `cache` must be empty (raises "<op>: the cache already holds ..."); `options`: the prefill's
  // (its press is not used: the pass gives its own), with its tokenizer and chat template for
  // encode() and user_turn_frame(). `press`: the press whose pass runs (checked against a
  // tensor-parallel shard; named in errors). `captured` (optional): a plain prefill of context_ids
  // whose keys/values captured_layer() gives.
  LlamaSecondPassRun(const char* op, const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                     const PrefillOptions& options, const BasePress& press, const CapturedPrefill* captured = nullptr);

  const char* op() const override { return op_; }
  const ModelView& model() const override { return model_; }
  const at::Tensor& context_ids() const override { return context_ids_; }
  std::pair<at::Tensor, at::Tensor> captured_layer(int64_t layer) const override;
  std::vector<int64_t> encode(const std::string& text) const override;
  std::optional<UserTurnFrame> user_turn_frame() const override;
  void prefill(const BasePress* press) override;
  at::Tensor cached_keys(int64_t layer) const override { return cache_.keys(layer); }
  at::Tensor cached_values(int64_t layer) const override { return cache_.values(layer); }
  void store(const LayerInputs& inputs, const KV& kv) override;
  void store_ragged(const LayerInputs& inputs, const RaggedKV& kv) override;
  bool packs_ragged_layers() const override { return options_.ragged_layout == PrefillOptions::RaggedLayout::kPacked; }
  void append(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) override;

  // Runs `pass` (the press's second pass through this run) and returns the prefill's output: the
  // logits of its last prefill(), the kept indices or masks of its layers. A failure leaves the cache
  // as it was.
  template <typename Pass>
  ForwardOutput take_output(Pass&& pass) {
    KVCache before = cache_;
    try {
      pass();
    } catch (...) {
      cache_ = std::move(before);
      throw;
    }
    return std::move(output_);
  }

 private:
  const char* op_;
  const LlamaModel& model_;
  const at::Tensor& context_ids_;
  KVCache& cache_;
  const PrefillOptions& options_;
  std::string press_name_;
  const CapturedPrefill* captured_;
  ForwardOutput output_;
};

}  // namespace kvpress::llama::detail
