// The CPU kernels of the ops that have them (src/ops/<family>/cpu) against their ATen composites
// (src/ops/<family>/<family>.h), which follow kvpress's formulas op by op, and the dispatch rule: an op on a
// device without a kernel takes its composite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "compactor/compactor.h"
#include "cpu/vec16.h"
#include "kvpress/ops.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "paged/paged.h"
#include "ragged_attention/ragged_attention.h"
#include "rope_heads/rope_heads.h"
#include "scores/scores.h"
#include "selection/selection.h"
#include "test_util.h"
#include "tile_kernels_skip.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::IntraOpThreads;
using testing::randn;
namespace vec16 = kernels::vec16;

TEST(KernelOps, TopkKernelMatchesTheStableSortIncludingTies) {
  at::Tensor scores = (randn({3, 5, 999}, 1) * 3).round();  // few distinct values: ties at every threshold
  scores.select(2, 10).fill_(-0.0);
  scores.select(2, 11).fill_(0.0);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (int64_t k : {1, 17, 500, 998, 999}) {
      const at::Tensor s = scores.to(dtype);
      EXPECT_TRUE(at::equal(ops::topk_indices(s, k), ops::composite::topk_indices(s, k))) << dtype << " k " << k;
    }
  }
  // Float32 scores that differ only in their 12 lowest bits, of both signs, with repeats: the
  // kernel's radix select must decide at its second and third digit.
  at::manual_seed(7);
  const at::Tensor low_bits = at::randint(0, 1 << 12, {2, 3, 5000}, at::kInt).add_(0x3F800000).view(at::kFloat);
  const at::Tensor close = low_bits * (at::randint(0, 2, {2, 3, 5000}).to(at::kFloat) * 2 - 1);
  for (int64_t k : {1, 2, 1000, 2500, 4999, 5000})
    EXPECT_TRUE(at::equal(ops::topk_indices(close, k), ops::composite::topk_indices(close, k))) << "k " << k;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    at::Tensor s = randn({1, 2, 100}, 2);
    s[0][1][50] = bad;
    for (const auto& run : {std::function<void()>([&] { ops::topk_indices(s, 10); }),
                            std::function<void()>([&] { ops::composite::topk_indices(s, 10); })})
      expect_error(run, {"topk_indices: scores must be finite, got 1 "});
  }
}

// Rows of 16-byte multiples take the kernel's streaming stores, others (bf16 x 4 = 8 bytes, float32
// x 3 = 12 bytes) memcpy; the row count crosses the prefetch distance and the parallel split.
TEST(KernelOps, GatherKernelMatchesTheComposite) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t dim : {3, 4, 8, 128}) {
      const at::Tensor keys = randn({2, 3, 700, dim}, 3, dtype), values = randn({2, 3, 700, dim}, 4, dtype);
      const at::Tensor idx =
          std::get<0>(at::randperm(700, at::kLong).narrow(0, 0, 313).sort()).expand({2, 3, 313}).contiguous();
      const KV kernel = ops::gather_kv(keys, values, idx);
      const auto [k, v] = ops::composite::gather_kv(keys, values, idx);
      EXPECT_TRUE(at::equal(kernel.keys, k)) << dtype << " dim " << dim;
      EXPECT_TRUE(at::equal(kernel.values, v)) << dtype << " dim " << dim;
    }
  }
  const at::Tensor keys = randn({1, 1, 10, 4}, 5);
  const at::Tensor bad = at::tensor({3, 10}, at::kLong).view({1, 1, 2});
  for (const auto& run : {std::function<void()>([&] { ops::gather_kv(keys, keys, bad); }),
                          std::function<void()>([&] { ops::composite::gather_kv(keys, keys, bad); })})
    expect_error(run, {"gather_kv: indices must be in [0, seq_len (10)), got values in [3, 10]"});
}

TEST(KernelOps, KeyScoreKernelsMatchTheComposites) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor keys = randn({2, 3, 70, 16}, 6, dtype);
    EXPECT_TRUE(at::allclose(ops::key_norm_scores(keys), ops::composite::key_norm_scores(keys), 1e-5, 1e-6)) << dtype;
    EXPECT_TRUE(at::allclose(ops::keydiff_scores(keys), ops::composite::keydiff_scores(keys), 1e-5, 1e-6)) << dtype;
  }
}

// The key norm sums every row in order over d (PRESS_NOTES: a reordered sum flips a near-tie of a
// parity fixture): float32 and bfloat16 sixteen rows at a time in vector lanes when the head dim is
// a multiple of 16, the scalar loop for the other rows, dims and dtypes. Bit for bit against that order.
TEST(KernelOps, KeyNormKernelSumsEachRowInOrder) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t dim : {8, 16, 40, 48, 128, 256}) {
      const at::Tensor keys = (randn({2, 3, 37, dim}, 14) * 3).to(dtype);  // 37 rows: two tiles, a tail
      const at::Tensor squares = keys.to(at::kFloat) * keys.to(at::kFloat);
      at::Tensor sum = at::zeros({2, 3, 37});
      for (int64_t d = 0; d < dim; ++d) sum = sum + squares.select(3, d);
      // ATen's float32 sqrt is not correctly rounded; sqrt in double then rounded to float is.
      EXPECT_TRUE(at::equal(ops::key_norm_scores(keys), -sum.to(at::kDouble).sqrt().to(at::kFloat)))
          << dtype << " dim " << dim;
    }
  }
}

