// Registers every op as torch.ops.kvpress.<name>, so Python can call them after
// torch.ops.load_library("libkvpress.so"). Composite ops are registered once for all backends;
// ops with dedicated kernels declare only the schema here (kernels/cpu, kernels/cuda).
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/StringUtil.h>

#include "kernel_ops.h"
#include "kvpress/cache.h"
#include "kvpress/ops.h"
#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"

namespace kvpress {
namespace {

at::Tensor random_scores_op(const at::Tensor& keys, int64_t seed) { return ops::random_scores(keys, seed); }

at::Tensor leverage_scores_op(const at::Tensor& prerope_keys, int64_t sketch_dimension, int64_t seed) {
  return ops::leverage_scores(prerope_keys, sketch_dimension, seed);
}

// ---- registry presses on one layer (press_compress, press_compress_ragged, press_scores) -----
// Their schemas list every LayerInputs field by name (for_each_field), so Python passes any of them
// as a keyword argument; the kernels are boxed and read the arguments in the same order.

// "(str name, float compression_ratio, str[] params, Tensor keys, Tensor values, Tensor? queries=None,
// ..., int num_heads=0, ...)": the arguments shared by the three ops.
std::string press_op_arguments() {
  std::string out = "(str name, float compression_ratio, str[] params";
  const LayerInputs defaults;
  for_each_field(defaults, [&](const LayerInputField& field, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    out += ", ";
    if constexpr (std::is_same_v<T, at::Tensor>) {
      out += field.required ? std::string("Tensor ") + field.name : std::string("Tensor? ") + field.name + "=None";
    } else if constexpr (std::is_same_v<T, int64_t>) {
      out += std::string("int ") + field.name + "=" + std::to_string(value);
    } else {
      static_assert(std::is_same_v<T, double>);
      out += std::string("float ") + field.name + "=" + format_double(value);
    }
  });
  return out + ")";
}

constexpr size_t kPressOpLeadingArguments = 3;  // name, compression_ratio, params

size_t press_op_argument_count() {
  size_t fields = 0;
  const LayerInputs defaults;
  for_each_field(defaults, [&](const LayerInputField&, const auto&) { ++fields; });
  return kPressOpLeadingArguments + fields;
}

// Pops a press op's arguments off the stack: the press (built by make_press from "key=value"
// strings) and its inputs.
std::pair<std::unique_ptr<BasePress>, LayerInputs> pop_press_arguments(const char* op, torch::jit::Stack& stack) {
  const size_t count = press_op_argument_count();
  const auto args = torch::jit::last(stack, count);
  const std::string name = args[0].toStringRef();
  const double ratio = args[1].toDouble();
  std::map<std::string, std::string> params;
  for (const c10::IValue& item : args[2].toListRef()) {
    const std::string& kv = item.toStringRef();
    const auto eq = kv.find('=');
    TORCH_CHECK(eq != std::string::npos && eq > 0, op, ": params must be [\"key=value\", ...], got \"", kv, "\"");
    params[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  LayerInputs in;
  size_t i = kPressOpLeadingArguments;
  for_each_field(in, [&](const LayerInputField&, auto& member) {
    const c10::IValue& value = args[i++];
    using T = std::decay_t<decltype(member)>;
    if constexpr (std::is_same_v<T, at::Tensor>) {
      if (!value.isNone()) member = value.toTensor();
    } else if constexpr (std::is_same_v<T, int64_t>) {
      member = value.toInt();
    } else {
      member = value.toDouble();
    }
  });
  torch::jit::drop(stack, count);
  std::unique_ptr<BasePress> press = make_press(name, ratio, params);  // unknown press/parameter first
  validate_layer_inputs(in, std::string(op) + "(" + name + ")");
  return {std::move(press), std::move(in)};
}

// -> (keys [B, Hkv, n_kept, D], values, kept_indices [B, Hkv, n_kept])
void press_compress_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto [press, in] = pop_press_arguments("press_compress", *stack);
  const KV kv = press->compress(in);
  torch::jit::push(*stack, kv.keys, kv.values, kv.kept_indices);
}

// -> (keys [T, D], values [T, D], kept_indices [T], lengths [B, Hkv] int64): every head's kept tokens
// packed one head after another (HeadRaggedLayer's layout); any press, head-ragged or not.
void press_compress_ragged_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto [press, in] = pop_press_arguments("press_compress_ragged", *stack);
  const HeadRaggedLayer layer = HeadRaggedLayer::from_ragged(press->compress_ragged(in), in.keys.size(2));
  torch::jit::push(*stack, layer.packed_keys(), layer.packed_values(), layer.packed_positions(),
                   layer.lengths().to(in.keys.device()));
}

// -> scores [B, Hkv, S] of a ScorerPress
void press_scores_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto [press, in] = pop_press_arguments("press_scores", *stack);
  const auto* scorer = dynamic_cast<const ScorerPress*>(press.get());
  TORCH_CHECK(scorer != nullptr, "press_scores: press must be a ScorerPress, got ", press->name());
  torch::jit::push(*stack, scorer->score(in));
}

}  // namespace

