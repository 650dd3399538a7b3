// Quantized pages: decode attention time per kept token and bytes per (head, token) for each page
// format against bfloat16 pages (docs/PERFORMANCE.md, "Quantized pages").
//
//   kvpress_bench_paged_formats [--seq-lens 4096,16384] [--ratios 0,0.5] [--page-size 16] [--repeats 20]
//
// Llama-3.1-8B's layer shape, Hkv = 8, Hq = 32, D = 128, bfloat16 queries and cache dtype, one
// layer, one sequence. For each length and ratio, KnormPress compresses while store() writes (no
// press at ratio 0), one token is appended, and each format's row gives the pool's bytes per kept
// (head, token) (pages in use x bytes per page, plus the residual rows that hold tokens, over the
// kept rows), the median of --repeats PagedKVCache::attention calls (one new token), the time per
// kept (head, token) row, and both relative to bfloat16 pages. The kernels read every kept row once
// per step, so the memory floor of a step is its bytes over the machine's bandwidth: the bytes
// column is what a format saves there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvpress/ops.h"
#include "kvpress/paged.h"
#include "kvpress/registry.h"

#include "bench_util.h"

namespace {

constexpr int64_t kKvHeads = 8, kQHeads = 32, kDim = 128;

struct Row {
  double bytes_per_token, ms, us_per_token;
};

Row measure(kvpress::KVFormat format, int64_t seq_len, double ratio, int64_t page_size, int repeats) {
  at::manual_seed(0);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const at::Tensor keys = at::randn({seq_len, kKvHeads, kDim}, bf16),
                   values = at::randn({seq_len, kKvHeads, kDim}, bf16);
  const at::Tensor new_k = at::randn({1, kKvHeads, 1, kDim}, bf16), new_v = at::randn({1, kKvHeads, 1, kDim}, bf16);
  const at::Tensor q = at::randn({1, kQHeads, 1, kDim}, bf16);
  kvpress::PagedCacheOptions opt;
  opt.kv_heads = kKvHeads;
  opt.head_dim = kDim;
  opt.page_size = page_size;
  opt.pages_per_layer = kKvHeads * (seq_len / page_size + 2);
  opt.dtype = at::kBFloat16;
  opt.kv_format = format;
  kvpress::PagedKVCache cache(opt);
  const kvpress::SequenceId seq = cache.add_sequence();
  const auto press = ratio > 0 ? kvpress::make_press("KnormPress", ratio) : nullptr;
  cache.store(0, {seq}, keys, values, at::tensor({int64_t{0}, seq_len}), press.get());
  cache.append(0, {seq}, new_k, new_v);
  int64_t kept = 0, residual = 0;
  for (int64_t h = 0; h < kKvHeads; ++h) {
    kept += cache.length(seq, 0, h);
    if (format != kvpress::KVFormat::kFull) residual += cache.length(seq, 0, h) % page_size;
  }
  const kvpress::PagedCacheStats s = cache.stats();
  const double bytes =
      static_cast<double>(s.pages_used * s.bytes_per_page) + static_cast<double>(residual * 2 * kDim * 2);
  const double ms = kvpress_bench::median_ms([&] { cache.attention(0, {seq}, q); }, repeats);
  return {bytes / static_cast<double>(kept), ms, 1000.0 * ms / static_cast<double>(kept)};
}

int run(int argc, char** argv) {
  std::vector<double> seq_lens{4096, 16384}, ratios{0.0, 0.5};
  int64_t page_size = kvpress::PagedCacheOptions::kDefaultPageSize;
  int repeats = 20;
  if (!kvpress_bench::Options()
           .list("--seq-lens", seq_lens)
           .list("--ratios", ratios)
           .integer("--page-size", page_size)
           .integer("--repeats", repeats)
           .parse(argc, argv, "[--seq-lens 4096,16384] [--ratios 0,0.5] [--page-size 16] [--repeats 20]"))
    return 2;
  std::printf(
      "Hkv=%lld Hq=%lld D=%lld bfloat16, page_size %lld, %d threads, median of %d decode steps (n=1), CPU kernels "
      "%s\n\n",
      static_cast<long long>(kKvHeads), static_cast<long long>(kQHeads), static_cast<long long>(kDim),
      static_cast<long long>(page_size), at::get_num_threads(), repeats, kvpress::ops::cpu_kernel_isa().c_str());
  std::printf(
      "| S | r | format | bytes per kept (head, token) | vs bf16 | attention ms | us per kept token | vs bf16 |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (double s : seq_lens)
    for (double r : ratios) {
      const auto len = static_cast<int64_t>(s);
      const Row base = measure(kvpress::KVFormat::kFull, len, r, page_size, repeats);
      for (kvpress::KVFormat f :
           {kvpress::KVFormat::kFull, kvpress::KVFormat::kInt8, kvpress::KVFormat::kFp8, kvpress::KVFormat::kInt4}) {
        const Row row = f == kvpress::KVFormat::kFull ? base : measure(f, len, r, page_size, repeats);
        std::printf("| %lld | %.2f | %s | %.1f | %.2f | %.3f | %.4f | %.2f |\n", static_cast<long long>(len), r,
                    f == kvpress::KVFormat::kFull ? "bf16" : kvpress::kv_format_name(f), row.bytes_per_token,
                    row.bytes_per_token / base.bytes_per_token, row.ms, row.us_per_token,
                    row.us_per_token / base.us_per_token);
      }
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
