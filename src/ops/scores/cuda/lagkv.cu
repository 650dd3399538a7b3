// Device code of kvpress::lagkv_partition_scores: the kernel and its launcher (lagkv.cuh),
// instantiated for the bridge (lagkv_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "scores/cuda/lagkv.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T)                                                                                  \
  template cudaError_t launch_lagkv_partition_scores<T>(const T*, const T*, int64_t, int64_t, int64_t, int64_t, \
                                                        int64_t, bool, int64_t, float*, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