TEST(KernelOps, RaggedAttentionKernelMatchesTheComposite) {
  // Two batch rows x 2 KV heads keeping 0, 3, 17 and 40 packed tokens, 5 tail tokens, GQA 3.
  const at::Tensor offsets = at::tensor({0, 0, 3, 20, 60}, at::kLong);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor pk = randn({60, 16}, 7, dtype), pv = randn({60, 16}, 8, dtype);
    const at::Tensor tk = randn({2, 2, 5, 16}, 9, dtype), tv = randn({2, 2, 5, 16}, 10, dtype);
    for (int64_t n : {1, 5}) {
      const at::Tensor q = randn({2, 6, n, 16}, 11, dtype);
      const at::Tensor kernel = ops::ragged_attention(q, pk, pv, offsets, tk, tv);
      const at::Tensor composite = ops::composite::ragged_attention(q, pk, pv, offsets, tk, tv, std::nullopt);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      EXPECT_TRUE(at::allclose(kernel.to(at::kFloat), composite.to(at::kFloat), tol, tol)) << dtype << " n " << n;
    }
  }
}

// The kernel's inner loops take the query heads of a group in tiles of up to four and the head
// dimension in vectors of 64 and 16 floats with a scalar tail: every combination against the composite.
TEST(KernelOps, RaggedAttentionCoversEveryGroupTileAndHeadDim) {
  const at::Tensor offsets = at::tensor({0, 70, 75}, at::kLong);
  for (int64_t groups : {1, 2, 3, 4, 5, 8}) {
    for (int64_t dim : {8, 16, 40, 64, 72, 80, 136}) {
      const at::Tensor pk = randn({75, dim}, 20), pv = randn({75, dim}, 21);
      const at::Tensor tk = randn({1, 2, 2, dim}, 22), tv = randn({1, 2, 2, dim}, 23);
      const at::Tensor q = randn({1, 2 * groups, 2, dim}, 24);
      const at::Tensor kernel = ops::ragged_attention(q, pk, pv, offsets, tk, tv);
      const at::Tensor composite = ops::composite::ragged_attention(q, pk, pv, offsets, tk, tv, std::nullopt);
      EXPECT_TRUE(at::allclose(kernel, composite, 1e-5, 1e-5)) << "groups " << groups << " dim " << dim;
    }
  }
}

// The float32 kernel is the composite bit for bit (same rounded products, no fused multiply-add),
// also on strided inputs; other dtypes take the composite.
TEST(KernelOps, InvertRopeKernelIsTheCompositeBitForBit) {
  const at::Tensor cos = randn({37, 64}, 30), sin = randn({37, 64}, 31);
  const at::Tensor x = randn({2, 3, 37, 64}, 32);
  EXPECT_TRUE(at::equal(ops::invert_rope(x, cos, sin), ops::composite::invert_rope(x, cos, sin)));
  const at::Tensor strided = randn({2, 37, 3, 64}, 33).transpose(1, 2);
  EXPECT_TRUE(at::equal(ops::invert_rope(strided, cos, sin), ops::composite::invert_rope(strided, cos, sin)));
  const at::Tensor half = x.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(ops::invert_rope(half, cos.to(at::kBFloat16), sin.to(at::kBFloat16)),
                        ops::composite::invert_rope(half, cos.to(at::kBFloat16), sin.to(at::kBFloat16))));
}

// The leverage kernels (register tiles, src/ops/compactor/cpu/leverage.cpp) against the per-head
// composite: every tile width k = 16..64, head_dim 32..256, sequences that end inside a tile and a
// chunk, shared and per-head sketches, strided keys. Shapes the tiles do not serve (bfloat16 keys,
// head_dim 48, k = 8 or 80) take the composite exactly.
TEST(KernelOps, SketchPreropeKeysMatchesTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  struct Case {
    int64_t batch, heads, seq, dim, k;
    bool shared_sketch;
  };
  for (const Case& c : {Case{1, 2, 600, 128, 48, false}, Case{2, 3, 7, 64, 16, true}, Case{1, 1, 513, 32, 64, false},
                        Case{1, 2, 300, 256, 32, true}, Case{1, 2, 40, 96, 48, false}}) {
    const at::Tensor cos = randn({c.seq, c.dim}, 60), sin = randn({c.seq, c.dim}, 61);
    const at::Tensor keys = randn({c.batch, c.heads, c.seq, c.dim}, 62) + 0.5;  // a mean to remove
    const at::Tensor sketch = c.shared_sketch ? randn({c.dim, c.k}, 63) : randn({c.batch, c.heads, c.dim, c.k}, 63);
    const auto [x, gram] = ops::sketch_prerope_keys(keys, cos, sin, sketch);
    const auto [x_ref, gram_ref] = ops::composite::sketch_prerope_keys(keys, cos, sin, sketch);
    ASSERT_EQ(x.sizes(), x_ref.sizes());
    ASSERT_EQ(gram.sizes(), (at::IntArrayRef{c.batch, c.heads, c.k, c.k}));
    const double x_scale = x_ref.abs().max().item<double>(), gram_scale = gram_ref.abs().max().item<double>();
    EXPECT_LT((x - x_ref).abs().max().item<double>(), 1e-5 * x_scale) << "seq " << c.seq << " dim " << c.dim;
    EXPECT_LT((gram - gram_ref).abs().max().item<double>(), 1e-5 * gram_scale) << "seq " << c.seq << " dim " << c.dim;
    EXPECT_TRUE(at::equal(gram, gram.transpose(2, 3))) << "the Gram matrix is exactly symmetric";
    // Strided keys (a view of [B, S, H, D]) give the same values.
    const at::Tensor strided = keys.transpose(1, 2).contiguous().transpose(1, 2);
    EXPECT_TRUE(at::equal(std::get<0>(ops::sketch_prerope_keys(strided, cos, sin, sketch)), x));
  }
  const at::Tensor cos = randn({50, 48}, 64), sin = randn({50, 48}, 65);
  for (const auto& [keys, sketch] : {std::pair{randn({1, 2, 50, 48}, 66), randn({48, 48}, 67)},
                                     std::pair{randn({1, 2, 50, 64}, 66).to(at::kBFloat16), randn({64, 48}, 67)},
                                     std::pair{randn({1, 2, 50, 64}, 66), randn({64, 8}, 67)},
                                     std::pair{randn({1, 2, 50, 64}, 66), randn({64, 80}, 67)}}) {
    const at::Tensor c = keys.size(3) == 48 ? cos : randn({50, 64}, 64),
                     s = keys.size(3) == 48 ? sin : randn({50, 64}, 65);
    const auto [x, gram] = ops::sketch_prerope_keys(keys, c, s, sketch);
    const auto [x_ref, gram_ref] = ops::composite::sketch_prerope_keys(keys, c, s, sketch);
    EXPECT_TRUE(at::equal(x, x_ref) && at::equal(gram, gram_ref)) << keys.scalar_type() << " " << sketch.sizes();
  }
}

