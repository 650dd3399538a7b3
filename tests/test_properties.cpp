// Properties of every registry press over random shapes (issue 12, item 4): B 1-3, Hkv 1-4, query
// groups 1-4, S 1-600 (shorter than windows and sinks included), D 8-128, float32/bfloat16/float16,
// contiguous and strided inputs, ratios 0-0.99. For every press and shape, either compress() raises
// a c10::Error because S is below the press's documented minimum, or:
//   * it keeps the documented number of tokens per head (per batch row for head-ragged presses);
//   * kept positions are strictly ascending and in [0, S), and the kept keys/values are the cache's
//     rows at those positions (KeyRerotationPress re-rotates its keys; CTRPress merges values);
//   * protected tokens (sinks, observation windows, forced spans) are kept when the budget covers them;
//   * the result is identical on a second call and with 1, 2 or 4 intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"
#include "random_inputs.h"
#include "runnable_press.h"

namespace kvpress {
namespace {

using testing::random_inputs;
using testing::Shape;

// What a press promises at a shape: the smallest S it accepts, the tokens it keeps per head (unset:
// not fixed by the shape alone), and the positions it always keeps when the budget covers them and
// `tie_slack` more (CompactorPress's sinks get the maximum score, which the best inner position
// ties, as in kvpress).
struct Promise {
  int64_t min_seq = 1;
  std::function<int64_t(const BasePress&, int64_t seq, double ratio)> kept = nullptr;
  std::function<std::vector<int64_t>(const BasePress&, int64_t seq)> protected_positions = nullptr;
  int64_t tie_slack = 0;
  // Head-ragged presses whose layer budget is not Hkv times the per-head one: the tokens each batch
  // row keeps over its heads.
  std::function<int64_t(int64_t seq, int64_t kv_heads, double ratio)> row_kept = nullptr;
};

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t i = std::max<int64_t>(begin, 0); i < end; ++i) out.push_back(i);
  return out;
}

int64_t default_kept(const BasePress&, int64_t seq, double ratio) {
  return ratio == 0.0 ? seq : ops::n_kept(seq, ratio);
}

