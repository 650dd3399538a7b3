// The word per CUDA device into which kernels or what they found wrong in device data the host did
// not check (PagedError, paged_launch.h); ops::check_device_errors reads, clears and raises it.
// Host code of the bridges.
#pragma once

namespace kvpress::cuda {

// The current device's word, allocated and zeroed on the current stream at its first use (an
// engine's warm-up step, before it captures a CUDA graph, allocates it).
int* device_error_word();

}  // namespace kvpress::cuda
