#include "kvpress/presses/qfilter_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/io/safetensors.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

void check_filters(const char* op, const at::Tensor& f) {
  TORCH_CHECK(f.dim() == 3, op, ": q_filters must be [num_layers, num_kv_heads, head_dim], got ", checks::shape_str(f));
  TORCH_CHECK(at::isFloatingType(f.scalar_type()), op, ": q_filters must be floating point, got ", f.scalar_type());
}

}  // namespace

QFilterPress::QFilterPress(double compression_ratio, const Params& params)
    : QFilterPress(compression_ratio, params.q_filters.empty() ? at::Tensor() : load_filters(params.q_filters)) {}

QFilterPress::QFilterPress(double compression_ratio, at::Tensor q_filters) : ScorerPress(compression_ratio) {
  if (q_filters.defined()) {
    check_filters("QFilterPress", q_filters);
    q_filters_ = q_filters.to(at::kFloat).contiguous();
  }
}

at::Tensor QFilterPress::load_filters(const std::string& path) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  const std::string where = "QFilterPress: " + path;
  const at::Tensor& filters = io::required_tensor(file, kTensorName, where);
  check_filters(where.c_str(), filters);
  return filters.to(at::kFloat).contiguous();
}

at::Tensor QFilterPress::score(const LayerInputs& in) const {
  constexpr const char* op = "QFilterPress.score";
  checks::check_kv(op, in.keys, in.values);
  TORCH_CHECK(q_filters_.defined(), op, ": no Q-filters: give q_filters=PATH, a safetensors file with '", kTensorName,
              "' [num_layers, num_kv_heads, head_dim] (scripts/make_artifact.py qfilters writes one for a model)");
  const int64_t layers = q_filters_.size(0), kv_heads = head_exchange::layer_kv_heads(in), head_dim = in.keys.size(3);
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the filters' layers), got ", in.layer_idx);
  TORCH_CHECK(q_filters_.size(1) == kv_heads && q_filters_.size(2) == head_dim, op, ": q_filters must be [", layers,
              ", ", kv_heads, ", ", head_dim, "] to match keys ", checks::shape_str(in.keys), ", got ",
              checks::shape_str(q_filters_));
  // [B, Hkv, S, D] @ [Hkv, D, 1] -> [B, Hkv, S]
  const at::Tensor filters =
      head_exchange::own_rows(op, "q_filters", q_filters_[in.layer_idx], 0, in).to(in.keys.device()).unsqueeze(-1);
  return at::matmul(in.keys.to(at::kFloat), filters).squeeze(-1).neg_();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"QFilterPress",
                    PressKind::kScorer,
                    "Q-Filters: -(filter · k), one filter per layer and KV head from a local file",
                    {{}, {}, {"layer_idx"}, "the filters come from the file named by q_filters"},
                    from_params<QFilterPress>};
});

}  // namespace

}  // namespace kvpress
