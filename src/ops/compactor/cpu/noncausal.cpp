// CPU kernel for kvpress::noncausal_column_sums (NonCausalAttnPress, CompactorPress), float32 on
// CPUs with AVX-512 or AVX2 + FMA: per (batch, KV head, chunk of positions) one work item that never writes the
// chunk's logits to memory. The chunk's keys are transposed into a buffer once; then for every
// query head of the group, 6 query rows at a time, the register tile (cpu/register_tile.h) makes
// their logits rows, each row goes through its softmax in L1 and is added into the head's column
// sums. The composite instead writes [B, Hkv, group x C, C] logits per chunk, runs torch's softmax
// over them and sums them (three passes over 8 MiB per chunk at the Llama-3.1-8B shape), with the
// logits GEMM from libtorch's BLAS.
//
// kvpress's padded last chunk (S not a multiple of C) is reproduced without building it: the real
// rows' softmax also counts C - len columns of logit -1e-9, and each of the C - len padded rows
// (logits 0 on the real columns, -1e-9 on the padded ones) adds 1 / (len + (C - len) e^-1e-9) to
// every real column. Elsewhere (other dtypes, a head_dim that is not a multiple of 16, no register
// tiles) the op takes its composite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "compactor/compactor.h"
#include "cpu/register_tile.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace {

// Logit kvpress writes into the padded key columns of the last chunk.
constexpr float kPaddedKeyLogit = -1e-9f;

// Query rows per register tile and keys per block (4 vectors, made in passes of the ISA's tile width).
constexpr int kTileRows = 6;
constexpr int64_t kKeyBlock = 4 * vec16::kLanes;

#if KVPRESS_HAVE_TILE_KERNELS

using vec16::kLanes;

// The logits of R query rows (rows `q_stride` floats apart) against the chunk's keys, transposed in
// kt [dim, width] (width a multiple of 64, columns past the real keys zero), into rows [R, width].
template <class Tiles, int R>
KVPRESS_VEC_INLINE void logits_rows(const float* q, int64_t q_stride, const float* kt, int64_t dim, int64_t width,
                                    float* rows) {
  using V = typename Tiles::Vec;
  constexpr int L = Tiles::kLanes, P = kPassVectors<Tiles, kKeyBlock / L>;
  static_assert(R <= Tiles::template kRowsFor<P>, "the tile must fit the registers");
  for (int64_t j0 = 0; j0 < width; j0 += P * L) {
    V acc[R][P] = {};
    multiply_tile<R, P>(q, q_stride, 1, kt + j0, width, dim, acc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < P; ++v) vec16::store(rows + r * width + j0 + v * L, acc[r][v]);
  }
}

// Adds the softmax of one logits row to column_sums: n real columns (the row's columns from n to
// the next multiple of 16 are overwritten with -inf, so they add 0), plus `pads` columns of logit
// kPaddedKeyLogit that count in the denominator only. In vectors V.
template <class V>
KVPRESS_VEC_INLINE void add_row_softmax(float* row, int64_t n, int64_t pads, float* column_sums) {
  constexpr int64_t L = vec16::lanes<V>;
  const int64_t padded_n = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = n; j < padded_n; ++j) row[j] = -std::numeric_limits<float>::infinity();
  float row_max = vec16::lane_max(vec16::lanes_max(row + L, padded_n - L, vec16::load<V>(row)));
  if (pads > 0) row_max = std::max(row_max, kPaddedKeyLogit);
  float total = vec16::lane_sum(vec16::exp_shifted_in_place<V>(row, padded_n, row_max));
  if (pads > 0) total += static_cast<float>(pads) * std::exp(kPaddedKeyLogit - row_max);
  const V inv = vec16::broadcast<V>(1.0f / total);
  for (int64_t j = 0; j < padded_n; j += L)
    vec16::store(column_sums + j, vec16::load<V>(column_sums + j) + vec16::load<V>(row + j) * inv);
}

// One work item: chunk [start, start + len) of one KV head of one batch row, for the group's query
// heads. q of query head h at q + h * q_head_stride (rows q_row_stride apart, unit stride along
// dim); keys of the chunk at k (rows k_row_stride apart); out of query head h at
// out + h * out_head_stride. kt [dim, width] and rows [kTileRows, width] are the caller's scratch
// (width >= len, a multiple of 64), sums [width].
struct ChunkItem {
  const float* q;
  int64_t q_head_stride, q_row_stride, group;
  const float* k;
  int64_t k_row_stride, len, chunk, dim, width;
  float *kt, *rows, *sums, *out;
  int64_t out_head_stride;
};

