#include "kvpress/presses/composed_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "layer_slices.h"

namespace kvpress {

ComposedPress::ComposedPress(std::vector<std::shared_ptr<const BasePress>> presses) : presses_(std::move(presses)) {
  TORCH_CHECK(!presses_.empty(), "ComposedPress: presses must hold at least one press, got none");
  for (size_t i = 0; i < presses_.size(); ++i)
    TORCH_CHECK(presses_[i] != nullptr, "ComposedPress: presses[", i, "] must be a press, got nullptr");
}

double ComposedPress::compression_ratio() const {
  double kept = 1.0;
  for (const auto& p : presses_) kept *= 1.0 - p->compression_ratio();
  return 1.0 - kept;
}

KV ComposedPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "ComposedPress.compress";
  checks::check_kv(op, in.keys, in.values);
  KV kv = presses_.front()->compress(in);
  for (size_t i = 1; i < presses_.size(); ++i) {
    const KV next = presses_[i]->compress(kv_only(in, kv.keys, kv.values));
    kv = KV{next.keys, next.values, kv.kept_indices.gather(-1, next.kept_indices).contiguous()};
  }
  return kv;
}

}  // namespace kvpress
