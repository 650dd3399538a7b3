// Greedy generation with an optional press, following kvpress's pipeline: the context is
// prefilled (and compressed by the press), the question (if any) runs over the compressed cache
// at the original positions (after KeyRerotationPress: from the compressed length, as kvpress's
// pipeline), then tokens are generated one at a time. A DecodingPress (or a
// PrefillDecodingPress's decoding part) compresses while the question and the generated tokens
// are fed, as kvpress's pipeline does; a DecodingPress does not compress the context.
#pragma once

#include <cstdint>
#include <vector>

#include "kvpress/llama/model.h"

namespace kvpress::llama {

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  const BasePress* press = nullptr;  // compresses the context after prefill; nullptr: full cache
  PressAttentions press_attentions = PressAttentions::kAuto;
  bool decoding_attentions = false;  // ForwardOptions::decoding_attentions (decoding presses)
  bool stop_at_eos = true;           // stop after generating config().eos_token_id (it is kept)
};

struct Generation {
  std::vector<int64_t> tokens;               // generated ids, without context and question
  int64_t context_length = 0;                // tokens prefilled
  std::vector<int64_t> cache_lengths;        // per layer, right after prefill (compressed with a press)
  std::vector<int64_t> final_cache_lengths;  // per layer, after the last forward (decoding presses)
};

// context: ids to prefill (batch 1; usually starting with BOS). question: ids run after the
// compression, at positions context.size()...; when empty, the first generated token is the argmax
// of the prefill's last logits (computed before any layer was compressed, as the press acts after
// each layer's attention) and later tokens attend over the compressed cache.
Generation generate_greedy(const LlamaModel& model, const std::vector<int64_t>& context,
                           const std::vector<int64_t>& question = {}, const GenerationOptions& options = {});

}  // namespace kvpress::llama
