// Registers every op as torch.ops.kvpress.<name>, so Python can call them after
// torch.ops.load_library("libkvpress.so"). Composite ops are registered once for all backends;
// ops with dedicated kernels declare only the schema here (kernels/cpu, kernels/cuda).
#include <torch/library.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "kernel_ops.h"

namespace kvpress {
namespace {

at::Tensor random_scores_op(const at::Tensor& keys, int64_t seed) { return ops::random_scores(keys, seed); }

at::Tensor leverage_scores_op(const at::Tensor& prerope_keys, int64_t sketch_dimension, int64_t seed) {
  return ops::leverage_scores(prerope_keys, sketch_dimension, seed);
}

at::Tensor noncausal_column_sums_op(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size) {
  return ops::noncausal_column_sums(queries, keys, chunk_size);
}

// press_scores / press_compress: run a registry press on one layer from Python (used by
// benchmarks/compare_kvpress.py). params are "key=value" strings, as kvpress-cli's --param.
LayerInputs press_inputs(const at::Tensor& keys, const at::Tensor& values, const c10::optional<at::Tensor>& queries,
                         const c10::optional<at::Tensor>& attentions, const c10::optional<at::Tensor>& hidden_states,
                         const c10::optional<at::Tensor>& q_proj, const c10::optional<at::Tensor>& k_proj,
                         const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, int64_t num_heads) {
  LayerInputs in;
  in.keys = keys;
  in.values = values;
  in.queries = queries.value_or(at::Tensor());
  in.attentions = attentions.value_or(at::Tensor());
  in.hidden_states = hidden_states.value_or(at::Tensor());
  in.q_proj = q_proj.value_or(at::Tensor());
  in.k_proj = k_proj.value_or(at::Tensor());
  in.cos = cos.value_or(at::Tensor());
  in.sin = sin.value_or(at::Tensor());
  in.num_heads = num_heads;
  return in;
}

std::unique_ptr<BasePress> press_from(const std::string& name, double ratio, const std::vector<std::string>& params) {
  std::map<std::string, std::string> values;
  for (const auto& kv : params) {
    const auto eq = kv.find('=');
    TORCH_CHECK(eq != std::string::npos && eq > 0, "press_compress: params must be [\"key=value\", ...], got \"", kv,
                "\"");
    values[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return make_press(name, ratio, values);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> press_compress_op(
    const std::string& name, double ratio, const std::vector<std::string>& params, const at::Tensor& keys,
    const at::Tensor& values, const c10::optional<at::Tensor>& queries, const c10::optional<at::Tensor>& attentions,
    const c10::optional<at::Tensor>& hidden_states, const c10::optional<at::Tensor>& q_proj,
    const c10::optional<at::Tensor>& k_proj, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
    int64_t num_heads) {
  KV kv = press_from(name, ratio, params)
              ->compress(press_inputs(keys, values, queries, attentions, hidden_states, q_proj, k_proj, cos, sin,
                                      num_heads));
  return {kv.keys, kv.values, kv.kept_indices};
}

at::Tensor press_scores_op(const std::string& name, double ratio, const std::vector<std::string>& params,
                           const at::Tensor& keys, const at::Tensor& values, const c10::optional<at::Tensor>& queries,
                           const c10::optional<at::Tensor>& attentions, const c10::optional<at::Tensor>& hidden_states,
                           const c10::optional<at::Tensor>& q_proj, const c10::optional<at::Tensor>& k_proj,
                           const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                           int64_t num_heads) {
  auto press = press_from(name, ratio, params);
  const auto* scorer = dynamic_cast<const ScorerPress*>(press.get());
  TORCH_CHECK(scorer != nullptr, "press_scores: press must be a ScorerPress, got ", name);
  return scorer->score(
      press_inputs(keys, values, queries, attentions, hidden_states, q_proj, k_proj, cos, sin, num_heads));
}

}  // namespace

TORCH_LIBRARY(kvpress, m) {
  m.def("n_kept(int seq_len, float compression_ratio) -> int", &ops::n_kept);
  // Ops with CPU and CUDA kernels (kernels/cpu, kernels/cuda) declare only their schema; their ATen
  // composite is registered below for every other device (src/kernel_ops.h).
  m.def("topk_indices(Tensor scores, int k) -> Tensor");
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)");
  m.def("rotate_half(Tensor x) -> Tensor", &ops::rotate_half);
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::apply_rope);
  m.def("invert_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::invert_rope);
  m.def("group_mean(Tensor per_query_head, int num_kv_heads) -> Tensor", &ops::group_mean);
  m.def("window_attention(Tensor queries, Tensor keys) -> Tensor", &ops::window_attention);
  m.def("window_attention_mean(Tensor queries, Tensor keys) -> Tensor");  // kernels
  m.def("key_norm_scores(Tensor keys) -> Tensor");                          // kernels
  m.def("keydiff_scores(Tensor keys) -> Tensor");                           // kernels
  m.def("streaming_llm_scores(Tensor keys, int n_sink, float compression_ratio) -> Tensor",
        &ops::streaming_llm_scores);
  m.def("random_scores(Tensor keys, int seed=-1) -> Tensor", &random_scores_op);
  m.def("lagkv_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor",
        &ops::lagkv_scores);
  // lagkv_scores' partition statistics for seq_len >= n_sink + 2 * lag_size (kernels).
  m.def("lagkv_partition_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor");
  m.def("snapkv_scores(Tensor window_attn, int num_kv_heads, int kernel_size) -> Tensor", &ops::snapkv_scores);
  m.def("snapkv_scores_from_mean(Tensor mean_attn, int num_kv_heads, int kernel_size, int window_size) -> Tensor",
        &ops::snapkv_scores_from_mean);
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
  // Head-ragged attention (kernels).
  m.def("ragged_attention(Tensor queries, Tensor packed_keys, Tensor packed_values, Tensor offsets, "
        "Tensor tail_keys, Tensor tail_values, float? scale=None) -> Tensor");
  // Any registry press on one layer (benchmarks/compare_kvpress.py); params: ["window_size=32", ...].
  m.def("press_compress(str name, float compression_ratio, str[] params, Tensor keys, Tensor values, "
        "Tensor? queries=None, Tensor? attentions=None, Tensor? hidden_states=None, Tensor? q_proj=None, "
        "Tensor? k_proj=None, Tensor? cos=None, Tensor? sin=None, int num_heads=0) -> (Tensor, Tensor, Tensor)",
        &press_compress_op);
  m.def("press_scores(str name, float compression_ratio, str[] params, Tensor keys, Tensor values, "
        "Tensor? queries=None, Tensor? attentions=None, Tensor? hidden_states=None, Tensor? q_proj=None, "
        "Tensor? k_proj=None, Tensor? cos=None, Tensor? sin=None, int num_heads=0) -> Tensor",
        &press_scores_op);
}

// Ops with CPU/CUDA kernels: the ATen composites serve every other device, and CUDA tensors in a
// build without CUDA kernels.
TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("topk_indices", &ops::composite::topk_indices);
  m.impl("gather_kv", &ops::composite::gather_kv);
  m.impl("key_norm_scores", &ops::composite::key_norm_scores);
  m.impl("keydiff_scores", &ops::composite::keydiff_scores);
  m.impl("window_attention_mean", &ops::composite::window_attention_mean);
  m.impl("lagkv_partition_scores", &ops::composite::lagkv_partition_scores);
  m.impl("ragged_attention", &ops::composite::ragged_attention);
}

}  // namespace kvpress
