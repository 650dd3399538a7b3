// Register tiles for small dense products (the leverage sketch, window logits, non-causal chunk
// logits): R rows x NV vectors accumulate a[r][t] * b[t][...] over the inner dimension t, one
// broadcast of a per row and NV vector loads of b per step, R x NV FMAs. Sized so that the
// accumulators, the loaded vectors and the broadcast stay in registers and at least 8 independent
// FMAs are in flight (two FMA pipes, latency 4), the FMA pipes are the bound: 230-260 GFLOP/s on the
// two cores of an AVX-512 development machine, where libtorch's BLAS runs narrow shapes
// ([S x 128] x [128 x 48], [256 x 128] x [128 x S]) at 85-150. Each kernel is one template compiled
// for AVX-512 (16-float vectors, 32 registers) and for AVX2 + FMA (8-float vectors, 16 registers),
// with the tile shapes of Avx512Tiles / Avx2Tiles below. Include it only from kernel .cpp files and
// call it from KVPRESS_AVX512_KERNEL / KVPRESS_AVX2_KERNEL functions (vector_clones.h): it is
// always inlined.
#pragma once

#include <cstdint>

#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {

// Tile shapes for AVX-512 (vectors of 16 floats, 32 registers): products are made up to
// kMaxVectors = 4 vectors (64 columns) wide at once, kRowsFor<NV> rows for a pass NV vectors wide:
// 6 x 4 accumulators + 4 loads + 1 broadcast = 29 registers; 8 x 3 + 3 + 1 = 28 below four vectors.
struct Avx512Tiles {
  using Vec = vec16::Vec;
  static constexpr int kLanes = 16;
  static constexpr int kMaxVectors = 4;
  template <int NV>
  static constexpr int kRowsFor = NV == 4 ? 6 : 8;
};

// Tile shapes for AVX2 + FMA (vectors of 8 floats, 16 registers): passes up to 2 vectors (16
// columns) wide over 6 rows: 6 x 2 accumulators + 2 loads + 1 broadcast = 15 registers, 12 FMAs in
// flight. A wider product is made in passes over the same rows.
struct Avx2Tiles {
  using Vec = vec16::Vec8;  // not vec16::Vec: gcc keeps arrays of 64-byte vectors in memory here
  static constexpr int kLanes = 8;
  static constexpr int kMaxVectors = 2;
  template <int NV>
  static constexpr int kRowsFor = 6;
};

// Vectors per pass for a product NV vectors wide.
template <class Tiles, int NV>
constexpr int kPassVectors = NV < Tiles::kMaxVectors ? NV : Tiles::kMaxVectors;

// acc[r][v] += sum over t < depth of a[r * row_stride + t * depth_stride] * b[t * b_stride + L v + lane],
// L the lanes of a vector V.
template <int R, int NV, class V>
KVPRESS_VEC_INLINE void multiply_tile(const float* a, int64_t row_stride, int64_t depth_stride, const float* b,
                                      int64_t b_stride, int64_t depth, V (&acc)[R][NV]) {
  for (int64_t t = 0; t < depth; ++t) {
    V bt[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bt[v] = vec16::load<V>(b + t * b_stride + v * vec16::lanes<V>);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V x = vec16::broadcast<V>(a[r * row_stride + t * depth_stride]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bt[v];
    }
  }
}

// Columns per panel of multiply_panels: one pass of the widest tile.
template <class Tiles>
constexpr int64_t kPanelWidth = Tiles::kMaxVectors* Tiles::kLanes;

// kPanelWidth of the tiles `isa` runs (AVX-512's unless isa is kAvx2).
inline int64_t panel_width(TileIsa isa) {
  return isa == TileIsa::kAvx2 ? kPanelWidth<Avx2Tiles> : kPanelWidth<Avx512Tiles>;
}

// Rows per call of multiply_panels: 240 rows of D = 128 floats (120 KiB) stay in L2 while every
// panel passes, and 240 is a multiple of every tile's rows.
constexpr int64_t kPanelRowBlock = 240;

// The products of the rows of a [n, d] (row major) with panels of columns [n_panels, d, W]
// (W = kPanelWidth<Tiles>, each panel contiguous), handed to sink.take(p, i, acc) for every panel p
// and row i, acc the row's W products as kMaxVectors vectors; nothing is stored. Panel-major, so
// each panel stays in L1 while the rows (a block sized for L2) pass R at a time.
template <class Tiles, class Sink>
KVPRESS_VEC_INLINE void multiply_panels(const float* a, int64_t n, int64_t d, const float* panels, int64_t n_panels,
                                        Sink& sink) {
  using V = typename Tiles::Vec;
  constexpr int P = Tiles::kMaxVectors, R = Tiles::template kRowsFor<P>;
  constexpr int64_t W = kPanelWidth<Tiles>;
  for (int64_t p = 0; p < n_panels; ++p) {
    const float* b = panels + p * d * W;
    int64_t i = 0;
    for (; i + R <= n; i += R) {
      V acc[R][P] = {};
      multiply_tile<R, P>(a + i * d, d, 1, b, W, d, acc);
      for (int r = 0; r < R; ++r) sink.take(p, i + r, acc[r]);
    }
    for (; i < n; ++i) {
      V acc[1][P] = {};
      multiply_tile<1, P>(a + i * d, d, 1, b, W, d, acc);
      sink.take(p, i, acc[0]);
    }
  }
}

// The b operand of a logits tile: kt[d][j] = k[j][d] for keys j < width (a multiple of 16), rows
// of k `k_stride` floats apart, dim a multiple of 16; keys from n on are zero. Blocks of L x L (the
// lanes of Tiles::Vec) are transposed in registers.
template <class Tiles>
KVPRESS_VEC_INLINE void transpose_keys(const float* k, int64_t k_stride, int64_t n, int64_t width, int64_t dim,
                                       float* kt) {
  using V = typename Tiles::Vec;
  constexpr int64_t L = Tiles::kLanes;
  for (int64_t j0 = 0; j0 < width; j0 += L) {
    for (int64_t d0 = 0; d0 < dim; d0 += L) {
      V block[L];
      for (int64_t j = 0; j < L; ++j) block[j] = j0 + j < n ? vec16::load<V>(k + (j0 + j) * k_stride + d0) : V{};
      vec16::transpose(block);
      for (int64_t d = 0; d < L; ++d) vec16::store(kt + (d0 + d) * width + j0, block[d]);
    }
  }
}

}  // namespace kvpress::kernels
