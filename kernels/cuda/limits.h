// Facts about the GPU that the kernels (device code) and their bridges (host code) both use.
// Torch-free and host-compilable, like every *_launch.h here.
#pragma once

#include <cstddef>

namespace kvpress::cuda {

constexpr int kWarpSize = 32;
// Dynamic plus static shared memory a block may use without the opt-in attribute.
constexpr size_t kSharedLimit = 48 * 1024;

}  // namespace kvpress::cuda
