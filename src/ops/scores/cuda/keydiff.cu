// Device code of kvpress::keydiff_scores: the kernels and their launcher (keydiff.cuh),
// instantiated for the bridge (keydiff_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "scores/cuda/keydiff.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T) \
  template cudaError_t launch_keydiff_scores<T>(const T*, int64_t, int64_t, int, float*, float*, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
