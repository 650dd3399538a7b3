// The paged engine soak's parts (issue 39): seeded traffic, an engine driving
// LlamaModel::prefill_paged / decode_paged as examples/engine_loop.cpp does, with overcommitted
// admissions, preemption, cancellations and injected failures, and the cache's invariants. Used by
// tests/test_paged_soak.cpp (the soak) and tests/test_concurrency.cpp (the soak with reader threads,
// under ThreadSanitizer).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "fault_sweep.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"
#include "tiny_model.h"

namespace kvpress::testing {

struct SoakPress {
  std::string name;  // "" for none
  double ratio;
  std::map<std::string, std::string> params;
  // Its scores tie exactly in real arithmetic, so rounding picks the tokens kept: a request batched
  // with others may then part from the dense run (see the comparison in the test).
  bool exact_ties = false;
};

// Prefill presses, decoding presses (one starting its state at prefill) and none. KnormPress's
// layer-0 scores tie for every repeated token (a layer-0 key depends on the token and its position
// only, and RoPE, a rotation, keeps its norm); prefill KnormPress scores the same prompt in the same
// call shape as the dense run, DecodingPress(KnormPress) scores keys a decode step projected in one
// GEMM with the batch's other tokens (other last bits, 1e-6 here, than the dense run's one-row GEMM).
inline const std::vector<SoakPress> kSoakPresses = {
    {"", 0.0, {}},
    {"SnapKVPress", 0.5, {{"window_size", "16"}}},
    {"KnormPress", 0.3, {}},
    {"StreamingLLMPress", 0.6, {}},
    {"DecodingPress",
     0.0,
     {{"compression_interval", "4"}, {"target_size", "48"}, {"press", "KnormPress"}},
     /*exact_ties=*/true},
    {"RKVDecodingPress", 0.0, {{"budget", "40"}, {"divide_length", "8"}, {"window_size", "4"}}},
};

inline std::vector<std::unique_ptr<BasePress>> soak_presses() {
  std::vector<std::unique_ptr<BasePress>> presses;
  for (const SoakPress& p : kSoakPresses)
    presses.push_back(p.name.empty() ? nullptr : make_press(p.name, p.ratio, p.params));
  return presses;
}

inline int64_t env_or(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoll(value) : fallback;
}

struct Request {
  int64_t id = 0, arrival = 0, max_new = 0;
  size_t press = 0;
  std::vector<int64_t> prompt;
  int64_t cancel_after = -1;  // cancelled once it has this many tokens (-1: never)
};

struct Live {
  const Request* request = nullptr;
  SequenceId seq = 0;
  std::unique_ptr<PressSequenceState> state;
  std::vector<int64_t> tokens;
};

struct SoakFigures {
  int64_t steps = 0, prefills = 0, decode_calls = 0, tokens = 0, finished = 0, cancelled = 0, preempted = 0;
  int64_t refused_steps = 0, peak_pages = 0, invariant_checks = 0, injected_failures = 0, swept_steps = 0;
};

// The requests: prompt lengths 24..220, 4..24 new tokens, arrivals in bursts, a tenth cancelled.
inline std::vector<Request> make_traffic(int64_t steps, std::mt19937_64& rng) {
  std::vector<Request> out;
  std::uniform_int_distribution<int64_t> length(24, 220), new_tokens(4, 24), token(3, 1999), burst(0, 3);
  std::uniform_int_distribution<size_t> press(0, kSoakPresses.size() - 1);
  for (int64_t step = 0; step < steps * 3 / 4; step += 1 + static_cast<int64_t>(rng() % 6)) {
    for (int64_t k = burst(rng); k >= 0; --k) {
      Request r;
      r.id = static_cast<int64_t>(out.size());
      r.arrival = step;
      r.max_new = new_tokens(rng);
      r.press = press(rng);
      r.prompt.resize(static_cast<size_t>(length(rng)));
      for (int64_t& t : r.prompt) t = token(rng);
      r.prompt[0] = 1;  // BOS
      if (rng() % 10 == 0) r.cancel_after = static_cast<int64_t>(rng() % static_cast<uint64_t>(r.max_new));
      out.push_back(std::move(r));
    }
  }
  return out;
}

// The cache against what the engine holds: pages owned once or free, each head's pages its length's.
inline ::testing::AssertionResult cache_invariants(const PagedKVCache& cache, const std::vector<SequenceId>& live) {
  const PagedCacheOptions& o = cache.options();
  std::vector<SequenceId> held = cache.sequences(), expected = live;
  std::sort(expected.begin(), expected.end());
  if (held != expected)
    return ::testing::AssertionFailure() << "the cache holds " << held.size() << " sequences, the engine "
                                         << expected.size();
  int64_t used = 0;
  for (int64_t l = 0; l < o.num_layers; ++l) {
    std::set<int64_t> owned;
    for (SequenceId s : held) {
      for (int64_t h = 0; h < o.kv_heads; ++h) {
        const std::vector<int64_t>& pages = cache.pages(s, l, h);
        const int64_t length = cache.length(s, l, h);
        if (static_cast<int64_t>(pages.size()) != (length + o.page_size - 1) / o.page_size)
          return ::testing::AssertionFailure() << "sequence " << s << " layer " << l << " head " << h << " holds "
                                               << pages.size() << " pages for " << length << " tokens";
        for (int64_t p : pages)
          if (p < 0 || p >= o.pages_per_layer || !owned.insert(p).second)
            return ::testing::AssertionFailure() << "layer " << l << " page " << p << " out of the pool or owned twice";
      }
    }
    if (static_cast<int64_t>(owned.size()) + cache.free_pages(l) != o.pages_per_layer)
      return ::testing::AssertionFailure() << "layer " << l << ": " << owned.size() << " pages owned + "
                                           << cache.free_pages(l) << " free != " << o.pages_per_layer;
    used += static_cast<int64_t>(owned.size());
  }
  if (cache.stats().pages_used != used)
    return ::testing::AssertionFailure() << "stats().pages_used " << cache.stats().pages_used << ", owned " << used;
  return ::testing::AssertionSuccess();
}

inline bool out_of_pages(const c10::Error& e) {
  return std::string(e.what_without_backtrace()).find("out of pages") != std::string::npos;
}

// What a test adds to the engine's loop: a lock held exclusively for each step (other threads may
// read the cache under it shared, as paged.h's threading contract allows), and a call on each
// finished sequence before it is freed (on the engine thread).
struct SoakHooks {
  std::shared_mutex* cache_lock = nullptr;
  std::function<void(const PagedKVCache&, SequenceId)> on_finished;
};

class SoakEngine {
 public:
  // Every `sweep_every`-th step runs each of its cache calls with a failure at each fault point in
  // turn; sweep_every <= 0: no failure is injected at all.
  SoakEngine(const llama::LlamaModel& model, int64_t pages_per_layer, uint64_t seed, int64_t sweep_every)
      : model_(model), cache_(model.new_paged_cache(pages_per_layer, 16)), rng_(seed), sweep_every_(sweep_every) {}

