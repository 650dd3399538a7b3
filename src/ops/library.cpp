// The op library torch.ops.kvpress (Python loads it with torch.ops.load_library("libkvpress.so")):
// its root, and the ops of no family. Each op family registers its own schemas and ATen composites
// beside its code (src/ops/<family>/<family>.cpp, TORCH_LIBRARY_FRAGMENT), its CPU and CUDA kernels
// in its cpu/ and cuda/ folders; the press-level ops live above the presses
// (src/bindings/press_ops.cpp).
#include <torch/library.h>

#include "kvpress/ops.h"

namespace kvpress {

TORCH_LIBRARY(kvpress, m) {
  // The instruction set the CPU kernels use in this process (benchmark tables record it).
  m.def("cpu_kernel_isa() -> str", &ops::cpu_kernel_isa);
}

}  // namespace kvpress
