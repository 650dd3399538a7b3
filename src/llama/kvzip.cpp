// The KVzip family's passes run on the Llama runner (include/kvpress/llama/kvzip.h): the passes are
// the presses' own (src/presses/kvzip_pass.cpp, kvgrad_pass.cpp); here they get a LlamaModel.
#include "kvpress/llama/kvzip.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <utility>

#include "presses/kvzip_pass.h"
#include "second_pass_run.h"

namespace kvpress::llama {
namespace {

// Runs `pass` (one of the family's passes) through a run of this prefill: the run's output and the
// pass's report, as KVzipResult. A failure leaves the cache as it was.
template <typename Pass>
KVzipResult run_pass(const char* op, const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                     const PrefillOptions& options, const BasePress& press, Pass&& pass) {
  detail::LlamaSecondPassRun run(op, model, context_ids, cache, options, press);
  KVzipPassResult report;
  KVzipResult result;
  result.prefill = run.take_output([&] { report = pass(run); });
  result.scores = std::move(report.scores);
  result.memory = report.memory;
  result.restore_keys = std::move(report.restore_keys);
  result.restore_values = std::move(report.restore_values);
  return result;
}

// `prefill` with the tokenizer whose text the pass encodes.
PrefillOptions with_tokenizer(const PrefillOptions& prefill, const Tokenizer& tokenizer) {
  PrefillOptions options = prefill;
  options.tokenizer = &tokenizer;
  return options;
}

void require_plain_kvzip(const char* op, const KVzipPress& press) {
  TORCH_CHECK(KVzipPress::plain(&press) != nullptr, op, ": ", press.name(),
              " adds to KVzip's passes (restore tokens, gradients); run kvzip_prefill");
}

}  // namespace

KVzipResult kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                          const KVzipPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill,
                          const KVzipRunOptions& run) {
  return run_pass("kvzip_prefill", model, context_ids, cache, with_tokenizer(prefill, tokenizer), press,
                  [&](SecondPassRun& r) { return press.run_second_pass(r, run); });
}

KVzipResult kvgrad_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                           const KVgradPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill,
                           const KVgradRunOptions& run) {
  return run_pass("kvgrad_prefill", model, context_ids, cache, with_tokenizer(prefill, tokenizer), press,
                  [&](SecondPassRun& r) { return press.run_kvgrad_pass(r, run); });
}

KVzipResult fast_kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                               const FastKVzipPress& press, const PrefillOptions& prefill) {
  return run_pass("fast_kvzip_prefill", model, context_ids, cache, prefill, press,
                  [&](SecondPassRun& r) { return press.run_second_pass(r); });
}

at::Tensor kvzip_scores(const LlamaModel& model, const at::Tensor& context_ids, const KVzipPress& press,
                        const Tokenizer& tokenizer, const ChatTemplate* chat_template, const KVzipRunOptions& run,
                        const CapturedPrefill* captured) {
  constexpr const char* op = "kvzip_scores";
  require_plain_kvzip(op, press);
  TORCH_CHECK(captured == nullptr || (static_cast<int64_t>(captured->layers.size()) == model.config().num_layers &&
                                      captured->is_prefill_of(context_ids)),
              op, ": captured holds another prefill than context_ids (capture_prefill of them)");
  PrefillOptions options;
  options.tokenizer = &tokenizer;
  options.chat_template = chat_template;
  KVCache unused = model.new_cache();  // the scoring pass fills no cache
  const detail::LlamaSecondPassRun pass_run(op, model, context_ids, unused, options, press, captured);
  return press.replay_scores(pass_run, run);
}

KVCache kvzip_compress_captured(const LlamaModel& model, const CapturedPrefill& captured, const KVzipPress& press,
                                const at::Tensor& scores, const PrefillOptions& options) {
  constexpr const char* op = "kvzip_compress_captured";
  require_plain_kvzip(op, press);
  model.check_press_on_shard(&press, op);
  const LlamaConfig& c = model.config();
  TORCH_CHECK(!captured.layers.empty() && captured.layers.front().keys.defined(), op,
              ": the capture is empty (LlamaModel::capture_prefill)");
  const int64_t n = captured.layers.front().keys.size(2);
  TORCH_CHECK(scores.defined() && scores.dim() == 3 && scores.size(0) == c.num_layers &&
                  scores.size(1) == c.num_kv_heads && scores.size(2) == n,
              op, ": scores must be [", c.num_layers, ", ", c.num_kv_heads, ", ", n,
              "] (kvzip_scores of the captured context), got ",
              scores.defined() ? c10::str(scores.sizes()) : std::string("undefined"));
  PrefillOptions compressing = options;
  if (press.compression_ratio() == 0.0) {  // kvzip_prefill's plain prefill
    compressing.press = nullptr;
    return model.compress_captured(captured, compressing);
  }
  const std::unique_ptr<BasePress> selected = selected_tokens_press(
      press,
      kvpress::detail::keep_masks_over_ranks(model, scores, [&](const at::Tensor& s) { return press.keep_masks(s); }));
  compressing.press = selected.get();
  return model.compress_captured(captured, compressing);
}

}  // namespace kvpress::llama
