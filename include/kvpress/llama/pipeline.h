// Question answering over a compressed context, as kvpress's KVPressTextGenerationPipeline does:
// the context is prefilled once and compressed by the press,
// then each question runs over the same compressed cache and is answered greedily, the cache cut
// back to the compressed context between questions. Query-aware: each question is prefilled with
// the context instead, so the press sees it (kvpress's evaluation: context + question as one
// text, an empty question after it; FinchPress: the question tokenized on its own, as kvpress's
// delimiter token makes it, and given to the press as LayerInputs::question_length).
//
//   auto answers = kvpress::llama::answer_questions(model, tokenizer, context, {"Who is Lily?"}, options);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvpress/llama/chat.h"
#include "kvpress/llama/model.h"
#include "kvpress/llama/tokenizer.h"

namespace kvpress::llama {

struct PipelineOptions {
  const BasePress* press = nullptr;  // nullptr: no compression
  PressAttentions press_attentions = PressAttentions::kAuto;
  int64_t max_new_tokens = 50;     // per answer, the first included (kvpress's default)
  std::string answer_prefix;       // text after each question's "\n", before the answer
  int64_t max_context_length = 0;  // > 0: the context's tokens (BOS included) are cut to this many
  bool query_aware = false;        // compress each question's own prefill of context + question
  // The model's chat template (kvpress's pipeline uses the tokenizer's when it has one): the context
  // is the content of one user message and each question continues it. nullptr: the plain prompt.
  const ChatTemplate* chat_template = nullptr;
  // The context's prefill, captured once (LlamaModel::capture_prefill of context_prefill_ids(), with
  // last_logits_only) and compressed here by `press` (compress_captured) instead of prefilled again:
  // the same cache and answers, for many presses at the cost of one prefill. With query_aware, the
  // prefill of the context and the one question asked (context_prefill_ids with that question and
  // this press). Not with a press LlamaModel::why_not_captured() names.
  const CapturedPrefill* captured = nullptr;
  // With `captured` and a KVzipPress as `press`: its token scores of this context (kvzip_scores(),
  // kvpress/llama/kvzip.h), so that the capture is compressed to its selection
  // (kvzip_compress_captured) instead of replaying the context: one scoring pass for every ratio.
  const at::Tensor* kvzip_scores = nullptr;
  // Unset: the answers come from the dense KVCache, as kvpress's. Set: from a PagedKVCache in that
  // format (kvpress/paged.h; int8, fp8 and int4 quantize each page when it fills): the prefill
  // (context, and question when query_aware) through prefill_paged, the press keeping its tokens as
  // the pages are written, then the question and the answer one decode_paged step per token. Each
  // question gets its own prefill. Not with `captured` (a dense capture), a press that observes the
  // question or runs a second pass (prefill_paged takes neither), or one decode_paged refuses.
  std::optional<KVFormat> paged_kv_format;
};

struct Answer {
  std::string text;                    // decoded without special tokens (an EOS that ended it is dropped)
  std::vector<int64_t> tokens;         // generated ids, EOS included when it ended the answer
  int64_t prefill_length = 0;          // tokens prefilled (the context, and the question when query-aware)
  std::vector<int64_t> cache_lengths;  // per layer, after the prefill's compression (head-ragged: the longest head)
  // The prefill's tokens still visible after its compression: mean over layers and KV heads of each
  // head's kept tokens over prefill_length (head-ragged and masked layers counted per head).
  double kept_fraction = 1.0;
};

// One answer per question, in order. Tokenization (kvpress's preprocess): without a chat template,
// the prefill is "<bos>" + context (+ question when query-aware) and each question is followed by
// "\n" + answer_prefix; with one, the template renders a user message of context + a separator
// ("#" x (len + 10)) with the generation prompt, the text before the separator is the prefill and
// the text after it follows each question (before answer_prefix), e.g. SmolLM2's
// "<|im_end|>\n<|im_start|>assistant\n". All is encoded without adding special tokens. A DecodingPress (or a
// PrefillDecodingPress) takes a single question, as in kvpress; a press that observes the question
// (BasePress::observes_question(): FinchPress) requires query_aware: its prefill is the framed
// context's tokens then the question's (kvpress: context + delimiter token + question as the
// message's text, the delimiter dropped). KVzipPress replays the context inside the template's
// user turn (PrefillOptions::chat_template). Raises c10::Error on an empty question list, a model config without
// bos_token_id (without a chat template), or options out of range. The tokens answer_questions() prefills for `context`
// (the framing above), to capture once for PipelineOptions::captured: without query_aware the
// context's; with it, the context's and `question`'s, framed for options.press (one text, or for a
// press that observes the question, FinchPress, the framed context's tokens then the question's).
std::vector<int64_t> context_prefill_ids(const LlamaModel& model, const Tokenizer& tokenizer,
                                         const std::string& context, const PipelineOptions& options = {},
                                         const std::string& question = "");

std::vector<Answer> answer_questions(const LlamaModel& model, const Tokenizer& tokenizer, const std::string& context,
                                     const std::vector<std::string>& questions, const PipelineOptions& options = {});

}  // namespace kvpress::llama
