// Thread safety (the contract in kvpress/presses/base_press.h and kvpress/cache.h): one press
// object shared by 8 threads, each compressing its own layer at the same time, returns exactly
// what serial calls return; a HeadRaggedLayer read by ops::ragged_attention from several threads
// at once equals the serial result; one LlamaModel generates for 8 sequences at once, each with its
// own KVCache and DecodingState; the registry's first use may come from several threads.
// scripts/test_tsan.sh runs these under ThreadSanitizer (docs/RELIABILITY.md).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvpress/kvpress.h"
#include "kvpress/llama/generation.h"
#include "kvpress/llama/model.h"
#include "kvpress/llama/tokenizer.h"
#include "kvpress/presses/qsm_press.h"
#include "paged_soak.h"
#include "random_inputs.h"
#include "runnable_press.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::randn;
using testing::random_layer;

constexpr int kThreads = 8;

// Runs fn(0) .. fn(n - 1) on n threads that start together (each waits until all exist), and
// returns the message of each call's exception ("" when it returned).
std::vector<std::string> run_together(int n, const std::function<void(int)>& fn) {
  std::atomic<int> waiting{n};
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      waiting.fetch_sub(1);
      while (waiting.load() > 0) std::this_thread::yield();
      try {
        fn(i);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// What a press returns for one layer, whatever its shape: compress() for uniform presses,
// compress_ragged() for head-ragged ones (then keys/values/kept_indices are the heads' concatenation).
struct Compressed {
  at::Tensor keys, values, kept_indices, keep_mask;
};

Compressed compress_any(const BasePress& press, const LayerInputs& in) {
  if (!press.head_ragged()) {
    const KV kv = press.compress(in);
    return {kv.keys, kv.values, kv.kept_indices, {}};
  }
  const RaggedKV kv = press.compress_ragged(in);
  std::vector<at::Tensor> keys, values, kept;
  for (const HeadKV& head : kv.heads) {
    keys.push_back(head.keys);
    values.push_back(head.values);
    kept.push_back(head.kept_indices);
  }
  return {at::cat(keys), at::cat(values), at::cat(kept), kv.keep_mask};
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || (a.sizes() == b.sizes() && at::equal(a, b)));
}

TEST(Concurrency, EveryPressSharedByEightThreadsMatchesSerialCalls) {
  std::vector<LayerInputs> inputs;
  for (int i = 0; i < kThreads; ++i)
    inputs.push_back(random_layer(96 + 16 * i, 100 + 10 * i, 8, 2, 16, /*with_input_ids=*/true));
  int presses_checked = 0;
  for (const PressInfo& info : list_presses()) {
    // As EveryPress.KeepsNKeptAscendingTokensMatchingTheGatheredCache: decoding presses compress
    // during generation (a DecodingState per sequence), KVComposePress needs its second pass.
    if (info.kind == PressKind::kDecoding || info.kind == PressKind::kSecondPass) continue;
    SCOPED_TRACE(info.name);
    // Presses with a random draw get a seed: without one every call draws fresh scores.
    std::unique_ptr<BasePress> built =
        make_press(info.name, ratio_for(info, 0.5), testing::runnable_params(info, inputs.front()));
    // QSMPress and CTRPress call their token text function from every thread.
    if (auto* qsm = dynamic_cast<QSMPress*>(built.get()))
      qsm->set_token_text([](int64_t id) { return id % 4 == 0 ? std::string("the") : "word" + std::to_string(id); });
    const std::unique_ptr<const BasePress> press = std::move(built);

    std::vector<Compressed> serial;
    for (const LayerInputs& in : inputs) serial.push_back(compress_any(*press, in));
    std::vector<Compressed> concurrent(kThreads);
    const std::vector<std::string> errors =
        run_together(kThreads, [&](int i) { concurrent[static_cast<size_t>(i)] = compress_any(*press, inputs[i]); });
    for (int i = 0; i < kThreads; ++i) {
      ASSERT_EQ(errors[i], "") << "thread " << i;
      const Compressed &a = serial[static_cast<size_t>(i)], &b = concurrent[static_cast<size_t>(i)];
      EXPECT_TRUE(same(a.kept_indices, b.kept_indices)) << "thread " << i;
      EXPECT_TRUE(same(a.keys, b.keys)) << "thread " << i;
      EXPECT_TRUE(same(a.values, b.values)) << "thread " << i;
      EXPECT_TRUE(same(a.keep_mask, b.keep_mask)) << "thread " << i;
    }
    ++presses_checked;
  }
  EXPECT_GE(presses_checked, 20);
}

TEST(Concurrency, RaggedAttentionReadsOneLayerFromEightThreads) {
  // A layer whose heads keep different counts (one keeps nothing), with appended tokens, read by
  // decode (n = 1, the flash-decoding split) and prefill-style (n = 4) attention.
  const int64_t batch = 2, kv_heads = 2, heads = 8, seq = 300, d = 32;
  at::Tensor mask = at::rand({batch, kv_heads, seq}, at::TensorOptions().dtype(at::kFloat)) < 0.4;
  mask[0][1].fill_(false);
  HeadRaggedLayer layer =
      HeadRaggedLayer::from_mask(randn({batch, kv_heads, seq, d}, 1), randn({batch, kv_heads, seq, d}, 2), mask);
  layer.append(randn({batch, kv_heads, 6, d}, 3), randn({batch, kv_heads, 6, d}, 4));

  std::vector<at::Tensor> queries, serial;
  for (int i = 0; i < kThreads; ++i) {
    queries.push_back(randn({batch, heads, i % 2 == 0 ? 1 : 4, d}, 10 + i));
    serial.push_back(ops::ragged_attention(queries.back(), layer));
  }
  std::vector<at::Tensor> concurrent(kThreads);
  const std::vector<std::string> errors = run_together(kThreads, [&](int i) {
    concurrent[static_cast<size_t>(i)] = ops::ragged_attention(queries[static_cast<size_t>(i)], layer);
  });
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(errors[i], "") << "thread " << i;
    EXPECT_TRUE(at::equal(concurrent[i], serial[i])) << "thread " << i;
  }
}

