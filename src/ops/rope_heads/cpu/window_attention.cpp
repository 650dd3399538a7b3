// CPU kernel for kvpress::window_attention_mean (SnapKVPress, TOVAPress): the causal softmax
// attention of the last w positions over the keys, averaged over the w window queries, without
// materialising [B, Hq, w, S] or repeated keys. KV heads go through in slabs whose float32 logits
// take at most 32 MiB (the buffer is reused); per slab:
//   logits = (q / sqrt(D)) k^T   each KV head's query heads stacked as rows: on AVX-512 or
//                                AVX2 + FMA the register tile (cpu/register_tile.h) over blocks
//                                of 64 keys transposed in L1, one work item per (head, block);
//                                else one batched GEMM. Up to kFewRows rows per head, either way: vector
//                                dot products instead.
//   per query head (a work item): each window row's softmax over the keys it sees (the causal
//   mask is the row's length, never written), accumulated into the head's output row while both
//   rows are in the core's cache, then scaled by 1 / w (WindowSoftmaxMean).
// The BLAS fallback is one multi-threaded ATen call: BLAS must not run inside an at::parallel_for region
// here, since torch turns MKL's dynamic threading off and nested GEMMs then oversubscribe the
// cores (measured 10x slower on 2 busy cores).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/float_rows.h"
#include "cpu/per_isa.h"
#include "cpu/register_tile.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"
#include "rope_heads/rope_heads.h"

