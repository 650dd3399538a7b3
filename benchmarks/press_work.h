// The work a press cannot avoid on one layer, and its floor on this machine's true limits
// (machine_peaks.h; docs/PERFORMANCE.md, "How it is measured"). The one definition: kvpress_bench
// reports each press's time over its floor, and benchmarks/compare_kvpress.py reads the same
// figures through kvpress_press_work (benchmarks/press_work.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <string>

#include "machine_peaks.h"

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
  double bytes_read;     // what any implementation reads to score, plus the kept K/V rows it gathers
  double bytes_written;  // the kept K/V rows, written once
  double flops;          // of the products the method defines (elementwise work and exponentials are
                         // not counted, so the floor is a lower bound)
  double bytes() const { return bytes_read + bytes_written; }
};

// The work of press `name` keeping n_kept tokens per head; nullopt for a press without a model.
inline std::optional<PressWork> press_work(const std::string& name, const LayerShape& s, int64_t n_kept) {
  const double B = s.batch, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim, S = s.seq, e = s.element_size;
  const double kv = B * Hkv * S * D * e;     // bytes of K (or of V)
  const double kept = 2 * kv * n_kept / S;   // the kept rows of K and V: read once, written once
  const double rope_tables = 2 * S * D * e;  // cos, sin
  const double sk = static_cast<double>(s.sketch);
  const double leverage = 2 * B * Hkv * S * (D * sk + 2 * sk * sk);  // K Phi, X^T X, G^-1 X^T, row dots
  const double chunked_attention = 2 * B * Hq * S * s.chunk * D;     // q k^T within each chunk
  const double all_queries = B * Hq * S * D * e;
  std::optional<PressWork> score;
  if (name == "RandomPress" || name == "StreamingLLMPress")
    score = PressWork{0, 0, 0};
  else if (name == "KnormPress")
    score = PressWork{kv, 0, 2 * B * Hkv * S * D};
  else if (name == "KeyDiffPress" || name == "LagKVPress")  // statistics over every key before any score
    score = PressWork{2 * kv, 0, 4 * B * Hkv * S * D};
  else if (name == "SnapKVPress")
    score = PressWork{kv + B * Hq * s.window * D * e, 0, 2 * B * Hq * s.window * S * D};
  else if (name == "TOVAPress")
    score = PressWork{kv + B * Hq * D * e, 0, 2 * B * Hq * S * D};
  else if (name == "ObservedAttentionPress")
    score = PressWork{B * Hq * S * S * e, 0, B * Hq * S * S};
  else if (name == "LeverageScorePress")
    score = PressWork{kv + rope_tables, 0, leverage};
  else if (name == "NonCausalAttnPress")  // queries, K, ||v||
    score = PressWork{all_queries + 2 * kv, 0, chunked_attention};
  else if (name == "CompactorPress")
    score = PressWork{all_queries + 2 * kv + rope_tables, 0, chunked_attention + leverage};
  if (!score) return std::nullopt;
  return PressWork{score->bytes_read + kept, kept, score->flops};
}

// Seconds no implementation can beat on this machine: the largest of the FLOPs at the FMA peak, the
// bytes read at the read bandwidth, the bytes written at the write bandwidth and both at the copy
// rate (compute, loads and stores proceed at once: a sum of the terms is not a floor, measured on a
// Xeon with a 300 MiB L3, where StreamingLLMPress's gather and LeverageScorePress ran under it).
struct Floor {
  double seconds;
  const char* bound;  // the largest term: "compute", "read", "write" or "copy"
};
inline Floor press_floor(const PressWork& work, const MachinePeaks& peaks) {
  const Floor terms[] = {{work.flops / peaks.fma_flops, "compute"},
                         {work.bytes_read / peaks.read_bytes, "read"},
                         {work.bytes_written / peaks.write_bytes, "write"},
                         {work.bytes() / peaks.copy_bytes, "copy"}};
  return *std::max_element(std::begin(terms), std::end(terms),
                           [](const Floor& a, const Floor& b) { return a.seconds < b.seconds; });
}

}  // namespace kvpress_bench