// cpu_kernel_isa() reports the dispatch this process runs: the tiles' ISA first, and the caps of
// the environment hold.
TEST(KernelOps, CpuKernelIsaNamesTheDispatch) {
  const std::string isa = ops::cpu_kernel_isa();
  const std::string tiles = isa.substr(0, isa.find('+'));
  EXPECT_EQ(tiles, kvpress::kernels::tile_isa_name(kvpress::kernels::cpu_tile_isa())) << isa;
  for (const char* clones : {"", "+avx512-clones", "+avx2-clones", "+baseline-clones"}) {
    if (isa == tiles + clones) return;
  }
  ADD_FAILURE() << "unexpected name " << isa;
}

TEST(KernelOps, CpuTileIsaHonoursTheEnvironmentCaps) {
  // The library's own reading of the switches (0 or 1).
  const auto is_set = [](const char* name) {
    return kvpress::checks::env_flag(name, "CpuTileIsaHonoursTheEnvironmentCaps");
  };
  const kvpress::kernels::TileIsa isa = kvpress::kernels::cpu_tile_isa();
  if (is_set("KVPRESS_DISABLE_AVX2")) EXPECT_EQ(isa, kvpress::kernels::TileIsa::kNone);
  if (is_set("KVPRESS_DISABLE_AVX512")) EXPECT_NE(isa, kvpress::kernels::TileIsa::kAvx512);
#if KVPRESS_HAVE_TILE_KERNELS
  if (!is_set("KVPRESS_DISABLE_AVX2") && !is_set("KVPRESS_DISABLE_AVX512") && __builtin_cpu_supports("avx512f"))
    EXPECT_EQ(isa, kvpress::kernels::TileIsa::kAvx512);
  if (!is_set("KVPRESS_DISABLE_AVX2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    EXPECT_NE(isa, kvpress::kernels::TileIsa::kNone);
#endif
}

// The ridge leverage of every row lies in [0, 1), whichever path computes it.
TEST(KernelOps, CholeskyLeverageLiesInTheUnitInterval) {
  for (int64_t k : {8, 48, 80}) {
    const at::Tensor x = randn({2, 3, 300, k}, 70);
    const at::Tensor factor = at::linalg_cholesky(at::matmul(x.transpose(2, 3), x) + at::eye(k) * 1e-2);
    const at::Tensor leverage = ops::cholesky_leverage(x, factor);
    ASSERT_EQ(leverage.sizes(), (at::IntArrayRef{2, 3, 300}));
    EXPECT_GE(leverage.min().item<float>(), 0.0f) << "k " << k;
    EXPECT_LT(leverage.max().item<float>(), 1.0f) << "k " << k;
  }
}

TEST(KernelOps, CholeskyLeverageMatchesTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  for (int64_t k : {8, 16, 32, 48, 64, 80}) {
    for (int64_t seq : {5, 300, 777}) {
      const at::Tensor x = randn({2, 3, seq, k}, 70);
      const at::Tensor gram = at::matmul(x.transpose(2, 3), x) + at::eye(k) * 1e-2;
      const at::Tensor factor = at::linalg_cholesky(gram);
      const at::Tensor kernel = ops::cholesky_leverage(x, factor);
      const at::Tensor composite = ops::composite::cholesky_leverage(x, factor);
      ASSERT_EQ(kernel.sizes(), (at::IntArrayRef{2, 3, seq}));
      EXPECT_TRUE(at::allclose(kernel, composite, 1e-4, 1e-6)) << "k " << k << " seq " << seq;
      EXPECT_GE(kernel.min().item<float>(), 0.0f);
      EXPECT_LT(kernel.max().item<float>(), 1.0f);
    }
  }
}

// The fused chunk kernel (src/ops/compactor/cpu/noncausal.cpp) against the composite, which builds kvpress's
// padded last chunk literally: chunks that divide S, a last partial chunk, a chunk longer than S,
// chunk sizes that are not multiples of 16 (or 1), GQA groups 1-4, strided queries. Shapes the kernel
// does not serve (bfloat16, head_dim 40) take the composite exactly.
TEST(KernelOps, NoncausalColumnSumsMatchTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  struct Case {
    int64_t heads, kv_heads, seq, dim, chunk;
  };
  for (const Case& c : {Case{8, 2, 512, 64, 256}, Case{8, 2, 1000, 128, 256}, Case{4, 4, 77, 32, 32},
                        Case{3, 1, 100, 16, 256}, Case{4, 2, 90, 64, 37}, Case{2, 1, 20, 16, 1}}) {
    const at::Tensor q = randn({2, c.heads, c.seq, c.dim}, 80), k = randn({2, c.kv_heads, c.seq, c.dim}, 81);
    const at::Tensor kernel = ops::noncausal_column_sums(q, k, c.chunk);
    const at::Tensor composite = ops::composite::noncausal_column_sums(q, k, c.chunk);
    ASSERT_EQ(kernel.sizes(), composite.sizes());
    EXPECT_TRUE(at::allclose(kernel, composite, 1e-5, 1e-5)) << "seq " << c.seq << " chunk " << c.chunk;
    const at::Tensor strided = q.transpose(1, 2).contiguous().transpose(1, 2);
    EXPECT_TRUE(at::equal(ops::noncausal_column_sums(strided, k, c.chunk), kernel)) << "seq " << c.seq;
  }
  for (const auto& [q, k] :
       {std::pair{randn({1, 4, 300, 40}, 82), randn({1, 2, 300, 40}, 83)},
        std::pair{randn({1, 4, 300, 64}, 82).to(at::kBFloat16), randn({1, 2, 300, 64}, 83).to(at::kBFloat16)}}) {
    EXPECT_TRUE(at::equal(ops::noncausal_column_sums(q, k, 256), ops::composite::noncausal_column_sums(q, k, 256)))
        << q.scalar_type() << " " << q.sizes();
  }
}

// A device with no kernel (here meta) is served by the composite instead of raising.
TEST(KernelOps, DevicesWithoutAKernelTakeTheComposite) {
  const at::Tensor keys = randn({1, 2, 30, 8}, 12).to(at::kMeta);
  EXPECT_EQ(ops::key_norm_scores(keys).sizes(), (at::IntArrayRef{1, 2, 30}));
  EXPECT_EQ(ops::keydiff_scores(keys).device().type(), at::kMeta);
  EXPECT_EQ(ops::window_attention_mean(randn({1, 4, 3, 8}, 13).to(at::kMeta), keys).sizes(),
            (at::IntArrayRef{1, 4, 27}));
  for (const char* op :
       {"kvpress::topk_indices", "kvpress::gather_kv", "kvpress::invert_rope", "kvpress::key_norm_scores",
        "kvpress::keydiff_scores", "kvpress::window_attention_mean", "kvpress::lagkv_partition_scores",
        "kvpress::ragged_attention", "kvpress::paged_attention", "kvpress::paged_write", "kvpress::sketch_prerope_keys",
        "kvpress::cholesky_leverage", "kvpress::noncausal_column_sums", "kvpress::rescue_column_max",
        "kvpress::output_projected_l1_norms", "kvpress::max_similarity"}) {
    const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, "");
    EXPECT_TRUE(handle.hasKernelForDispatchKey(c10::DispatchKey::CPU)) << op;
    EXPECT_TRUE(handle.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) << op;
  }
}

TEST(WindowAttentionMean, MatchesWindowAttentionMeanForEveryDtype) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor q = randn({2, 8, 5, 16}, 1);
    const at::Tensor k = randn({2, 2, 40, 16}, 2, dtype);
    const at::Tensor fused = ops::window_attention_mean(q, k);
    ASSERT_EQ(fused.sizes(), (at::IntArrayRef{2, 8, 35}));
    ASSERT_EQ(fused.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::allclose(fused, ops::window_attention(q, k).mean(2), 1e-5, 1e-7)) << dtype;
  }
}

