// The first thing to read: compress one layer's KV cache with two presses.
#include <ATen/ATen.h>

#include <iostream>

#include "kvpress/kvpress.h"

int main() {
  // One layer of a GQA model right after prefill: batch 1, 8 query heads, 2 KV heads,
  // 1024 cached tokens, head_dim 64. Keys are post-RoPE, as an engine caches them.
  kvpress::LayerInputs layer;
  layer.keys = at::randn({1, 2, 1024, 64});
  layer.values = at::randn({1, 2, 1024, 64});

  // KnormPress needs nothing but the keys: it drops the half with the largest L2 norm.
  kvpress::KnormPress knorm(/*compression_ratio=*/0.5);
  kvpress::KV small = knorm.compress(layer);
  std::cout << "KnormPress:  keys " << small.keys.sizes() << ", values " << small.values.sizes() << ", kept_indices "
            << small.kept_indices.sizes() << "\n";

  // SnapKVPress looks at how the last window_size queries attend to the rest of the cache.
  // An engine already has these post-RoPE queries: hand over the last 64 positions.
  layer.queries = at::randn({1, 8, 64, 64});
  kvpress::SnapKVPress snapkv(/*compression_ratio=*/0.75, /*window_size=*/64, /*kernel_size=*/5);
  kvpress::KV smaller = snapkv.compress(layer);
  std::cout << "SnapKVPress: keys " << smaller.keys.sizes() << ", first kept positions of head 0:";
  for (int64_t i = 0; i < 8; ++i) std::cout << " " << smaller.kept_indices[0][0][i].item<int64_t>();
  std::cout << " ...\n";

  // The same presses by name, as kvpress-cli and the benchmarks build them.
  auto press = kvpress::make_press("SnapKVPress", 0.75, {{"window_size", "32"}});
  std::cout << press->name() << " (window 32): keeps " << press->compress(layer).keys.size(2) << " of "
            << layer.keys.size(2) << " tokens per head\n";
  return 0;
}
