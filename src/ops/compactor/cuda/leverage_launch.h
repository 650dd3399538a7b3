// Launcher of the leverage kernel of kvpress::cholesky_leverage (leverage.cuh), as the host bridge
// sees it, with the limits both sides share. Torch-free and host-compilable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvpress::cuda {

constexpr int kLeverageRows = 64;             // sketched rows per block, one thread each
constexpr int64_t kLeverageMaxSketch = 64;    // larger sketches take the ATen composite
constexpr int64_t kLeverageMaxUnits = 65535;  // B * H, gridDim.y

// Dynamic shared memory of one block: L⁻¹ [k, k] and the block's rows [kLeverageRows, k + 1]
// (padded against bank conflicts). 33 KiB at k = 64.
inline size_t leverage_shared_bytes(int64_t k) {
  return static_cast<size_t>(k * k + kLeverageRows * (k + 1)) * sizeof(float);
}

// out[u, i] = ||inverse[u] · sketched[u, i]||² for every unit u = (b, h) and row i.
// cudaErrorInvalidValue when k > kLeverageMaxSketch or units > kLeverageMaxUnits.
cudaError_t launch_cholesky_leverage(const float* sketched,  // [units, seq, k] contiguous
                                     const float* inverse,   // [units, k, k] lower triangular (L⁻¹)
                                     float* out,             // [units, seq]
                                     int64_t units, int64_t seq, int64_t k, cudaStream_t stream);

}  // namespace kvpress::cuda