template <class Tiles>
KVPRESS_VEC_INLINE void chunk_column_sums(const ChunkItem& w) {
  transpose_keys<Tiles>(w.k, w.k_row_stride, w.len, w.width, w.dim, w.kt);  // columns past len are zero
  const int64_t pads = w.chunk - w.len;
  for (int64_t h = 0; h < w.group; ++h) {
    const float* qh = w.q + h * w.q_head_stride;
    std::fill(w.sums, w.sums + w.width, 0.0f);
    int64_t i = 0;
    for (; i + kTileRows <= w.len; i += kTileRows) {
      logits_rows<Tiles, kTileRows>(qh + i * w.q_row_stride, w.q_row_stride, w.kt, w.dim, w.width, w.rows);
      for (int r = 0; r < kTileRows; ++r)
        add_row_softmax<typename Tiles::Vec>(w.rows + r * w.width, w.len, pads, w.sums);
    }
    for (; i < w.len; ++i) {
      logits_rows<Tiles, 1>(qh + i * w.q_row_stride, w.q_row_stride, w.kt, w.dim, w.width, w.rows);
      add_row_softmax<typename Tiles::Vec>(w.rows, w.len, pads, w.sums);
    }
    float* oh = w.out + h * w.out_head_stride;
    if (pads > 0) {
      // Every padded row: logits 0 on the real columns (the row's max), -1e-9 on the padded ones.
      const float per_column =
          1.0f / (static_cast<float>(w.len) + static_cast<float>(pads) * std::exp(kPaddedKeyLogit));
      for (int64_t j = 0; j < w.len; ++j) oh[j] = w.sums[j] + static_cast<float>(pads) * per_column;
    } else {
      std::copy(w.sums, w.sums + w.len, oh);
    }
  }
}

KVPRESS_AVX512_KERNEL void chunk_column_sums_avx512(const ChunkItem& item) { chunk_column_sums<Avx512Tiles>(item); }
KVPRESS_AVX2_KERNEL void chunk_column_sums_avx2(const ChunkItem& item) { chunk_column_sums<Avx2Tiles>(item); }

#endif  // KVPRESS_HAVE_TILE_KERNELS

at::Tensor noncausal_column_sums_cpu(const at::Tensor& queries_in, const at::Tensor& keys_in, int64_t chunk_size) {
  constexpr const char* op = "noncausal_column_sums";
  checks::check_noncausal(op, queries_in, keys_in, chunk_size);
  const int64_t dim = keys_in.size(3);
  const TileIsa isa = cpu_tile_isa();
  if (queries_in.scalar_type() != at::kFloat || keys_in.scalar_type() != at::kFloat || dim % vec16::kLanes != 0 ||
      isa == TileIsa::kNone)
    return ops::composite::noncausal_column_sums(queries_in, keys_in, chunk_size);
#if KVPRESS_HAVE_TILE_KERNELS
  const auto column_sums = isa == TileIsa::kAvx512 ? &chunk_column_sums_avx512 : &chunk_column_sums_avx2;
  const at::Tensor queries = queries_in.stride(3) == 1 ? queries_in : queries_in.contiguous();
  const at::Tensor keys = keys_in.stride(3) == 1 ? keys_in : keys_in.contiguous();
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), seq = keys.size(2);
  const int64_t heads = queries.size(1), group = heads / kv_heads;
  const int64_t chunk = chunk_size, chunks = (seq + chunk - 1) / chunk;
  // Scratch width: the longest chunk's keys, rounded up to whole blocks of 64.
  const int64_t width = (std::min(chunk, seq) + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  at::Tensor out = at::empty({batch, heads, seq}, keys.options());
  const float *qp = queries.data_ptr<float>(), *kp = keys.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads * chunks, /*grain_size=*/1, [&](int64_t first, int64_t last) {
    std::vector<float> kt(static_cast<size_t>(dim * width)), rows(static_cast<size_t>(kTileRows * width)),
        sums(static_cast<size_t>(width));
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / (kv_heads * chunks), g = item / chunks % kv_heads, c = item % chunks;
      const int64_t start = c * chunk, len = std::min(chunk, seq - start);
      column_sums(ChunkItem{qp + b * queries.stride(0) + g * group * queries.stride(1) + start * queries.stride(2),
                            queries.stride(1), queries.stride(2), group,
                            kp + b * keys.stride(0) + g * keys.stride(1) + start * keys.stride(2), keys.stride(2), len,
                            chunk, dim, width, kt.data(), rows.data(), sums.data(),
                            op_out + (b * heads + g * group) * seq + start, seq});
    }
  });
  return out;
#else
  TORCH_CHECK(false, op, ": unreachable without the register-tile kernels");
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("noncausal_column_sums", &noncausal_column_sums_cpu); }

}  // namespace kvpress::kernels
