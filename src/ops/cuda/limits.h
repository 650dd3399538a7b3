// Facts about the GPU that the kernels (device code) and their bridges (host code) both use.
// Torch-free and host-compilable, like every *_launch.h here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvpress::cuda {

constexpr int kWarpSize = 32;
// Dynamic plus static shared memory a block may use without the opt-in attribute.
constexpr size_t kSharedLimit = 48 * 1024;

// Shared-memory layouts of the tensor-core kernels (noncausal column sums, the fused pre-RoPE
// sketch): each region starts on a 128-byte boundary; rows of 16-bit elements are padded by 8
// elements and float rows by 4, so rows stay 16-byte multiples, wmma tiles 32-byte aligned, and
// consecutive rows start in different banks.
constexpr size_t kSharedRegionAlign = 128;
constexpr int64_t kHalfRowPad = 8, kFloatRowPad = 4;
inline size_t shared_region_bytes(size_t bytes) {
  return (bytes + kSharedRegionAlign - 1) / kSharedRegionAlign * kSharedRegionAlign;
}

}  // namespace kvpress::cuda
