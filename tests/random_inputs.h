// Random LayerInputs holding every field a press may read, of consistent shapes (the property
// and paged-cache tests).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kvpress/types.h"

namespace kvpress::testing {

struct Shape {
  int64_t batch, kv_heads, groups, seq, head_dim;
  at::ScalarType dtype;
  bool strided;
  double ratio;
};

inline std::string describe(const Shape& s) {
  return "B=" + std::to_string(s.batch) + " Hkv=" + std::to_string(s.kv_heads) + " G=" + std::to_string(s.groups) +
         " S=" + std::to_string(s.seq) + " D=" + std::to_string(s.head_dim) + " " + c10::toString(s.dtype) +
         (s.strided ? " strided" : "") + " ratio=" + std::to_string(s.ratio);
}

// Every LayerInputs field a press may read, of consistent shapes; keys and values in s.dtype, as
// strided views when s.strided.
inline LayerInputs random_inputs(const Shape& s, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t heads = s.kv_heads * s.groups, hidden = 32;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto cache_tensor = [&] {
    // A strided view: [B, S, Hkv, D] memory seen as [B, Hkv, S, D].
    if (s.strided) return at::randn({s.batch, s.seq, s.kv_heads, s.head_dim}, f32).to(s.dtype).transpose(1, 2);
    return at::randn({s.batch, s.kv_heads, s.seq, s.head_dim}, f32).to(s.dtype);
  };
  LayerInputs in;
  in.keys = cache_tensor();
  in.values = cache_tensor();
  in.queries = at::randn({s.batch, heads, s.seq, s.head_dim}, f32).to(s.dtype);
  const at::Tensor logits =
      at::matmul(in.queries.to(at::kFloat), in.keys.to(at::kFloat).repeat_interleave(s.groups, 1).transpose(2, 3)) /
      std::sqrt(static_cast<double>(s.head_dim));
  in.attentions = at::softmax(logits.masked_fill(at::ones({s.seq, s.seq}, at::kBool).triu(1), -INFINITY), -1);
  in.hidden_states = at::randn({s.batch, s.seq, hidden}, f32);
  in.q_proj = at::randn({heads * s.head_dim, hidden}, f32) / std::sqrt(hidden);
  in.k_proj = at::randn({s.kv_heads * s.head_dim, hidden}, f32) / std::sqrt(hidden);
  in.o_proj = at::randn({hidden, heads * s.head_dim}, f32) / std::sqrt(heads * s.head_dim);
  in.inv_freq = at::pow(10000.0, -at::arange(0, s.head_dim, 2, at::kDouble) / s.head_dim).to(at::kFloat);
  const at::Tensor angles = at::outer(at::arange(s.seq, at::kFloat), in.inv_freq);
  in.cos = at::cat({angles, angles}, -1).cos();
  in.sin = at::cat({angles, angles}, -1).sin();
  in.input_ids = at::randint(0, 500, {s.batch, s.seq}, at::kLong);
  in.num_heads = heads;
  in.layer_idx = 1;
  in.num_layers = 3;
  return in;
}

}  // namespace kvpress::testing
