// Device code of kvpress::invert_rope: the kernel and its launcher (invert_rope.cuh), instantiated
// for the bridge (invert_rope_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "rope_heads/cuda/invert_rope.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T) \
  template cudaError_t launch_invert_rope<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
