// CPU kernels for the leverage scores of LeverageScorePress and CompactorPress, float32 on CPUs with
// AVX-512 or AVX2 + FMA: kvpress::sketch_prerope_keys (X = (P - mean_S P) Φ and XᵀX, P the pre-RoPE keys) and
// kvpress::cholesky_leverage (ℓ_i = ||L⁻¹ x_i||²).
//
// All three products are narrow ([S x D] x [D x k], [k x S] x [S x k] and [S x k] x [k x k] with
// k = 48), which libtorch's BLAS runs at about half its square-matrix rate; each is the register
// tile of cpu/register_tile.h with R rows x k columns. The sketch's rows are un-rotated and centred
// into a small buffer just before they are multiplied, so K is read twice (its mean, then the
// sketch) and nothing of its size is written.
//
// Deterministic: positions are cut into fixed chunks of kChunk; each chunk's partial sums (column
// sums for the mean, the Gram matrix) are formed in a fixed order and added in chunk order in
// double, so no result depends on the thread count. Elsewhere (other dtypes, a head_dim that is
// not a multiple of 32 or above kMaxDim, k not a multiple of 16 or above 64, no register tiles) the
// ops take their ATen composites.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "compactor/compactor.h"
#include "cpu/register_tile.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace {

constexpr int64_t kChunk = 256;   // positions per task and per partial sum
constexpr int64_t kMaxDim = 256;  // largest head_dim of the row buffer
constexpr int64_t kMaxSketch = 64;

int64_t chunks_of(int64_t seq) { return (seq + kChunk - 1) / kChunk; }

// Whether the register tiles below serve this head_dim (0: not needed) and sketch dimension.
bool tiles_fit(int64_t dim, int64_t sketch_dimension) {
  return cpu_tile_isa() != TileIsa::kNone && dim % 32 == 0 && dim <= kMaxDim && sketch_dimension % 16 == 0 &&
         sketch_dimension <= kMaxSketch;
}

#if KVPRESS_HAVE_TILE_KERNELS

using vec16::kLanes;

// Rows of the Gram's tiles for passes P vectors wide: a power of two (they must divide 16) within
// the ISA's rows for that width.
template <class Tiles, int P>
constexpr int kGramRows = Tiles::template kRowsFor<P> >= 8 ? 8 : 4;

// The keys of every unit (batch x head) as rows with a unit stride along head_dim; any other strides
// (a slice of a longer cache, a [B, S, H, D] layout) are read in place.
struct KeyRows {
  const float* data;
  int64_t heads, batch_stride, head_stride, row_stride;
  const float* row(int64_t unit, int64_t position) const {
    return data + unit / heads * batch_stride + unit % heads * head_stride + position * row_stride;
  }
};

// The pre-RoPE row of the post-RoPE row x (invert_rope's formula, half = dim / 2 a multiple of 16):
// out[d] = x[d] c[d] + x[d + half] s[d] below half, x[d] c[d] - x[d - half] s[d] from half on, minus
// mean[d] when mean is given. In vectors V.
template <class V>
KVPRESS_VEC_INLINE void unrotate_row(const float* x, const float* c, const float* s, const float* mean, float* out,
                                     int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; d += vec16::lanes<V>) {
    const V x_lo = vec16::load<V>(x + d), x_hi = vec16::load<V>(x + d + half);
    V lo = x_lo * vec16::load<V>(c + d) + x_hi * vec16::load<V>(s + d);
    V hi = x_hi * vec16::load<V>(c + d + half) - x_lo * vec16::load<V>(s + d + half);
    if (mean != nullptr) {
      lo -= vec16::load<V>(mean + d);
      hi -= vec16::load<V>(mean + d + half);
    }
    vec16::store(out + d, lo);
    vec16::store(out + d + half, hi);
  }
}

