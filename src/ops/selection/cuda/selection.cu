// Device code of kvpress::topk_indices and kvpress::gather_kv: the kernels and their launchers
// (selection.cuh), for the bridge (selection_bridge.cpp). Torch-free, so nvcc compiles it in seconds.
#include "selection/cuda/selection.cuh"
