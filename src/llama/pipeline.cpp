// kvpress's KVPressTextGenerationPipeline on the kvpress::llama runner (docs/LLAMA_RUNNER.md).
#include "kvpress/llama/pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "greedy.h"
#include "kvpress/llama/kvzip.h"
#include "kvpress/paged.h"

namespace kvpress::llama {
namespace {

constexpr const char* kOp = "answer_questions";
// kvpress's preprocess of a context text: the prefill's text and what follows each question.
struct Framed {
  std::string prefill, question_suffix;
};
Framed frame(const std::string& text, const std::string& bos_text, const ChatTemplate* chat) {
  if (chat == nullptr) return {bos_text + text, "\n"};  // the tokenizer has no chat template
  // A user message of the text and a separator no text contains, rendered, split at the separator.
  auto [prefill, question_suffix] = chat->split_user_turn(text, std::string(text.size() + 10, '#'), {}, kOp);
  return {std::move(prefill), std::move(question_suffix)};
}

struct Prefilled {
  KVCache cache;
  at::Tensor logits;  // [1, 1, V]: the last position's
  int64_t length = 0;
  // The press's state for this context's sequence, from the prefill through the decoding (a
  // decoding press takes a single question, so one is enough).
  std::unique_ptr<PressSequenceState> press_state;
};

// The context's tokens cut to options.max_context_length (kvpress cuts its context text's tokens,
// the question's too when it is part of that text), and how many of the last are the question's.
void cut_context(std::vector<int64_t>& ids, int64_t& question_length, const PipelineOptions& options) {
  if (options.max_context_length <= 0 || static_cast<int64_t>(ids.size()) <= options.max_context_length) return;
  const int64_t cut = static_cast<int64_t>(ids.size()) - options.max_context_length;
  ids.resize(static_cast<size_t>(options.max_context_length));
  question_length = std::max<int64_t>(0, question_length - cut);
}

Prefilled prefill(const LlamaModel& model, const Tokenizer& tokenizer, std::vector<int64_t> ids,
                  int64_t question_length, const PipelineOptions& options) {
  cut_context(ids, question_length, options);
  Prefilled p;
  p.length = static_cast<int64_t>(ids.size());
  PrefillOptions prefill;
  prefill.press = options.press;  // a DecodingPress leaves the prefill alone
  p.press_state = new_sequence_state_of(options.press);
  prefill.press_state = p.press_state.get();
  prefill.press_attentions = options.press_attentions;
  prefill.question_length = question_length;
  if (const CapturedPrefill* captured = options.captured) {
    const at::Tensor batch = detail::as_batch(ids);
    TORCH_CHECK(captured->is_prefill_of(batch), kOp, ": options.captured holds another prefill than this context's ",
                ids.size(), " tokens (capture context_prefill_ids())");
    TORCH_CHECK(captured->logits.dim() == 3 && captured->logits.size(1) >= 1, kOp,
                ": options.captured has no logits (capture_prefill gives them)");
    if (options.kvzip_scores != nullptr) {
      const KVzipPress* kvzip = KVzipPress::of(options.press);
      TORCH_CHECK(kvzip != nullptr, kOp, ": options.kvzip_scores are for a KVzipPress, got ",
                  options.press ? options.press->name() : std::string("no press"));
      p.cache = kvzip_compress_captured(model, *captured, *kvzip, *options.kvzip_scores, prefill);
    } else {
      p.cache = model.compress_captured(*captured, prefill);
    }
    p.logits = captured->logits.narrow(1, captured->logits.size(1) - 1, 1);
    return p;
  }
  p.cache = model.new_cache();
  prefill.last_logits_only = true;
  prefill.tokenizer = &tokenizer;                 // KVzipPress's repeat prompt
  prefill.chat_template = options.chat_template;  // and the user turn it replays the context in
  p.logits = model.prefill(detail::as_batch(ids), p.cache, prefill).logits;
  return p;
}

// Mean over layers and KV heads of the tokens each head keeps of the prefill's `length`.
double kept_fraction(const KVCache& cache, int64_t length) {
  double sum = 0.0;
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    if (cache.is_ragged(l)) {
      const HeadRaggedLayer& r = cache.ragged(l);
      sum += static_cast<double>(r.total_tokens() - r.appended() * r.batch() * r.kv_heads()) /
             static_cast<double>(r.batch() * r.kv_heads() * length);
    } else if (const at::Tensor mask = cache.keep_mask(l); mask.defined()) {
      sum += mask.narrow(2, 0, length).to(at::kDouble).mean().item<double>();
    } else {
      sum += static_cast<double>(cache.length(l)) / static_cast<double>(length);
    }
  }
  return sum / static_cast<double>(cache.num_layers());
}

// One answer over a PagedKVCache in *options.paged_kv_format: `ids` prefilled with the press
// compressing as the pages are written, then `question_ids` and the answer one decode step each.
Answer answer_over_pages(const LlamaModel& model, std::vector<int64_t> ids, const std::vector<int64_t>& question_ids,
                         const PipelineOptions& options) {
  int64_t question_length = 0;
  cut_context(ids, question_length, options);
  const auto prefill_length = static_cast<int64_t>(ids.size());
  const int64_t page_size = PagedCacheOptions::kDefaultPageSize, heads = model.config().num_kv_heads;
  const int64_t rows = prefill_length + static_cast<int64_t>(question_ids.size()) + options.max_new_tokens;
  PagedKVCache cache =
      model.new_paged_cache(heads * ((rows + page_size - 1) / page_size), page_size, *options.paged_kv_format);
  const SequenceId seq = cache.add_sequence();
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(options.press);
  PagedPrefillOptions prefill;
  prefill.press = options.press;
  prefill.press_attentions = options.press_attentions;
  if (state) prefill.press_states.push_back(state.get());
  at::Tensor logits = model.prefill_paged({ids}, {seq}, cache, prefill)[0];  // [vocab]
  Answer a;
  a.prefill_length = prefill_length;
  double kept = 0.0;
  for (int64_t l = 0; l < model.config().num_layers; ++l) {
    const std::vector<int64_t> lengths = cache.lengths(seq, l);
    a.cache_lengths.push_back(*std::max_element(lengths.begin(), lengths.end()));
    for (int64_t n : lengths) kept += static_cast<double>(n) / static_cast<double>(prefill_length * heads);
  }
  a.kept_fraction = kept / static_cast<double>(model.config().num_layers);
  PagedDecodeOptions step;
  step.press = options.press;
  if (state) step.press_states.push_back(state.get());
  const auto feed = [&](int64_t token) { return model.decode_paged({seq}, {token}, cache, step)[0]; };  // [V]
  for (int64_t token : question_ids) logits = feed(token);
  a.tokens = detail::greedy_tokens(logits, feed, model.config().eos_token_id, options.max_new_tokens,
                                   /*stop_at_eos=*/true);
  return a;
}

// The text the plain prompt starts with (the model's BOS token), or "" with a chat template.
std::string bos_text_of(const LlamaModel& model, const Tokenizer& tokenizer, const ChatTemplate* chat, const char* op) {
  if (chat != nullptr) return std::string();
  const int64_t bos = model.config().bos_token_id;
  TORCH_CHECK(bos >= 0, op, ": the model's config has no bos_token_id; the prefill starts with it");
  return tokenizer.id_to_token(bos);
}

// A query-aware prefill for question `q`: its tokens, how many of its last tokens are the question
// (a press that observes the question reads them), and the framing (what follows the question).
struct QueryAwarePrefill {
  std::vector<int64_t> ids;
  int64_t question_length = 0;
  Framed framed;
};
QueryAwarePrefill query_aware_prefill(const Tokenizer& tokenizer, const std::string& context, const std::string& q,
                                      const std::string& bos_text, const ChatTemplate* chat, bool observes_question) {
  const auto encode = [&](const std::string& text) { return tokenizer.encode(text, /*add_special_tokens=*/false); };
  QueryAwarePrefill out;
  if (observes_question) {
    // kvpress's text is context + delimiter token + question, framed as one user message; the
    // delimiter splits the tokenization, and the press drops it. So: the framed context's tokens,
    // then the question's, then after the prefill what follows the message.
    out.framed = frame(context, bos_text, chat);
    out.ids = encode(out.framed.prefill);
    const std::vector<int64_t> question_ids = encode(q);
    out.ids.insert(out.ids.end(), question_ids.begin(), question_ids.end());
    out.question_length = static_cast<int64_t>(question_ids.size());
  } else {
    out.framed = frame(context + q, bos_text, chat);  // kvpress's evaluation: one text, an empty question
    out.ids = encode(out.framed.prefill);
  }
  return out;
}

}  // namespace