// partial[u][chunk][d]: the sum of the pre-RoPE rows of chunk `chunk` of every unit (batch x head),
// accumulated in registers (HV = dim / 32: half a row is 16 HV floats). keys: units x seq rows,
// cos/sin [seq, dim], partial [units, chunks, dim].
template <class Tiles, int HV>
KVPRESS_VEC_INLINE void prerope_chunk_sums(const KeyRows& keys, const float* cos, const float* sin, int64_t units,
                                           int64_t seq, int64_t chunk, float* partial) {
  using V = typename Tiles::Vec;
  constexpr int64_t dim = 2 * HV * kLanes, half = HV * kLanes, L = Tiles::kLanes, NH = half / L;
  const int64_t begin = chunk * kChunk, end = std::min(seq, begin + kChunk), chunks = chunks_of(seq);
  for (int64_t u = 0; u < units; ++u) {
    V lo_sum[NH] = {}, hi_sum[NH] = {};
    for (int64_t p = begin; p < end; ++p) {
      const float *x = keys.row(u, p), *c = cos + p * dim, *s = sin + p * dim;
#pragma GCC unroll 16
      for (int v = 0; v < NH; ++v) {
        const int64_t d = v * L;
        const V x_lo = vec16::load<V>(x + d), x_hi = vec16::load<V>(x + d + half);
        lo_sum[v] += x_lo * vec16::load<V>(c + d) + x_hi * vec16::load<V>(s + d);
        hi_sum[v] += x_hi * vec16::load<V>(c + d + half) - x_lo * vec16::load<V>(s + d + half);
      }
    }
    float* out = partial + (u * chunks + chunk) * dim;
    for (int v = 0; v < NH; ++v) {
      vec16::store(out + v * L, lo_sum[v]);
      vec16::store(out + half + v * L, hi_sum[v]);
    }
  }
}

// RG rows of a chunk's Gram matrix, W vectors wide, in passes of P vectors: out[r][L v + lane] =
// sum over the n rows t of X of a[t * k + r] * b[t * k + L v + lane] (a and b point into X, rows k
// floats apart; L the lanes of V).
template <int RG, int W, int P, class V>
KVPRESS_VEC_INLINE void gram_rows(const float* a, const float* b, int64_t k, int64_t n, float* out) {
  constexpr int kWidth = W < P ? W : P;
  for (int v0 = 0; v0 < W; v0 += kWidth) {
    V acc[RG][kWidth] = {};
    multiply_tile<RG, kWidth>(a, 1, k, b + v0 * vec16::lanes<V>, k, n, acc);
    for (int r = 0; r < RG; ++r)
      for (int v = 0; v < kWidth; ++v) vec16::store(out + r * k + (v0 + v) * vec16::lanes<V>, acc[r][v]);
  }
}

// gram_rows for a width W <= N known at run time.
template <int RG, int N, int P, class V>
KVPRESS_VEC_INLINE void gram_rows_of_width(int64_t width, const float* a, const float* b, int64_t k, int64_t n,
                                           float* out) {
  if constexpr (N > 1) {
    if (width < N) return gram_rows_of_width<RG, N - 1, P, V>(width, a, b, k, n, out);
  }
  gram_rows<RG, N, P, V>(a, b, k, n, out);
}

