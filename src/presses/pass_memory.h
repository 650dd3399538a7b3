// Byte counts for the memory reports of the presses' second passes (kvzip_pass.cpp, kvgrad_pass.cpp,
// kvcompose_pass.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace kvpress::detail {

// Bytes of the defined tensors among `tensors`.
inline int64_t bytes_of(std::initializer_list<const at::Tensor*> tensors) {
  int64_t total = 0;
  for (const at::Tensor* t : tensors)
    if (t->defined()) total += static_cast<int64_t>(t->nbytes());
  return total;
}

inline int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors)
    if (t.defined()) total += static_cast<int64_t>(t.nbytes());
  return total;
}

}  // namespace kvpress::detail