  const PagedKVCache& cache() const { return cache_; }

  SoakFigures run(const std::vector<Request>& traffic, int64_t steps,
                  std::map<int64_t, std::vector<int64_t>>& finished_tokens, const SoakHooks& hooks = {}) {
    hooks_ = hooks;
    size_t next = 0;
    for (int64_t step = 0; step < steps || !waiting_.empty() || !running_.empty(); ++step) {
      std::unique_lock<std::shared_mutex> lock;
      if (hooks_.cache_lock != nullptr) lock = std::unique_lock<std::shared_mutex>(*hooks_.cache_lock);
      for (; next < traffic.size() && traffic[next].arrival <= step; ++next) waiting_.push_back(&traffic[next]);
      sweeping_ = sweep_every_ > 0 && step % sweep_every_ == sweep_every_ - 1;
      figures_.swept_steps += sweeping_ ? 1 : 0;
      admit();
      decode(finished_tokens);
      cancel_some();
      ++figures_.steps;
      figures_.peak_pages = std::max(figures_.peak_pages, cache_.stats().pages_used);
      ++figures_.invariant_checks;
      std::vector<SequenceId> live;
      for (const auto& r : running_) live.push_back(r->seq);
      EXPECT_TRUE(cache_invariants(cache_, live)) << "step " << step;
      if (figures_.steps % 20000 == 0)  // a long run's progress
        std::printf("soak: step %lld, %lld finished, %lld cancelled, %lld injected failures\n",
                    static_cast<long long>(figures_.steps), static_cast<long long>(figures_.finished),
                    static_cast<long long>(figures_.cancelled), static_cast<long long>(figures_.injected_failures));
      if (::testing::Test::HasFailure() || step > 50 * steps) break;
    }
    EXPECT_EQ(cache_.stats().pages_used, 0) << "every finished or cancelled sequence gave its pages back";
    return figures_;
  }

