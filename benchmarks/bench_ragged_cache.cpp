// Head-ragged cache: memory and decode-attention time (docs/PERFORMANCE.md, "Head-ragged cache").
//
//   kvpress_bench_ragged [--seq-lens 4096,32768] [--ratios 0.5,0.75] [--repeats 20]
//
// For B = 1, Hkv = 8, Hq = 32, D = 128, float32: keep Hkv * n_kept(S, r) tokens with uneven per-head
// budgets (head h gets a share proportional to h + 1, random positions), store them as a
// HeadRaggedLayer, and print one Markdown row per (S, r):
//   * bytes of the ragged layer versus (1 - r) x full-cache bytes + its index bytes (must be within
//     2%: the layer allocates the kept tokens and nothing else);
//   * decode attention (one new token, n = 1) over the ragged layer versus over the full dense
//     cache: the same fused kernel on an uncompressed layer, and the runner's ATen path
//     (matmul, float32 softmax, matmul) without and with a -inf keep mask (kvpress's way of
//     applying per-head budgets). Median of --repeats calls after a warm-up.
// Exits 1 when a memory check fails.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"

#include "bench_util.h"

namespace {

using kvpress_bench::median_ms;

constexpr int64_t kBatch = 1, kKvHeads = 8, kQHeads = 32, kDim = 128;

// Per-head budgets summing to `total`, head h weighted h + 1 (capped at seq_len).
std::vector<int64_t> uneven_budgets(int64_t total, int64_t seq_len) {
  std::vector<int64_t> budget(kKvHeads);
  const double weight_sum = kKvHeads * (kKvHeads + 1) / 2.0;
  int64_t assigned = 0;
  for (int64_t h = 0; h < kKvHeads; ++h) {
    budget[static_cast<size_t>(h)] = std::min<int64_t>(seq_len, static_cast<int64_t>(total * (h + 1) / weight_sum));
    assigned += budget[static_cast<size_t>(h)];
  }
  for (int64_t h = 0; assigned < total; h = (h + 1) % kKvHeads) {  // hand out the rounding remainder
    if (budget[static_cast<size_t>(h)] < seq_len) {
      ++budget[static_cast<size_t>(h)];
      ++assigned;
    }
  }
  return budget;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> seq_lens{4096, 32768}, ratios{0.5, 0.75};
  int repeats = 20;
  if (!kvpress_bench::Options()
           .list("--seq-lens", seq_lens)
           .list("--ratios", ratios)
           .integer("--repeats", repeats)
           .parse(argc, argv, "[--seq-lens 4096,32768] [--ratios 0.5,0.75] [--repeats 20]"))
    return 2;
  std::printf("B=%lld Hkv=%lld Hq=%lld D=%lld float32, %d threads, median of %d decode calls (n=1)\n\n",
              static_cast<long long>(kBatch), static_cast<long long>(kKvHeads), static_cast<long long>(kQHeads),
              static_cast<long long>(kDim), at::get_num_threads(), repeats);
  std::printf(
      "| S | r | head budgets (min-max) | full cache MiB | ragged MiB | (1-r) full + index MiB | diff | "
      "ragged attn ms | dense, same kernel ms | dense ATen ms | dense ATen + mask ms | ragged / ATen per row |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  bool ok = true;
  for (double s_value : seq_lens) {
    const int64_t seq_len = static_cast<int64_t>(s_value);
    at::manual_seed(0);
    const at::Tensor keys = at::randn({kBatch, kKvHeads, seq_len + 1, kDim});
    const at::Tensor values = at::randn({kBatch, kKvHeads, seq_len + 1, kDim});
    const at::Tensor past_k = keys.narrow(2, 0, seq_len).contiguous(),
                     past_v = values.narrow(2, 0, seq_len).contiguous();
    const at::Tensor new_k = keys.narrow(2, seq_len, 1), new_v = values.narrow(2, seq_len, 1);
    const at::Tensor q = at::randn({kBatch, kQHeads, 1, kDim});
    const double full_bytes = 2.0 * static_cast<double>(past_k.nbytes());

    kvpress::HeadRaggedLayer dense_layer = kvpress::HeadRaggedLayer::from_dense(past_k, past_v);
    dense_layer.append(new_k, new_v);
    const double dense_kernel_ms = median_ms([&] { kvpress::ops::ragged_attention(q, dense_layer); }, repeats);
    const at::Tensor all_k = keys.contiguous(), all_v = values.contiguous();
    const double dense_aten_ms =
        median_ms([&] { kvpress_bench::aten_decode_attention(q, all_k, all_v, at::Tensor()); }, repeats);

    for (double ratio : ratios) {
      const int64_t n_kept = kvpress::ops::n_kept(seq_len, ratio);
      const std::vector<int64_t> budget = uneven_budgets(kKvHeads * n_kept, seq_len);
      at::Tensor mask = at::zeros({kBatch, kKvHeads, seq_len}, at::kBool);
      for (int64_t h = 0; h < kKvHeads; ++h)
        mask[0][h].index_fill_(0, at::randperm(seq_len, at::kLong).narrow(0, 0, budget[static_cast<size_t>(h)]), true);

      kvpress::HeadRaggedLayer layer = kvpress::HeadRaggedLayer::from_mask(past_k, past_v, mask);
      const double ragged_bytes = static_cast<double>(layer.bytes());
      const double expected = (1.0 - ratio) * full_bytes + static_cast<double>(layer.index_bytes());
      const double diff = (ragged_bytes - expected) / expected;
      if (std::abs(diff) > 0.02) ok = false;

      layer.append(new_k, new_v);
      const double ragged_ms = median_ms([&] { kvpress::ops::ragged_attention(q, layer); }, repeats);
      const at::Tensor full_mask = at::cat({mask, at::ones({kBatch, kKvHeads, 1}, at::kBool)}, 2);
      const double masked_ms =
          median_ms([&] { kvpress_bench::aten_decode_attention(q, all_k, all_v, full_mask); }, repeats);

      const double mib = 1024.0 * 1024.0;
      // Time per attended (head, token) row, ours over ATen's dense path (issue 14's target: <= 1.1).
      const double per_row_ratio = (ragged_ms / static_cast<double>(kKvHeads * (n_kept + 1))) /
                                   (dense_aten_ms / static_cast<double>(kKvHeads * (seq_len + 1)));
      std::printf("| %lld | %.2f | %lld-%lld | %.1f | %.2f | %.2f | %+.3f%% | %.3f | %.3f | %.3f | %.3f | %.2f |\n",
                  static_cast<long long>(seq_len), ratio, static_cast<long long>(budget.front()),
                  static_cast<long long>(budget.back()), full_bytes / mib, ragged_bytes / mib, expected / mib,
                  100.0 * diff, ragged_ms, dense_kernel_ms, dense_aten_ms, masked_ms, per_row_ratio);
      std::fflush(stdout);
    }
  }
  if (!ok) {
    std::fprintf(stderr, "FAIL: a ragged layer's bytes differ from (1 - r) x full + index by more than 2%%\n");
    return 1;
  }
  return 0;
}
