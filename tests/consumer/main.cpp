// Links against the installed kvpress package and compresses a small random cache.
#include <ATen/ATen.h>

#include <cstdio>

#include "kvpress/kvpress.h"

int main() {
  kvpress::LayerInputs in;
  in.keys = at::randn({1, 2, 100, 16});
  in.values = at::randn({1, 2, 100, 16});

  kvpress::KnormPress press(0.25);
  kvpress::KV out = press.compress(in);

  const int64_t expected = kvpress::ops::n_kept(100, 0.25);  // int(100 * 0.75) = 75
  bool ok = expected == 75 && out.keys.sizes() == at::IntArrayRef({1, 2, 75, 16}) &&
            out.values.sizes() == out.keys.sizes() && out.kept_indices.sizes() == at::IntArrayRef({1, 2, 75});
  // Kept positions are ascending and in range.
  if (ok) {
    auto idx = out.kept_indices;
    ok = (idx.diff(1, -1) > 0).all().item<bool>() && idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < 100;
  }
  // KnormPress keeps the smallest-norm keys: the largest kept norm is at most the smallest dropped.
  if (ok) {
    auto norms = in.keys.norm(2, -1);  // [1, 2, 100]
    auto kept = at::zeros_like(norms, at::kBool).scatter_(-1, out.kept_indices, true);
    ok = (norms.masked_fill(~kept, -1).amax(-1) <= norms.masked_fill(kept, 1e9).amin(-1)).all().item<bool>();
  }
  std::printf("kvpress %s consumer: KnormPress(0.25) kept %lld of 100 tokens per head: %s\n", KVPRESS_VERSION,
              static_cast<long long>(out.keys.size(2)), ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