 private:
  // call(), failing first at each of its fault points in turn on a sweeping step, and otherwise one
  // call in 48 failing at one of its first 64 fault points (fault_injection.h: tensor allocations,
  // pages taken, table growth and uploads): a failed call must leave the cache as it was, and the
  // engine then makes the same call again.
  template <typename Call>
  auto with_injected_failures(Call&& call) {
    decltype(call()) out{};
    const bool inject = sweeping_ || (sweep_every_ > 0 && rng_() % 48 == 0);
    if (!inject) return call();
    const CacheImage before = image_of(cache_);
    const auto unchanged = [&] {
      ++figures_.injected_failures;
      EXPECT_TRUE(same_image(image_of(cache_), before))
          << "a failed call changed the cache (failure " << figures_.injected_failures << ")";
    };
    if (sweeping_) {
      sweep_fault_points([&] { out = call(); }, unchanged);
      return out;
    }
    detail::inject_failure_after(static_cast<int64_t>(rng_() % 64));
    try {
      out = call();  // it passed fewer points: nothing failed
      detail::inject_failure_after(-1);
      return out;
    } catch (const c10::Error& e) {
      detail::inject_failure_after(-1);
      if (!is_injected_failure(e)) throw;
      unchanged();
      return call();
    }
  }

  void free_sequence(SequenceId seq) {
    with_injected_failures([&] {
      cache_.free_sequence(seq);
      return 0;
    });
  }

  // Pages of one layer a request may need: its prompt and every new token stored whole.
  int64_t worst_pages(const Request& r) const {
    return model_.config().num_kv_heads * ((static_cast<int64_t>(r.prompt.size()) + r.max_new + 15) / 16);
  }

  // Admits waiting requests in order while the pool holds their worst case, and now and then one
  // whose prompt fits but whose worst case does not (the decode steps may then run out).
  void admit() {
    while (!waiting_.empty()) {
      const Request& r = *waiting_.front();
      int64_t free_now = cache_.free_pages(0);
      for (int64_t l = 1; l < model_.config().num_layers; ++l) free_now = std::min(free_now, cache_.free_pages(l));
      int64_t free = free_now;  // less what the running sequences may still take
      for (const auto& live : running_)
        free -= model_.config().num_kv_heads *
                ((live->request->max_new - static_cast<int64_t>(live->tokens.size()) + 15) / 16 + 1);
      const bool overcommit = rng_() % 2 == 0 && free_now >= worst_pages(r);
      if (worst_pages(r) > free && !overcommit) return;
      auto live = std::make_unique<Live>();
      live->request = &r;
      live->seq = with_injected_failures([&] { return cache_.add_sequence(); });
      live->state = new_sequence_state_of(presses_[r.press].get());
      llama::PagedPrefillOptions prefill;
      prefill.press = presses_[r.press].get();
      if (live->state) prefill.press_states = {live->state.get()};
      const at::Tensor logits =
          with_injected_failures([&] { return model_.prefill_paged({r.prompt}, {live->seq}, cache_, prefill); });
      ++figures_.prefills;
      live->tokens.push_back(logits[0].argmax().item<int64_t>());
      waiting_.pop_front();
      running_.push_back(std::move(live));
    }
  }

