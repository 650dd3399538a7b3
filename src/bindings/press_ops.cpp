// The presses as ops (torch.ops.kvpress.press_compress, press_compress_ragged, press_scores) and the
// registry as JSON: bindings above the presses and the registry, which the op families below them
// do not see.
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"

namespace kvpress {
namespace {

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

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  // The registry as JSON (kvpress/registry.h): presses, kinds, inputs, parameters and defaults.
  m.def("registry_json() -> str", [] { return registry_json(); });
  // Any registry press on one layer; params: ["window_size=32", ...]; every LayerInputs field by name.
  const std::string press_arguments = press_op_arguments();
  m.def(("press_compress" + press_arguments + " -> (Tensor, Tensor, Tensor)").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_compress_boxed>());
  m.def(("press_compress_ragged" + press_arguments + " -> (Tensor, Tensor, Tensor, Tensor)").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_compress_ragged_boxed>());
  m.def(("press_scores" + press_arguments + " -> Tensor").c_str(),
        torch::CppFunction::makeFromBoxedFunction<&press_scores_boxed>());
}

}  // namespace kvpress