TEST(Concurrency, PagedAttentionReadsOneCacheFromEightThreads) {
  // Three sequences of different lengths stored through a head-ragged press (heads keep different
  // counts), then decoded tokens appended: 8 threads attend over them at once, n = 1 and n = 2.
  const int64_t kv_heads = 2, heads = 4, d = 16;
  PagedCacheOptions opt;
  opt.kv_heads = kv_heads;
  opt.head_dim = d;
  opt.page_size = 8;
  opt.pages_per_layer = 256;
  PagedKVCache cache(opt);
  const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
  const at::Tensor cu = at::tensor({int64_t{0}, int64_t{70}, int64_t{95}, int64_t{215}});
  const auto press = make_press("AdaKVPress", 0.5, {{"press", "KnormPress"}});
  cache.store(0, seqs, randn({215, kv_heads, d}, 1), randn({215, kv_heads, d}, 2), cu, press.get());
  cache.append(0, seqs, randn({3, kv_heads, 2, d}, 3), randn({3, kv_heads, 2, d}, 4));

  std::vector<at::Tensor> queries, serial;
  for (int i = 0; i < kThreads; ++i) {
    queries.push_back(randn({3, heads, i % 2 == 0 ? 1 : 2, d}, 10 + i));
    serial.push_back(cache.attention(0, seqs, queries.back()));
  }
  std::vector<at::Tensor> concurrent(kThreads);
  const std::vector<std::string> errors = run_together(kThreads, [&](int i) {
    concurrent[static_cast<size_t>(i)] = cache.attention(0, seqs, queries[static_cast<size_t>(i)]);
  });
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(errors[i], "") << "thread " << i;
    EXPECT_TRUE(at::equal(concurrent[i], serial[i])) << "thread " << i;
  }
}

// One head's attention for one query token, from its keys and values [L, D]: the reference.
at::Tensor head_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  return at::softmax(at::matmul(keys, q) * scale, 0).unsqueeze(0).matmul(values).squeeze(0);  // [D]
}

