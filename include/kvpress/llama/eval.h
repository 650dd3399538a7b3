// Quality under compression on held-out text (the protocol of `kvpress-cli eval`, the main demo
// and docs/EVAL.md), batch 1:
//
//   1. prefill the first `prefix` tokens of a story (BOS included); with a press, every layer's
//      cache is compressed right after that layer's prefill attention (kvpress's protocol);
//   2. teacher-force the rest over that cache at the original position ids (after
//      KeyRerotationPress, from the compressed length, where kvpress's pipeline puts a question):
//      feed tokens prefix .. n-2, which predict tokens prefix+1 .. n-1 (the scored positions;
//      token `prefix` itself is predicted by the uncompressed prefill and is left out, so every
//      scored position reads the compressed cache);
//      With a decoding press (a DecodingPress, or a PrefillDecodingPress with a decoding part) the
//      prefill is compressed only by a prefilling press, and the tokens are fed ONE PER FORWARD with
//      the decoding press in the loop (fresh state), so that it compresses at its interval while the
//      continuation is read, as it would while generating it;
//   3. record the mean negative log-likelihood of the scored tokens and, per position, the
//      argmax token; the greedy agreement of a compressed run is the fraction of scored
//      positions whose argmax equals the full-cache run's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kvpress/llama/model.h"

namespace kvpress::llama {

struct ContinuationScore {
  double mean_nll = 0.0;  // mean over the scored positions, natural log
  at::Tensor argmax;      // [n_scored] int64: the most likely token at each scored position
  int64_t scored = 0;     // n - prefix - 1
};

// Runs the protocol above on `ids` (a whole story). Requires 1 <= prefix <= ids.size() - 2.
// press == nullptr: the full cache. tokenizer: PrefillOptions::tokenizer (KVzipPress needs it).
ContinuationScore score_continuation(const LlamaModel& model, const std::vector<int64_t>& ids, int64_t prefix,
                                     const BasePress* press = nullptr, const Tokenizer* tokenizer = nullptr);

// Fraction of positions where the two argmax sequences agree (same length required).
double greedy_agreement(const ContinuationScore& a, const ContinuationScore& b);

// The prefix length for a story of n tokens: `prefix_tokens` when > 0, else
// floor(prefix_fraction * n); -1 when the story is too short (fewer than 2 tokens would be left to
// feed and score, or the prefix would be empty).
int64_t prefix_length(int64_t n, int64_t prefix_tokens, double prefix_fraction);

}  // namespace kvpress::llama