// Window logits of many rows (here 4 query heads x 64 = 256, SnapKV's shape) come from the
// register tile in blocks of 64 keys (the last one partial) and tiles of 6 rows (the last one of 4);
// head_dim 80 (not a multiple of 16) takes the batched GEMM. Both against the composite.
TEST(WindowAttentionMean, TiledLogitsMatchTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  for (int64_t dim : {128, 80, 16}) {
    const at::Tensor q = randn({1, 8, 64, dim}, 3);
    const at::Tensor k = randn({1, 2, 1000, dim}, 4);
    const at::Tensor fused = ops::window_attention_mean(q, k);
    EXPECT_TRUE(at::allclose(fused, ops::composite::window_attention_mean(q, k), 1e-5, 1e-7)) << dim;
    const at::Tensor strided = k.transpose(1, 2).contiguous().transpose(1, 2);  // rows Hkv * D apart
    EXPECT_TRUE(at::equal(ops::window_attention_mean(q, strided), fused)) << dim;
  }
}

// The window softmax's exponential (vec16::exp_nonpositive) against std::exp in double: within
// 2 ulp over softmax's range, 0 below the smallest normal float and for -inf, 1 at -0 and 0.
TEST(KernelOps, VectorExpIsWithinTwoUlpOfStdExp) {
  std::vector<float> xs{0.0f, -0.0f, -1e-30f, -1e-7f, -0.34657359f, -0.5f, -1.0f, -87.0f, -87.3f};
  for (int i = 0; i < 200000; ++i) xs.push_back(-87.3f * static_cast<float>(i) / 200000.0f);
  for (size_t start = 0; start < xs.size(); start += vec16::kLanes) {
    float in[vec16::kLanes] = {}, got[vec16::kLanes];
    const size_t n = std::min<size_t>(vec16::kLanes, xs.size() - start);
    std::copy(xs.begin() + start, xs.begin() + start + n, in);
    vec16::store(got, vec16::exp_nonpositive(vec16::load(in)));
    for (size_t j = 0; j < n; ++j) {
      const float want = static_cast<float>(std::exp(static_cast<double>(in[j])));
      const float ulp = std::nextafter(want, 2.0f * want + 1.0f) - want;
      ASSERT_LE(std::abs(got[j] - want), 2.0f * ulp) << "x = " << in[j];
    }
  }
  float low[vec16::kLanes], got[vec16::kLanes];
  for (int64_t j = 0; j < vec16::kLanes; ++j) low[j] = -87.34f - static_cast<float>(j) * 10.0f;
  low[vec16::kLanes - 1] = -std::numeric_limits<float>::infinity();
  vec16::store(got, vec16::exp_nonpositive(vec16::load(low)));
  for (int64_t j = 0; j < vec16::kLanes; ++j) EXPECT_EQ(got[j], 0.0f) << "x = " << low[j];
}

