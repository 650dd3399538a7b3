// Host helpers of the CUDA bridges (src/ops/<family>/cuda/*_bridge.cpp, which validate, pick the stream and
// register the kernels): the dtype dispatch to CUDA element types and the launch check. Every other
// header here is torch-free: *_launch.h declare the launchers (host-compilable), *.cuh hold the
// kernels and the launchers' definitions, which only the *.cu files compile.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kvpress::cuda {

// Calls f(T{}) with T the CUDA element type of `type` (float, __half or __nv_bfloat16); any other
// dtype raises "<op>: <name> must be float32, float16 or bfloat16, got <type>".
template <typename F>
void dispatch_float_types(c10::ScalarType type, const char* op, const char* name, F&& f) {
  switch (type) {
    case c10::ScalarType::Float: f(float{}); break;
    case c10::ScalarType::Half: f(__half{}); break;
    case c10::ScalarType::BFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16, got ", type);
  }
}

// Raises when a launcher (or cudaGetLastError after a launch) reports an error.
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace kvpress::cuda