const std::map<std::string, Promise>& promises() {
  static const std::map<std::string, Promise> table = {
      {"StreamingLLMPress",
       {StreamingLLMPress::kDefaultNSink + 1, default_kept,
        [](const BasePress&, int64_t) { return range(0, StreamingLLMPress::kDefaultNSink); }}},
      {"SnapKVPress",
       {SnapKVPress::kDefaultWindowSize + 1, default_kept,
        [](const BasePress&, int64_t seq) { return range(seq - SnapKVPress::kDefaultWindowSize, seq); }}},
      // The question (the last testing::question_length(S) positions) gets max + 1.
      {"FinchPress",
       {2, default_kept,
        [](const BasePress&, int64_t seq) { return range(seq - testing::question_length(seq), seq); }}},
      // Its default inner press, ExpectedAttentionPress, needs S > its n_sink.
      {"LUKVPress", {ExpectedAttentionPress::kDefaultNSink + 1, nullptr, nullptr}},
      // No streaming head by default (head_compression_ratio 0).
      {"DuoAttentionPress", {1, [](const BasePress&, int64_t seq, double) { return seq; }, nullptr}},
      // The threshold and the content decide how many go (tests/test_dms.cpp checks which).
      {"DMSPress", {1, nullptr, nullptr}},
      // AdaKV-style selection across heads of int(S (1 - ratio) Hkv) pairs (the authors' rounding).
      {"DefensiveKVPress",
       {DefensiveKVPress::kDefaultWindowSize + 1, nullptr, nullptr, 0,
        [](int64_t seq, int64_t kv_heads, double ratio) {
          return ratio == 0.0
                     ? seq * kv_heads
                     : static_cast<int64_t>(static_cast<double>(seq) * (1.0 - ratio) * static_cast<double>(kv_heads));
        }}},
      {"TOVAPress", {2, default_kept, [](const BasePress&, int64_t seq) { return range(seq - 1, seq); }}},
      {"LagKVPress", {1, default_kept, [](const BasePress&, int64_t) { return range(0, LagKVPress::kDefaultNSink); }}},
      {"ExpectedAttentionPress",
       {ExpectedAttentionPress::kDefaultNSink + 1, default_kept,
        [](const BasePress&, int64_t) { return range(0, ExpectedAttentionPress::kDefaultNSink); }}},
      {"ExpectedAttentionStatsPress",
       {ExpectedAttentionPress::kDefaultNSink + 1, default_kept,
        [](const BasePress&, int64_t) { return range(0, ExpectedAttentionPress::kDefaultNSink); }}},
      {"CapPress",
       {CapPress::kDefaultNSink + 1, default_kept,
        [](const BasePress&, int64_t) { return range(0, CapPress::kDefaultNSink); }}},
      {"CompactorPress",
       {1, default_kept,
        [](const BasePress&, int64_t seq) {
          std::vector<int64_t> p = range(0, CompactorPress::kDefaultSinkSizeStart);
          for (int64_t i : range(seq - CompactorPress::kDefaultSinkSizeEnd, seq))
            if (i >= CompactorPress::kDefaultSinkSizeStart) p.push_back(i);
          return p;
        },
        1}},
      {"PyramidKVPress",
       {PyramidKVPress::kDefaultWindowSize + 1,
        [](const BasePress& p, int64_t seq, double ratio) {
          return ratio == 0.0 ? seq : dynamic_cast<const PyramidKVPress&>(p).layer_budget(seq, 1, 3);
        },
        nullptr}},
      {"ChunkKVPress", {1, nullptr, nullptr}},  // whole chunks: the count depends on which chunks win
      {"EntropyGatedChunkKVPress", {1, default_kept, nullptr}},
      {"ChunkPress",
       {1,
        [](const BasePress&, int64_t seq, double ratio) {
          if (ratio == 0.0) return seq;
          int64_t n = 0;
          for (int64_t start = 0; start < seq; start += ChunkPress::kDefaultChunkLength)
            n += ops::n_kept(std::min(ChunkPress::kDefaultChunkLength, seq - start), ratio);
          return n;
        },
        nullptr}},
      {"QSMPress",
       {1,
        [](const BasePress& p, int64_t seq, double ratio) {
          return ratio == 0.0 ? seq : dynamic_cast<const QSMPress&>(p).kept_count(seq);
        },
        [](const BasePress& p, int64_t seq) {
          const at::Tensor forced = dynamic_cast<const QSMPress&>(p).forced_keep_mask(seq);
          const at::Tensor where = forced.nonzero().flatten();
          return std::vector<int64_t>(where.data_ptr<int64_t>(), where.data_ptr<int64_t>() + where.numel());
        }}},
      {"CTRPress", {1, nullptr, nullptr}},  // entropy-adaptive budget (tests/test_ctr.cpp)
      {"ThinKPress", {1, [](const BasePress&, int64_t seq, double) { return seq; }, nullptr}},  // prunes channels
      // Its default lazy_threshold 1 judges no layer (tests/test_presses.cpp: lazy layers).
      {"SimLayerKVPress", {1, [](const BasePress&, int64_t seq, double) { return seq; }, nullptr}},
      {"DecodingPress",
       {1, [](const BasePress&, int64_t seq, double) { return std::min(seq, DecodingPress::kDefaultTargetSize); },
        nullptr}},
      {"CompressionRatioDecodingPress",
       {1,
        [](const BasePress& p, int64_t seq, double) {
          return std::max<int64_t>(1, dynamic_cast<const DecodingPress&>(p).target_size(seq));
        },
        nullptr}},
      {"PrefillDecodingPress", {1, [](const BasePress&, int64_t seq, double) { return seq; }, nullptr}},
      // Its prefill keeps `budget` tokens of a longer prompt, the last window_size among them.
      {"RKVDecodingPress",
       {1, [](const BasePress&, int64_t seq, double) { return std::min(seq, RKVDecodingPress::kDefaultBudget); },
        [](const BasePress&, int64_t seq) { return range(seq - RKVPress::kDefaultWindowSize, seq); }}},
      {"RKVPress",
       {1, default_kept, [](const BasePress&, int64_t seq) { return range(seq - RKVPress::kDefaultWindowSize, seq); }}},
  };
  return table;
}