// Logits far apart (large queries): most of each row's exponentials underflow to 0, as in torch's
// softmax, and the rows' lengths leave tails of every size below the vector width.
TEST(WindowAttentionMean, MatchesTheCompositeWhenMostExponentialsUnderflow) {
  for (int64_t seq : {17, 33, 250}) {
    const at::Tensor q = randn({1, 4, 7, 16}, 60) * 40;
    const at::Tensor k = randn({1, 2, seq, 16}, 61);
    EXPECT_TRUE(at::allclose(ops::window_attention_mean(q, k), ops::composite::window_attention_mean(q, k), 1e-5, 1e-7))
        << "S=" << seq;
  }
}

TEST(WindowAttentionMean, SplitsLongSequencesIntoSlabsOfKvHeads) {
  // 4 query heads x 32 rows x 16400 keys x 4 bytes = 8.4 MiB of logits per KV head: the CPU kernel
  // takes its 5 KV heads in slabs of 3 and 2 (32 MiB at most).
  const at::Tensor q = randn({1, 20, 32, 32}, 3);
  const at::Tensor k = randn({1, 5, 16400, 32}, 4);
  EXPECT_TRUE(at::allclose(ops::window_attention_mean(q, k), ops::composite::window_attention_mean(q, k), 1e-5, 1e-9));
}

TEST(WindowAttentionMean, AcceptsStridedInputsAndSingleQueryWindows) {
  const at::Tensor q = randn({1, 4, 6, 8}, 5).transpose(2, 3).contiguous().transpose(2, 3);  // strided view
  const at::Tensor k = randn({1, 30, 2, 8}, 6).transpose(1, 2);                              // [1, 2, 30, 8]
  EXPECT_TRUE(at::allclose(ops::window_attention_mean(q, k), ops::composite::window_attention_mean(q, k), 1e-5, 1e-7));
  const at::Tensor last = q.narrow(2, 5, 1);
  EXPECT_TRUE(at::allclose(ops::window_attention_mean(last, k), ops::window_attention(last, k).squeeze(2), 1e-5, 1e-7));
}

TEST(WindowAttentionMean, SnapKVScoresFromMeanEqualScoresFromFullAttention) {
  const at::Tensor q = randn({1, 8, 6, 16}, 7);
  const at::Tensor k = randn({1, 2, 50, 16}, 8);
  const at::Tensor full = ops::snapkv_scores(ops::window_attention(q, k), 2, 5);
  const at::Tensor fused = ops::snapkv_scores_from_mean(ops::window_attention_mean(q, k), 2, 5, 6);
  EXPECT_TRUE(at::allclose(full, fused, 1e-5, 1e-7));
}