// Rows of chunk `chunk` of every unit: x[u][p] = (P[u][p] - mean[u]) Φ_u, then the chunk's Gram
// matrix partial_gram[u][chunk] = X_chunkᵀ X_chunk from those rows while they are in cache.
// mean [units, dim]; sketch Φ_u at sketch + u * sketch_stride ([dim, k], k = 16 NV16); x [units,
// seq, k]; partial_gram [units, chunks, k, k]. Products in passes of P vectors over R rows.
template <class Tiles, int NV16>
KVPRESS_VEC_INLINE void sketch_chunk(const KeyRows& keys, const float* cos, const float* sin, const float* mean,
                                     const float* sketch, int64_t sketch_stride, int64_t units, int64_t seq,
                                     int64_t dim, int64_t chunk, float* x, float* partial_gram) {
  using V = typename Tiles::Vec;
  constexpr int64_t k = NV16 * kLanes;
  constexpr int L = Tiles::kLanes, NV = k / L, P = kPassVectors<Tiles, NV>;
  constexpr int R = Tiles::template kRowsFor<P>, RG = kGramRows<Tiles, P>;
  const int64_t begin = chunk * kChunk, end = std::min(seq, begin + kChunk), chunks = chunks_of(seq);
  alignas(64) float rows[R * kMaxDim];
  for (int64_t u = 0; u < units; ++u) {
    const float* phi = sketch + u * sketch_stride;

    float* x_rows = x + u * seq * k;
    int64_t p = begin;
    for (; p + R <= end; p += R) {
      for (int r = 0; r < R; ++r)
        unrotate_row<V>(keys.row(u, p + r), cos + (p + r) * dim, sin + (p + r) * dim, mean + u * dim, rows + r * dim,
                        dim);
      for (int v0 = 0; v0 < NV; v0 += P) {
        V acc[R][P] = {};
        multiply_tile<R, P>(rows, dim, 1, phi + v0 * L, k, dim, acc);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < P; ++v) vec16::store(x_rows + (p + r) * k + (v0 + v) * L, acc[r][v]);
      }
    }
    for (; p < end; ++p) {
      unrotate_row<V>(keys.row(u, p), cos + p * dim, sin + p * dim, mean + u * dim, rows, dim);
      for (int v0 = 0; v0 < NV; v0 += P) {
        V acc[1][P] = {};
        multiply_tile<1, P>(rows, dim, 1, phi + v0 * L, k, dim, acc);
        for (int v = 0; v < P; ++v) vec16::store(x_rows + p * k + (v0 + v) * L, acc[0][v]);
      }
    }
    // Gram rows i0 .. i0 + RG, the chunk's X read as its transpose (a[i][t] = X[t][i]), from the
    // vector holding the diagonal on: the rest is the lower triangle, which reduce_gram mirrors (a
    // third of the products saved at k = 48). RG divides L, so a tile of rows starts in one vector.
    static_assert(L % RG == 0);
    const float* x_chunk = x_rows + begin * k;
    float* gram = partial_gram + (u * chunks + chunk) * k * k;
    for (int64_t i0 = 0; i0 < k; i0 += RG) {
      const int64_t v0 = i0 / L;
      const float* a = x_chunk + i0;
      const float* b = x_chunk + v0 * L;
      float* out = gram + i0 * k + v0 * L;
      gram_rows_of_width<RG, NV, P, V>(NV - v0, a, b, k, end - begin, out);
    }
  }
}

// out[p] = ||L⁻¹ x_p||² for rows [begin, end) of one unit: x [seq, k], inverse_t = (L⁻¹)ᵀ [k, k],
// k = 16 NV16. In passes of P vectors over R rows, the squares summed across passes.
template <class Tiles, int NV16>
KVPRESS_VEC_INLINE void leverage_rows(const float* x, const float* inverse_t, int64_t begin, int64_t end, float* out) {
  using V = typename Tiles::Vec;
  constexpr int64_t k = NV16 * kLanes;
  constexpr int L = Tiles::kLanes, NV = k / L, P = kPassVectors<Tiles, NV>, R = Tiles::template kRowsFor<P>;
  int64_t p = begin;
  for (; p + R <= end; p += R) {
    V squares[R] = {};
    for (int v0 = 0; v0 < NV; v0 += P) {
      V acc[R][P] = {};
      multiply_tile<R, P>(x + p * k, k, 1, inverse_t + v0 * L, k, k, acc);
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < P; ++v) squares[r] += acc[r][v] * acc[r][v];
    }
    for (int r = 0; r < R; ++r) out[p + r] = vec16::lane_sum(squares[r]);
  }
  for (; p < end; ++p) {
    V squares{};
    for (int v0 = 0; v0 < NV; v0 += P) {
      V acc[1][P] = {};
      multiply_tile<1, P>(x + p * k, k, 1, inverse_t + v0 * L, k, k, acc);
      for (int v = 0; v < P; ++v) squares += acc[0][v] * acc[0][v];
    }
    out[p] = vec16::lane_sum(squares);
  }
}

