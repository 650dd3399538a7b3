// Device code of kvpress::noncausal_column_sums: the kernel and its launcher (noncausal.cuh),
// instantiated for the bridge (noncausal_bridge.cpp). Torch-free.
#include "compactor/cuda/noncausal.cuh"

namespace kvpress::cuda {

#define KVPRESS_INSTANTIATE(T)                                                                                       \
  template cudaError_t launch_noncausal_column_sums<T>(const T*, int64_t, int64_t, int64_t, const T*, int64_t,       \
                                                       int64_t, int64_t, float*, int64_t, int64_t, int64_t, int64_t, \
                                                       const NoncausalPlan&, cudaStream_t);
KVPRESS_INSTANTIATE(__half)
KVPRESS_INSTANTIATE(__nv_bfloat16)
#undef KVPRESS_INSTANTIATE

}  // namespace kvpress::cuda
