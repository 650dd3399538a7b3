// Device code of kvpress::window_attention_mean: the reduction kernels and their launcher
// (window_attention.cuh), for the bridge (window_attention_bridge.cpp). Torch-free, so nvcc
// compiles it in seconds.
#include "rope_heads/cuda/window_attention.cuh"
