// Every registered press's head_span() (kvpress/presses/base_press.h) checked against what it
// does, with kvpress::distributed's global budgets over 2 and 4 ranks: threads of this process,
// each a member of a Gloo group on loopback (tests/test_distributed.cpp runs ranks as processes).
// - A press that can be sharded keeps on each rank, in global mode, exactly what compressing the
//   whole layer in one process keeps of that rank's heads (kept positions, keys and values; the
//   keep mask of head-ragged presses). Presses declared per_head exchange nothing, so this also
//   checks that their kept tokens depend on their own heads only; presses declared exchanged sum or
//   gather across ranks (TOVAPress, ChunkKVPress, SimLayerKVPress add float sums in another order
//   than one process: their kept sets agree here, as they do unless two scores tie to float rounding).
// - A press declared exchanged keeps something else on some rank in per-rank mode (its heads alone)
//   with 2 or 4 ranks: the declaration is needed. (SimLayerKVPress's default never finds a layer
//   lazy: a layer of its own shows it.)
// - A press declared whole_layer, or one that needs a second pass or compresses while decoding, is
//   refused by ShardedPress on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "distributed_layer.h"
#include "kvpress/distributed.h"
#include "kvpress/kvpress.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/qsm_press.h"
#include "kvpress/presses/score_blend_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "random_inputs.h"
#include "runnable_press.h"
#include "test_util.h"