TEST(WindowAttentionMean, RejectsBadArguments) {
  const at::Tensor k = randn({1, 2, 20, 8}, 9);
  expect_error(
      [&] {
        ops::window_attention_mean(randn({1, 3, 4, 8}, 1), k);
      },
      {"window_attention_mean: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
  expect_error(
      [&] {
        ops::window_attention_mean(randn({1, 4, 20, 8}, 1), k);
      },
      {"window_attention_mean: window must be < seq_len (20), got 20"});
  expect_error(
      [&] {
        ops::window_attention_mean(randn({1, 4, 4, 6}, 1), k);
      },
      {"window_attention_mean: queries must be [1, num_heads, window, 8] to match keys, got [1, 4, 4, 6]"});
  expect_error(
      [&] {
        ops::snapkv_scores_from_mean(randn({1, 4, 10}, 1), 2, 4, 3);
      },
      {"snapkv_scores_from_mean: kernel_size must be a positive odd number, got 4"});
}

// The kernel's ranks may differ from the ATen ranks only where two statistics of a partition are
// within float32 rounding of each other: allow a few such swaps, never a large move.
// The fused kernel (through the op) against the ATen composite on keys/values [batch, heads, seq,
// dim]: averages to float32 rounding; ranks ordered as the composite's averages are (a near-tie may
// swap), the sinks and the unscored end alike.
void expect_lag_kernel_matches_composite(const at::Tensor& k, const at::Tensor& v, int64_t n_sink, int64_t lag,
                                         bool cross, const std::string& what) {
  const at::Tensor fused = ops::lagkv_scores(k, v, n_sink, lag, cross);
  const at::Tensor averages = ops::composite::lagkv_partition_scores(k, v, n_sink, lag, true);
  const double rtol = testing::lag_average_rtol(k.size(3), lag);
  if (cross) {
    EXPECT_TRUE(at::allclose(fused, averages, rtol, 1e-30)) << what;
    return;
  }
  const checks::LagLayout layout = checks::lag_layout(k.size(2), n_sink, lag);
  const at::Tensor ranks = ops::composite::lagkv_partition_scores(k, v, n_sink, lag, false);
  const int64_t scored_end = layout.end - lag;
  EXPECT_TRUE(at::equal(fused.narrow(2, 0, n_sink), ranks.narrow(2, 0, n_sink))) << what;
  EXPECT_TRUE(at::equal(fused.narrow(2, scored_end, k.size(2) - scored_end),
                        ranks.narrow(2, scored_end, k.size(2) - scored_end)))
      << what;
  testing::expect_lag_ranks_consistent(fused, averages, n_sink, lag, layout.n_parts - 1, k.scalar_type(), rtol, what);
}

// CTRPress's rescue, fused per row, against its ATen composite: row lengths below, at and past the
// vector width (AVX-512 16, AVX2 8 lanes: the AVX2 rerun covers that path), one row to several
// blocks of rows. The kernel's exponentials are within 2 ulp of std::exp, the composite's are ATen's:
// each log-sum-exp agrees to a few float ulps of its magnitude (about 1e-6 here).
TEST(RescueColumnMax, MatchesTheComposite) {
  for (int64_t rows : {1, 7, 300}) {
    for (int64_t keys : {1, 5, 16, 37, 1000}) {
      const at::Tensor logits = randn({rows, keys}, 40 + rows + keys) * 8.0;
      const at::Tensor fused = ops::rescue_column_max(logits, std::sqrt(64.0));
      const at::Tensor reference = ops::composite::rescue_column_max(logits, std::sqrt(64.0));
      ASSERT_EQ(fused.sizes(), (at::IntArrayRef{keys}));
      EXPECT_TRUE(at::allclose(fused, reference, 1e-5, 1e-5))
          << rows << " x " << keys << ": max |d| " << (fused - reference).abs().max().item<float>();
    }
  }
  // Every value a log-probability: at most 0, and one key per row reaches its row's largest.
  const at::Tensor one_row = ops::rescue_column_max(randn({1, 50}, 3), 1.0);
  EXPECT_LE(one_row.max().item<float>(), 0.f);
  EXPECT_NEAR(one_row.exp().sum().item<float>(), 1.f, 1e-5);
  expect_error(
      [] {
        ops::rescue_column_max(at::zeros({2, 3}, at::kDouble), 1.0);
      },
      {"rescue_column_max: logits must be a non-empty float32 [rows, keys] matrix"});
  expect_error([] { ops::rescue_column_max(at::zeros({2, 3}), 0.0); }, {"rescue_column_max: scale must be > 0, got 0"});
}

// CriticalKVPress's value norms, register-tiled with the L1 sum in registers, against the composite's
// GEMM and norm: heads of 1, 2 and 4 query heads per KV head, row counts below, at and past the
// tile's rows and the 240-row blocks, hidden sizes of one and several panels (64 columns under
// AVX-512, 16 under AVX2), and one hidden size no panel divides (the composite, on every path). Each
// product entry is a D = 32-term dot product summed in another order: its error is at most
// D·eps·sum|v_t w_t|, about 4e-6 of it, and the L1 sum of such entries is within that relatively.
TEST(OutputProjectedL1Norms, MatchesTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  struct Shape {
    int64_t batch, kv_heads, heads, seq, hidden;
  };
  for (const Shape& s :
       {Shape{1, 1, 1, 5, 64}, Shape{2, 2, 4, 37, 128}, Shape{1, 2, 8, 251, 192}, Shape{1, 1, 2, 6, 72}}) {
    const int64_t d = 32;
    const at::Tensor values = randn({s.batch, s.kv_heads, s.seq, d}, 7 + s.seq);
    const at::Tensor o_proj = randn({s.hidden, s.heads * d}, 11 + s.hidden) * 0.1;
    const at::Tensor fused = ops::output_projected_l1_norms(values, o_proj, s.heads);
    const at::Tensor reference = ops::composite::output_projected_l1_norms(values, o_proj, s.heads);
    ASSERT_EQ(fused.sizes(), (at::IntArrayRef{s.batch, s.kv_heads, s.seq}));
    EXPECT_TRUE(at::allclose(fused, reference, 2e-5, 0))
        << s.seq << " rows, hidden " << s.hidden << ": max relative |d| "
        << ((fused - reference).abs() / reference).max().item<float>();
  }
  // bfloat16 values are read exactly as float32.
  const at::Tensor v16 = randn({1, 2, 20, 32}, 5).to(at::kBFloat16);
  const at::Tensor w = randn({64, 4 * 32}, 6);
  EXPECT_TRUE(at::allclose(ops::output_projected_l1_norms(v16, w, 4),
                           ops::composite::output_projected_l1_norms(v16, w, 4), 2e-5, 0));
}

TEST(OutputProjectedL1Norms, RefusesMismatchedHeads) {
  const at::Tensor v16 = randn({1, 2, 20, 32}, 5).to(at::kBFloat16);
  const at::Tensor w = randn({64, 4 * 32}, 6);
  expect_error([&] { ops::output_projected_l1_norms(v16, w, 3); },
               {"output_projected_l1_norms: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
  expect_error([&] { ops::output_projected_l1_norms(v16, w, 2); },
               {"output_projected_l1_norms: o_proj must be [hidden, 64] (num_heads * head_dim), got [64, 128]"});
}

// MergingPress's nearest kept key, register-tiled with the maximum taken in registers, against the
// composite's GEMM and max: candidate counts below, at and past a panel (64 columns under AVX-512,
// 16 under AVX2) and row counts past a tile and a 240-row block. Products of unit rows (|x| <= 1)
// summed in another order differ by at most D·eps = 8e-6 (D = 64); an index may differ only where
// two candidates are that close, and then the kernel's pick is within that of the maximum.
TEST(MaxSimilarity, MatchesTheComposite) {
  KVPRESS_SKIP_UNLESS_TILE_KERNELS();
  const auto unit = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
  for (int64_t m : {1, 15, 64, 65, 300}) {
    for (int64_t n : {1, 7, 250}) {
      const at::Tensor rows = unit(randn({2, 3, n, 64}, 100 + n));
      const at::Tensor candidates = unit(randn({2, 3, m, 64}, 200 + m));
      const auto [value, index] = ops::max_similarity(rows, candidates);
      const auto [want_value, want_index] = ops::composite::max_similarity(rows, candidates);
      ASSERT_EQ(index.scalar_type(), at::kLong);
      EXPECT_TRUE(at::allclose(value, want_value, 0, 1e-5)) << n << " x " << m;
      // The kernel's index reaches its value: the similarity of that candidate, recomputed.
      const at::Tensor picked = candidates.gather(2, index.unsqueeze(-1).expand({2, 3, n, 64}));
      EXPECT_TRUE(at::allclose((rows * picked).sum(-1), want_value, 0, 1e-5)) << n << " x " << m;
      EXPECT_GE(at::eq(index, want_index).to(at::kFloat).mean().item<float>(), 0.99f) << n << " x " << m;
    }
  }
  // Equal candidates: the first one, as ATen's max.
  const at::Tensor row = unit(randn({1, 1, 3, 64}, 1));
  const at::Tensor twice = at::cat({unit(randn({1, 1, 20, 64}, 2)), row.narrow(2, 0, 1), row.narrow(2, 0, 1)}, 2);
  EXPECT_EQ(std::get<1>(ops::max_similarity(row.narrow(2, 0, 1), twice)).item<int64_t>(), 20);
}

TEST(MaxSimilarity, RefusesMismatchedCandidates) {
  expect_error(
      [] {
        ops::max_similarity(at::zeros({1, 2, 3, 8}), at::zeros({1, 2, 0, 8}));
      },
      {"max_similarity: candidates must be [1, 2, m >= 1, 8] (the rows' batch, heads and head_dim), got "
       "[1, 2, 0, 8]"});
  expect_error(
      [] {
        ops::max_similarity(at::zeros({1, 2, 3, 8}, at::kDouble), at::zeros({1, 2, 3, 8}));
      },
      {"max_similarity: rows and candidates must be float32, got Double and Float"});
}

TEST(LagKVKernel, MatchesAtenStatisticsAndRanks) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool cross : {true, false}) {
      // 4 sinks, lag 16, 7 partitions and 3 leftover tokens.
      const at::Tensor k = randn({2, 3, 4 + 7 * 16 + 3, 32}, 10, dtype);
      const at::Tensor v = randn({2, 3, 4 + 7 * 16 + 3, 32}, 11, dtype);
      expect_lag_kernel_matches_composite(k, v, 4, 16, cross, c10::toString(dtype));
    }
  }
}

// Ranks within a partition are stable: equal scores (here every token appears twice in a row, K and
// V alike) rank by position, the earlier one directly below the later one. Partitions of 16 are
// ranked by counting, partitions of 600 by a sort; both against the composite.
TEST(LagKVKernel, TiedScoresRankByPositionInBothRankingPaths) {
  for (int64_t lag : {16, 600}) {
    const int64_t seq = 4 * lag;
    const at::Tensor k = randn({1, 2, seq / 2, 32}, 14).repeat_interleave(2, 2);
    const at::Tensor v = randn({1, 2, seq / 2, 32}, 15).repeat_interleave(2, 2);
    const at::Tensor ranks = ops::lagkv_scores(k, v, 0, lag, false);
    expect_lag_kernel_matches_composite(k, v, 0, lag, false, "ties");
    for (int64_t p = 0; p + 1 < seq / lag; ++p) {  // the last partition has no reference: all ones
      const at::Tensor part = ranks[0][1].narrow(0, p * lag, lag);
      EXPECT_TRUE(at::equal(std::get<0>(part.sort()), at::arange(lag, at::kFloat) / lag)) << lag << " " << p;
      const at::Tensor earlier = part.slice(0, 0, lag, 2), later = part.slice(0, 1, lag, 2);
      EXPECT_TRUE(at::allclose(later - earlier, at::full({lag / 2}, 1.0 / lag), 0, 1e-6)) << lag << " " << p;
    }
  }
}

TEST(LagKVKernel, CoversEveryTiledHeadDimAndTheGenericLoop) {
  // Head dims 16..128 in steps of 16 take the register-tiled statistics (rows in groups of four,
  // then single rows: lag 18), the others the generic loop.
  for (int64_t dim : {16, 48, 64, 80, 96, 112, 128, 24, 136}) {
    for (bool cross : {true, false}) {
      const at::Tensor k = randn({1, 2, 2 + 5 * 18, dim}, 20 + dim), v = randn({1, 2, 2 + 5 * 18, dim}, 21 + dim);
      expect_lag_kernel_matches_composite(k, v, 2, 18, cross, "dim " + std::to_string(dim));
    }
  }
}

TEST(LagKVKernel, HandlesNoSinksStridedInputsAndExactPartitions) {
  const at::Tensor k = randn({1, 40, 2, 8}, 12).transpose(1, 2);  // [1, 2, 40, 8], strided
  const at::Tensor v = randn({1, 2, 40, 8}, 13);
  expect_lag_kernel_matches_composite(k, v, 0, 8, true, "strided");
  expect_lag_kernel_matches_composite(k, v, 0, 8, false, "strided");
  // Ranks of one partition are a permutation of 0 .. lag - 1, divided by lag.
  const at::Tensor s = ops::lagkv_scores(k, v, 0, 8, false);
  for (int64_t p = 0; p < 4; ++p) {
    const at::Tensor sorted = std::get<0>(s[0][1].narrow(0, p * 8, 8).sort());
    EXPECT_TRUE(at::equal(sorted, at::arange(8, at::kFloat) / 8)) << p;
  }
  EXPECT_TRUE(at::equal(s[0][1].narrow(0, 32, 8), at::ones({8})));  // last partition
}

TEST(LagKVKernel, NaNInputsReachTheSelectionCheck) {
  at::Tensor k = randn({1, 1, 64, 8}, 14);
  k[0][0][5][3] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor v = randn({1, 1, 64, 8}, 15);
  EXPECT_TRUE(at::isnan(ops::lagkv_scores(k, v, 0, 16, false)).any().item<bool>());
  LayerInputs in;
  in.keys = k;
  in.values = v;
  expect_error([&] { LagKVPress(0.5, 0, 16).compress(in); }, {"scores must be finite"});
}

TEST(LagKVKernel, RejectsShortSequences) {
  const at::Tensor k = randn({1, 1, 20, 8}, 16);
  const auto kernel = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("kvpress::lagkv_partition_scores", "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  for (const auto& run : {std::function<void()>([&] { kernel.call(k, k, 4, 16, false); }),
                          std::function<void()>([&] { ops::composite::lagkv_partition_scores(k, k, 4, 16, false); })}) {
    expect_error(run, {"lagkv_partition_scores: seq_len must be >= n_sink + 2 * lag_size (36), got 20"});
  }
}

