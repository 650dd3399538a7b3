// Paged cache: pages and bytes before and after compression, and decode-attention time per token,
// paged versus dense (docs/PERFORMANCE.md, "Paged cache").
//
//   kvpress_bench_paged [--seq-lens 16384] [--batch 16384,9000,3000,700,128] [--ratios 0.5,0.75]
//                       [--page-size 16] [--repeats 20]
//
// Llama-3.1-8B's layer shape, Hkv = 8, Hq = 32, D = 128, float32, one layer. Two workloads:
//   * one sequence of each --seq-lens length;
//   * a mixed-length batch (--batch), stored packed along tokens (cu_seqlens) in one store() call.
// For each workload, press (KnormPress: equal heads; AdaKVPress over Knorm: heads keep different
// counts) and ratio, store() compresses while writing the pages, and the program prints one
// Markdown row: pages and MiB of the uncompressed cache (Hkv x ceil(S / page_size) per sequence)
// and of the compressed one, the bound sum over heads of ceil(kept / page_size) (pages must equal
// it) and (1 - r) x uncompressed + one page per head (pages must not exceed it), then one decode
// step's attention (one new token per sequence, appended first), median of --repeats calls:
// PagedKVCache::attention over the compressed pages, the same over uncompressed pages, and the
// runner's dense ATen attention over each sequence's full cache (summed over the batch), each
// also per kept / per cached token. Exits 1 when a memory check fails.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kvpress/paged.h"
#include "kvpress/registry.h"

#include "bench_util.h"

namespace {

using kvpress_bench::median_ms;

constexpr int64_t kKvHeads = 8, kQHeads = 32, kDim = 128;

struct Workload {
  std::string name;
  std::vector<int64_t> lengths;
};

struct Press {
  std::string label;
  std::string name;
  std::map<std::string, std::string> params;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> seq_lens{16384}, batch{16384, 9000, 3000, 700, 128}, ratios{0.5, 0.75};
  int64_t page_size = kvpress::PagedCacheOptions::kDefaultPageSize;
  int repeats = 20;
  if (!kvpress_bench::Options()
           .list("--seq-lens", seq_lens)
           .list("--batch", batch)
           .list("--ratios", ratios)
           .integer("--page-size", page_size)
           .integer("--repeats", repeats)
           .parse(argc, argv,
                  "[--seq-lens 16384] [--batch 16384,9000,3000,700,128] [--ratios 0.5,0.75] [--page-size 16] "
                  "[--repeats 20]"))
    return 2;
  std::vector<Workload> workloads;
  for (double s : seq_lens)
    workloads.push_back({"S=" + std::to_string(static_cast<int64_t>(s)), {static_cast<int64_t>(s)}});
  Workload mixed{"batch ", {}};
  for (double s : batch) {
    mixed.lengths.push_back(static_cast<int64_t>(s));
    mixed.name += (mixed.lengths.size() > 1 ? "+" : "") + std::to_string(static_cast<int64_t>(s));
  }
  workloads.push_back(mixed);
  const std::vector<Press> presses = {{"KnormPress", "KnormPress", {}},
                                      {"AdaKVPress(Knorm)", "AdaKVPress", {{"press", "KnormPress"}}}};