TORCH_LIBRARY(kvpress, m) {
  m.def("n_kept(int seq_len, float compression_ratio) -> int", &ops::n_kept);
  // The registry as JSON (kvpress/registry.h): presses, kinds, inputs, parameters and defaults.
  m.def("registry_json() -> str", [] { return registry_json(); });
  // The instruction set the CPU kernels use in this process (benchmark tables record it).
  m.def("cpu_kernel_isa() -> str", &ops::cpu_kernel_isa);
  // Ops with CPU and CUDA kernels (kernels/cpu, kernels/cuda) declare only their schema; their ATen
  // composite is registered below for every other device (src/kernel_ops.h).
  m.def("topk_indices(Tensor scores, int k) -> Tensor");
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)");
  m.def("compact_kv_(Tensor(a!) keys, Tensor(b!) values, Tensor indices) -> ()");
  m.def("rotate_half(Tensor x) -> Tensor", &ops::rotate_half);
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::apply_rope);
  m.def("invert_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");  // kernels
  m.def("group_mean(Tensor per_query_head, int num_kv_heads) -> Tensor", &ops::group_mean);
  m.def("window_attention(Tensor queries, Tensor keys) -> Tensor",
        static_cast<at::Tensor (*)(const at::Tensor&, const at::Tensor&)>(&ops::window_attention));
  m.def("window_attention_mean(Tensor queries, Tensor keys) -> Tensor");  // kernels
  m.def("key_norm_scores(Tensor keys) -> Tensor");                        // kernels
  m.def("keydiff_scores(Tensor keys) -> Tensor");                         // kernels
  m.def("streaming_llm_scores(Tensor keys, int n_sink, float compression_ratio) -> Tensor", &ops::streaming_llm_scores);
  // Defaults are the C++ constants (python/.../ops.py reads them back from these schemas).
  m.def(c10::str("random_scores(Tensor keys, int seed=", ops::kUnseeded, ") -> Tensor").c_str(), &random_scores_op);
  m.def("lagkv_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor",
        &ops::lagkv_scores);
  // lagkv_scores' partition statistics for seq_len >= n_sink + 2 * lag_size (kernels).
  m.def("lagkv_partition_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor");
  m.def("snapkv_scores(Tensor window_attn, int num_kv_heads, int kernel_size) -> Tensor", &ops::snapkv_scores);
  m.def("snapkv_scores_from_mean(Tensor mean_attn, int num_kv_heads, int kernel_size, int window_size) -> Tensor",
        &ops::snapkv_scores_from_mean);
  m.def("tova_scores(Tensor last_attn, int num_kv_heads) -> Tensor", &ops::tova_scores);
  m.def("observed_attention_scores(Tensor attentions, int num_kv_heads) -> Tensor", &ops::observed_attention_scores);
  // Compactor (src/ops/compactor.cpp).
  m.def("zscore(Tensor scores) -> Tensor", &ops::zscore);
  m.def("blend_scores(Tensor[] scores, float[] weights, bool normalize=True) -> Tensor", &ops::blend_scores);
  m.def(c10::str("gaussian_sketch(int batch, int heads, int head_dim, int sketch_dimension, ScalarType dtype, ",
                 "Device device, int seed=", ops::kUnseeded, ") -> Tensor")
            .c_str(),
        &ops::gaussian_sketch);
  m.def("sketch_keys(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketch_keys);
  m.def("sketch_prerope_keys(Tensor keys, Tensor cos, Tensor sin, Tensor sketch) -> (Tensor, Tensor)");  // kernels
  m.def("cholesky_leverage(Tensor sketched, Tensor factor) -> Tensor");                                  // kernels
  m.def("ridge_leverage(Tensor sketched) -> Tensor", &ops::ridge_leverage);
  m.def("sketched_leverage(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketched_leverage);
  m.def(c10::str("leverage_scores(Tensor prerope_keys, int sketch_dimension=",
                 LeverageScorePress::kDefaultSketchDimension, ", int seed=", ops::kUnseeded, ") -> Tensor")
            .c_str(),
        &leverage_scores_op);
  m.def(c10::str(
            "noncausal_column_sums(Tensor queries, Tensor keys, int chunk_size=", NonCausalAttnPress::kDefaultChunkSize,
            ") -> Tensor")
            .c_str());  // kernels
  m.def("noncausal_attention_scores(Tensor column_sums, Tensor values) -> Tensor", &ops::noncausal_attention_scores);
  m.def("topk_mask_across_heads(Tensor scores, int n_total) -> Tensor", &ops::topk_mask_across_heads);
  // Head-ragged attention (kernels).
  m.def(
      "ragged_attention(Tensor queries, Tensor packed_keys, Tensor packed_values, Tensor offsets, "
      "Tensor tail_keys, Tensor tail_values, float? scale=None) -> Tensor");
  // Paged KV cache (kernels; kvpress/paged.h).
  m.def(
      "paged_attention(Tensor queries, Tensor key_pool, Tensor value_pool, Tensor page_table, Tensor lengths, "
      "float? scale=None) -> Tensor");
  m.def("paged_write(Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor keys, Tensor values, Tensor slots) -> ()");
  // Any registry press on one layer; params: ["window_size=32", ...]; every LayerInputs field by name.
  const std::string press_arguments = press_op_arguments();
  m.def(("press_compress" + press_arguments + " -> (Tensor, Tensor, Tensor)").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_compress_boxed>());
  m.def(("press_compress_ragged" + press_arguments + " -> (Tensor, Tensor, Tensor, Tensor)").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_compress_ragged_boxed>());
  m.def(("press_scores" + press_arguments + " -> Tensor").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_scores_boxed>());
}

// Ops with CPU/CUDA kernels: the ATen composites serve every other device, and CUDA tensors in a
// build without CUDA kernels.
TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("topk_indices", &ops::composite::topk_indices);
  m.impl("gather_kv", &ops::composite::gather_kv);
  m.impl("compact_kv_", &ops::composite::compact_kv_);
  m.impl("invert_rope", &ops::composite::invert_rope);
  m.impl("sketch_prerope_keys", &ops::composite::sketch_prerope_keys);
  m.impl("cholesky_leverage", &ops::composite::cholesky_leverage);
  m.impl("noncausal_column_sums", &ops::composite::noncausal_column_sums);
  m.impl("key_norm_scores", &ops::composite::key_norm_scores);
  m.impl("keydiff_scores", &ops::composite::keydiff_scores);
  m.impl("window_attention_mean", &ops::composite::window_attention_mean);
  m.impl("lagkv_partition_scores", &ops::composite::lagkv_partition_scores);
  m.impl("ragged_attention", &ops::composite::ragged_attention);
  m.impl("paged_attention", &ops::composite::paged_attention);
  m.impl("paged_write", &ops::composite::paged_write);
}

}  // namespace kvpress