// The kernels compiled for each ISA.
template <int HV>
KVPRESS_AVX512_KERNEL void prerope_chunk_sums_avx512(const KeyRows& keys, const float* cos, const float* sin,
                                                     int64_t units, int64_t seq, int64_t chunk, float* partial) {
  prerope_chunk_sums<Avx512Tiles, HV>(keys, cos, sin, units, seq, chunk, partial);
}
template <int HV>
KVPRESS_AVX2_KERNEL void prerope_chunk_sums_avx2(const KeyRows& keys, const float* cos, const float* sin, int64_t units,
                                                 int64_t seq, int64_t chunk, float* partial) {
  prerope_chunk_sums<Avx2Tiles, HV>(keys, cos, sin, units, seq, chunk, partial);
}
template <int NV>
KVPRESS_AVX512_KERNEL void sketch_chunk_avx512(const KeyRows& keys, const float* cos, const float* sin,
                                               const float* mean, const float* sketch, int64_t sketch_stride,
                                               int64_t units, int64_t seq, int64_t dim, int64_t chunk, float* x,
                                               float* partial_gram) {
  sketch_chunk<Avx512Tiles, NV>(keys, cos, sin, mean, sketch, sketch_stride, units, seq, dim, chunk, x, partial_gram);
}
template <int NV>
KVPRESS_AVX2_KERNEL void sketch_chunk_avx2(const KeyRows& keys, const float* cos, const float* sin, const float* mean,
                                           const float* sketch, int64_t sketch_stride, int64_t units, int64_t seq,
                                           int64_t dim, int64_t chunk, float* x, float* partial_gram) {
  sketch_chunk<Avx2Tiles, NV>(keys, cos, sin, mean, sketch, sketch_stride, units, seq, dim, chunk, x, partial_gram);
}
template <int NV>
KVPRESS_AVX512_KERNEL void leverage_rows_avx512(const float* x, const float* inverse_t, int64_t begin, int64_t end,
                                                float* out) {
  leverage_rows<Avx512Tiles, NV>(x, inverse_t, begin, end, out);
}
template <int NV>
KVPRESS_AVX2_KERNEL void leverage_rows_avx2(const float* x, const float* inverse_t, int64_t begin, int64_t end,
                                            float* out) {
  leverage_rows<Avx2Tiles, NV>(x, inverse_t, begin, end, out);
}

// Calls body<NV>() for k = 16 NV (k a multiple of 16 up to kMaxSketch, checked by tiles_fit).
template <typename Body>
void with_vectors_per_row(int64_t k, const Body& body) {
  switch (k / kLanes) {
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 3: return body(std::integral_constant<int, 3>{});
    default: return body(std::integral_constant<int, 4>{});
  }
}

// Calls body<HV>() for head_dim = 32 HV (a multiple of 32 up to kMaxDim, checked by tiles_fit).
template <typename Body>
void with_half_row_vectors(int64_t dim, const Body& body) {
  switch (dim / (2 * kLanes)) {
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 3: return body(std::integral_constant<int, 3>{});
    case 4: return body(std::integral_constant<int, 4>{});
    case 5: return body(std::integral_constant<int, 5>{});
    case 6: return body(std::integral_constant<int, 6>{});
    case 7: return body(std::integral_constant<int, 7>{});
    default: return body(std::integral_constant<int, 8>{});
  }
}

// The Gram matrices: G[u][i][j] = G[u][j][i] = sum over chunks of partial[u][c][i][j] for j >= i,
// in chunk order, in double (the partials hold the upper triangle). partial [units, chunks, k * k].
void reduce_gram(const at::Tensor& partial, int64_t k, float* out) {
  const int64_t units = partial.size(0), chunks = partial.size(1);
  const float* p = partial.data_ptr<float>();
  at::parallel_for(0, units * k, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t u = t / k, i = t % k;
      for (int64_t j = i; j < k; ++j) {
        double total = 0.0;
        for (int64_t c = 0; c < chunks; ++c) total += p[(u * chunks + c) * k * k + i * k + j];
        out[(u * k + i) * k + j] = out[(u * k + j) * k + i] = static_cast<float>(total);
      }
    }
  });
}

// sum over chunks of partial[u][c][i] in chunk order, in double, times `scale`: [units, n] float32.
void reduce_chunks(const at::Tensor& partial, double scale, float* out) {  // partial [units, chunks, n]
  const int64_t units = partial.size(0), chunks = partial.size(1), n = partial.size(2);
  const float* p = partial.data_ptr<float>();
  at::parallel_for(0, units * n, 4096, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t u = t / n, i = t % n;
      double total = 0.0;
      for (int64_t c = 0; c < chunks; ++c) total += p[(u * chunks + c) * n + i];
      out[t] = static_cast<float>(total * scale);
    }
  });
}

#endif  // KVPRESS_HAVE_TILE_KERNELS