// The kept positions [B, Hkv] -> per-head sets, whatever the press's layout.
struct Result {
  at::Tensor keep_mask;     // [B, Hkv, S] bool
  at::Tensor keys, values;  // packed over heads in position order
};

Result run(const BasePress& press, const LayerInputs& in) {
  const RaggedKV r = press.compress_ragged(in);
  std::vector<at::Tensor> keys, values;
  for (const HeadKV& h : r.heads) {
    keys.push_back(h.keys);
    values.push_back(h.values);
  }
  return {r.keep_mask, at::cat(keys), at::cat(values)};
}

void check_press(const PressInfo& info, const Shape& s, uint64_t seed) {
  SCOPED_TRACE(info.name + " " + testing::describe(s));
  const auto it = promises().find(info.name);
  const Promise promise = it == promises().end() ? Promise{1, default_kept, nullptr} : it->second;
  const double ratio = ratio_for(info, s.ratio);
  const LayerInputs in = random_inputs(s, seed);
  const auto press = make_press(info.name, ratio, testing::runnable_params(info, in, "3"));

  at::set_num_threads(1);
  Result first;
  try {
    first = run(*press, in);
  } catch (const c10::Error& e) {
    // Refusals are for inputs below the documented minimum only.
    EXPECT_LT(s.seq, promise.min_seq) << "raised: " << e.what_without_backtrace();
    return;
  }
  EXPECT_GE(s.seq, promise.min_seq) << "accepted an input shorter than its documented minimum";
  ASSERT_EQ(first.keep_mask.sizes(), (at::IntArrayRef{s.batch, s.kv_heads, s.seq}));
  const at::Tensor per_head = first.keep_mask.sum(-1);                   // [B, Hkv]
  if (const auto* lukv = dynamic_cast<const LUKVPress*>(press.get())) {  // its curve's budgets, every row
    EXPECT_TRUE(at::equal(per_head, lukv->head_budgets(in.layer_idx, s.kv_heads, s.seq).expand({s.batch, -1})) ||
                ratio == 0.0);
  } else if (promise.row_kept) {
    EXPECT_TRUE(at::equal(per_head.sum(-1), at::full({s.batch}, promise.row_kept(s.seq, s.kv_heads, ratio), at::kLong)))
        << "kept " << per_head;
  } else if (press->head_ragged() && it == promises().end()) {  // the layer keeps Hkv * n_kept
    EXPECT_TRUE(
        at::equal(per_head.sum(-1), at::full({s.batch}, s.kv_heads * default_kept(*press, s.seq, ratio), at::kLong)));
  } else if (promise.kept) {
    EXPECT_TRUE((per_head == promise.kept(*press, s.seq, ratio)).all().item<bool>())
        << "kept " << per_head << " expected " << promise.kept(*press, s.seq, ratio);
  }
  EXPECT_TRUE((per_head >= 1).all().item<bool>() || press->head_ragged());

  // Kept rows are the cache's rows at the kept positions (positions ascending, per head).
  const at::Tensor where = first.keep_mask.nonzero();  // [T, 3] in (b, h, position) order
  const at::Tensor rows = at::stack({where.select(1, 0), where.select(1, 1), where.select(1, 2)});
  const at::Tensor expected_keys = in.keys.index({rows[0], rows[1], rows[2]});
  const at::Tensor expected_values = in.values.index({rows[0], rows[1], rows[2]});
  // KeyRerotationPress and FinchPress re-rotate the kept keys, a channel press (ThinKPress) zeroes channels.
  if (!press->rerotates_keys() && info.kind != PressKind::kChannel) EXPECT_TRUE(at::equal(first.keys, expected_keys));
  // CTRPress rescues and MergingPress merges evicted values into the kept ones.
  if (info.name != "CTRPress" && info.name != "MergingPress") EXPECT_TRUE(at::equal(first.values, expected_values));

  // Protected positions are kept when the budget covers them.
  if (promise.protected_positions && promise.kept && ratio > 0.0) {
    const std::vector<int64_t> must = promise.protected_positions(*press, s.seq);
    if (static_cast<int64_t>(must.size()) + promise.tie_slack <= promise.kept(*press, s.seq, ratio)) {
      for (int64_t p : must)
        EXPECT_TRUE(first.keep_mask.select(2, p).all().item<bool>()) << "protected position " << p << " evicted";
    }
  }

  // The same answer again, and with 2 and 4 intra-op threads. MergingPress's merged values are
  // weighted by key similarities from at::matmul, whose BLAS blocks its sums by thread count (MKL's
  // AVX2 path does on an Intel Sapphire Rapids): equal within float32 rounding of a D-term dot
  // product (D <= 128: about sqrt(D) 2^-24 = 7e-7 relative; rtol 1e-5), not bit for bit; in
  // bfloat16/half a merged value may round to the neighbouring representable value (2^-8 / 2^-11).
  const bool values_from_blas = info.name == "MergingPress";
  const double values_rtol = s.dtype == at::kBFloat16 ? 1e-2 : s.dtype == at::kHalf ? 2e-3 : 1e-5;
  for (int threads : {1, 2, 4}) {
    at::set_num_threads(threads);
    const Result again = run(*press, in);
    EXPECT_TRUE(at::equal(again.keep_mask, first.keep_mask)) << threads << " threads";
    EXPECT_TRUE(at::equal(again.keys, first.keys)) << threads << " threads";
    if (values_from_blas)
      EXPECT_TRUE(at::allclose(again.values.to(at::kFloat), first.values.to(at::kFloat), values_rtol, 1e-6))
          << threads << " threads";
    else
      EXPECT_TRUE(at::equal(again.values, first.values)) << threads << " threads";
  }
  at::set_num_threads(1);
}

