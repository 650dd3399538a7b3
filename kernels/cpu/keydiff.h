// Fused CPU kernel behind ops::keydiff_scores (internal header).
#pragma once

#include <ATen/core/Tensor.h>

namespace kvpress::kernels {

// -cos(k_i, mean_j k_j / ||k_j||) per (batch, head, position), two passes over the keys per head,
// float32 accumulation (double for double keys). Same eps as kvpress: F.normalize 1e-12,
// cosine_similarity 1e-8 on each norm.
at::Tensor keydiff_scores_cpu(const at::Tensor& keys);  // [B, H, S, D] -> [B, H, S] float32

}  // namespace kvpress::kernels
