// Device code of kvpress::paged_attention, paged_attention_quantized and paged_write: the kernels and their
// launchers (paged.cuh), instantiated for the bridge (paged_bridge.cpp). Torch-free, so nvcc
// compiles it in seconds.
#include "paged/cuda/paged.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T)                                                                                      \
  template cudaError_t launch_paged_attention<T>(const T*, const T*, const T*, const int64_t*, const int64_t*, T*,  \
                                                 float*, int*, const PagedAttentionShape&, cudaStream_t);           \
  template cudaError_t launch_paged_attention_quantized<T>(const T*, const kernels::QuantizedPagePools<T>&,         \
                                                           const int64_t*, const int64_t*, T*, float*, int*,        \
                                                           const PagedAttentionShape&, cudaStream_t);               \
  template cudaError_t launch_paged_write<T>(T*, T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, \
                                             int*, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