std::vector<Shape> random_shapes(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  // Edge cases first: one token, sequences shorter than the windows and sinks, the largest shapes.
  std::vector<Shape> shapes = {
      {1, 1, 1, 1, 8, at::kFloat, false, 0.5},     {2, 3, 2, 4, 16, at::kBFloat16, true, 0.9},
      {1, 2, 4, 64, 32, at::kHalf, false, 0.25},   {3, 4, 4, 65, 128, at::kFloat, true, 0.99},
      {1, 2, 2, 600, 64, at::kFloat, false, 0.75}, {2, 1, 3, 300, 8, at::kFloat, false, 0.0},
  };
  while (static_cast<int>(shapes.size()) < count) {
    const int64_t seq = pick(0, 3) == 0 ? pick(1, 70) : pick(1, 600);
    shapes.push_back({pick(1, 3), pick(1, 4), pick(1, 4), seq, 8 * pick(1, 16), dtypes[pick(0, 2)], pick(0, 1) == 1,
                      std::uniform_real_distribution<double>(0.0, 0.99)(rng)});
  }
  return shapes;
}

TEST(Properties, EveryPressOverRandomShapes) {
  const testing::IntraOpThreads restore(at::get_num_threads());  // check_press changes the count
  const std::vector<Shape> shapes = random_shapes(14, 2026);
  for (const PressInfo& info : list_presses()) {
    if (info.kind == PressKind::kSecondPass) continue;  // KVComposePress: tests/test_kvcompose.cpp
    for (size_t i = 0; i < shapes.size(); ++i) check_press(info, shapes[i], 100 + i);
  }
}

}  // namespace
}  // namespace kvpress
