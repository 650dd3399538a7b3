// Greedy generation with an optional press, following kvpress's pipeline: the context is
// prefilled (and compressed by the press), the question (if any) runs over the compressed cache
// at the original positions (after KeyRerotationPress: from the compressed length, as kvpress's
// pipeline), then tokens are generated one at a time. A DecodingPress (or a
// PrefillDecodingPress's decoding part) compresses while the question and the generated tokens
// are fed, as kvpress's pipeline does; a DecodingPress does not compress the context.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kvpress/llama/model.h"

namespace kvpress::llama {

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  const BasePress* press = nullptr;  // compresses the context after prefill; nullptr: full cache
  PressAttentions press_attentions = PressAttentions::kAuto;
  bool decoding_attentions = false;      // ForwardOptions::decoding_attentions (decoding presses)
  bool stop_at_eos = true;               // stop after generating config().eos_token_id (it is kept)
  const Tokenizer* tokenizer = nullptr;  // PrefillOptions::tokenizer (KVzipPress needs it)
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

// ---- continuous batching over a PagedKVCache ------------------------------------------------

struct PagedGenerationOptions {
  int64_t max_new_tokens = 64;
  // As generate_greedy: a prefill press compresses each prompt while its pages are written; a
  // DecodingPress (or a PrefillDecodingPress's decoding part) compacts while generating.
  const BasePress* press = nullptr;
  PressAttentions press_attentions = PressAttentions::kAuto;
  bool stop_at_eos = true;
  int64_t page_size = PagedCacheOptions::kDefaultPageSize;
  KVFormat kv_format = KVFormat::kFull;  // how full pages are stored (kvpress/kv_format.h)
  // Pool size of each layer; 0: room for max_batch copies of the longest prompt plus max_new_tokens,
  // uncompressed.
  int64_t pages_per_layer = 0;
  int64_t max_batch = 8;  // sequences running at once
  // Called with each sequence's logits [vocab] (model dtype) before its next token is chosen:
  // the prompt's index and the step (0: the prefill's last position).
  std::function<void(int64_t prompt, int64_t step, const at::Tensor& logits)> on_logits;
};

struct PagedGenerationStats {
  int64_t num_layers = 0, pages_per_layer = 0, page_size = 0, bytes_per_page = 0;
  KVFormat kv_format = KVFormat::kFull;
  int64_t residual_bytes = 0;  // a quantized cache's residual rows (PagedCacheStats::residual_bytes)
  // Over every prompt and layer: the pages its prefill would take stored whole (Hkv * ceil(S / page)
  // per layer), and the pages store() took after compression.
  int64_t prompt_pages_uncompressed = 0;
  int64_t prompt_pages_stored = 0;
  int64_t peak_pages_used = 0;  // most pages in use at once, over all layers
  int64_t max_running = 0;      // most sequences running at once
  int64_t prefill_batches = 0;  // prefill_paged calls (prompts admitted together)
  int64_t decode_steps = 0;     // decode_paged calls
};

struct PagedGenerations {
  std::vector<Generation> generations;  // one per prompt, in the order given
  PagedGenerationStats stats;
};

// Greedy generation for many prompts at once over one PagedKVCache (LlamaModel::prefill_paged /
// decode_paged). Prompts are admitted in order while max_batch allows and the pool holds the
// worst case of every running sequence (its prompt stored whole plus its remaining tokens), so no
// step runs out of pages; prompts admitted together are prefilled in one packed call; every
// running sequence decodes one token per step; a finished sequence frees its pages, which the
// next waiting prompt takes. Each sequence's tokens are those generate_greedy() gives it alone
// (context = its prompt, no question). Generation::cache_lengths / final_cache_lengths hold the
// longest head of each layer.
PagedGenerations generate_paged(const LlamaModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                const PagedGenerationOptions& options = {});

}  // namespace kvpress::llama