// The paged engine's soak (paged_soak.h, no injected failures) on one thread, and two readers that
// use its cache as paged.h's threading contract allows: only while it does not mutate (a shared
// lock; the engine holds it exclusively for each step), to read its statistics and export a live
// sequence, and from snapshots (export_sequence, taken by the engine as each request finishes,
// before freeing it), which they adopt into caches of their own and attend over while the engine
// goes on reusing those pages. Under ThreadSanitizer (scripts/test_tsan.sh) a snapshot that still
// shared the engine's pools, or a const read with hidden state, is reported as a race.
TEST(Concurrency, PagedEngineSoakWithReadersOfStatisticsAndSnapshots) {
  const llama::LlamaModel& model = testing::tiny_model();
  std::mt19937_64 rng(39);
  const int64_t steps = 200;
  const std::vector<testing::Request> traffic = testing::make_traffic(steps, rng);
  testing::SoakEngine engine(model, 160, 40, /*sweep_every=*/0);
  std::shared_mutex cache_lock;
  std::mutex queue_lock;
  std::deque<SequenceTokens> finished;
  std::atomic<bool> done{false};
  std::atomic<int64_t> attended{0}, stats_read{0};
  testing::SoakHooks hooks;
  hooks.cache_lock = &cache_lock;
  hooks.on_finished = [&](const PagedKVCache& cache, SequenceId seq) {
    SequenceTokens snapshot = cache.export_sequence(seq);
    const std::lock_guard<std::mutex> lock(queue_lock);
    finished.push_back(std::move(snapshot));
  };
  const PagedCacheOptions options = engine.cache().options();
  const int64_t group = model.config().num_heads / options.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(options.head_dim));
  // A reader: the statistics and a live sequence's export under the shared lock, then each snapshot
  // it takes off the queue adopted into its own cache and attended over, layer by layer.
  const auto read = [&](int reader) {
    PagedKVCache own(options);
    for (int64_t round = 0;; ++round) {
      const bool last_round = done.load();
      {
        const std::shared_lock<std::shared_mutex> lock(cache_lock);
        const PagedKVCache& cache = engine.cache();
        const PagedCacheStats stats = cache.stats();
        int64_t free = 0;
        for (int64_t l = 0; l < options.num_layers; ++l) free += cache.free_pages(l);
        ASSERT_EQ(stats.pages_used + free, options.num_layers * options.pages_per_layer) << "reader " << reader;
        const std::vector<SequenceId> live = cache.sequences();
        if (!live.empty()) cache.export_sequence(live[static_cast<size_t>(round) % live.size()]);
        ++stats_read;
      }
      std::optional<SequenceTokens> snapshot;
      {
        const std::lock_guard<std::mutex> lock(queue_lock);
        if (!finished.empty()) {
          snapshot = std::move(finished.front());
          finished.pop_front();
        }
      }
      if (!snapshot) {
        if (last_round) return;
        std::this_thread::yield();
        continue;
      }
      const SequenceId seq = own.adopt_sequence(*snapshot);
      for (int64_t l = 0; l < options.num_layers; ++l) {
        const at::Tensor q = randn({1, model.config().num_heads, 1, options.head_dim}, 1000 * reader + round);
        const at::Tensor out = own.attention(l, {seq}, q, scale);  // [1, Hq, 1, D]
        for (int64_t h = 0; h < model.config().num_heads; ++h) {
          const at::Tensor expected =
              head_attention(q[0][h][0], own.head_keys(seq, l, h / group), own.head_values(seq, l, h / group), scale);
          ASSERT_TRUE(at::allclose(out[0][h][0], expected, 1e-5, 1e-5)) << "reader " << reader << " layer " << l;
        }
      }
      own.free_sequence(seq);
      ++attended;
    }
  };
  std::map<int64_t, std::vector<int64_t>> tokens;
  testing::SoakFigures figures;
  const std::vector<std::string> errors = run_together(3, [&](int i) {
    if (i > 0) return read(i);
    figures = engine.run(traffic, steps, tokens, hooks);
    done = true;
  });
  for (int i = 0; i < 3; ++i) ASSERT_EQ(errors[static_cast<size_t>(i)], "") << "thread " << i;
  EXPECT_EQ(attended.load(), figures.finished) << "every finished request's snapshot was attended over";
  EXPECT_GT(stats_read.load(), 0);
  EXPECT_GT(figures.finished, 50);
}