// ---- the kernels' parallel loops -----------------------------------------------------------

// Every CPU kernel with a parallel loop (rows, heads, runs or key chunks split among the intra-op
// threads) gives on four threads what it gives on one. The inputs are larger than every loop's
// grain size, so the four-thread run really splits the work. Attention merges key chunks whose
// number depends on the thread count, so it is compared within float32 rounding; the rest must be
// equal.
TEST(ParallelKernels, FourThreadsGiveTheResultsOfOne) {
  const at::Tensor keys = randn({2, 4, 1500, 64}, 40), values = randn({2, 4, 1500, 64}, 41);
  const at::Tensor scores = randn({2, 4, 1500}, 42);
  const at::Tensor window = randn({2, 8, 16, 64}, 43);
  const at::Tensor queries = randn({2, 8, 1, 64}, 44);
  // Head-ragged storage: 2 x 4 heads keeping 0 .. 1400 packed tokens, 3 tail tokens.
  const at::Tensor offsets = at::tensor({0, 0, 1, 200, 900, 2300, 2301, 2400, 2460}, at::kLong);
  const at::Tensor packed_k = randn({2460, 64}, 45), packed_v = randn({2460, 64}, 46);
  const at::Tensor tail_k = randn({2, 4, 3, 64}, 47), tail_v = randn({2, 4, 3, 64}, 48);
  // A paged layout: every head's tokens in pages of 16 taken from a shuffled pool.
  const int64_t page = 16, pages_per_head = 1500 / page;
  const at::Tensor page_table = at::randperm(8 * pages_per_head, at::kLong).view({2, 4, pages_per_head});
  const at::Tensor lengths = at::full({2, 4}, pages_per_head * page, at::kLong);
  const at::Tensor key_pool = randn({8 * pages_per_head, page, 64}, 49);
  const at::Tensor value_pool = randn({8 * pages_per_head, page, 64}, 50);
  const at::Tensor rope_cos = randn({1500, 64}, 52), rope_sin = randn({1500, 64}, 53);
  const at::Tensor sketch = randn({2, 4, 64, 48}, 54);
  const at::Tensor all_queries = randn({2, 8, 1500, 64}, 55);
  const at::Tensor rows = randn({3000, 64}, 51),
                   slots = at::randperm(8 * pages_per_head * page, at::kLong).narrow(0, 0, 3000);

  const auto run_all = [&] {
    std::vector<at::Tensor> out;
    out.push_back(ops::key_norm_scores(keys));
    out.push_back(ops::keydiff_scores(keys));
    out.push_back(ops::lagkv_scores(keys, values, 4, 16, true));
    const at::Tensor kept = ops::topk_indices(scores, 700);
    out.push_back(kept);
    const KV gathered = ops::gather_kv(keys, values, kept);
    out.push_back(gathered.keys);
    out.push_back(gathered.values);
    at::Tensor k = keys.clone(), v = values.clone();
    const KV compacted = ops::compact_kv_in_place(k, v, kept);
    out.push_back(compacted.keys.clone());
    out.push_back(compacted.values.clone());
    out.push_back(ops::window_attention_mean(window, keys));
    out.push_back(ops::ragged_attention(queries, packed_k, packed_v, offsets, tail_k, tail_v));
    out.push_back(ops::paged_attention(queries, key_pool, value_pool, page_table, lengths));
    at::Tensor kp = key_pool.clone(), vp = value_pool.clone();
    ops::paged_write(kp, vp, rows, rows * 2, slots);
    out.push_back(kp);
    out.push_back(vp);
    const auto [sketched, gram] = ops::sketch_prerope_keys(keys, rope_cos, rope_sin, sketch);
    out.push_back(sketched);
    out.push_back(gram);
    out.push_back(ops::cholesky_leverage(sketched, at::linalg_cholesky(gram + at::eye(48) * 1e-2)));
    out.push_back(ops::noncausal_column_sums(all_queries, keys, 256));
    return out;
  };
  std::vector<at::Tensor> one, four;
  {
    IntraOpThreads threads(1);
    one = run_all();
  }
  {
    IntraOpThreads threads(4);
    ASSERT_EQ(at::get_num_threads(), 4);
    four = run_all();
  }
  const std::vector<std::string> names = {"key_norm_scores",    "keydiff_scores",        "lagkv_scores",
                                          "topk_indices",       "gather_kv keys",        "gather_kv values",
                                          "compact keys",       "compact values",        "window_attention_mean",
                                          "ragged_attention",   "paged_attention",       "paged_write keys",
                                          "paged_write values", "sketch_prerope_keys X", "sketch_prerope_keys Gram",
                                          "cholesky_leverage",  "noncausal_column_sums"};
  ASSERT_EQ(one.size(), names.size());
  // Without the register tiles the leverage ops are their ATen composites (at::matmul, triangular
  // solves): BLAS blocks its sums by thread count and alignment (MKL's AVX2 path does on an Intel
  // Sapphire Rapids), so they are compared within float32 rounding of their longest sums (the
  // Gram's 1500 terms: about sqrt(1500) 2^-24 = 2.3e-6 relative; rtol 1e-4). Our own loops must be
  // equal.
  const bool leverage_is_composite = kvpress::kernels::cpu_tile_isa() == kvpress::kernels::TileIsa::kNone;
  for (size_t i = 0; i < names.size(); ++i) {
    const bool leverage_op = names[i].rfind("sketch_prerope_keys", 0) == 0 || names[i] == "cholesky_leverage";
    if (names[i] == "ragged_attention" || names[i] == "paged_attention")
      EXPECT_TRUE(at::allclose(one[i], four[i], 1e-5, 1e-6)) << names[i];
    else if (leverage_op && leverage_is_composite)
      EXPECT_TRUE(at::allclose(one[i], four[i], 1e-4, 1e-6)) << names[i] << " (ATen composite)";
    else
      EXPECT_TRUE(at::equal(one[i], four[i])) << names[i];
  }
}

}  // namespace
}  // namespace kvpress
