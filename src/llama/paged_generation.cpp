// generate_paged: continuous batching of greedy generations over one PagedKVCache.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "kvpress/llama/generation.h"

namespace kvpress::llama {
namespace {

// One prompt being generated.
struct Running {
  int64_t prompt = 0;
  SequenceId seq = 0;
  std::unique_ptr<PressSequenceState> state;  // its press's, fresh per generation (nullptr: none)
  int64_t steps = 0;                          // decoding steps run so far
  bool done = false;
};

// Per layer, the longest head of the sequence.
std::vector<int64_t> longest_heads(const PagedKVCache& cache, SequenceId seq) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < cache.options().num_layers; ++l) {
    const std::vector<int64_t> len = cache.lengths(seq, l);
    out.push_back(*std::max_element(len.begin(), len.end()));
  }
  return out;
}

}  // namespace

PagedGenerations generate_paged(const LlamaModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                const PagedGenerationOptions& options) {
  constexpr const char* op = "generate_paged";
  TORCH_CHECK(options.max_new_tokens >= 0, op, ": max_new_tokens must be >= 0, got ", options.max_new_tokens);
  TORCH_CHECK(options.max_batch > 0, op, ": max_batch must be > 0, got ", options.max_batch);
  const std::string why_not = LlamaModel::why_not_paged_decoding(options.press);
  TORCH_CHECK(why_not.empty(), op, ": ", why_not);
  TORCH_CHECK(options.page_size > 0, op, ": page_size must be > 0, got ", options.page_size);
  TORCH_CHECK(options.pages_per_layer >= 0, op, ": pages_per_layer must be >= 0 (0: sized for max_batch), got ",
              options.pages_per_layer);
  const LlamaConfig& config = model.config();
  const int64_t max_new = options.max_new_tokens, page_size = options.page_size;
  // Pages of `tokens` tokens in every KV head of one layer.
  const auto pages = [&](int64_t tokens) { return config.num_kv_heads * ((tokens + page_size - 1) / page_size); };
  PagedGenerations out;
  out.generations.resize(prompts.size());
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    TORCH_CHECK(!prompts[i].empty(), op, ": prompt ", i, " is empty");
    out.generations[i].context_length = static_cast<int64_t>(prompts[i].size());
    longest = std::max(longest, static_cast<int64_t>(prompts[i].size()));
  }
  const int64_t pages_per_layer =
      options.pages_per_layer > 0 ? options.pages_per_layer : options.max_batch * pages(longest + max_new);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t worst = pages(static_cast<int64_t>(prompts[i].size())) + pages(max_new);
    TORCH_CHECK(worst <= pages_per_layer, op, ": prompt ", i, " (", prompts[i].size(), " tokens) can need ", worst,
                " pages per layer with max_new_tokens ", max_new, ", more than the pool's ", pages_per_layer);
  }
  PagedKVCache cache = model.new_paged_cache(pages_per_layer, page_size);
  PagedGenerationStats& stats = out.stats;
  stats.num_layers = config.num_layers;
  stats.pages_per_layer = pages_per_layer;
  stats.page_size = page_size;
  stats.bytes_per_page = cache.stats().bytes_per_page;
  if (prompts.empty() || max_new == 0) return out;

  PagedPrefillOptions prefill;
  prefill.press = options.press;  // prefill_paged applies a PrefillDecodingPress's prefilling part
  prefill.press_attentions = options.press_attentions;
  const int64_t eos = config.eos_token_id;

  std::deque<int64_t> waiting;
  for (size_t i = 0; i < prompts.size(); ++i) waiting.push_back(static_cast<int64_t>(i));
  std::vector<std::unique_ptr<Running>> running;                 // stable addresses: decode_paged holds their states
  const auto emit = [&](Running& r, const at::Tensor& logits) {  // logits [vocab]
    if (options.on_logits) options.on_logits(r.prompt, r.steps, logits);
    std::vector<int64_t>& tokens = out.generations[static_cast<size_t>(r.prompt)].tokens;
    tokens.push_back(logits.argmax().item<int64_t>());
    r.done = static_cast<int64_t>(tokens.size()) >= max_new || (options.stop_at_eos && tokens.back() == eos);
  };
  const auto retire_finished = [&] {
    for (auto& r : running) {
      if (!r->done) continue;
      out.generations[static_cast<size_t>(r->prompt)].final_cache_lengths = longest_heads(cache, r->seq);
      cache.free_sequence(r->seq);  // its pages go to the next waiting prompt
    }
    running.erase(std::remove_if(running.begin(), running.end(), [](const auto& r) { return r->done; }), running.end());
  };

  while (!waiting.empty() || !running.empty()) {
    // Admit in order while the pool holds every running sequence's worst case and the prompt's.
    int64_t free = pages_per_layer;
    for (int64_t l = 0; l < config.num_layers; ++l) free = std::min(free, cache.free_pages(l));
    for (const auto& r : running)
      free -= pages(max_new - static_cast<int64_t>(out.generations[static_cast<size_t>(r->prompt)].tokens.size()));
    std::vector<std::vector<int64_t>> batch;
    std::vector<SequenceId> seqs;
    std::vector<int64_t> admitted;
    while (!waiting.empty() && static_cast<int64_t>(running.size() + admitted.size()) < options.max_batch) {
      const std::vector<int64_t>& prompt = prompts[static_cast<size_t>(waiting.front())];
      const int64_t need = pages(static_cast<int64_t>(prompt.size())) + pages(max_new);
      if (need > free) break;
      free -= need;
      batch.push_back(prompt);
      admitted.push_back(waiting.front());
      waiting.pop_front();
    }
    if (!admitted.empty()) {
      for (size_t k = 0; k < admitted.size(); ++k) seqs.push_back(cache.add_sequence());
      at::Tensor logits;
      try {
        logits = model.prefill_paged(batch, seqs, cache, prefill);
      } catch (...) {
        for (SequenceId s : seqs) cache.free_sequence(s);
        throw;
      }
      ++stats.prefill_batches;
      for (size_t k = 0; k < admitted.size(); ++k) {
        auto r = std::make_unique<Running>();
        r->prompt = admitted[k];
        r->seq = seqs[k];
        if (options.press) r->state = options.press->new_sequence_state();
        Generation& g = out.generations[static_cast<size_t>(r->prompt)];
        g.cache_lengths = longest_heads(cache, r->seq);
        for (int64_t l = 0; l < config.num_layers; ++l) {
          stats.prompt_pages_uncompressed += pages(g.context_length);
          for (int64_t h = 0; h < config.num_kv_heads; ++h)
            stats.prompt_pages_stored += static_cast<int64_t>(cache.pages(r->seq, l, h).size());
        }
        emit(*r, logits[static_cast<int64_t>(k)]);
        running.push_back(std::move(r));
      }
      stats.max_running = std::max(stats.max_running, static_cast<int64_t>(running.size()));
    }
    retire_finished();
    if (running.empty()) continue;

    // One token for every running sequence.
    std::vector<SequenceId> step_seqs;
    std::vector<int64_t> tokens;
    PagedDecodeOptions step;
    step.press = options.press;
    for (const auto& r : running) {
      step_seqs.push_back(r->seq);
      tokens.push_back(out.generations[static_cast<size_t>(r->prompt)].tokens.back());
      if (r->state) step.press_states.push_back(r->state.get());
    }
    const at::Tensor logits = model.decode_paged(step_seqs, tokens, cache, step);
    ++stats.decode_steps;
    for (size_t k = 0; k < running.size(); ++k) {
      ++running[k]->steps;
      emit(*running[k], logits[static_cast<int64_t>(k)]);
    }
    retire_finished();
  }
  stats.peak_pages_used = cache.stats().peak_pages_used;
  return out;
}

}  // namespace kvpress::llama
