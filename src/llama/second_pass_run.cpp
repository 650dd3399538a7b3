// The Llama runner's side of a press's second pass (second_pass_run.h).
#include "second_pass_run.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "kvpress/cache.h"
#include "kvpress/llama/chat.h"
#include "kvpress/llama/tokenizer.h"

namespace kvpress::llama::detail {

LlamaSecondPassRun::LlamaSecondPassRun(const char* op, const LlamaModel& model, const at::Tensor& context_ids,
                                       KVCache& cache, const PrefillOptions& options, const BasePress& press,
                                       const CapturedPrefill* captured)
    : op_(op),
      model_(model),
      context_ids_(context_ids),
      cache_(cache),
      options_(options),
      press_name_(press.name()),
      captured_(captured) {
  model.check_press_on_shard(&press, op);
  TORCH_CHECK(cache.position() == 0, op, ": the cache already holds ", cache.position(),
              " tokens; it prefills an empty cache");
}

std::pair<at::Tensor, at::Tensor> LlamaSecondPassRun::captured_layer(int64_t layer) const {
  if (captured_ == nullptr) return {};
  const LayerInputs& in = captured_->layers.at(static_cast<size_t>(layer));
  return {in.keys, in.values};
}

std::vector<int64_t> LlamaSecondPassRun::encode(const std::string& text) const {
  TORCH_CHECK(options_.tokenizer != nullptr, op_, ": ", press_name_,
              " prompts the model with text of its own (KVzip's repeat prompts), so it needs the model's "
              "tokenizer: set PrefillOptions::tokenizer");
  return options_.tokenizer->encode(text, /*add_special_tokens=*/false);
}

std::optional<UserTurnFrame> LlamaSecondPassRun::user_turn_frame() const {
  const ChatTemplate* chat = options_.chat_template;
  if (chat == nullptr) return std::nullopt;
  // kvpress's own probe: a dummy message followed by a separator, rendered without thinking; the
  // frame opens where the dummy message starts.
  const std::string dummy = "dummy context";
  ChatOptions no_thinking;
  no_thinking.enable_thinking = false;
  auto [before, after] = chat->split_user_turn(dummy, "\n" + std::string(dummy.size(), '#'), no_thinking, op_);
  return UserTurnFrame{before.substr(0, before.find(dummy)), std::move(after)};
}

void LlamaSecondPassRun::prefill(const BasePress* press) {
  TORCH_CHECK(press == nullptr || !press->needs_second_pass(), op_,
              ": the second pass's prefill takes a press that "
              "compresses layer by layer, got ",
              press->name());
  PrefillOptions compressing = options_;
  compressing.press = press;
  compressing.press_state = nullptr;
  cache_ = model_.new_cache();  // a later prefill replaces an earlier one's cache
  output_ = model_.prefill(context_ids_, cache_, compressing);
}

void LlamaSecondPassRun::store(const LayerInputs& inputs, const KV& kv) {
  cache_.replace(inputs.layer_idx, kv.keys, kv.values);
  output_.kept_indices.push_back(kv.kept_indices);
  if (options_.on_compress) options_.on_compress(inputs, kv);
}

void LlamaSecondPassRun::store_ragged(const LayerInputs& inputs, const RaggedKV& kv) {
  if (packs_ragged_layers())
    cache_.replace_ragged(inputs.layer_idx, HeadRaggedLayer::from_ragged(kv, inputs.keys.size(2)));
  else
    cache_.set_keep_mask(inputs.layer_idx, kv.keep_mask);
  output_.keep_masks.push_back(kv.keep_mask);
  if (options_.on_compress_ragged) options_.on_compress_ragged(inputs, kv);
}

void LlamaSecondPassRun::append(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
  TORCH_CHECK(!keys.empty() && keys.size() == static_cast<size_t>(cache_.num_layers()) && values.size() == keys.size(),
              op_, ": append needs keys and values for each of the ", cache_.num_layers(), " layers, got ", keys.size(),
              " and ", values.size());
  for (int64_t l = 0; l < cache_.num_layers(); ++l)
    cache_.append(l, keys[static_cast<size_t>(l)], values[static_cast<size_t>(l)]);
  cache_.advance(keys.front().size(2));
}

}  // namespace kvpress::llama::detail
