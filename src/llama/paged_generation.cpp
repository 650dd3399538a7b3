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

// Pages of `tokens` tokens in every KV head of one layer.
struct PageCount {
  int64_t kv_heads, page_size;
  int64_t operator()(int64_t tokens) const { return kv_heads * ((tokens + page_size - 1) / page_size); }
};

// generate_paged's checks of its arguments; returns the pool's pages per layer (options', or sized for
// max_batch of the longest prompt), which every prompt's worst case fits.
int64_t checked_pool_pages(const std::vector<std::vector<int64_t>>& prompts, const PagedGenerationOptions& options,
                           const PageCount& pages, const char* op) {
  TORCH_CHECK(options.max_new_tokens >= 0, op, ": max_new_tokens must be >= 0, got ", options.max_new_tokens);
  TORCH_CHECK(options.max_batch > 0, op, ": max_batch must be > 0, got ", options.max_batch);
  const std::string why_not = LlamaModel::why_not_paged_decoding(options.press);
  TORCH_CHECK(why_not.empty(), op, ": ", why_not);
  TORCH_CHECK(options.page_size > 0, op, ": page_size must be > 0, got ", options.page_size);
  TORCH_CHECK(options.pages_per_layer >= 0, op, ": pages_per_layer must be >= 0 (0: sized for max_batch), got ",
              options.pages_per_layer);
  const int64_t max_new = options.max_new_tokens;
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    TORCH_CHECK(!prompts[i].empty(), op, ": prompt ", i, " is empty");
    longest = std::max(longest, static_cast<int64_t>(prompts[i].size()));
  }
  const int64_t pages_per_layer =
      options.pages_per_layer > 0 ? options.pages_per_layer : options.max_batch * pages(longest + max_new);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t worst = pages(static_cast<int64_t>(prompts[i].size())) + pages(max_new);
    TORCH_CHECK(worst <= pages_per_layer, op, ": prompt ", i, " (", prompts[i].size(), " tokens) can need ", worst,
                " pages per layer with max_new_tokens ", max_new, ", more than the pool's ", pages_per_layer);
  }
  return pages_per_layer;
}

// The waiting prompts admitted now, in order (taken from `waiting`): at most `slots`, while the `free`
// pages per layer hold each one's worst case (its prompt stored whole and max_new tokens).
std::vector<int64_t> admit(std::deque<int64_t>& waiting, const std::vector<std::vector<int64_t>>& prompts, int64_t free,
                           int64_t slots, int64_t max_new, const PageCount& pages) {
  std::vector<int64_t> admitted;
  while (!waiting.empty() && static_cast<int64_t>(admitted.size()) < slots) {
    const int64_t need =
        pages(static_cast<int64_t>(prompts[static_cast<size_t>(waiting.front())].size())) + pages(max_new);
    if (need > free) break;
    free -= need;
    admitted.push_back(waiting.front());
    waiting.pop_front();
  }
  return admitted;
}

// Adds a just-prefilled sequence's pages to the statistics: those stored, and `uncompressed` (the
// prompt's pages per layer without a press) in every layer.
void count_prompt_pages(const PagedKVCache& cache, SequenceId seq, int64_t uncompressed, PagedGenerationStats& stats) {
  const PagedCacheOptions& o = cache.options();
  for (int64_t l = 0; l < o.num_layers; ++l) {
    stats.prompt_pages_uncompressed += uncompressed;
    for (int64_t h = 0; h < o.kv_heads; ++h)
      stats.prompt_pages_stored += static_cast<int64_t>(cache.pages(seq, l, h).size());
  }
}

// One token for every running sequence (its last one in `generations`) -> logits [B, vocab].
at::Tensor decode_running(const LlamaModel& model, PagedKVCache& cache,
                          const std::vector<std::unique_ptr<Running>>& running,
                          const std::vector<Generation>& generations, const BasePress* press) {
  std::vector<SequenceId> seqs;
  std::vector<int64_t> tokens;
  PagedDecodeOptions step;
  step.press = press;
  for (const auto& r : running) {
    seqs.push_back(r->seq);
    tokens.push_back(generations[static_cast<size_t>(r->prompt)].tokens.back());
    if (r->state) step.press_states.push_back(r->state.get());
  }
  return model.decode_paged(seqs, tokens, cache, step);
}

}  // namespace

PagedGenerations generate_paged(const LlamaModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                const PagedGenerationOptions& options) {
  constexpr const char* op = "generate_paged";
  const LlamaConfig& config = model.config();
  const int64_t max_new = options.max_new_tokens, page_size = options.page_size;
  const PageCount pages{config.num_kv_heads, page_size};
  const int64_t pages_per_layer = checked_pool_pages(prompts, options, pages, op);
  PagedGenerations out;
  out.generations.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i)
    out.generations[i].context_length = static_cast<int64_t>(prompts[i].size());
  PagedKVCache cache = model.new_paged_cache(pages_per_layer, page_size, options.kv_format);
  PagedGenerationStats& stats = out.stats;
  stats.num_layers = config.num_layers;
  stats.pages_per_layer = pages_per_layer;
  stats.page_size = page_size;
  stats.bytes_per_page = cache.stats().bytes_per_page;
  stats.kv_format = options.kv_format;
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
    const std::vector<int64_t> admitted =
        admit(waiting, prompts, free, options.max_batch - static_cast<int64_t>(running.size()), max_new, pages);
    if (!admitted.empty()) {
      std::vector<std::vector<int64_t>> batch;
      std::vector<SequenceId> seqs;
      std::vector<std::unique_ptr<PressSequenceState>> states;  // started by the prefill (record_prefill)
      prefill.press_states.clear();
      for (int64_t i : admitted) {
        batch.push_back(prompts[static_cast<size_t>(i)]);
        seqs.push_back(cache.add_sequence());
        states.push_back(new_sequence_state_of(options.press));
        if (states.back()) prefill.press_states.push_back(states.back().get());
      }
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
        r->state = std::move(states[k]);
        Generation& g = out.generations[static_cast<size_t>(r->prompt)];
        g.cache_lengths = longest_heads(cache, r->seq);
        count_prompt_pages(cache, r->seq, pages(g.context_length), stats);
        emit(*r, logits[static_cast<int64_t>(k)]);
        running.push_back(std::move(r));
      }
      stats.max_running = std::max(stats.max_running, static_cast<int64_t>(running.size()));
    }
    retire_finished();
    if (running.empty()) continue;

    const at::Tensor logits = decode_running(model, cache, running, out.generations, options.press);
    ++stats.decode_steps;
    for (size_t k = 0; k < running.size(); ++k) {
      ++running[k]->steps;
      emit(*running[k], logits[static_cast<int64_t>(k)]);
    }
    retire_finished();
  }
  const PagedCacheStats final_stats = cache.stats();
  stats.peak_pages_used = final_stats.peak_pages_used;
  stats.residual_bytes = final_stats.residual_bytes;
  return out;
}

}  // namespace kvpress::llama
