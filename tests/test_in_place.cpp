// In-place compaction (issue 14, item 2): ops::compact_kv_in_place moves the kept rows to the front
// of the tensors themselves, and BasePress::compress_in_place gives compress()'s result inside the
// layer's own buffers, for every press of the registry.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "random_inputs.h"
#include "runnable_press.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;
using Params = std::map<std::string, std::string>;

// Strictly ascending random positions, n of seq per (b, h).
at::Tensor random_kept(int64_t batch, int64_t heads, int64_t seq, int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor order = at::argsort(at::rand({batch, heads, seq}), /*dim=*/-1, /*descending=*/false);
  return std::get<0>(order.narrow(2, 0, n).sort(-1)).contiguous();
}

TEST(CompactInPlace, MatchesGatherOnTheFrontOfALargerBuffer) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // The layer is the front of a buffer with spare capacity, as in a cache: [B, Hkv, S, D] of
    // [B, Hkv, 80, D], not contiguous.
    const at::Tensor key_buffer = randn({2, 3, 80, 16}, 1).to(dtype), value_buffer = randn({2, 3, 80, 16}, 2).to(dtype);
    const at::Tensor keys = key_buffer.narrow(2, 0, 64), values = value_buffer.narrow(2, 0, 64);
    const at::Tensor kept = random_kept(2, 3, 64, 40, 3);
    const KV expected = ops::gather_kv(keys, values, kept);  // a copy, taken before anything moves
    const KV kv = ops::compact_kv_in_place(keys, values, kept);
    EXPECT_TRUE(at::equal(kv.keys, expected.keys));
    EXPECT_TRUE(at::equal(kv.values, expected.values));
    EXPECT_TRUE(at::equal(kv.kept_indices, kept));
    // Views of the buffers themselves, not copies.
    EXPECT_EQ(kv.keys.data_ptr(), key_buffer.data_ptr());
    EXPECT_EQ(kv.values.data_ptr(), value_buffer.data_ptr());
    EXPECT_EQ(kv.keys.strides(), keys.strides());
  }
}

TEST(CompactInPlace, KeepsAPrefixAndEveryPositionUnchanged) {
  const at::Tensor keys = randn({1, 2, 10, 4}, 4), values = randn({1, 2, 10, 4}, 5);
  const at::Tensor k0 = keys.clone(), v0 = values.clone();
  const at::Tensor all = at::arange(10, at::kLong).expand({1, 2, 10}).contiguous();
  ops::compact_kv_in_place(keys, values, all);
  EXPECT_TRUE(at::equal(keys, k0));
  EXPECT_TRUE(at::equal(values, v0));
  const at::Tensor prefix = at::arange(3, at::kLong).expand({1, 2, 3}).contiguous();
  const KV kv = ops::compact_kv_in_place(keys, values, prefix);
  EXPECT_TRUE(at::equal(kv.keys, k0.narrow(2, 0, 3)));
}

TEST(CompactInPlace, RefusesBadArgumentsBeforeMovingAnything) {
  const at::Tensor keys = randn({1, 2, 8, 4}, 6), values = randn({1, 2, 8, 4}, 7);
  const at::Tensor k0 = keys.clone(), v0 = values.clone();
  const auto idx = [](std::vector<int64_t> first, std::vector<int64_t> second) {
    return at::stack({at::tensor(first, at::kLong), at::tensor(second, at::kLong)}).unsqueeze(0);
  };
  // Head 0 is fine and would move first; head 1 is bad: nothing may move.
  expect_error(
      [&] {
        ops::compact_kv_in_place(keys, values, idx({1, 3}, {5, 2}));
      },
      {"compact_kv_in_place", "strictly ascending"});
  expect_error(
      [&] {
        ops::compact_kv_in_place(keys, values, idx({1, 3}, {4, 4}));
      },
      {"compact_kv_in_place", "strictly ascending"});
  expect_error(
      [&] {
        ops::compact_kv_in_place(keys, values, idx({1, 3}, {2, 8}));
      },
      {"compact_kv_in_place", "indices must be in [0, seq_len (8))", "[1, 8]"});
  expect_error(
      [&] {
        ops::compact_kv_in_place(keys, values, idx({1, 3}, {-1, 2}));
      },
      {"compact_kv_in_place", "indices must be in [0, seq_len (8))"});
  EXPECT_TRUE(at::equal(keys, k0));
  EXPECT_TRUE(at::equal(values, v0));
  // Layouts it cannot write in place.
  const at::Tensor kept = idx({1, 3}, {2, 5});
  expect_error(
      [&] {
        ops::compact_kv_in_place(keys.expand({1, 2, 8, 4}).transpose(2, 3), values, kept);
      },
      {"compact_kv_in_place"});
  expect_error(
      [&] {
        ops::compact_kv_in_place(randn({1, 1, 8, 4}, 8).expand({1, 2, 8, 4}), values, kept);
      },
      {"compact_kv_in_place", "no expanded views"});
  expect_error([&] { ops::compact_kv_in_place(keys, keys, kept); }, {"compact_kv_in_place", "share no memory"});
  expect_error([&] { ops::compact_kv_in_place(keys.transpose(2, 3).contiguous().transpose(2, 3), values, kept); },
               {"compact_kv_in_place", "unit stride along head_dim"});
  expect_error([&] { ops::compact_kv_in_place(keys, values, kept.to(at::kInt)); },
               {"compact_kv_in_place", "indices must be int64"});
}

// Every press of the registry, at the same inputs: compress_in_place() keeps what compress() keeps,
// inside the inputs' own buffers; where the press selects (kept_positions() defined) it is
// kept_positions(). Head-ragged presses raise as compress() does.
TEST(CompressInPlace, EveryRegistryPressMatchesCompress) {
  int selecting = 0;
  for (const PressInfo& info : list_presses()) {
    SCOPED_TRACE(info.name);
    if (info.kind == PressKind::kDecoding) continue;    // they compress while decoding (step())
    if (info.kind == PressKind::kSecondPass) continue;  // KVComposePress: its second pass (tests/test_kvcompose.cpp)
    // RandomPress unseeded draws new scores at every call.
    const LayerInputs in = testing::random_layer(96, 11, 8, 2, 16, /*with_input_ids=*/true);
    const auto press = make_press(info.name, ratio_for(info, 0.5), testing::runnable_params(info, in, "3"));
    if (press->head_ragged()) {
      expect_error([&] { press->compress_in_place(in); }, {info.name, "compress_ragged"});
      continue;
    }
    const KV expected = press->compress(in);
    LayerInputs own = in;
    own.keys = in.keys.clone();
    own.values = in.values.clone();
    const KV kv = press->compress_in_place(own);
    EXPECT_TRUE(at::equal(kv.kept_indices, expected.kept_indices));
    EXPECT_TRUE(at::equal(kv.keys, expected.keys));
    EXPECT_TRUE(at::equal(kv.values, expected.values));
    EXPECT_EQ(kv.keys.data_ptr(), own.keys.data_ptr());
    EXPECT_EQ(kv.values.data_ptr(), own.values.data_ptr());
    const at::Tensor kept = press->kept_positions(in);
    if (kept.defined()) {
      ++selecting;
      EXPECT_TRUE(at::equal(kept, expected.kept_indices));
    }
  }
  EXPECT_GE(selecting, 16);  // every ScorerPress, Block/Chunk/ChunkKV/PyramidKV
}

}  // namespace
}  // namespace kvpress