  // One decode step per press among the running sequences; a step that runs out of pages changes
  // nothing, and the youngest sequence of its group is preempted (queued again from scratch).
  void decode(std::map<int64_t, std::vector<int64_t>>& finished_tokens) {
    retire(finished_tokens);
    for (size_t p = 0; p < presses_.size(); ++p) {
      std::vector<Live*> group;
      for (const auto& r : running_)
        if (r->request->press == p) group.push_back(r.get());
      if (group.empty()) continue;
      std::vector<SequenceId> seqs;
      std::vector<int64_t> tokens;
      llama::PagedDecodeOptions step;
      step.press = presses_[p].get();
      for (Live* r : group) {
        seqs.push_back(r->seq);
        tokens.push_back(r->tokens.back());
        if (r->state) step.press_states.push_back(r->state.get());
      }
      ++figures_.decode_calls;
      at::Tensor logits;
      try {
        logits = with_injected_failures([&] { return model_.decode_paged(seqs, tokens, cache_, step); });
      } catch (const c10::Error& e) {
        ASSERT_TRUE(out_of_pages(e)) << e.what_without_backtrace();
        ++figures_.refused_steps;
        preempt(group.back());
        continue;
      }
      for (size_t i = 0; i < group.size(); ++i) {
        group[i]->tokens.push_back(logits[static_cast<int64_t>(i)].argmax().item<int64_t>());
        ++figures_.tokens;
      }
    }
    retire(finished_tokens);
  }

  void retire(std::map<int64_t, std::vector<int64_t>>& finished_tokens) {
    for (auto& r : running_) {
      if (static_cast<int64_t>(r->tokens.size()) < r->request->max_new) continue;
      finished_tokens[r->request->id] = r->tokens;
      if (hooks_.on_finished) hooks_.on_finished(cache_, r->seq);
      ++figures_.finished;
      free_sequence(r->seq);
      r.reset();
    }
    running_.erase(std::remove(running_.begin(), running_.end(), nullptr), running_.end());
  }

  void preempt(Live* victim) {
    ++figures_.preempted;
    waiting_.push_front(victim->request);
    free_sequence(victim->seq);
    running_.erase(std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == victim; }));
  }

  void cancel_some() {
    for (auto& r : running_) {
      if (r->request->cancel_after < 0 || static_cast<int64_t>(r->tokens.size()) < r->request->cancel_after) continue;
      ++figures_.cancelled;
      free_sequence(r->seq);
      r.reset();
    }
    running_.erase(std::remove(running_.begin(), running_.end(), nullptr), running_.end());
  }

  const llama::LlamaModel& model_;
  PagedKVCache cache_;
  std::mt19937_64 rng_;
  const int64_t sweep_every_;
  bool sweeping_ = false;
  SoakHooks hooks_;
  const std::vector<std::unique_ptr<BasePress>> presses_ = soak_presses();
  std::deque<const Request*> waiting_;
  std::vector<std::unique_ptr<Live>> running_;
  SoakFigures figures_;
};

// The request's tokens from the paged runner with no other sequence in the cache.
inline std::vector<int64_t> paged_alone(const Request& r, const BasePress* press) {
  const llama::LlamaModel& model = tiny_model();
  PagedKVCache cache = model.new_paged_cache(160, 16);
  const SequenceId seq = cache.add_sequence();
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(press);
  llama::PagedPrefillOptions prefill;
  prefill.press = press;
  if (state) prefill.press_states = {state.get()};
  std::vector<int64_t> tokens{model.prefill_paged({r.prompt}, {seq}, cache, prefill)[0].argmax().item<int64_t>()};
  llama::PagedDecodeOptions step;
  step.press = press;
  if (state) step.press_states = {state.get()};
  while (static_cast<int64_t>(tokens.size()) < r.max_new)
    tokens.push_back(model.decode_paged({seq}, {tokens.back()}, cache, step)[0].argmax().item<int64_t>());
  return tokens;
}

}  // namespace kvpress::testing
