// Registers every op as torch.ops.kvpress.<name>, so Python can call them after
// torch.ops.load_library("libkvpress.so"). Composite ops are registered once for all backends;
// ops with dedicated kernels declare only the schema here (kernels/cpu, kernels/cuda).
#include <torch/library.h>

#include <tuple>

#include "kvpress/ops.h"

namespace kvpress {
namespace {

std::tuple<at::Tensor, at::Tensor> gather_kv_op(const at::Tensor& keys, const at::Tensor& values,
                                                const at::Tensor& indices) {
  KV kv = ops::gather_kv(keys, values, indices);
  return {kv.keys, kv.values};
}

at::Tensor random_scores_op(const at::Tensor& keys, int64_t seed) { return ops::random_scores(keys, seed); }

at::Tensor leverage_scores_op(const at::Tensor& prerope_keys, int64_t sketch_dimension, int64_t seed) {
  return ops::leverage_scores(prerope_keys, sketch_dimension, seed);
}

at::Tensor noncausal_column_sums_op(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size) {
  return ops::noncausal_column_sums(queries, keys, chunk_size);
}

}  // namespace

TORCH_LIBRARY(kvpress, m) {
  m.def("n_kept(int seq_len, float compression_ratio) -> int", &ops::n_kept);
  m.def("topk_indices(Tensor scores, int k) -> Tensor", &ops::topk_indices);
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)", &gather_kv_op);
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::apply_rope);
  m.def("invert_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::invert_rope);
  m.def("group_mean(Tensor per_query_head, int num_kv_heads) -> Tensor", &ops::group_mean);
  m.def("window_attention(Tensor queries, Tensor keys) -> Tensor", &ops::window_attention);
  m.def("key_norm_scores(Tensor keys) -> Tensor");  // kernels/cpu/key_norm.cpp, kernels/cuda/key_norm.cu
  m.def("keydiff_scores(Tensor keys) -> Tensor", &ops::keydiff_scores);
  m.def("streaming_llm_scores(Tensor keys, int n_sink, float compression_ratio) -> Tensor",
        &ops::streaming_llm_scores);
  m.def("random_scores(Tensor keys, int seed=-1) -> Tensor", &random_scores_op);
  m.def("lagkv_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor",
        &ops::lagkv_scores);
  m.def("snapkv_scores(Tensor window_attn, int num_kv_heads, int kernel_size) -> Tensor", &ops::snapkv_scores);
  m.def("tova_scores(Tensor last_attn, int num_kv_heads) -> Tensor", &ops::tova_scores);
  m.def("observed_attention_scores(Tensor attentions, int num_kv_heads) -> Tensor",
        &ops::observed_attention_scores);
  // Compactor (src/ops/compactor.cpp).
  m.def("zscore(Tensor scores) -> Tensor", &ops::zscore);
  m.def("blend_scores(Tensor[] scores, float[] weights, bool normalize=True) -> Tensor", &ops::blend_scores);
  m.def("gaussian_sketch(int batch, int heads, int head_dim, int sketch_dimension, ScalarType dtype, Device device, "
        "int seed=-1) -> Tensor",
        &ops::gaussian_sketch);
  m.def("sketch_keys(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketch_keys);
  m.def("ridge_leverage(Tensor sketched) -> Tensor", &ops::ridge_leverage);
  m.def("sketched_leverage(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketched_leverage);
  m.def("leverage_scores(Tensor prerope_keys, int sketch_dimension=48, int seed=-1) -> Tensor", &leverage_scores_op);
  m.def("noncausal_column_sums(Tensor queries, Tensor keys, int chunk_size=256) -> Tensor", &noncausal_column_sums_op);
  m.def("noncausal_attention_scores(Tensor column_sums, Tensor values) -> Tensor", &ops::noncausal_attention_scores);
  m.def("topk_mask_across_heads(Tensor scores, int n_total) -> Tensor", &ops::topk_mask_across_heads);
}

}  // namespace kvpress
