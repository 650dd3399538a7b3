// Launcher of the window-attention reduction kernels (window_attention.cuh), as the host bridge
// sees it. Torch-free and host-compilable; window_attention.cu defines it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

// The two kernels over one KV head's float32 logits [group * window, seq] (group query heads of
// `window` rows each): row h of `out` (stride out_row_stride) gets query head h's mean over its
// window rows of the causal softmax, for the seq - window columns before the window.
cudaError_t launch_window_mean(const float* logits, int64_t group, int64_t seq, int64_t window, float* row_max,
                               float* row_inv_sum, float* out, int64_t out_row_stride, cudaStream_t stream);

}  // namespace kvpress::cuda