std::vector<int64_t> context_prefill_ids(const LlamaModel& model, const Tokenizer& tokenizer,
                                         const std::string& context, const PipelineOptions& options,
                                         const std::string& question) {
  constexpr const char* op = "context_prefill_ids";
  TORCH_CHECK(options.query_aware || question.empty(), op,
              ": a question is part of the prefill only with query_aware (kvpress's query-aware evaluation)");
  const ChatTemplate* chat = options.chat_template;
  const std::string bos_text = bos_text_of(model, tokenizer, chat, op);
  std::vector<int64_t> ids =
      options.query_aware ? query_aware_prefill(tokenizer, context, question, bos_text, chat,
                                                options.press != nullptr && options.press->observes_question())
                                .ids
                          : tokenizer.encode(frame(context, bos_text, chat).prefill, /*add_special_tokens=*/false);
  if (options.max_context_length > 0 && static_cast<int64_t>(ids.size()) > options.max_context_length)
    ids.resize(static_cast<size_t>(options.max_context_length));
  return ids;
}

std::vector<Answer> answer_questions(const LlamaModel& model, const Tokenizer& tokenizer, const std::string& context,
                                     const std::vector<std::string>& questions, const PipelineOptions& options) {
  TORCH_CHECK(!questions.empty(), kOp, ": questions must hold at least one question, got none");
  TORCH_CHECK(options.max_new_tokens >= 1, kOp, ": max_new_tokens must be >= 1, got ", options.max_new_tokens);
  TORCH_CHECK(options.max_context_length >= 0, kOp, ": max_context_length must be >= 0 (0: no limit), got ",
              options.max_context_length);
  const BasePress* press = options.press;
  // A press evicting while decoding changes the context's cache, which the next question would reuse.
  const bool evicts_while_decoding = press != nullptr && press->decoding_role().compresses;
  TORCH_CHECK(!evicts_while_decoding || questions.size() == 1, kOp, ": ", press ? press->name() : std::string(),
              " compresses while decoding and takes a single question (as kvpress's pipeline for decoding "
              "presses), got ",
              questions.size());
  const bool observes_question = press != nullptr && press->observes_question();
  TORCH_CHECK(!observes_question || options.query_aware, kOp, ": ", press ? press->name() : std::string(),
              " observes the question: set query_aware (kvpress: the question after its delimiter token in the "
              "context)");
  const ChatTemplate* chat = options.chat_template;
  TORCH_CHECK(options.captured == nullptr || !options.query_aware || questions.size() == 1, kOp,
              ": a query-aware options.captured holds one question's prefill, got ", questions.size(), " questions");
  TORCH_CHECK(options.kvzip_scores == nullptr || options.captured != nullptr, kOp,
              ": options.kvzip_scores compress options.captured, which is not given");
  const std::string bos_text = bos_text_of(model, tokenizer, chat, kOp);
  const auto encode = [&](const std::string& text) { return tokenizer.encode(text, /*add_special_tokens=*/false); };

  // Each question's answer over `p`'s cache, which is cut back to the prefill afterwards.
  const auto answer = [&](Prefilled& p, const std::vector<int64_t>& question_ids) {
    const std::vector<int64_t> lengths = p.cache.lengths();
    const int64_t position = p.cache.position();
    ForwardOptions step;
    step.last_logits_only = true;
    step.press = press;
    step.press_state = p.press_state.get();
    Answer a;
    a.prefill_length = p.length;
    a.cache_lengths = lengths;
    a.kept_fraction = kept_fraction(p.cache, p.length);
    a.tokens = detail::greedy_continue(model, p.cache, p.logits, question_ids, step, options.max_new_tokens,
                                       /*stop_at_eos=*/true);
    a.text = tokenizer.decode(a.tokens, /*skip_special_tokens=*/true);
    if (!evicts_while_decoding) p.cache.truncate(lengths, position);  // else the context changed
    return a;
  };

  std::vector<Answer> answers;
  if (options.paged_kv_format) {
    TORCH_CHECK(
        options.captured == nullptr, kOp,
        ": options.captured is a dense prefill; answers over pages (paged_kv_format) prefill with prefill_paged");
    TORCH_CHECK(!observes_question, kOp, ": ", press ? press->name() : std::string(),
                " observes the question, which prefill_paged does not give a press (paged_kv_format)");
    const Framed framed = frame(context, bos_text, chat);
    for (const std::string& q : questions) {
      Answer a;
      if (options.query_aware) {
        QueryAwarePrefill aware = query_aware_prefill(tokenizer, context, q, bos_text, chat, false);
        a = answer_over_pages(model, std::move(aware.ids), encode(aware.framed.question_suffix + options.answer_prefix),
                              options);
      } else {
        a = answer_over_pages(model, encode(framed.prefill), encode(q + framed.question_suffix + options.answer_prefix),
                              options);
      }
      a.text = tokenizer.decode(a.tokens, /*skip_special_tokens=*/true);
      answers.push_back(std::move(a));
    }
    return answers;
  }
  if (!options.query_aware) {
    const Framed framed = frame(context, bos_text, chat);
    Prefilled p = prefill(model, tokenizer, encode(framed.prefill), 0, options);
    for (const std::string& q : questions) {
      std::vector<int64_t> ids = encode(q + framed.question_suffix + options.answer_prefix);
      answers.push_back(answer(p, ids));
    }
    return answers;
  }
  for (const std::string& q : questions) {
    QueryAwarePrefill aware = query_aware_prefill(tokenizer, context, q, bos_text, chat, observes_question);
    Prefilled p = prefill(model, tokenizer, std::move(aware.ids), aware.question_length, options);
    answers.push_back(answer(p, encode(aware.framed.question_suffix + options.answer_prefix)));
  }
  return answers;
}

}  // namespace kvpress::llama
