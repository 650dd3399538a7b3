// The work a press cannot avoid on one layer, and the machine rates that turn it into a floor
// (docs/PERFORMANCE.md, "How it is measured"). The one definition: kvpress_bench reports each
// press's time over its floor, and benchmarks/compare_kvpress.py reads the same figures through
// kvpress_press_work (benchmarks/press_work.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace kvpress_bench {

// One layer's inputs as the benchmarks feed them: SnapKV/TOVA get the last `window` post-RoPE
// queries, NonCausalAttn/Compactor the queries of every position, chunked by `chunk`; LeverageScore
// and Compactor sketch pre-RoPE keys to `sketch` columns.
struct LayerShape {
  int64_t batch, q_heads, kv_heads, head_dim, seq;
  int64_t element_size;  // bytes per element of K, V and the queries
  int64_t window = 64;   // SnapKVPress's default window_size
  int64_t chunk = 256;   // NonCausalAttnPress's and CompactorPress's default chunk_size
  int64_t sketch = 48;   // LeverageScorePress's and CompactorPress's default sketch_dimension
};

struct PressWork {
  double bytes;  // that must move: what any implementation reads to score, plus reading and writing
                 // the kept K/V rows
  double flops;  // of the products the method defines (elementwise work and exponentials are not
                 // counted, so the floor is a lower bound)
};

// The work of press `name` keeping n_kept tokens per head; nullopt for a press without a model.
inline std::optional<PressWork> press_work(const std::string& name, const LayerShape& s, int64_t n_kept) {
  const double B = s.batch, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim, S = s.seq, e = s.element_size;
  const double kv = B * Hkv * S * D * e;          // bytes of K (or of V)
  const double gather = 2 * 2 * kv * n_kept / S;  // read and write the kept rows of K and V
  const double rope_tables = 2 * S * D * e;       // cos, sin
  const double sk = static_cast<double>(s.sketch);
  const double leverage = 2 * B * Hkv * S * (D * sk + 2 * sk * sk);  // K Phi, X^T X, G^-1 X^T, row dots
  const double chunked_attention = 2 * B * Hq * S * s.chunk * D;     // q k^T within each chunk
  const double all_queries = B * Hq * S * D * e;
  std::optional<PressWork> score;
  if (name == "RandomPress" || name == "StreamingLLMPress")
    score = PressWork{0, 0};
  else if (name == "KnormPress")
    score = PressWork{kv, 2 * B * Hkv * S * D};
  else if (name == "KeyDiffPress" || name == "LagKVPress")  // statistics over every key before any score
    score = PressWork{2 * kv, 4 * B * Hkv * S * D};
  else if (name == "SnapKVPress")
    score = PressWork{kv + B * Hq * s.window * D * e, 2 * B * Hq * s.window * S * D};
  else if (name == "TOVAPress")
    score = PressWork{kv + B * Hq * D * e, 2 * B * Hq * S * D};
  else if (name == "ObservedAttentionPress")
    score = PressWork{B * Hq * S * S * e, B * Hq * S * S};
  else if (name == "LeverageScorePress")
    score = PressWork{kv + rope_tables, leverage};
  else if (name == "NonCausalAttnPress")  // queries, K, ||v||
    score = PressWork{all_queries + 2 * kv, chunked_attention};
  else if (name == "CompactorPress")
    score = PressWork{all_queries + 2 * kv + rope_tables, chunked_attention + leverage};
  if (!score) return std::nullopt;
  return PressWork{score->bytes + gather, score->flops};
}

// Seconds of the fastest of `repeats` calls.
template <typename Fn>
double best_seconds(Fn&& fn, int repeats) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Bytes/s of a multithreaded copy (read + write) of at least 256 MiB (past the caches), best of 5.
inline double copy_bandwidth(int64_t min_bytes) {
  const at::Tensor src = at::ones({std::max<int64_t>(min_bytes, int64_t{256} << 20)}, at::kByte);
  at::Tensor dst = at::empty_like(src);
  return 2.0 * static_cast<double>(src.nbytes()) / best_seconds([&] { dst.copy_(src); }, 5);
}

// FLOP/s of a 2048^3 matrix product in `dtype` through this libtorch and thread count, best of 3.
inline double gemm_rate(at::ScalarType dtype) {
  const int64_t n = 2048;
  const at::Tensor a = at::randn({n, n}).to(dtype), b = at::randn({n, n}).to(dtype);
  at::mm(a, b);  // warm-up
  return 2.0 * static_cast<double>(n * n * n) / best_seconds([&] { at::mm(a, b); }, 3);
}

// Seconds no implementation can beat on this machine: the larger of moving the bytes and doing the
// FLOPs.
inline double floor_seconds(const PressWork& work, double bandwidth, double flop_rate) {
  return std::max(work.bytes / bandwidth, work.flops / flop_rate);
}

}  // namespace kvpress_bench