namespace kvpress {
namespace {

// What a press keeps of a layer: compress() for uniform presses, compress_ragged() for head-ragged
// ones (then keys/values are each head's, in batch-major head order).
struct Kept {
  at::Tensor kept_indices, keys, values, keep_mask;
  std::vector<at::Tensor> head_keys, head_values;
  std::string error;                     // the c10::Error's message, when the press raised
  distributed::ExchangeStats exchanged;  // a rank's, in its compression
};

Kept kept_by(const std::function<KV()>& uniform, const std::function<RaggedKV()>& ragged, bool head_ragged) {
  Kept kept;
  try {
    if (!head_ragged) {
      const KV kv = uniform();
      kept.kept_indices = kv.kept_indices;
      kept.keys = kv.keys;
      kept.values = kv.values;
    } else {
      const RaggedKV kv = ragged();
      kept.keep_mask = kv.keep_mask;
      for (const HeadKV& head : kv.heads) {
        kept.head_keys.push_back(head.keys);
        kept.head_values.push_back(head.values);
      }
    }
  } catch (const c10::Error& e) {
    kept.error = e.what_without_backtrace();
  }
  return kept;
}

// `whole` restricted to the KV heads [first, first + count) (batch 1).
Kept restricted(const Kept& whole, int64_t first, int64_t count) {
  Kept part;
  if (whole.kept_indices.defined()) {
    part.kept_indices = whole.kept_indices.narrow(1, first, count);
    part.keys = whole.keys.narrow(1, first, count);
    part.values = whole.values.narrow(1, first, count);
  } else {
    part.keep_mask = whole.keep_mask.narrow(1, first, count);
    part.head_keys.assign(whole.head_keys.begin() + first, whole.head_keys.begin() + first + count);
    part.head_values.assign(whole.head_values.begin() + first, whole.head_values.begin() + first + count);
  }
  return part;
}

bool same(const Kept& a, const Kept& b) {
  const auto eq = [](const at::Tensor& x, const at::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || (x.sizes() == y.sizes() && at::equal(x, y)));
  };
  if (!a.error.empty() || !b.error.empty()) return false;
  if (!eq(a.kept_indices, b.kept_indices) || !eq(a.keys, b.keys) || !eq(a.values, b.values) ||
      !eq(a.keep_mask, b.keep_mask) || a.head_keys.size() != b.head_keys.size())
    return false;
  for (size_t h = 0; h < a.head_keys.size(); ++h)
    if (!eq(a.head_keys[h], b.head_keys[h]) || !eq(a.head_values[h], b.head_values[h])) return false;
  return true;
}

bool shardable(const BasePress& press) {
  return press.head_span() != HeadSpan::kWholeLayer && !press.needs_second_pass() &&
         !press.decoding_role().compresses && press.prefill_press() == &press;
}

// Every registered press, built to run on `layer`; sketches narrower than the head dimension, so
// that a leverage sketched with another head's draw would differ. Then the blends' other paths:
// FastKVzipPress layerwise (one layer at prefill), CompactorPress selecting across heads, and a
// ScoreBlendPress that z-scores raw scores itself
// (KnormPress's and SnapKVPress's) with sinks at both ends.
std::vector<std::shared_ptr<const BasePress>> every_press(const LayerInputs& layer) {
  std::vector<std::shared_ptr<const BasePress>> presses;
  for (const PressInfo& info : list_presses()) {
    std::map<std::string, std::string> params = testing::runnable_params(info, layer);
    for (const PressParam& p : info.params)
      if (p.name == "sketch_dimension") params[p.name] = "4";
    std::unique_ptr<BasePress> built = make_press(info.name, ratio_for(info, 0.5), params);
    if (auto* qsm = dynamic_cast<QSMPress*>(built.get()))
      qsm->set_token_text([](int64_t id) { return id % 4 == 0 ? std::string("the") : "word" + std::to_string(id); });
    presses.push_back(std::move(built));
    if (info.name == "FastKVzipPress") {  // one layer at prefill: its evictions across the layer's heads
      params["layerwise"] = "true";
      presses.push_back(make_press(info.name, ratio_for(info, 0.5), params));
    }
  }
  presses.push_back(
      make_press("CompactorPress", 0.5, {{"selection", "across_heads"}, {"sketch_dimension", "4"}, {"seed", "1"}}));
  presses.push_back(std::make_shared<ScoreBlendPress>(
      0.5,
      std::vector<std::shared_ptr<const ScorerPress>>{std::make_shared<KnormPress>(), std::make_shared<SnapKVPress>()},
      std::vector<double>{0.3, 1.0}, ScoreBlendOptions{4, 2, /*normalize=*/true, TokenSelection::kPerHead}));
  return presses;
}

// Each rank of `world` (a thread with its own Gloo group member) compresses its share of `layer`
// with every press in `mode`: [press][rank].
std::vector<std::vector<Kept>> sharded_runs(const std::vector<std::shared_ptr<const BasePress>>& presses,
                                            const LayerInputs& layer, int world, distributed::BudgetMode mode) {
  const testing::TemporaryFolder dir("kvpress_head_span");
  std::vector<std::vector<Kept>> runs(presses.size(), std::vector<Kept>(static_cast<size_t>(world)));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      auto group = distributed::gloo_group(dir.file("store"), rank, world, std::chrono::seconds(30));
      const int64_t kv_heads = layer.keys.size(1);
      const LayerInputs local = distributed::rank_share(layer, distributed::head_shard(kv_heads, rank, world));
      for (size_t p = 0; p < presses.size(); ++p) {
        Kept& kept = runs[p][static_cast<size_t>(rank)];
        try {
          const distributed::ShardedPress sharded(presses[p], group, kv_heads, mode);
          kept = kept_by([&] { return sharded.compress(local); }, [&] { return sharded.compress_ragged(local); },
                         presses[p]->head_ragged());
          kept.exchanged = sharded.exchange_stats();
        } catch (const c10::Error& e) {
          kept.error = e.what_without_backtrace();
        }
      }
    });
  }
  for (auto& t : ranks) t.join();
  return runs;
}

