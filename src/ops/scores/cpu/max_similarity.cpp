// CPU kernel of kvpress::max_similarity (MergingPress's nearest kept key): per head, the rows'
// products with the candidates packed as panels of columns (register_tile.h's multiply_panels),
// compared in registers against each lane's best so far. The composite stores every [rows, m]
// block of similarities and reads it again for the maximum: at the Llama-3.1-8B shape with half
// the tokens evicted that is 0.5 G floats per layer, written and read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/register_tile.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"
#include "scores/scores.h"

namespace kvpress::kernels {
namespace {

typedef int32_t Ints16 __attribute__((vector_size(16 * sizeof(int32_t))));
typedef int32_t Ints8 __attribute__((vector_size(8 * sizeof(int32_t))));

// Each row's best product so far and its column, lane by lane (lane l sees columns l mod L of every
// panel vector): best [n, L], column [n, L]. Strictly greater replaces, so each lane keeps the first
// column reaching its maximum; columns >= m (the last panel's padding) never count.
template <class V>
struct RowMaxSink {
  static constexpr int64_t L = vec16::lanes<V>;
  float* best;
  int32_t* column;
  int64_t width;  // columns per panel
  int32_t m;      // candidates

  template <int P>
  KVPRESS_VEC_INLINE void take(int64_t panel, int64_t i, const V (&acc)[P]) {
    using Ints = std::conditional_t<L == 16, Ints16, Ints8>;
    V b = vec16::load<V>(best + i * L);
    Ints c;
    std::memcpy(&c, column + i * L, sizeof c);
    Ints lane;
    for (int64_t l = 0; l < L; ++l) lane[l] = static_cast<int32_t>(l);
    const V minus_inf = vec16::broadcast<V>(-std::numeric_limits<float>::infinity());
    for (int q = 0; q < P; ++q) {
      const Ints col = lane + static_cast<int32_t>(panel * width + q * L);
      const V x = col < m ? acc[q] : minus_inf;
      const Ints better = x > b;
      b = better ? x : b;
      c = better ? col : c;
    }
    vec16::store(best + i * L, b);
    std::memcpy(column + i * L, &c, sizeof c);
  }
};

template <class Tiles>
KVPRESS_VEC_INLINE void row_max_of_products(const float* rows, int64_t n, int64_t d, const float* panels,
                                            int64_t n_panels, int32_t m, float* best, int32_t* column) {
  using V = typename Tiles::Vec;
  RowMaxSink<V> sink{best, column, kPanelWidth<Tiles>, m};
  multiply_panels<Tiles>(rows, n, d, panels, n_panels, sink);
}

KVPRESS_AVX512_KERNEL void row_max_of_products_avx512(const float* rows, int64_t n, int64_t d, const float* panels,
                                                      int64_t n_panels, int32_t m, float* best, int32_t* column) {
  row_max_of_products<Avx512Tiles>(rows, n, d, panels, n_panels, m, best, column);
}

KVPRESS_AVX2_KERNEL void row_max_of_products_avx2(const float* rows, int64_t n, int64_t d, const float* panels,
                                                  int64_t n_panels, int32_t m, float* best, int32_t* column) {
  row_max_of_products<Avx2Tiles>(rows, n, d, panels, n_panels, m, best, column);
}

std::tuple<at::Tensor, at::Tensor> max_similarity_cpu(const at::Tensor& rows_in, const at::Tensor& candidates) {
  constexpr const char* op = "max_similarity";
  checks::check_similarity_rows(op, rows_in, candidates);
  const TileIsa isa = cpu_tile_isa();
  const int64_t m = candidates.size(2);
  if (!KVPRESS_HAVE_TILE_KERNELS || isa == TileIsa::kNone || m > std::numeric_limits<int32_t>::max())
    return ops::composite::max_similarity(rows_in, candidates);
  const bool avx512 = isa == TileIsa::kAvx512;
  const int64_t width = panel_width(isa), lanes = avx512 ? 16 : 8;
  const auto products = avx512 ? &row_max_of_products_avx512 : &row_max_of_products_avx2;
  const at::Tensor rows = rows_in.contiguous();
  const int64_t units = rows.size(0) * rows.size(1), n = rows.size(2), d = rows.size(3);
  const int64_t n_panels = (m + width - 1) / width, row_blocks = (n + kPanelRowBlock - 1) / kPanelRowBlock;
  at::Tensor values = at::empty({rows.size(0), rows.size(1), n}, rows.options());
  at::Tensor indices = at::empty({rows.size(0), rows.size(1), n}, rows.options().dtype(at::kLong));
  const at::Tensor flat_candidates = candidates.reshape({units, m, d});
  const float* r = rows.data_ptr<float>();
  float* value_out = values.data_ptr<float>();
  int64_t* index_out = indices.data_ptr<int64_t>();
  for (int64_t u = 0; u < units; ++u) {
    // The head's candidates as panels [n_panels, D, W], zero past m (those columns are masked).
    const at::Tensor panels = at::constant_pad_nd(flat_candidates[u], {0, 0, 0, n_panels * width - m})
                                  .view({n_panels, width, d})
                                  .transpose(1, 2)
                                  .contiguous();
    const float* w = panels.data_ptr<float>();
    at::parallel_for(0, row_blocks, 1, [&](int64_t first, int64_t last) {
      std::vector<float> best(static_cast<size_t>(kPanelRowBlock * lanes));
      std::vector<int32_t> column(static_cast<size_t>(kPanelRowBlock * lanes));
      for (int64_t t = first; t < last; ++t) {
        const int64_t start = t * kPanelRowBlock, count = std::min(kPanelRowBlock, n - start), row0 = u * n + start;
        std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
        std::fill(column.begin(), column.end(), 0);
        products(r + row0 * d, count, d, w, n_panels, static_cast<int32_t>(m), best.data(), column.data());
        // Each row's largest lane; of equal ones, the first column.
        for (int64_t i = 0; i < count; ++i) {
          float b = best[static_cast<size_t>(i * lanes)];
          int32_t c = column[static_cast<size_t>(i * lanes)];
          for (int64_t l = 1; l < lanes; ++l) {
            const float x = best[static_cast<size_t>(i * lanes + l)];
            const int32_t k = column[static_cast<size_t>(i * lanes + l)];
            if (x > b || (x == b && k < c)) b = x, c = k;
          }
          value_out[row0 + i] = b;
          index_out[row0 + i] = c;
        }
      }
    });
  }
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("max_similarity", &max_similarity_cpu); }

}  // namespace kvpress::kernels
