#include "kvpress/presses/snapkv_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {

SnapKVPress::SnapKVPress(double compression_ratio, int64_t window_size, int64_t kernel_size)
    : ScorerPress(compression_ratio), window_size_(window_size), kernel_size_(kernel_size) {
  checks::check_positive("SnapKVPress", "window_size", window_size);
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1, "SnapKVPress: kernel_size must be a positive odd number, got ",
              kernel_size);
}

at::Tensor SnapKVPress::score(const LayerInputs& inputs) const {
  const at::Tensor mean_attn = ops::window_attention_mean(inputs, window_size_, "SnapKVPress");
  return ops::snapkv_scores_from_mean(mean_attn, inputs.keys.size(1), kernel_size_, window_size_);
}

}  // namespace kvpress
