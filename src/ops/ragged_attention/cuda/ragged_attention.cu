// Device code of kvpress::ragged_attention: the kernel and its launcher (ragged_attention.cuh),
// instantiated for the bridge (ragged_attention_bridge.cpp). Torch-free, so nvcc compiles it in
// seconds.
#include "ragged_attention/cuda/ragged_attention.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T)                                                                                      \
  template cudaError_t launch_ragged_attention<T>(const T*, const T*, const T*, const int64_t*, const T*, const T*, \
                                                  T*, float*, const RaggedAttentionShape&, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