namespace kvpress::kernels {
namespace {

// Upper bound of one slab's float32 logits; at least one KV head is always taken.
constexpr int64_t kSlabBytes = int64_t{32} << 20;

// Up to this many logits rows per KV head (group x window: TOVA's last query, small windows), the
// logits are streaming dot products instead of a GEMM: with a handful of rows a GEMM spends its
// time packing the keys, while the dot products read each key row once, at memory speed.
constexpr int64_t kFewRows = 8;

// few_rows_logits for R rows and dim a multiple of the lanes: each key row is loaded once per vector
// and multiplied into R independent accumulators (one per query row), then each is summed across
// lanes.
template <int R, class V>
KVPRESS_VEC_INLINE void few_rows_logits_tiled(const float* q, const float* k, int64_t n, int64_t dim, int64_t seq,
                                              float* logits) {
  for (int64_t j = 0; j < n; ++j) {
    V acc[R] = {};
    for (int64_t d = 0; d < dim; d += vec16::lanes<V>) {
      const V kv = vec16::load<V>(k + j * dim + d);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] += vec16::load<V>(q + r * dim + d) * kv;
    }
    for (int r = 0; r < R; ++r) logits[r * seq + j] = vec16::lane_sum(acc[r]);
  }
}

// logits[r * seq + j] = q[r] . k[j] for the rows of one KV head and n consecutive keys; q [rows,
// dim] and k [n, dim] contiguous, logits rows `seq` apart. Per ISA (per_isa.h).
struct FewRowsLogits {
  template <class V>
  static KVPRESS_VEC_INLINE void run(const float* q, int64_t rows, const float* k, int64_t n, int64_t dim, int64_t seq,
                                     float* logits) {
    if (dim % vec16::lanes<V> == 0) {
      switch (rows) {
        case 1: return few_rows_logits_tiled<1, V>(q, k, n, dim, seq, logits);
        case 2: return few_rows_logits_tiled<2, V>(q, k, n, dim, seq, logits);
        case 3: return few_rows_logits_tiled<3, V>(q, k, n, dim, seq, logits);
        case 4: return few_rows_logits_tiled<4, V>(q, k, n, dim, seq, logits);
        case 5: return few_rows_logits_tiled<5, V>(q, k, n, dim, seq, logits);
        case 6: return few_rows_logits_tiled<6, V>(q, k, n, dim, seq, logits);
        case 7: return few_rows_logits_tiled<7, V>(q, k, n, dim, seq, logits);
        case 8: return few_rows_logits_tiled<8, V>(q, k, n, dim, seq, logits);
        default: break;
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r) logits[r * seq + j] = vec16::dot<V>(q + r * dim, k + j * dim, dim);
  }
};

// The mean over a query head's `window` rows of their causal softmax, in one pass per row while
// the row (S floats) and the output row stay in the core's cache: row i sees keys 0 .. S - w + i;
// out[j] = (1 / w) sum_i e^(l_ij - max_i) / sum_i for j < S - w. `logits` (w rows `seq` apart) is
// overwritten with the exponentials. Replaces masking the logits, torch's softmax in place and a
// mean over the window: three passes over every slab of logits. Per ISA (per_isa.h).
struct WindowSoftmaxMean {
  template <class V>
  static KVPRESS_VEC_INLINE void run(float* logits, int64_t window, int64_t seq, float* __restrict out) {
    constexpr int64_t kLanes = vec16::lanes<V>;
    const int64_t n_out = seq - window;
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n_out; ++j) out[j] = 0.0f;
    for (int64_t i = 0; i < window; ++i) {
      float* row = logits + i * seq;
      const int64_t visible = seq - window + i + 1;
      const int64_t body = visible / kLanes * kLanes;
      // The tail of the visible columns, padded with -inf (e^-inf = 0 adds nothing).
      float tail_in[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) tail_in[j] = body + j < visible ? row[body + j] : neg_inf;
      const float row_max = vec16::lane_max(vec16::lanes_max(row, body, vec16::load<V>(tail_in)));
      V sum_v = vec16::exp_shifted_in_place<V>(row, body, row_max);
      const V tail_e = vec16::exp_nonpositive(vec16::load<V>(tail_in) - vec16::broadcast<V>(row_max));
      sum_v += tail_e;
      for (int64_t j = body; j < visible; ++j) row[j] = tail_e[j - body];
      const float inv = 1.0f / vec16::lane_sum(sum_v);
      for (int64_t j = 0; j < n_out; ++j) out[j] += row[j] * inv;
    }
    const float inv_window = 1.0f / static_cast<float>(window);
    for (int64_t j = 0; j < n_out; ++j) out[j] *= inv_window;
  }
};

// The few-rows logits of a slab: q [nh, rows, D] float32 contiguous, k [nh, S, D] in the cache
// dtype, logits [nh, rows, S]. float16/bfloat16 keys are converted a block of rows at a time
// (exactly), never as a float32 copy of the slab.
void few_rows_slab(const at::Tensor& q, const at::Tensor& k_in, int64_t rows, float* logits) {
  const at::Tensor k = k_in.contiguous();
  const int64_t nh = k.size(0), seq = k.size(1), dim = k.size(2);
  const float* qp = q.data_ptr<float>();
  AT_DISPATCH_V2(
      k.scalar_type(), "window_attention_mean_cpu", AT_WRAP([&] {
        const scalar_t* kp = k.data_ptr<scalar_t>();
        at::parallel_for(0, nh * seq, /*grain_size=*/1024, [&](int64_t begin, int64_t end) {
          std::vector<float> block(std::is_same_v<scalar_t, float> ? 0 : static_cast<size_t>(kConvertBlockRows * dim));
          for (int64_t i = begin; i < end;) {  // (head, key) pairs [begin, end), head by head, in blocks
            const int64_t h = i / seq, j0 = i % seq;
            const int64_t j1 = std::min({seq, j0 + (end - i), j0 + kConvertBlockRows});
            // keys j0 .. j1 as float32, [j1 - j0, dim]
            const float* rows_f32 = as_float32(kp + (h * seq + j0) * dim, (j1 - j0) * dim, block);
            run_per_isa<FewRowsLogits>(qp + h * rows * dim, rows, rows_f32, j1 - j0, dim, seq,
                                       logits + h * rows * seq + j0);
            i += j1 - j0;
          }
        });
      }),
      at::kFloat, at::kHalf, at::kBFloat16);
}

// Keys per block of the tiled logits (four vectors: a block is rows x 64 logits) and the largest
// head_dim of the block's transposed keys (64 KiB).
constexpr int64_t kKeyBlock = 4 * vec16::kLanes;
constexpr int64_t kTileMaxDim = 256;

#if KVPRESS_HAVE_TILE_KERNELS
// Logits of rows r0 .. r0 + R against the block's n <= 64 keys: q [rows, dim], kt the keys
// transposed [dim, 64], out column 0 of row r0, rows `seq` apart. In passes of P vectors.
template <class Tiles, int R>
KVPRESS_VEC_INLINE void logits_tile(const float* q, const float* kt, int64_t dim, int64_t n, int64_t seq, float* out) {
  using V = typename Tiles::Vec;
  constexpr int L = Tiles::kLanes, kBlockVectors = kKeyBlock / L, P = kPassVectors<Tiles, kBlockVectors>;
  alignas(64) float partial[R][kKeyBlock];  // a block's rows when it has fewer than 64 keys
  for (int v0 = 0; v0 < kBlockVectors; v0 += P) {
    V acc[R][P] = {};
    multiply_tile<R, P>(q, dim, 1, kt + v0 * L, kKeyBlock, dim, acc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < P; ++v) vec16::store((n == kKeyBlock ? out + r * seq : partial[r]) + (v0 + v) * L, acc[r][v]);
  }
  if (n != kKeyBlock)
    for (int r = 0; r < R; ++r) std::copy(partial[r], partial[r] + n, out + r * seq);
}

// logits[r][j0 + j] = q[r] . k[j] for all `rows` rows and the n <= 64 keys of one block: the keys
// (rows k_stride floats apart) are transposed into L1 in 16 x 16 register blocks, then every
// tile of R query rows runs the register tile over them. dim a multiple of 16.
template <class Tiles>
KVPRESS_VEC_INLINE void tiled_logits_block(const float* q, int64_t rows, const float* k, int64_t k_stride, int64_t n,
                                           int64_t dim, int64_t seq, float* logits) {
  constexpr int R = Tiles::template kRowsFor<kPassVectors<Tiles, kKeyBlock / Tiles::kLanes>>;
  static_assert(R == 6, "the remainder rows below are 1 to 5");
  alignas(64) float kt[kTileMaxDim * kKeyBlock];
  transpose_keys<Tiles>(k, k_stride, n, kKeyBlock, dim, kt);
  int64_t r = 0;
  for (; r + R <= rows; r += R) logits_tile<Tiles, R>(q + r * dim, kt, dim, n, seq, logits + r * seq);
  switch (rows - r) {
    case 5: return logits_tile<Tiles, 5>(q + r * dim, kt, dim, n, seq, logits + r * seq);
    case 4: return logits_tile<Tiles, 4>(q + r * dim, kt, dim, n, seq, logits + r * seq);
    case 3: return logits_tile<Tiles, 3>(q + r * dim, kt, dim, n, seq, logits + r * seq);
    case 2: return logits_tile<Tiles, 2>(q + r * dim, kt, dim, n, seq, logits + r * seq);
    case 1: return logits_tile<Tiles, 1>(q + r * dim, kt, dim, n, seq, logits + r * seq);
    default: return;
  }
}

KVPRESS_AVX512_KERNEL
void tiled_logits_block_avx512(const float* q, int64_t rows, const float* k, int64_t k_stride, int64_t n, int64_t dim,
                               int64_t seq, float* logits) {
  tiled_logits_block<Avx512Tiles>(q, rows, k, k_stride, n, dim, seq, logits);
}

KVPRESS_AVX2_KERNEL
void tiled_logits_block_avx2(const float* q, int64_t rows, const float* k, int64_t k_stride, int64_t n, int64_t dim,
                             int64_t seq, float* logits) {
  tiled_logits_block<Avx2Tiles>(q, rows, k, k_stride, n, dim, seq, logits);
}
#endif

// logits [nh, rows, S] = q [nh, rows, D] float32 contiguous x k [nh, S, D]ᵀ (float32, unit stride
// along D). With register tiles (AVX-512 or AVX2) and D a multiple of 16 up to kTileMaxDim: the
// tile, one work item per (head, block of 64 keys); elsewhere one batched GEMM.
void slab_logits(const at::Tensor& q, const at::Tensor& k, at::Tensor& logits) {
  const int64_t nh = k.size(0), seq = k.size(1), dim = k.size(2), rows = q.size(1);
  const TileIsa isa = cpu_tile_isa();
  if (isa == TileIsa::kNone || dim % vec16::kLanes != 0 || dim > kTileMaxDim || k.stride(2) != 1) {
    at::bmm_out(logits, q, k.transpose(1, 2));
    return;
  }
#if KVPRESS_HAVE_TILE_KERNELS
  const auto block_logits = isa == TileIsa::kAvx512 ? &tiled_logits_block_avx512 : &tiled_logits_block_avx2;
  const int64_t blocks = (seq + kKeyBlock - 1) / kKeyBlock;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  at::parallel_for(0, nh * blocks, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, j0 = item % blocks * kKeyBlock;
      block_logits(qp + h * rows * dim, rows, kp + h * k.stride(0) + j0 * k.stride(1), k.stride(1),
                   std::min(kKeyBlock, seq - j0), dim, seq, lp + h * rows * seq + j0);
    }
  });
