// CPU kernel of kvpress::output_projected_l1_norms (CriticalKVPress's ||v W_o^h||_1): per KV head, the
// product of its values [S, D] with its query heads' W_o columns side by side [D, G·hidden], made by
// the register tiles (register_tile.h) over panels of W_o packed contiguously (L1-resident), whose
// results are summed as absolute values in registers. The composite stores every [rows, G·hidden]
// block of the product and reads it again for the norm; ATen's GEMM runs these narrow products
// (inner dimension D = 128) at about half the FMA peak.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "cpu/register_tile.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"
#include "scores/scores.h"

namespace kvpress::kernels {
namespace {

// out[i] += the L1 norm of row i's products with a panel.
struct L1Sink {
  float* out;
  template <class V, int P>
  KVPRESS_VEC_INLINE void take(int64_t /*panel*/, int64_t i, const V (&acc)[P]) {
    V sum = vec16::abs(acc[0]);
    for (int q = 1; q < P; ++q) sum += vec16::abs(acc[q]);
    out[i] += vec16::lane_sum(sum);
  }
};

// out[i] += sum over panels p and columns c of |v_i . panels[p][:, c]| for rows i < n: v [n, d] row
// major, panels [n_panels, d, kPanelWidth] (one panel of W_o columns each, contiguous).
template <class Tiles>
KVPRESS_VEC_INLINE void l1_of_products(const float* v, int64_t n, int64_t d, const float* panels, int64_t n_panels,
                                       float* out) {
  L1Sink sink{out};
  multiply_panels<Tiles>(v, n, d, panels, n_panels, sink);
}

KVPRESS_AVX512_KERNEL void l1_of_products_avx512(const float* v, int64_t n, int64_t d, const float* panels,
                                                 int64_t n_panels, float* out) {
  l1_of_products<Avx512Tiles>(v, n, d, panels, n_panels, out);
}

KVPRESS_AVX2_KERNEL void l1_of_products_avx2(const float* v, int64_t n, int64_t d, const float* panels,
                                             int64_t n_panels, float* out) {
  l1_of_products<Avx2Tiles>(v, n, d, panels, n_panels, out);
}

at::Tensor output_projected_l1_norms_cpu(const at::Tensor& values_in, const at::Tensor& o_proj, int64_t num_heads) {
  constexpr const char* op = "output_projected_l1_norms";
  checks::check_output_projection(op, values_in, o_proj, num_heads);
  const TileIsa isa = cpu_tile_isa();
  const int64_t width = panel_width(isa);
  const int64_t batch = values_in.size(0), kv_heads = values_in.size(1), seq = values_in.size(2), d = values_in.size(3),
                hidden = o_proj.size(0), groups = num_heads / kv_heads;
  // Panels must not straddle two query heads' columns (hidden is a multiple of 64 in every model).
  if (!KVPRESS_HAVE_TILE_KERNELS || isa == TileIsa::kNone || hidden % width != 0)
    return ops::composite::output_projected_l1_norms(values_in, o_proj, num_heads);
  const at::Tensor values = values_in.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({batch, kv_heads, seq}, values.options());
  const float* v = values.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const auto products = isa == TileIsa::kAvx512 ? &l1_of_products_avx512 : &l1_of_products_avx2;
  const int64_t n_panels = groups * hidden / width, row_blocks = (seq + kPanelRowBlock - 1) / kPanelRowBlock;
  for (int64_t j = 0; j < kv_heads; ++j) {
    // W_o^h of the group's query heads h = j·G + g, [hidden, D] each, as panels [G, hidden / W, D, W]:
    // panel (g, p) holds rows p·W .. p·W + W - 1 of W_o^h transposed, contiguous (8 MiB per KV head
    // at the Llama-3.1-8B shape; one head packed at a time).
    const at::Tensor panels = o_proj.narrow(1, j * groups * d, groups * d)
                                  .to(at::kFloat)
                                  .view({hidden / width, width, groups, d})
                                  .permute({2, 0, 3, 1})
                                  .contiguous();
    const float* w = panels.data_ptr<float>();
    at::parallel_for(0, batch * row_blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const int64_t b = t / row_blocks, start = (t % row_blocks) * kPanelRowBlock,
                      n = std::min(kPanelRowBlock, seq - start);
        const int64_t row0 = (b * kv_heads + j) * seq + start;
        products(v + row0 * d, n, d, w, n_panels, o + row0);
      }
    });
  }
  return out.div_(static_cast<double>(groups));  // the group's mean
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("output_projected_l1_norms", &output_projected_l1_norms_cpu); }

}  // namespace kvpress::kernels
