// CPU kernel of kvpress::keydiff_scores, in two passes over each head's keys: the anchor (mean of
// unit keys), then the cosine of every key to it. float32 arithmetic, the anchor's sum in double;
// the same eps as kvpress: F.normalize 1e-12, cosine_similarity 1e-8 on each norm. The ATen
// composite writes three [B, H, S, D] temporaries instead.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/float_rows.h"
#include "cpu/per_isa.h"
#include "cpu/vec16.h"

namespace kvpress::kernels {
namespace {

// Scratch of one thread: the anchor's running sum (double: over millions of rows a float sum
// drifts), the anchor itself, every row's norm and, for float16/bfloat16 keys, one block of rows
// in float32.
struct KeyDiffScratch {
  std::vector<double> anchor_sum;
  std::vector<float> anchor, norms;
  std::vector<float> block;
  KeyDiffScratch(int64_t dim, int64_t seq, bool convert)
      : anchor_sum(static_cast<size_t>(dim)), anchor(static_cast<size_t>(dim)), norms(static_cast<size_t>(seq)) {
    if (convert) block.resize(static_cast<size_t>(kConvertBlockRows * dim));
  }
};

// The float32 passes, with vector dot products, each compiled per ISA (per_isa.h). Pass 1 over n
// rows: each row's norm, and the unit rows added to the anchor's running sum.
struct AddUnitRows {
  template <class V>
  static KVPRESS_VEC_INLINE void run(const float* rows, int64_t n, int64_t dim, float* norms, double* anchor_sum) {
    for (int64_t s = 0; s < n; ++s) {
      const float* k = rows + s * dim;
      const float norm = std::sqrt(vec16::dot<V>(k, k, dim));
      norms[s] = norm;
      const float inv = 1.f / std::max(norm, 1e-12f);
      for (int64_t d = 0; d < dim; ++d) anchor_sum[d] += static_cast<double>(k[d] * inv);
    }
  }
};

// The anchor (mean unit row) from its sum over `seq` rows; returns its norm (eps 1e-8).
struct FinishAnchor {
  template <class V>
  static KVPRESS_VEC_INLINE float run(const double* anchor_sum, int64_t seq, int64_t dim, float* anchor) {
    for (int64_t d = 0; d < dim; ++d) anchor[d] = static_cast<float>(anchor_sum[d] / static_cast<double>(seq));
    return std::max(std::sqrt(vec16::dot<V>(anchor, anchor, dim)), 1e-8f);
  }
};

// Pass 2 over n rows: minus the cosine of each row to the anchor.
struct NegativeCosines {
  template <class V>
  static KVPRESS_VEC_INLINE void run(const float* rows, int64_t n, int64_t dim, const float* anchor, float anchor_norm,
                                     const float* norms, float* out) {
    for (int64_t s = 0; s < n; ++s)
      out[s] = -vec16::dot<V>(rows + s * dim, anchor, dim) / (std::max(norms[s], 1e-8f) * anchor_norm);
  }
};

// One head, float32 arithmetic: float32 keys are read in place, float16/bfloat16 keys converted a
// block of rows at a time.
template <typename scalar_t>
void keydiff_head(const scalar_t* keys, int64_t seq, int64_t dim, float* out, KeyDiffScratch& scratch) {
  auto rows = [&](int64_t s0, int64_t n) {  // [n, dim] float32
    return as_float32(keys + s0 * dim, n * dim, scratch.block);
  };
  std::fill(scratch.anchor_sum.begin(), scratch.anchor_sum.end(), 0.0);
  for (int64_t s0 = 0; s0 < seq; s0 += kConvertBlockRows) {
    const int64_t n = std::min(kConvertBlockRows, seq - s0);
    run_per_isa<AddUnitRows>(rows(s0, n), n, dim, scratch.norms.data() + s0, scratch.anchor_sum.data());
  }
  const float anchor_norm = run_per_isa<FinishAnchor>(scratch.anchor_sum.data(), seq, dim, scratch.anchor.data());
  for (int64_t s0 = 0; s0 < seq; s0 += kConvertBlockRows) {
    const int64_t n = std::min(kConvertBlockRows, seq - s0);
    run_per_isa<NegativeCosines>(rows(s0, n), n, dim, scratch.anchor.data(), anchor_norm, scratch.norms.data() + s0,
                                 out + s0);
  }
}

at::Tensor keydiff_scores_cpu(const at::Tensor& keys_in) {
  checks::check_keys("keydiff_scores", keys_in);
  const at::Tensor keys = keys_in.contiguous();
  const int64_t heads = keys.size(0) * keys.size(1), seq = keys.size(2), dim = keys.size(3);
  at::Tensor out = at::empty({keys.size(0), keys.size(1), seq}, keys.options().dtype(at::kFloat));
  float* out_ptr = out.data_ptr<float>();
  // check_keys admits float32, float16 and bfloat16 only.
  AT_DISPATCH_V2(keys.scalar_type(), "keydiff_scores_cpu", AT_WRAP([&] {
                   const scalar_t* k = keys.data_ptr<scalar_t>();
                   at::parallel_for(0, heads, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
                     KeyDiffScratch scratch(dim, seq, !std::is_same_v<scalar_t, float>);
                     for (int64_t h = begin; h < end; ++h)
                       keydiff_head(k + h * seq * dim, seq, dim, out_ptr + h * seq, scratch);
                   });
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("keydiff_scores", &keydiff_scores_cpu); }

}  // namespace kvpress::kernels