TEST(HeadSpan, EveryPressKeepsOnEachRankWhatTheWholeLayerKeepsOfItsHeads) {
  LayerInputs layer = testing::random_layer(96, 11, /*heads=*/8, /*kv_heads=*/4, /*d=*/16, /*with_input_ids=*/true);
  layer.num_heads = 8;
  const std::vector<std::shared_ptr<const BasePress>> presses = every_press(layer);
  std::vector<Kept> whole;
  for (const auto& press : presses)
    whole.push_back(kept_by([&] { return press->compress(layer); }, [&] { return press->compress_ragged(layer); },
                            press->head_ragged()));
  std::map<std::string, bool> exchanged_differs;  // per-rank differs somewhere from the whole layer
  int per_head = 0;
  for (int world : {2, 4}) {
    const auto global = sharded_runs(presses, layer, world, distributed::BudgetMode::kGlobal);
    const auto per_rank = sharded_runs(presses, layer, world, distributed::BudgetMode::kPerRank);
    const int64_t count = 4 / world;
    for (size_t p = 0; p < presses.size(); ++p) {
      const BasePress& press = *presses[p];
      SCOPED_TRACE(press.name() + " (" + head_span_name(press.head_span()) + "), " + std::to_string(world) + " ranks");
      if (!shardable(press)) {
        for (int r = 0; r < world; ++r)
          EXPECT_NE(global[p][r].error.find("cannot be sharded across ranks"), std::string::npos)
              << "rank " << r << ": " << global[p][r].error;
        continue;
      }
      ASSERT_EQ(whole[p].error, "");
      bool per_rank_differs = false;
      for (int r = 0; r < world; ++r) {
        const Kept expected = restricted(whole[p], r * count, count);
        EXPECT_TRUE(same(global[p][r], expected)) << "rank " << r << " " << global[p][r].error;
        per_rank_differs = per_rank_differs || !same(per_rank[p][r], expected);
        // A scorer whose exchange changes its scores but not its own kept sets (a z-score over every
        // head keeps each head's order): its heads alone score otherwise.
        if (const auto* scorer = dynamic_cast<const ScorerPress*>(&press);
            scorer != nullptr && press.head_span() == HeadSpan::kExchanged) {
          LayerInputs alone = distributed::rank_share(layer, distributed::head_shard(4, r, world));
          alone.kv_head_range = {r * count, 4};
          per_rank_differs =
              per_rank_differs || !at::allclose(scorer->score(alone), scorer->score(layer).narrow(1, r * count, count));
        }
      }
      for (int r = 0; r < world; ++r) {  // what each rank exchanged: nothing per rank, nor for a per_head press
        EXPECT_EQ(per_rank[p][r].exchanged.collectives, 0);
        if (press.head_span() == HeadSpan::kPerHead) EXPECT_EQ(global[p][r].exchanged.collectives, 0) << "rank " << r;
        if (press.head_span() == HeadSpan::kExchanged && press.name() != "SimLayerKVPress")  // default: never lazy
          EXPECT_GT(global[p][r].exchanged.collectives, 0) << "rank " << r;
      }
      if (press.name() == "AdaKVPress") {  // one all-gather of its [1, Hkv / world, S] float32 scores
        EXPECT_EQ(global[p][0].exchanged.collectives, 1);
        EXPECT_EQ(global[p][0].exchanged.bytes_sent, count * 96 * 4);
        EXPECT_EQ(global[p][0].exchanged.bytes_received, (world - 1) * count * 96 * 4);
      }
      if (press.head_span() == HeadSpan::kExchanged) {
        exchanged_differs[press.name()] = exchanged_differs[press.name()] || per_rank_differs;
      } else {
        EXPECT_FALSE(per_rank_differs) << "declared per_head, yet each rank's heads alone keep something else";
        ++per_head;
      }
    }
  }
  for (const auto& [name, differs] : exchanged_differs)
    if (name != "SimLayerKVPress")
      EXPECT_TRUE(differs) << name << ": declared exchanged, yet each rank's heads alone keep the same";
  EXPECT_GE(exchanged_differs.size(), 10u);
  EXPECT_GE(per_head, 2 * 20);
}

TEST(HeadSpan, SimLayerKVDecidesLazinessOverEveryRanksQueryHeads) {
  // The last query: heads 0-3 (rank 0's of 2) attend only to the first token (a lazy share of 1),
  // heads 4-7 spread evenly over the 63 before it (4 initial + 8 recent: 12/63). The layer's mean
  // share, 0.595, is under the threshold 0.6: the whole layer is not lazy, rank 0's heads alone are.
  LayerInputs layer = testing::random_layer(64, 3, 8, 4, 16);
  layer.num_heads = 8;
  at::Tensor attentions = at::zeros({1, 8, 64, 64});
  attentions.narrow(1, 0, 4).select(3, 0).fill_(1.0);
  attentions.narrow(1, 4, 4).narrow(3, 0, 63).fill_(1.0 / 63);
  layer.attentions = attentions;
  const std::vector<std::shared_ptr<const BasePress>> presses{std::make_shared<SimLayerKVPress>(0.6, 1, 8, 4)};
  const Kept whole = kept_by([&] { return presses[0]->compress(layer); }, {}, false);
  ASSERT_EQ(whole.kept_indices.size(2), 64);  // not lazy
  const auto global = sharded_runs(presses, layer, 2, distributed::BudgetMode::kGlobal);
  const auto per_rank = sharded_runs(presses, layer, 2, distributed::BudgetMode::kPerRank);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(same(global[0][r], restricted(whole, 2 * r, 2))) << "rank " << r;
  EXPECT_EQ(per_rank[0][0].kept_indices.size(2), 4 + 8 - 1);  // rank 0 alone: lazy
}

}  // namespace
}  // namespace kvpress
