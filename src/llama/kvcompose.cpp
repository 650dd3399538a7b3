// KVCompose's second pass run on the Llama runner (include/kvpress/llama/kvcompose.h): the pass is
// the press's own (src/presses/kvcompose_pass.cpp); here it gets a LlamaModel.
#include "kvpress/llama/kvcompose.h"

#include <utility>

#include "second_pass_run.h"

namespace kvpress::llama {

KVComposeResult kvcompose_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                                  const KVComposePress& press, const KVComposeRunOptions& run,
                                  const PrefillOptions& prefill) {
  detail::LlamaSecondPassRun pass_run("kvcompose_prefill", model, context_ids, cache, prefill, press);
  KVComposePassResult pass;
  KVComposeResult result;
  result.prefill = pass_run.take_output([&] { pass = press.run_second_pass(pass_run, run); });
  result.budgets = std::move(pass.budgets);
  result.scores = std::move(pass.scores);
  result.memory = pass.memory;
  return result;
}

}  // namespace kvpress::llama
