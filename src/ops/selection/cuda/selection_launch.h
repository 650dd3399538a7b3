// Launchers of the selection kernels (selection.cuh), as the host bridge sees them. Torch-free and
// host-compilable; selection.cu defines them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

// One block per row of `scores` [rows, seq] float32: out [rows, k] gets each row's kept positions in
// ascending order; *not_finite (zeroed by the caller) is set when a row holds NaN or Inf.
cudaError_t launch_topk_rows(const float* scores, int64_t rows, int64_t seq, int64_t k, int64_t* out, int* not_finite,
                             cudaStream_t stream);

// keys_out/values_out [rows, n, row_bytes] get the rows `indices` [rows, n] of keys/values
// [rows, seq, row_bytes]; *bad (zeroed by the caller) is set for an index outside [0, seq).
cudaError_t launch_gather_rows(const void* keys, const void* values, const int64_t* indices, int64_t rows, int64_t seq,
                               int64_t n, int64_t row_bytes, void* keys_out, void* values_out, int* bad,
                               cudaStream_t stream);

}  // namespace kvpress::cuda
