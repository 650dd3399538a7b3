// Out-of-line parts of the first presses: constructors that validate, and scorers that choose
// where their attention comes from.
#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/observed_attention_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "kvpress/presses/streaming_llm_press.h"
#include "kvpress/presses/tova_press.h"

namespace kvpress {
namespace {

// The mean over the last `window` query rows of the attention paid to the first S - window keys
// ([B, Hq, S - window] float32): from the given attentions, or recomputed from queries (given or
// rebuilt from hidden states) by the fused window_attention_mean, which never holds all rows.
at::Tensor observation_attention_mean(const LayerInputs& in, int64_t window, const char* op) {
  checks::check_kv(op, in.keys, in.values);
  const int64_t seq = in.keys.size(2);
  checks::check_window(op, "window_size", window, seq);
  if (in.attentions.defined()) {
    const at::Tensor& a = in.attentions;
    checks::check_rank(op, "attentions", a, 4, "[batch, num_heads, q_len, seq_len]");
    checks::check_same_device(op, "attentions", a, "keys", in.keys);
    TORCH_CHECK(a.size(0) == in.keys.size(0) && a.size(3) == seq, op, ": attentions must be [",
                in.keys.size(0), ", num_heads, q_len, ", seq, "] to match keys, got ", checks::shape_str(a));
    TORCH_CHECK(a.size(2) >= window, op, ": attentions must hold at least the last ", window,
                " query rows, got q_len ", a.size(2));
    return a.narrow(2, a.size(2) - window, window).narrow(3, 0, seq - window).to(at::kFloat).mean(2);
  }
  return ops::window_attention_mean(ops::window_queries(in, window, op), in.keys);
}

}  // namespace

StreamingLLMPress::StreamingLLMPress(double compression_ratio, int64_t n_sink)
    : ScorerPress(compression_ratio), n_sink_(n_sink) {
  checks::check_non_negative("StreamingLLMPress", "n_sink", n_sink);
}

LagKVPress::LagKVPress(double compression_ratio, int64_t n_sink, int64_t lag_size, bool cross_scoring)
    : ScorerPress(compression_ratio), n_sink_(n_sink), lag_size_(lag_size), cross_scoring_(cross_scoring) {
  checks::check_non_negative("LagKVPress", "n_sink", n_sink);
  checks::check_positive("LagKVPress", "lag_size", lag_size);
}

SnapKVPress::SnapKVPress(double compression_ratio, int64_t window_size, int64_t kernel_size)
    : ScorerPress(compression_ratio), window_size_(window_size), kernel_size_(kernel_size) {
  checks::check_positive("SnapKVPress", "window_size", window_size);
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1,
              "SnapKVPress: kernel_size must be a positive odd number, got ", kernel_size);
}

at::Tensor SnapKVPress::score(const LayerInputs& inputs) const {
  const at::Tensor mean_attn = observation_attention_mean(inputs, window_size_, "SnapKVPress");
  return ops::snapkv_scores_from_mean(mean_attn, inputs.keys.size(1), kernel_size_, window_size_);
}

at::Tensor TOVAPress::score(const LayerInputs& inputs) const {
  // With one query row the mean is that row: [B, Hq, 1, S - 1] as tova_scores expects.
  const at::Tensor attn = observation_attention_mean(inputs, 1, "TOVAPress").unsqueeze(2);
  return ops::tova_scores(attn, inputs.keys.size(1));
}

at::Tensor ObservedAttentionPress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "ObservedAttentionPress";
  checks::check_kv(op, inputs.keys, inputs.values);
  TORCH_CHECK(inputs.attentions.defined(), op,
              ": needs attentions (the full eager attention matrix); none were given");
  checks::check_same_device(op, "attentions", inputs.attentions, "keys", inputs.keys);
  const at::Tensor& a = inputs.attentions;
  TORCH_CHECK(a.dim() == 4 && a.size(0) == inputs.keys.size(0) && a.size(3) == inputs.keys.size(2), op,
              ": attentions must be [", inputs.keys.size(0), ", num_heads, ", inputs.keys.size(2), ", ",
              inputs.keys.size(2), "], got ", checks::shape_str(a));
  return ops::observed_attention_scores(a, inputs.keys.size(1));
}

}  // namespace kvpress
