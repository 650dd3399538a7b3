// What kvpress/model_view.h defines beside its interfaces.
#include "kvpress/model_view.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "kvpress/presses/base_press.h"

namespace kvpress {
namespace {

// The compressing prefill of a second pass: each layer keeps the selection made for it.
class SelectedTokensPress : public BasePress {
 public:
  SelectedTokensPress(const BasePress& press, std::vector<at::Tensor> masks)
      : press_(press), masks_(std::move(masks)) {}
  std::string name() const override { return press_.name(); }
  double compression_ratio() const override { return press_.compression_ratio(); }
  bool head_ragged() const override { return true; }
  KV compress(const LayerInputs&) const override { refuse_uniform_compress(); }
  at::Tensor keep_mask(const LayerInputs& inputs) const override {
    TORCH_CHECK(inputs.layer_idx >= 0 && inputs.layer_idx < static_cast<int64_t>(masks_.size()), name(),
                ": the selection covers ", masks_.size(), " layers, got layer_idx ", inputs.layer_idx);
    return masks_[static_cast<size_t>(inputs.layer_idx)].to(inputs.keys.device());
  }

 private:
  const BasePress& press_;
  std::vector<at::Tensor> masks_;  // per layer [B, Hkv, N] bool
};

}  // namespace

std::unique_ptr<BasePress> selected_tokens_press(const BasePress& press, std::vector<at::Tensor> masks) {
  return std::make_unique<SelectedTokensPress>(press, std::move(masks));
}

}  // namespace kvpress
