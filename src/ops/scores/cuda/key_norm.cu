// Device code of kvpress::key_norm_scores: the kernel and its launcher (key_norm.cuh), instantiated
// for the bridge (key_norm_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "scores/cuda/key_norm.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T) \
  template cudaError_t launch_key_norm_scores<T>(const T*, float*, int64_t, int64_t, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
