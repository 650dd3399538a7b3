// The runner's small shared helpers: ids -> a batch of one, and the greedy loop of
// generate_greedy() and answer_questions().
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kvpress/llama/model.h"

namespace kvpress::llama::detail {

// ids -> [1, n] int64.
inline at::Tensor as_batch(const std::vector<int64_t>& ids) {
  return at::tensor(at::ArrayRef<int64_t>(ids), at::kLong).unsqueeze(0);
}

// Runs `question` over the cache (when not empty), then picks argmax tokens one forward at a time
// until max_new_tokens (>= 1) are chosen or, with stop_at_eos, the model's EOS was (it is kept).
// `logits` [1, n, V]: the prefill's, whose last row chooses the first token when question is empty.
// The greedy loop itself: `next_logits` [V] chooses each token; `feed(token)` runs it and returns
// the next logits [V]; until max_new_tokens (>= 1) are chosen or, with stop_at_eos, `eos` was (kept).
template <typename Feed>
std::vector<int64_t> greedy_tokens(at::Tensor next_logits, Feed&& feed, int64_t eos, int64_t max_new_tokens,
                                   bool stop_at_eos) {
  std::vector<int64_t> tokens;
  while (true) {
    tokens.push_back(next_logits.argmax().item<int64_t>());
    if (static_cast<int64_t>(tokens.size()) >= max_new_tokens) break;
    if (stop_at_eos && tokens.back() == eos) break;
    next_logits = feed(tokens.back());
  }
  return tokens;
}

inline std::vector<int64_t> greedy_continue(const LlamaModel& model, KVCache& cache, at::Tensor logits,
                                            const std::vector<int64_t>& question, const ForwardOptions& step,
                                            int64_t max_new_tokens, bool stop_at_eos) {
  if (!question.empty()) logits = model.forward(as_batch(question), cache, step).logits;
  const auto feed = [&](int64_t token) {
    const at::Tensor out = model.forward(as_batch({token}), cache, step).logits;  // [1, 1, V]
    return out[0][out.size(1) - 1];
  };
  return greedy_tokens(logits[0][logits.size(1) - 1], feed, model.config().eos_token_id, max_new_tokens, stop_at_eos);
}

}  // namespace kvpress::llama::detail
