// Device code of kvpress::cholesky_leverage: the kernel and its launcher (leverage.cuh), compiled
// for the bridge (leverage_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "compactor/cuda/leverage.cuh"
