// Quality under compression: prefill (+ press), teacher-forced continuation, NLL and argmax.
#include "kvpress/llama/eval.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#include "greedy.h"

namespace kvpress::llama {

ContinuationScore score_continuation(const LlamaModel& model, const std::vector<int64_t>& ids, int64_t prefix,
                                     const BasePress* press, const Tokenizer* tokenizer) {
  const int64_t n = static_cast<int64_t>(ids.size());
  TORCH_CHECK(prefix >= 1 && prefix <= n - 2, "score_continuation: prefix must be in [1, ", n - 2, "] for a story of ",
              n, " tokens, got ", prefix);
  c10::InferenceMode guard;
  const at::Tensor all = detail::as_batch(ids);
  KVCache cache = model.new_cache();
  PrefillOptions prefill;
  prefill.press = press;            // a DecodingPress does nothing at prefill; a PrefillDecodingPress its prefill part
  prefill.last_logits_only = true;  // token `prefix` is not scored
  prefill.tokenizer = tokenizer;
  // The press's state for this sequence, from the prefill through the continuation.
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(press);
  prefill.press_state = state.get();
  model.prefill(all.narrow(1, 0, prefix), cache, prefill);
  // Feed tokens prefix .. n-2 at positions cache.position() on (prefix .. n-2, or from n_kept after
  // KeyRerotationPress); they predict tokens prefix+1 .. n-1.
  at::Tensor logits;
  if (press && press->decoding_role().compresses) {
    // A decoding press compresses while tokens are generated: feed them one per forward, as
    // generation would, so that it compresses at its interval and later tokens read the result.
    ForwardOptions step;
    step.press = press;
    step.press_state = state.get();
    std::vector<at::Tensor> rows;
    for (int64_t p = prefix; p < n - 1; ++p)
      rows.push_back(model.forward(all.narrow(1, p, 1), cache, step).logits[0][0]);
    logits = at::stack(rows).to(at::kFloat);
  } else {
    logits = model.forward(all.narrow(1, prefix, n - 1 - prefix), cache).logits[0].to(at::kFloat);
  }
  const at::Tensor targets = all[0].narrow(0, prefix + 1, n - 1 - prefix);
  const at::Tensor logp = at::log_softmax(logits, -1);
  ContinuationScore s;
  s.scored = n - 1 - prefix;
  s.mean_nll = -logp.gather(1, targets.view({-1, 1})).mean().item<double>();
  s.argmax = logits.argmax(-1);
  return s;
}

double greedy_agreement(const ContinuationScore& a, const ContinuationScore& b) {
  TORCH_CHECK(a.argmax.defined() && b.argmax.defined() && a.argmax.numel() == b.argmax.numel() && a.argmax.numel() > 0,
              "greedy_agreement: both scores must cover the same non-empty positions");
  return a.argmax.eq(b.argmax).to(at::kDouble).mean().item<double>();
}

int64_t prefix_length(int64_t n, int64_t prefix_tokens, double prefix_fraction) {
  const int64_t p =
      prefix_tokens > 0 ? prefix_tokens : static_cast<int64_t>(std::floor(prefix_fraction * static_cast<double>(n)));
  return (p >= 1 && p <= n - 2) ? p : -1;
}

}  // namespace kvpress::llama
