// Device code of kvpress::sketch_prerope_keys' centring: the kernels and their launchers
// (prerope.cuh), instantiated for the bridge (prerope_bridge.cpp). Torch-free.
#include "compactor/cuda/prerope.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T)                                                                                        \
  template cudaError_t launch_prerope_column_means<T>(const T*, int64_t, const float*, const float*, float*, int64_t, \
                                                      int64_t, int64_t, cudaStream_t);                                \
  template cudaError_t launch_prerope_centred<T>(const T*, int64_t, const float*, const float*, const float*, T*,     \
                                                 int64_t, int64_t, int64_t, cudaStream_t);
KVPRESS_INSTANTIATE(float)
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

// The fused sketch runs on the tensor cores: half and bfloat16 only.
#define KVPRESS_INSTANTIATE(T)                                                                                         \
  template cudaError_t launch_prerope_sketch<T>(const T*, int64_t, const float*, const float*, const float*, const T*, \
                                                int64_t, float*, int64_t, int64_t, int64_t, int64_t,                   \
                                                const PreropeSketchPlan&, cudaStream_t);
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
