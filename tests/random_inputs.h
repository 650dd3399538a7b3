// Random LayerInputs holding every field a press may read, of consistent shapes (the press,
// property, concurrency and paged-cache tests).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kvpress/types.h"
#include "test_util.h"

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

// The last positions of a random layer that play a user question (LayerInputs::question_length;
// only a query-aware press, FinchPress, reads it): 8, fewer in a shorter layer, none in one token.
inline int64_t question_length(int64_t seq) { return std::min<int64_t>(8, seq - 1); }

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
  in.question_length = question_length(s.seq);
  return in;
}

// One float32 layer, batch 1: keys, values and queries of every position, their causal attention
// (softmax(q k^T), no 1/sqrt(D)), RoPE tables, an output projection and hidden states [1, S, 32]; with_input_ids adds
// token ids (QSMPress/CTRPress's token text); question_length(seq).
inline LayerInputs random_layer(int64_t seq, uint64_t seed, int64_t heads = 8, int64_t kv_heads = 2, int64_t d = 16,
                                bool with_input_ids = false) {
  LayerInputs in;
  in.keys = randn({1, kv_heads, seq, d}, seed);
  in.values = randn({1, kv_heads, seq, d}, seed + 1);
  in.queries = randn({1, heads, seq, d}, seed + 2);
  const at::Tensor logits = at::matmul(in.queries, in.keys.repeat_interleave(heads / kv_heads, 1).transpose(2, 3));
  in.attentions = at::softmax(logits.masked_fill(at::ones({seq, seq}, at::kBool).triu(1), -INFINITY), -1);
  // RoPE tables (pre-RoPE keys for LeverageScorePress / CompactorPress).
  const at::Tensor inv_freq = at::pow(10000.0, -at::arange(0, d, 2, at::kDouble) / d);
  const at::Tensor angles = at::outer(at::arange(seq, at::kDouble), inv_freq);
  in.cos = at::cat({angles, angles}, -1).cos().to(at::kFloat);
  in.sin = at::cat({angles, angles}, -1).sin().to(at::kFloat);
  in.o_proj = randn({64, heads * d}, seed + 3) * 0.1;  // output projection (CriticalKVPress, CriticalAdaKVPress)
  in.hidden_states = randn({1, seq, 32}, seed + 5);    // without q_proj: only KVzapPress reads them
  in.question_length = question_length(seq);
  if (with_input_ids) {
    at::manual_seed(seed + 4);
    in.input_ids = at::randint(0, 64, {1, seq}, at::kLong);
  }
  return in;
}

}  // namespace kvpress::testing