#endif
}

at::Tensor window_attention_mean_cpu(const at::Tensor& queries_in, const at::Tensor& keys_in) {
  constexpr const char* op = "window_attention_mean";
  checks::check_window_attention(op, queries_in, keys_in);
  const int64_t batch = keys_in.size(0), kv_heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), window = queries_in.size(2), group = heads / kv_heads;
  const int64_t rows = group * window;  // logits rows of one KV head
  // Scaling the (small) queries once replaces a pass over every logit.
  const at::Tensor queries = (queries_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(dim))))
                                 .contiguous()
                                 .view({batch, kv_heads, rows, dim});
  at::Tensor out = at::empty({batch, heads, seq - window}, keys_in.options().dtype(at::kFloat));
  const int64_t slab = std::clamp<int64_t>(kSlabBytes / std::max<int64_t>(1, rows * seq * 4), 1, kv_heads);
  at::Tensor logits_buffer = at::empty({slab, rows, seq}, out.options());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h0 = 0; h0 < kv_heads; h0 += slab) {
      const int64_t nh = std::min(slab, kv_heads - h0);
      at::Tensor logits = logits_buffer.narrow(0, 0, nh);
      const at::Tensor q = queries.select(0, b).narrow(0, h0, nh);  // [nh, rows, D]
      float* lp = logits.data_ptr<float>();
      if (rows <= kFewRows) {
        few_rows_slab(q, keys_in.select(0, b).narrow(0, h0, nh), rows, lp);
      } else {
        // float32 keys of the slab: a view when the cache is float32, else one converted copy.
        const at::Tensor k = keys_in.select(0, b).narrow(0, h0, nh).to(at::kFloat);  // [nh, S, D]
        slab_logits(q, k, logits);
      }
      // Softmax of each window row over the keys it sees, averaged over the window, written
      // straight into the output: one work item per query head.
      float* dst = out.select(0, b).data_ptr<float>() + h0 * group * (seq - window);
      at::parallel_for(0, nh * group, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
        for (int64_t head = begin; head < end; ++head)
          run_per_isa<WindowSoftmaxMean>(lp + head * window * seq, window, seq, dst + head * (seq - window));
      });
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("window_attention_mean", &window_attention_mean_cpu); }

}  // namespace kvpress::kernels
