// CPU kernel of kvpress::keydiff_scores, in two passes over each head's keys: the anchor (mean of
// unit keys), then the cosine of every key to it. float32 accumulation (double for double keys);
// the same eps as kvpress: F.normalize 1e-12, cosine_similarity 1e-8 on each norm. The ATen
// composite writes three [B, H, S, D] temporaries instead.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace {

// Scratch of one thread: the anchor's running sum (double: over millions of rows a float sum
// drifts), the anchor itself and every row's norm.
template <typename acc_t>
struct KeyDiffScratch {
  std::vector<double> anchor_sum;
  std::vector<acc_t> anchor, norms;
  KeyDiffScratch(int64_t dim, int64_t seq)
      : anchor_sum(static_cast<size_t>(dim)), anchor(static_cast<size_t>(dim)), norms(static_cast<size_t>(seq)) {}
};

// One head of float32 keys, with vector dot products (compiled per ISA).
KVPRESS_VECTOR_CLONES
void keydiff_head_f32(const float* keys, int64_t seq, int64_t dim, float* out, double* anchor_sum, float* anchor,
                      float* norms) {
  std::fill(anchor_sum, anchor_sum + dim, 0.0);
  for (int64_t s = 0; s < seq; ++s) {
    const float* k = keys + s * dim;
    const float norm = std::sqrt(vec16::dot(k, k, dim));
    norms[s] = norm;
    const float inv = 1.f / std::max(norm, 1e-12f);
    for (int64_t d = 0; d < dim; ++d) anchor_sum[d] += static_cast<double>(k[d] * inv);
  }
  for (int64_t d = 0; d < dim; ++d) anchor[d] = static_cast<float>(anchor_sum[d] / static_cast<double>(seq));
  const float anchor_norm = std::max(std::sqrt(vec16::dot(anchor, anchor, dim)), 1e-8f);
  for (int64_t s = 0; s < seq; ++s)
    out[s] = -vec16::dot(keys + s * dim, anchor, dim) / (std::max(norms[s], 1e-8f) * anchor_norm);
}

template <typename scalar_t, typename acc_t>
void keydiff_head(const scalar_t* keys, int64_t seq, int64_t dim, float* out, KeyDiffScratch<acc_t>& scratch) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    keydiff_head_f32(keys, seq, dim, out, scratch.anchor_sum.data(), scratch.anchor.data(), scratch.norms.data());
  } else {
    std::vector<double>& sum = scratch.anchor_sum;
    std::vector<acc_t>& anchor = scratch.anchor;
    std::vector<acc_t>& norms = scratch.norms;
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t s = 0; s < seq; ++s) {
      const scalar_t* k = keys + s * dim;
      acc_t sq = 0;
      for (int64_t d = 0; d < dim; ++d) {
        const acc_t v = static_cast<acc_t>(k[d]);
        sq += v * v;
      }
      const acc_t norm = std::sqrt(sq);
      norms[static_cast<size_t>(s)] = norm;
      const acc_t inv = acc_t(1) / std::max(norm, acc_t(1e-12));
      for (int64_t d = 0; d < dim; ++d)
        sum[static_cast<size_t>(d)] += static_cast<double>(static_cast<acc_t>(k[d]) * inv);
    }
    acc_t anchor_sq = 0;
    for (int64_t d = 0; d < dim; ++d) {
      anchor[static_cast<size_t>(d)] = static_cast<acc_t>(sum[static_cast<size_t>(d)] / static_cast<double>(seq));
      anchor_sq += anchor[static_cast<size_t>(d)] * anchor[static_cast<size_t>(d)];
    }
    const acc_t anchor_norm = std::max(std::sqrt(anchor_sq), acc_t(1e-8));
    for (int64_t s = 0; s < seq; ++s) {
      const scalar_t* k = keys + s * dim;
      acc_t dot = 0;
      for (int64_t d = 0; d < dim; ++d) dot += static_cast<acc_t>(k[d]) * anchor[static_cast<size_t>(d)];
      out[s] = static_cast<float>(-dot / (std::max(norms[static_cast<size_t>(s)], acc_t(1e-8)) * anchor_norm));
    }
  }
}

at::Tensor keydiff_scores_cpu(const at::Tensor& keys_in) {
  checks::check_keys("keydiff_scores", keys_in);
  const at::Tensor keys = keys_in.contiguous();
  const int64_t heads = keys.size(0) * keys.size(1), seq = keys.size(2), dim = keys.size(3);
  at::Tensor out = at::empty({keys.size(0), keys.size(1), seq}, keys.options().dtype(at::kFloat));
  float* out_ptr = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "keydiff_scores_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* k = keys.data_ptr<scalar_t>();
    at::parallel_for(0, heads, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
      KeyDiffScratch<acc_t> scratch(dim, seq);
      for (int64_t h = begin; h < end; ++h)
        keydiff_head<scalar_t, acc_t>(k + h * seq * dim, seq, dim, out_ptr + h * seq, scratch);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("keydiff_scores", &keydiff_scores_cpu); }

}  // namespace kvpress::kernels
