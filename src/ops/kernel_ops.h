// What the op families with dedicated CPU and CUDA kernels share (private): the dispatcher lookup
// and the CUDA device-error hook. Each family's argument checks (shared by every backend, so all
// raise the same messages) and its ATen composites (the CompositeExplicitAutograd fallback for
// devices without a kernel and builds without CUDA kernels, and the tests' reference) are in
// src/ops/<family>/<family>.h.
//
// The dispatch rule: the public function in kvpress/ops.h calls the dispatcher (dispatcher_op
// below); the dispatcher picks the kernel registered for the tensors' device
// (TORCH_LIBRARY_IMPL(kvpress, CPU | CUDA) in src/ops/<family>/cpu and cuda), else the composite.
// No code in src/ branches on the device.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

#include "checks.h"

namespace kvpress {

// The typed dispatcher handle of kvpress::<name>, looked up once per call site:
//   static const auto op = dispatcher_op<at::Tensor(const at::Tensor&)>("kvpress::key_norm_scores");
//   return op.call(keys);
template <typename Signature>
c10::TypedOperatorHandle<Signature> dispatcher_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

// Reads and clears the record of bad device data of CUDA device `index` (ops::check_device_errors)
// and raises what it names. The CUDA kernels' host part (src/ops/cuda/device_errors.cpp) registers
// it when the library is built with them.
using DeviceErrorCheck = void (*)(c10::DeviceIndex index);
void register_cuda_device_error_check(DeviceErrorCheck check);

}  // namespace kvpress
