// The Llama runner's paged mode (issue 13, item 5): continuous batching over a PagedKVCache gives
// every prompt the greedy tokens and the logits (within 1e-4) of the dense runner on that prompt
// alone, with prefill presses (compress while storing), head-ragged presses and decoding presses
// (compaction in place), while finished sequences hand their pages to waiting prompts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fault_sweep.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/presses/prefill_decoding_press.h"
#include "kvpress/presses/rkv_decoding_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace kvpress {
namespace {

using llama::LlamaModel;
using testing::expect_error;

const LlamaModel& model() {
  static const LlamaModel m = LlamaModel::load(llama::resolve_model_dir("tinystories-656k"));
  return m;
}

// Prompts of different lengths: real token ids drawn from a fixed seed (BOS first).
std::vector<std::vector<int64_t>> prompts(const std::vector<int64_t>& lengths, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<std::vector<int64_t>> out;
  for (int64_t n : lengths) {
    const at::Tensor ids = at::randint(3, 2000, {n}, at::kLong);
    std::vector<int64_t> p(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
    p[0] = 1;
    out.push_back(p);
  }
  return out;
}

// The dense runner's logits for `prompt` followed by `generated` (kvpress's pipeline, batch 1):
// the prefill's last position, then one forward per generated token but the last.
std::vector<at::Tensor> dense_logits(const std::vector<int64_t>& prompt, const std::vector<int64_t>& generated,
                                     const BasePress* press) {
  const LlamaModel& m = model();
  llama::KVCache cache = m.new_cache();
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(press);  // started by the prefill
  llama::PrefillOptions pre;
  pre.press = press;
  pre.press_state = state.get();
  pre.last_logits_only = true;
  std::vector<at::Tensor> out;
  out.push_back(m.prefill(at::tensor(at::ArrayRef<int64_t>(prompt), at::kLong).unsqueeze(0), cache, pre).logits[0][0]);
  llama::ForwardOptions step;
  step.last_logits_only = true;
  step.press = press;
  step.press_state = state.get();
  for (size_t k = 0; k + 1 < generated.size(); ++k)
    out.push_back(m.forward(at::tensor({generated[k]}, at::kLong).unsqueeze(0), cache, step).logits[0][0]);
  return out;
}

struct PressCase {
  std::string name;
  double ratio;
  std::map<std::string, std::string> params;
};

TEST(PagedLlama, ContinuousBatchingGivesEachPromptItsDenseGeneration) {
  const std::vector<std::vector<int64_t>> ps = prompts({95, 150, 70, 210, 120, 88, 131}, 1);
  const std::vector<PressCase> cases = {
      {"", 0.0, {}},
      {"SnapKVPress", 0.5, {}},
      {"KnormPress", 0.7, {}},
      {"AdaKVPress", 0.5, {}},  // head-ragged: heads keep different counts
      {"KeyRerotationPress", 0.5, {}},
      {"ExpectedAttentionPress", 0.4, {}},
      {"DecodingPress",
       0.0,
       {{"compression_interval", "4"}, {"target_size", "60"}, {"press", "SnapKVPress"}, {"press.window_size", "4"}}},
      {"CompressionRatioDecodingPress", 0.3, {{"compression_interval", "5"}, {"press", "KnormPress"}}},
      {"PrefillDecodingPress",
       0.0,
       {{"prefilling_press", "StreamingLLMPress"},
        {"prefilling_press.compression_ratio", "0.5"},
        {"decoding_press", "DecodingPress"},
        {"decoding_press.compression_interval", "3"},
        {"decoding_press.target_size", "50"}}},
      // its query window started at prefill (record_prefill, from prefill_paged's press_states)
      {"RKVDecodingPress", 0.0, {{"budget", "40"}, {"divide_length", "8"}, {"window_size", "4"}}},
  };
  for (const PressCase& c : cases) {
    SCOPED_TRACE(c.name.empty() ? "no press" : c.name);
    const std::unique_ptr<BasePress> press = c.name.empty() ? nullptr : make_press(c.name, c.ratio, c.params);
    llama::PagedGenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = 14;
    opt.stop_at_eos = false;
    opt.max_batch = 3;
    // Room for about two sequences' worst case: prompts wait and take freed pages.
    opt.pages_per_layer = 4 * (14 + 2 + 1);
    std::map<std::pair<int64_t, int64_t>, at::Tensor> paged_logits;
    opt.on_logits = [&](int64_t prompt, int64_t step, const at::Tensor& logits) {
      paged_logits[{prompt, step}] = logits.clone();
    };
    const llama::PagedGenerations run = llama::generate_paged(model(), ps, opt);
    ASSERT_EQ(run.generations.size(), ps.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      llama::GenerationOptions dense;
      dense.press = press.get();
      dense.max_new_tokens = 14;
      dense.stop_at_eos = false;
      const llama::Generation expected = llama::generate_greedy(model(), ps[i], {}, dense);
      EXPECT_EQ(run.generations[i].tokens, expected.tokens) << "prompt " << i;
      const std::vector<at::Tensor> logits = dense_logits(ps[i], expected.tokens, press.get());
      for (size_t k = 0; k < logits.size(); ++k) {
        const at::Tensor& got = paged_logits.at({static_cast<int64_t>(i), static_cast<int64_t>(k)});
        EXPECT_LE((got - logits[k]).abs().max().item<double>(), 1e-4) << "prompt " << i << " step " << k;
      }
      if (c.name != "AdaKVPress") {  // a head-ragged layer's longest head is not the dense length
        EXPECT_EQ(run.generations[i].cache_lengths, expected.cache_lengths) << "prompt " << i;
        EXPECT_EQ(run.generations[i].final_cache_lengths, expected.final_cache_lengths) << "prompt " << i;
      }
    }
    const llama::PagedGenerationStats& s = run.stats;
    EXPECT_GT(s.prefill_batches, 1) << "some prompts waited for pages";
    EXPECT_GE(s.max_running, 2);
    EXPECT_LE(s.max_running, 3);
    EXPECT_LE(s.peak_pages_used, s.num_layers * s.pages_per_layer);
    if (prefill_press_of(press.get()) != nullptr) {  // compressed at prefill
      EXPECT_LT(s.prompt_pages_stored, s.prompt_pages_uncompressed);
    }
  }
}

// A decoding press written outside the library, as an engine's own: every `interval` decoding forwards
// of a layer it keeps the layer's last `window` tokens. It counts the forwards in its own state type
// and implements only the lifecycle members, and both runners drive it without knowing its type.
class KeepRecentWhileDecoding : public BasePress {
 public:
  KeepRecentWhileDecoding(int64_t window, int64_t interval) : window_(window), interval_(interval) {}
  std::string name() const override { return "KeepRecentWhileDecoding"; }
  KV compress(const LayerInputs& inputs) const override { return KV{inputs.keys, inputs.values, at::Tensor()}; }
  double compression_ratio() const override { return 0.0; }

  struct Forwards : CopyableSequenceState<Forwards> {
    std::map<int64_t, int64_t> per_layer;  // decoding forwards since the layer's last compression
  };
  const BasePress* prefill_press() const override { return nullptr; }
  std::unique_ptr<PressSequenceState> new_sequence_state() const override { return std::make_unique<Forwards>(); }
  DecodingRole decoding_role() const override {
    DecodingRole role;
    role.compresses = true;
    return role;
  }
  bool decoding_reads_cache(int64_t layer, int64_t, int64_t, const PressSequenceState& state) const override {
    const auto& seen = own_sequence_state<const Forwards>(state, *this).per_layer;
    const auto it = seen.find(layer);
    return (it == seen.end() ? 0 : it->second) + 1 >= interval_;
  }
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override {
    const bool due = decoding_reads_cache(forward.layer_idx, 0, tokens_seen, state);
    int64_t& seen = own_sequence_state<Forwards>(state, *this).per_layer[forward.layer_idx];
    ++seen;
    DecodingUpdate update;
    if (!due || forward.keys.size(2) <= window_) return update;
    seen = 0;
    const int64_t length = forward.keys.size(2);
    const at::Tensor kept = at::arange(length - window_, length, at::kLong)
                                .view({1, 1, window_})
                                .expand({forward.keys.size(0), forward.keys.size(1), window_})
                                .contiguous();
    update.kind = DecodingUpdate::Kind::kReplace;
    update.replacement = KV{forward.keys.narrow(2, length - window_, window_).contiguous(),
                            forward.values.narrow(2, length - window_, window_).contiguous(), kept};
    return update;
  }

 private:
  int64_t window_, interval_;
};

TEST(PagedLlama, AnEnginesOwnDecodingPressRunsThroughTheLifecycle) {
  const std::vector<std::vector<int64_t>> ps = prompts({40, 75, 52}, 7);
  const KeepRecentWhileDecoding press(/*window=*/24, /*interval=*/5);
  llama::PagedGenerationOptions opt;
  opt.press = &press;
  opt.max_new_tokens = 12;
  opt.stop_at_eos = false;
  opt.max_batch = 2;
  const llama::PagedGenerations run = llama::generate_paged(model(), ps, opt);
  for (size_t i = 0; i < ps.size(); ++i) {
    llama::GenerationOptions dense;
    dense.press = &press;
    dense.max_new_tokens = 12;
    dense.stop_at_eos = false;
    const llama::Generation expected = llama::generate_greedy(model(), ps[i], {}, dense);
    EXPECT_EQ(run.generations[i].tokens, expected.tokens) << "prompt " << i;
    // The prefill is kept whole; the last compression (the 10th forward: 9 tokens fed, the window
    // kept, the 10th and 11th appended after it) leaves 24 + 1 in every layer.
    EXPECT_EQ(expected.cache_lengths, std::vector<int64_t>(2, static_cast<int64_t>(ps[i].size())));
    EXPECT_EQ(expected.final_cache_lengths, std::vector<int64_t>(2, 24 + 1)) << "prompt " << i;
    EXPECT_EQ(run.generations[i].final_cache_lengths, expected.final_cache_lengths) << "prompt " << i;
  }
}

// A decoding step that fails at any of its fault points (fault_sweep.h), its compactions included
// (a device-table upload of the second sequence's after the first's was staged, an allocation
// while applying them) leaves the cache as it was: every compaction of a step is staged before any
// is applied, applying allocates nothing, and the appends are undone. Found by the soak
// (PagedSoak.*): before, compactions were applied one by one after the step, and then each applied
// its moved rows through ops::paged_write, which allocates.
TEST(PagedLlama, ADecodeStepFailingInItsCompactionsLeavesTheCacheAsItWas) {
  const LlamaModel& m = model();
  const KeepRecentWhileDecoding press(/*window=*/24, /*interval=*/1);  // compacts every step
  PagedKVCache cache = m.new_paged_cache(40, 16);
  const std::vector<std::vector<int64_t>> ps = prompts({40, 52}, 8);
  const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence()};
  m.prefill_paged(ps, seqs, cache);
  std::vector<std::unique_ptr<PressSequenceState>> states;
  llama::PagedDecodeOptions step;
  step.press = &press;
  for (size_t i = 0; i < seqs.size(); ++i) {
    states.push_back(press.new_sequence_state());
    step.press_states.push_back(states.back().get());
  }
  const testing::CacheImage before = testing::image_of(cache);
  const int64_t failures = testing::sweep_fault_points(
      [&] {
        m.decode_paged(seqs, {5, 6}, cache, step);
      },
      [&] { EXPECT_TRUE(testing::same_image(testing::image_of(cache), before)); });
  EXPECT_GE(failures, 6) << "the step's table uploads alone: an append per layer, a compaction per layer and sequence";
  EXPECT_EQ(cache.lengths(seqs[0], 1), std::vector<int64_t>(4, 24)) << "compacted once the step succeeds";
  const at::Tensor keep = at::ones({4, 24}, at::kBool);
  expect_error(
      [&] {
        cache.compact({{1, seqs[0], keep}, {0, seqs[1], keep}, {1, seqs[0], keep}});
      },
      {"PagedKVCache::compact: layer 1 of sequence 0 is compacted twice in one call"});
}

// Quantized pages under continuous batching, with a prefill press and a decoding press that reads
// the cached keys back (dequantized) to compact: every sequence keeps the full cache's counts. With
// the prefill press (its kept sets chosen from the unquantized prompt, so the same as the full
// cache's), until a sequence's tokens first differ from the full cache's its logits stay within a
// sanity bound of them (a bound on the whole model's output, not an analysis: every layer's
// quantization errors add up). The decoding press chooses from dequantized keys, so its kept sets,
// and the logits after them, may differ from the full cache's.
TEST(PagedLlama, QuantizedPagesKeepTheFullCachesCounts) {
  const std::vector<std::vector<int64_t>> ps = prompts({95, 150, 88}, 3);
  const std::vector<PressCase> cases = {
      {"SnapKVPress", 0.5, {}},
      {"DecodingPress", 0.0, {{"compression_interval", "4"}, {"target_size", "30"}, {"press", "KnormPress"}}},
  };
  for (const PressCase& c : cases) {
    const std::unique_ptr<BasePress> press = make_press(c.name, c.ratio, c.params);
    std::map<std::pair<int64_t, int64_t>, at::Tensor> logits[2];
    llama::PagedGenerations runs[2];
    for (int quantized = 0; quantized < 2; ++quantized) {
      llama::PagedGenerationOptions opt;
      opt.press = press.get();
      opt.max_new_tokens = 12;
      opt.stop_at_eos = false;
      opt.max_batch = 2;
      opt.page_size = 8;
      opt.kv_format = quantized ? KVFormat::kInt8 : KVFormat::kFull;
      std::map<std::pair<int64_t, int64_t>, at::Tensor>& seen = logits[quantized];
      opt.on_logits = [&seen](int64_t prompt, int64_t step, const at::Tensor& l) {
        seen[{prompt, step}] = l.to(at::kFloat).clone();
      };
      runs[quantized] = llama::generate_paged(model(), ps, opt);
    }
    EXPECT_EQ(runs[1].stats.kv_format, KVFormat::kInt8);
    EXPECT_EQ(runs[1].stats.bytes_per_page, 2 * (8 * 16 + 4)) << "int8 codes and a float32 scale, keys and values";
    EXPECT_GT(runs[1].stats.residual_bytes, 0);
    for (size_t i = 0; i < ps.size(); ++i) {
      const llama::Generation &full = runs[0].generations[i], &int8 = runs[1].generations[i];
      EXPECT_EQ(int8.final_cache_lengths, full.final_cache_lengths) << c.name << " prompt " << i;
      EXPECT_EQ(int8.tokens.size(), full.tokens.size());
      for (size_t k = 0; k < full.tokens.size() && c.name == "SnapKVPress"; ++k) {
        const at::Tensor& a = logits[0].at({static_cast<int64_t>(i), static_cast<int64_t>(k)});
        const at::Tensor& b = logits[1].at({static_cast<int64_t>(i), static_cast<int64_t>(k)});
        EXPECT_LE((a - b).abs().max().item<double>(), 0.25) << c.name << " prompt " << i << " step " << k;
        if (int8.tokens[k] != full.tokens[k]) break;  // from here on the two runs feed different tokens
      }
    }
  }
}

TEST(PagedLlama, PrefillAndDecodeRefuseBadInputAndLeaveTheCacheAsItWas) {
  const LlamaModel& m = model();
  PagedKVCache cache = m.new_paged_cache(40, 16);
  const std::vector<std::vector<int64_t>> ps = prompts({64, 32}, 2);  // whole pages: a step needs new ones
  const SequenceId a = cache.add_sequence(), b = cache.add_sequence();
  expect_error(
      [&] {
        m.prefill_paged({ps[0], {1, 5000}}, {a, b}, cache);
      },
      {"LlamaModel::prefill_paged: token ids must be in [0, vocab_size (2048)), got 5000"});
  // A press failing in the first layer on prompt 1 (32 tokens < SnapKV's window + 1): nothing stays.
  const auto snapkv = make_press("SnapKVPress", 0.5);
  llama::PagedPrefillOptions with_snapkv;
  with_snapkv.press = snapkv.get();
  expect_error([&] { m.prefill_paged(ps, {a, b}, cache, with_snapkv); }, {"SnapKVPress"});
  EXPECT_EQ(cache.stats().pages_used, 0);
  m.prefill_paged(ps, {a, b}, cache);
  expect_error([&] { m.prefill_paged({ps[0]}, {a}, cache); },
               {"LlamaModel::prefill_paged: sequence 0 already holds tokens"});
  // 4 heads x (4 + 2) of the 40 pages per layer are used; a 64-token filler takes the other 16.
  const SequenceId filler = cache.add_sequence();
  m.prefill_paged({prompts({64}, 3)[0]}, {filler}, cache);
  EXPECT_EQ(cache.free_pages(0), 0);
  const PagedCacheStats before = cache.stats();
  expect_error(
      [&] {
        m.decode_paged({a, b}, {5, 6}, cache);
      },
      {"LlamaModel::decode_paged: out of pages at layer 0: the step needs 8 new pages, 0 are free"});
  EXPECT_EQ(cache.stats().pages_used, before.pages_used);
  EXPECT_EQ(cache.next_position(a, 1), 64);
  expect_error(
      [&] {
        m.decode_paged({a}, {5, 6}, cache);
      },
      {"LlamaModel::decode_paged: seqs and tokens must be non-empty and of one size"});
  PagedKVCache wrong(PagedCacheOptions{});
  expect_error([&] { m.decode_paged({0}, {5}, wrong); },
               {"LlamaModel::decode_paged: the cache must have 2 layers of 4 KV heads x 16 in Float like the model"});
}

// A press that starts its decoding state at prefill (RKVDecodingPress) needs one state per prompt;
// a failure part-way leaves the states as they were, so a retry records from scratch.
TEST(PagedLlama, PrefillRecordsEachSequencesPressStateOrRefuses) {
  const LlamaModel& m = model();
  PagedKVCache cache = m.new_paged_cache(40, 16);
  const std::vector<std::vector<int64_t>> ps = prompts({48, 30}, 4);
  const auto rkv = make_press("RKVDecodingPress", 0.0, {{"budget", "20"}, {"window_size", "4"}});
  const SequenceId a = cache.add_sequence(), b = cache.add_sequence();
  llama::PagedPrefillOptions prefill;
  prefill.press = rkv.get();
  expect_error(
      [&] {
        m.prefill_paged(ps, {a, b}, cache, prefill);
      },
      {"LlamaModel::prefill_paged: RKVDecodingPress starts its decoding state at prefill: press_states must "
       "hold one state per prompt (2"});
  const std::unique_ptr<PressSequenceState> sa = rkv->new_sequence_state(), sb = rkv->new_sequence_state();
  prefill.press_states = {sa.get(), sb.get()};
  // Token 5000 fails the prefill before any layer: the states stay empty.
  expect_error([&] { m.prefill_paged({ps[0], {1, 5000}}, {a, b}, cache, prefill); }, {"token ids must be in"});
  const auto window_rows = [&](const PressSequenceState& s) {
    const auto& w = dynamic_cast<const RKVQueryWindow&>(s);
    std::vector<int64_t> rows;
    for (const at::Tensor& q : w.queries) rows.push_back(q.defined() ? q.size(2) : 0);
    return rows;
  };
  EXPECT_TRUE(window_rows(*sa).empty());
  m.prefill_paged(ps, {a, b}, cache, prefill);
  EXPECT_EQ(window_rows(*sa), std::vector<int64_t>({4, 4}));  // each layer's last 4 prompt queries
  EXPECT_EQ(window_rows(*sb), std::vector<int64_t>({4, 4}));
  EXPECT_EQ(cache.lengths(a, 0), std::vector<int64_t>(4, 20)) << "a prompt over the budget is kept to it";
  llama::PagedPrefillOptions stray;
  stray.press_states = {sa.get()};
  const SequenceId c = cache.add_sequence();
  expect_error([&] { m.prefill_paged({ps[0]}, {c}, cache, stray); },
               {"press_states must be empty or hold one state per prompt (1) of a press, got 1 without a press"});
}

}  // namespace
}  // namespace kvpress
