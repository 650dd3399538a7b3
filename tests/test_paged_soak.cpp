// The paged engine under load (issue 39, item 1, short run): a seeded traffic generator drives
// LlamaModel::prefill_paged / decode_paged as an engine does (examples/engine_loop.cpp), with random
// prompt lengths, arrival steps, presses (prefill, decoding, none) and output lengths, admissions
// that overcommit the pool (a decode step then runs out of pages, fails whole, and the engine
// preempts its youngest sequence and queues it again), and requests cancelled at random steps
// (PagedKVCache::free_sequence). After every step the cache's invariants are checked: every page of a
// layer is owned by one head or free, never both and never twice; each head holds exactly the pages
// its length needs; the live sequences are the engine's; and every finished or cancelled sequence
// gave its pages back. One call in 48 has a device-table upload fail part-way (item 2's injection,
// for the one failure point the cache has a hook for so far): the cache must then be as it was
// (pages, positions, rows, free pages), and the engine makes the call again. Every finished
// request's tokens equal the dense runner's for its prompt and press alone (one exception: exact
// score ties, see kSoakPresses). KVPRESS_SOAK_STEPS sets the length (default 1500 steps),
// KVPRESS_SOAK_COMPARE_EVERY compares only every n-th finished request (default 1: all).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "paged_soak.h"
#include "test_util.h"

namespace kvpress {
namespace {

using namespace testing;  // the soak's parts (paged_soak.h)

TEST(PagedSoak, TrafficWithOvercommitAndCancellationsKeepsEveryInvariant) {
  const int64_t steps = env_or("KVPRESS_SOAK_STEPS", 1500);
  std::mt19937_64 rng(39);
  const std::vector<Request> traffic = make_traffic(steps, rng);
  SoakEngine engine(testing::tiny_model(), 160, 40, env_or("KVPRESS_SOAK_SWEEP_EVERY", 300));
  std::map<int64_t, std::vector<int64_t>> finished;
  const SoakFigures f = engine.run(traffic, steps, finished);
  std::printf(
      "soak: %lld steps, %zu requests, %lld prefills, %lld decode calls, %lld tokens, %lld finished, %lld cancelled, "
      "%lld preempted after %lld refused steps, peak %lld pages of %d, %lld invariant checks, %lld injected failures "
      "(%lld steps swept)\n",
      static_cast<long long>(f.steps), traffic.size(), static_cast<long long>(f.prefills),
      static_cast<long long>(f.decode_calls), static_cast<long long>(f.tokens), static_cast<long long>(f.finished),
      static_cast<long long>(f.cancelled), static_cast<long long>(f.preempted), static_cast<long long>(f.refused_steps),
      static_cast<long long>(f.peak_pages), 2 * 160, static_cast<long long>(f.invariant_checks),
      static_cast<long long>(f.injected_failures), static_cast<long long>(f.swept_steps));
  EXPECT_GT(f.preempted, 0) << "the traffic must overcommit the pool at least once";
  EXPECT_GT(f.cancelled, 0);
  EXPECT_GT(f.injected_failures, 0);
  EXPECT_EQ(f.finished + f.cancelled, static_cast<int64_t>(traffic.size()));
  // Every finished request's tokens equal the dense runner's for its prompt and press alone, but for
  // a press with exact ties (kSoakPresses): a batched step's rounding may break a tie the other way
  // (a 67,096-step run found 2 of 29,108 requests, docs/RELIABILITY.md). Such a request must then
  // give the dense tokens when run alone through the paged runner (its own rounding, no batch), and
  // parting requests must stay rare: any fault of the batched path would show in most requests.
  const int64_t every = std::max<int64_t>(1, env_or("KVPRESS_SOAK_COMPARE_EVERY", 1));
  const std::vector<std::unique_ptr<BasePress>> presses = soak_presses();
  int64_t compared = 0, parted_at_ties = 0;
  for (const auto& [id, tokens] : finished) {
    if (id % every != 0) continue;
    const Request& r = traffic[static_cast<size_t>(id)];
    ++compared;
    llama::GenerationOptions dense;
    dense.press = presses[r.press].get();
    dense.max_new_tokens = r.max_new;
    dense.stop_at_eos = false;
    const std::vector<int64_t> expected = llama::generate_greedy(testing::tiny_model(), r.prompt, {}, dense).tokens;
    if (tokens == expected) continue;
    const std::string what = "request " + std::to_string(id) + " (" +
                             (r.press == 0 ? "no press" : kSoakPresses[r.press].name) + ", prompt " +
                             std::to_string(r.prompt.size()) + ")";
    EXPECT_TRUE(kSoakPresses[r.press].exact_ties) << what << " parted from the dense run";
    EXPECT_EQ(paged_alone(r, presses[r.press].get()), expected) << what << " run alone on the paged runner";
    ++parted_at_ties;
  }
  std::printf("soak: %lld finished requests compared with the dense runner, %lld parted at exact ties\n",
              static_cast<long long>(compared), static_cast<long long>(parted_at_ties));
  EXPECT_LE(parted_at_ties * 200, compared) << "more than 1 in 200 requests parted from the dense run at ties";
}

}  // namespace
}  // namespace kvpress
