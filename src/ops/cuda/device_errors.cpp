// The CUDA devices' records of bad device data (device_errors.h) and ops::check_device_errors'
// CUDA part, registered with the library at load.
#include "cuda/device_errors.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <string>
#include <vector>

#include "kernel_ops.h"
#include "paged/cuda/paged_launch.h"

namespace kvpress::cuda {
namespace {

// One int32 tensor per device, made at the device's first use; never freed (not even at exit, when
// the CUDA runtime may already be gone), so a captured graph keeps a valid pointer.
at::Tensor& word_of(c10::DeviceIndex index) {
  static std::mutex mutex;
  static auto* words = new std::vector<at::Tensor>(static_cast<size_t>(c10::cuda::device_count()));
  const std::lock_guard<std::mutex> lock(mutex);
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < words->size(), "check_device_errors: device must be a CUDA ",
              "device in [0, ", words->size(), "), got ", static_cast<int>(index));
  at::Tensor& word = (*words)[static_cast<size_t>(index)];
  if (!word.defined()) word = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, index));
  return word;
}

void check_and_clear(c10::DeviceIndex index) {
  if (index < 0) index = c10::cuda::current_device();
  const c10::cuda::CUDAGuard guard(index);
  at::Tensor& word = word_of(index);
  const int bits = word.item<int>();
  if (bits == 0) return;
  word.zero_();
  std::string what;
  const auto add = [&](int bit, const char* text) {
    if (bits & bit) what += std::string(what.empty() ? "" : "; ") + text;
  };
  add(kPagedBadLength,
      "paged_attention (paged_attention_quantized) got lengths outside [n, max_pages * page_size] ([n, (max_pages + 1) "
      "* page_size - 1]) (those heads' outputs are NaN)");
  add(kPagedBadPage,
      "paged_attention (paged_attention_quantized) got used page_table entries outside [0, num_pages) (those heads' "
      "outputs are NaN)");
  add(kPagedBadSlot, "paged_write got slots outside [0, num_pages * page_size) (those rows were not written)");
  add(kPagedBadResidual,
      "paged_attention_quantized got residual_slots outside [0, residual rows) (those batch rows' outputs are NaN)");
  TORCH_CHECK(false, "check_device_errors: the CUDA kernels on device ", static_cast<int>(index),
              " found bad device data since the last check: ", what,
              ". Turn on device argument checks (kvpress::ops::set_device_argument_checks(true) or "
              "KVPRESS_CHECK_DEVICE_ARGUMENTS=1) to have each call check its arguments on the host and name the head.");
}

const bool registered = [] {
  register_cuda_device_error_check(&check_and_clear);
  return true;
}();

}  // namespace

int* device_error_word() { return word_of(c10::cuda::current_device()).data_ptr<int>(); }

}  // namespace kvpress::cuda
