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
inline std::vector<int64_t> greedy_continue(const LlamaModel& model, KVCache& cache, at::Tensor logits,
                                            const std::vector<int64_t>& question, const ForwardOptions& step,
                                            int64_t max_new_tokens, bool stop_at_eos) {
  if (!question.empty()) logits = model.forward(as_batch(question), cache, step).logits;
  const int64_t eos = model.config().eos_token_id;
  std::vector<int64_t> tokens;
  while (true) {
    const int64_t next = logits[0][logits.size(1) - 1].argmax().item<int64_t>();
    tokens.push_back(next);
    if (static_cast<int64_t>(tokens.size()) >= max_new_tokens) break;
    if (stop_at_eos && next == eos) break;
    logits = model.forward(as_batch({next}), cache, step).logits;
  }
  return tokens;
}

}  // namespace kvpress::llama::detail