std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys_cpu(const at::Tensor& keys_in, const at::Tensor& cos_in,
                                                           const at::Tensor& sin_in, const at::Tensor& sketch_in) {
  checks::check_sketch_prerope_keys(keys_in, cos_in, sin_in, sketch_in);
  const int64_t batch = keys_in.size(0), heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t k = sketch_in.size(-1);
  if (keys_in.scalar_type() != at::kFloat || !tiles_fit(dim, k))
    return ops::composite::sketch_prerope_keys(keys_in, cos_in, sin_in, sketch_in);
#if KVPRESS_HAVE_TILE_KERNELS
  const bool avx512 = cpu_tile_isa() == TileIsa::kAvx512;
  const at::Tensor keys = keys_in.stride(3) == 1 ? keys_in : keys_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor sketch = sketch_in.to(at::kFloat).contiguous();
  const int64_t units = batch * heads, chunks = chunks_of(seq);
  const int64_t sketch_stride = sketch.dim() == 2 ? 0 : dim * k;
  const KeyRows kp{keys.data_ptr<float>(), heads, keys.stride(0), keys.stride(1), keys.stride(2)};
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const auto f32 = keys.options().dtype(at::kFloat);

  // The mean of every unit's pre-RoPE keys (kvpress centres before it sketches).
  const at::Tensor partial_sums = at::empty({units, chunks, dim}, f32);
  float* sums = partial_sums.data_ptr<float>();
  with_half_row_vectors(dim, [&](auto hv) {
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      constexpr int HV = decltype(hv)::value;
      const auto chunk_sums = avx512 ? &prerope_chunk_sums_avx512<HV> : &prerope_chunk_sums_avx2<HV>;
      for (int64_t c = first; c < last; ++c) chunk_sums(kp, cp, sp, units, seq, c, sums);
    });
  });
  const at::Tensor mean = at::empty({units, dim}, f32);
  reduce_chunks(partial_sums, 1.0 / static_cast<double>(seq), mean.data_ptr<float>());

  at::Tensor x = at::empty({batch, heads, seq, k}, f32);
  const at::Tensor partial_gram = at::empty({units, chunks, k * k}, f32);
  with_vectors_per_row(k, [&](auto nv) {
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      constexpr int NV = decltype(nv)::value;
      const auto sketch_rows = avx512 ? &sketch_chunk_avx512<NV> : &sketch_chunk_avx2<NV>;
      for (int64_t c = first; c < last; ++c)
        sketch_rows(kp, cp, sp, mean.data_ptr<float>(), sketch.data_ptr<float>(), sketch_stride, units, seq, dim, c,
                    x.data_ptr<float>(), partial_gram.data_ptr<float>());
    });
  });
  at::Tensor gram = at::empty({batch, heads, k, k}, f32);
  reduce_gram(partial_gram, k, gram.data_ptr<float>());
  return {x, gram};
#else
  TORCH_CHECK(false, "sketch_prerope_keys: unreachable without the register-tile kernels");
#endif
}

at::Tensor cholesky_leverage_cpu(const at::Tensor& sketched_in, const at::Tensor& factor) {
  constexpr const char* op = "cholesky_leverage";
  checks::check_cholesky_leverage(op, sketched_in, factor);
  const int64_t k = sketched_in.size(3);
  if (!tiles_fit(0, k)) return ops::composite::cholesky_leverage(sketched_in, factor);
#if KVPRESS_HAVE_TILE_KERNELS
  const bool avx512 = cpu_tile_isa() == TileIsa::kAvx512;
  const at::Tensor x = sketched_in.contiguous();
  // Row j of (L⁻¹)ᵀ holds column j of L⁻¹, the vector the tile multiplies x_p[j] by.
  const at::Tensor inverse_t = ops::lower_triangular_inverse(factor).transpose(2, 3).contiguous();  // [B, H, k, k]
  const int64_t seq = x.size(2), units = x.size(0) * x.size(1), chunks = chunks_of(seq);
  at::Tensor out = at::empty({x.size(0), x.size(1), seq}, x.options());
  const float *xp = x.data_ptr<float>(), *ip = inverse_t.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  with_vectors_per_row(k, [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    const auto rows_leverage = avx512 ? &leverage_rows_avx512<NV> : &leverage_rows_avx2<NV>;
    at::parallel_for(0, units * chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const int64_t u = t / chunks, begin = (t % chunks) * kChunk, end = std::min(seq, begin + kChunk);
        rows_leverage(xp + u * seq * k, ip + u * k * k, begin, end, op_out + u * seq);
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, op, ": unreachable without the register-tile kernels");
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) {
  m.impl("sketch_prerope_keys", &sketch_prerope_keys_cpu);
  m.impl("cholesky_leverage", &cholesky_leverage_cpu);
}

}  // namespace kvpress::kernels