  std::printf("Hkv=%lld Hq=%lld D=%lld float32, page_size %lld, %d threads, median of %d decode steps (n=1)\n\n",
              static_cast<long long>(kKvHeads), static_cast<long long>(kQHeads), static_cast<long long>(kDim),
              static_cast<long long>(page_size), at::get_num_threads(), repeats);
  std::printf(
      "| workload | press | r | pages before | MiB before | pages after | MiB after | sum ceil(kept/page) | "
      "(1-r) before + Hkv/seq | paged ms (us/kept token) | paged, uncompressed ms (us/token) | dense ATen ms "
      "(us/token) | paged / ATen per token |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  bool ok = true;
  const double mib = 1024.0 * 1024.0;
  for (const Workload& w : workloads) {
    const int64_t batch_size = static_cast<int64_t>(w.lengths.size());
    const int64_t total = std::accumulate(w.lengths.begin(), w.lengths.end(), int64_t{0});
    std::vector<int64_t> cu{0};
    for (int64_t s : w.lengths) cu.push_back(cu.back() + s);
    at::manual_seed(0);
    const at::Tensor keys = at::randn({total, kKvHeads, kDim}), values = at::randn({total, kKvHeads, kDim});
    const at::Tensor new_k = at::randn({batch_size, kKvHeads, 1, kDim}),
                     new_v = at::randn({batch_size, kKvHeads, 1, kDim});
    const at::Tensor q = at::randn({batch_size, kQHeads, 1, kDim});
    int64_t pages_before = 0;
    for (int64_t s : w.lengths) pages_before += kKvHeads * ceil_div(s + 1, page_size);

    kvpress::PagedCacheOptions opt;
    opt.kv_heads = kKvHeads;
    opt.head_dim = kDim;
    opt.page_size = page_size;
    opt.pages_per_layer = pages_before;
    // Uncompressed pages and the dense caches: the baselines of every row of this workload.
    kvpress::PagedKVCache full(opt);
    std::vector<kvpress::SequenceId> full_seqs;
    for (int64_t b = 0; b < batch_size; ++b) full_seqs.push_back(full.add_sequence());
    full.store(0, full_seqs, keys, values, at::tensor(cu));
    full.append(0, full_seqs, new_k, new_v);
    const double full_ms = median_ms([&] { full.attention(0, full_seqs, q); }, repeats);
    std::vector<at::Tensor> dense_k, dense_v;
    for (int64_t b = 0; b < batch_size; ++b) {
      const int64_t s = w.lengths[static_cast<size_t>(b)];
      dense_k.push_back(at::cat({keys.narrow(0, cu[b], s).permute({1, 0, 2}), new_k[b]}, 1).unsqueeze(0).contiguous());
      dense_v.push_back(
          at::cat({values.narrow(0, cu[b], s).permute({1, 0, 2}), new_v[b]}, 1).unsqueeze(0).contiguous());
    }
    const double dense_ms = median_ms(
        [&] {
          for (int64_t b = 0; b < batch_size; ++b)
            kvpress_bench::aten_decode_attention(q.narrow(0, b, 1), dense_k[static_cast<size_t>(b)],
                                                 dense_v[static_cast<size_t>(b)]);
        },
        repeats);
    const double cached_tokens = static_cast<double>(kKvHeads * (total + batch_size));

    for (const Press& p : presses) {
      for (double ratio : ratios) {
        const auto press = kvpress::make_press(p.name, ratio, p.params);
        kvpress::PagedKVCache cache(opt);
        std::vector<kvpress::SequenceId> seqs;
        for (int64_t b = 0; b < batch_size; ++b) seqs.push_back(cache.add_sequence());
        cache.store(0, seqs, keys, values, at::tensor(cu), press.get());
        const kvpress::PagedCacheStats after = cache.stats();
        int64_t bound = 0, kept = 0, loose = 0;
        for (int64_t b = 0; b < batch_size; ++b) {
          for (int64_t h = 0; h < kKvHeads; ++h) {
            const int64_t n = cache.length(seqs[static_cast<size_t>(b)], 0, h);
            kept += n;
            bound += ceil_div(n, page_size);
          }
          loose += kKvHeads * ceil_div(w.lengths[static_cast<size_t>(b)], page_size);
        }
        const double loose_bound =
            (1.0 - ratio) * static_cast<double>(loose) + static_cast<double>(kKvHeads * batch_size);
        if (after.pages_used != bound || static_cast<double>(after.pages_used) > loose_bound) ok = false;
        cache.append(0, seqs, new_k, new_v);
        const double paged_ms = median_ms([&] { cache.attention(0, seqs, q); }, repeats);
        const double kept_tokens = static_cast<double>(kept + kKvHeads * batch_size);
        std::printf(
            "| %s | %s | %.2f | %lld | %.1f | %lld | %.1f | %lld | %.0f | %.3f (%.4f) | %.3f (%.4f) | %.3f (%.4f) | "
            "%.2f "
            "|\n",
            w.name.c_str(), p.label.c_str(), ratio, static_cast<long long>(loose),
            static_cast<double>(loose * after.bytes_per_page) / mib, static_cast<long long>(after.pages_used),
            static_cast<double>(after.bytes_used()) / mib, static_cast<long long>(bound), loose_bound, paged_ms,
            1e3 * paged_ms / kept_tokens, full_ms, 1e3 * full_ms / cached_tokens, dense_ms,
            1e3 * dense_ms / cached_tokens, (paged_ms / kept_tokens) / (dense_ms / cached_tokens));
        std::fflush(stdout);
      }
    }
  }
  if (!ok) {
    std::fprintf(stderr,
                 "FAIL: pages after compression differ from sum ceil(kept / page_size) or exceed (1 - r) x "
                 "uncompressed + one page per head\n");
    return 1;
  }
  return 0;
}