// One model, tokenizer and set of presses shared by 8 generations at once (generate_greedy gives
// each its own KVCache and DecodingState): a uniform press, a head-ragged one (packed layers read by
// ops::ragged_attention), QSMPress calling the shared tokenizer for its token text, a decoding press.
TEST(Concurrency, OneLlamaModelGeneratesEightSequencesAtOnce) {
  const std::string dir = llama::resolve_model_dir("tinystories-656k");
  const llama::LlamaModel model = llama::LlamaModel::load(dir);
  const llama::Tokenizer tokenizer = llama::Tokenizer::load(dir + "/tokenizer.json");
  auto qsm = std::make_unique<QSMPress>(0.5);
  qsm->set_token_text([&tokenizer](int64_t id) { return tokenizer.decode({id}, /*skip_special_tokens=*/false); });
  std::vector<std::unique_ptr<const BasePress>> presses;
  presses.push_back(make_press("SnapKVPress", 0.5, {{"window_size", "8"}}));
  presses.push_back(make_press("AdaKVPress", 0.5, {{"press", "KeyDiffPress"}}));
  presses.push_back(std::move(qsm));
  presses.push_back(make_press("DecodingPress", 0.0,
                               {{"press", "KnormPress"}, {"compression_interval", "3"}, {"target_size", "24"}}));

  const std::string story =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
      "friends. One day, Lily saw a big red ball under a tree. She ran to the ball and kicked it very hard. The "
      "ball flew over the fence and into the garden of an old man.";
  const std::vector<int64_t> ids = tokenizer.encode(story);
  ASSERT_GE(ids.size(), 40u);
  auto generate = [&](int i) {
    const std::vector<int64_t> context(ids.begin(), ids.begin() + 30 + i);  // its own length
    llama::GenerationOptions opt;
    opt.max_new_tokens = 8;
    opt.stop_at_eos = false;
    opt.press = presses[static_cast<size_t>(i) % presses.size()].get();
    return llama::generate_greedy(model, context, {ids[35], ids[36]}, opt);
  };
  std::vector<llama::Generation> serial, concurrent(kThreads);
  for (int i = 0; i < kThreads; ++i) serial.push_back(generate(i));
  const std::vector<std::string> errors =
      run_together(kThreads, [&](int i) { concurrent[static_cast<size_t>(i)] = generate(i); });
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(errors[i], "") << "thread " << i;
    EXPECT_EQ(concurrent[i].tokens, serial[i].tokens) << "thread " << i;
    EXPECT_EQ(concurrent[i].cache_lengths, serial[i].cache_lengths) << "thread " << i;
    EXPECT_EQ(concurrent[i].final_cache_lengths, serial[i].final_cache_lengths) << "thread " << i;
  }
}

// Run alone (ctest runs each test in its own process), this is the registry's first use: its
// tables are function-local statics, initialised once whichever thread comes first.
TEST(Concurrency, RegistryFirstUseFromEightThreads) {
  std::vector<const std::vector<PressInfo>*> tables(kThreads);
  std::vector<std::string> names(kThreads);
  const std::vector<std::string> errors = run_together(kThreads, [&](int i) {
    const auto press = i % 2 == 0 ? make_press("SnapKVPress", 0.25, {{"window_size", "8"}})
                                  : make_press("AdaKVPress", 0.25, {{"press", "KnormPress"}});
    names[static_cast<size_t>(i)] = press->name();
    tables[static_cast<size_t>(i)] = &list_presses();
  });
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(errors[i], "") << "thread " << i;
    EXPECT_EQ(tables[i], &list_presses());
    EXPECT_EQ(names[i], i % 2 == 0 ? "SnapKVPress" : "AdaKVPress");
  }
}

}  // namespace
}  // namespace kvpress
