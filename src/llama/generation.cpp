// Greedy generation with a press on the context (kvpress's pipeline, batch 1).
#include "kvpress/llama/generation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "greedy.h"

namespace kvpress::llama {

Generation generate_greedy(const LlamaModel& model, const std::vector<int64_t>& context,
                           const std::vector<int64_t>& question, const GenerationOptions& options) {
  TORCH_CHECK(!context.empty(), "generate_greedy: context must hold at least one token, got none");
  TORCH_CHECK(options.max_new_tokens >= 0, "generate_greedy: max_new_tokens must be >= 0, got ",
              options.max_new_tokens);
  Generation g;
  g.context_length = static_cast<int64_t>(context.size());
  if (options.max_new_tokens == 0) return g;

  KVCache cache = model.new_cache();
  // This generation's press state, from the prefill through the decoding (kvpress resets its press
  // per pipeline call).
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(options.press);
  PrefillOptions prefill;
  prefill.press = options.press;  // kvpress's pipeline: a DecodingPress skips the prefill
  prefill.press_state = state.get();
  prefill.press_attentions = options.press_attentions;
  prefill.last_logits_only = true;
  prefill.tokenizer = options.tokenizer;
  const at::Tensor logits = model.prefill(detail::as_batch(context), cache, prefill).logits;
  g.cache_lengths = cache.lengths();

  ForwardOptions step;
  step.last_logits_only = true;
  step.press = options.press;
  step.press_state = state.get();
  step.decoding_attentions = options.decoding_attentions;
  g.tokens = detail::greedy_continue(model, cache, logits, question, step, options.max_new_tokens, options.stop_at_eos);
  g.final_cache_lengths = cache.lengths();
  return g;
}

}  // namespace kvpress::llama
