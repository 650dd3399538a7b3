// run_per_isa<Body>(args...): a hot loop compiled once per ISA from one template and run for the ISA
// cpu_tile_isa() names (vector_clones.h): Body::run<vec16::Vec>(args...) inside an AVX-512
// function, Body::run<vec16::Vec8>(args...) inside an AVX2 + FMA one (8-float vectors: gcc keeps
// 16-float vectors that are not one machine register in memory and compares them lane by lane), and
// Body::run<vec16::Vec> for the baseline x86-64 elsewhere. Body::run must be KVPRESS_VEC_INLINE, so
// that it is compiled inside the ISA's function. Unlike KVPRESS_VECTOR_CLONES (gcc's
// target_clones, whose "avx2" clone has no FMA) the choice follows the environment's caps
// (KVPRESS_DISABLE_AVX512, KVPRESS_DISABLE_AVX2), so the tests and benchmarks reach every path.
// Include it only in kernel .cpp files (vec16.h).
#pragma once

#include "cpu/vec16.h"
#include "cpu/vector_clones.h"

namespace kvpress::kernels {
namespace per_isa_detail {
template <class Body, class... Args>
KVPRESS_AVX512_KERNEL auto run_avx512(Args... args) {
  return Body::template run<vec16::Vec>(args...);
}
template <class Body, class... Args>
KVPRESS_AVX2_KERNEL auto run_avx2(Args... args) {
  return Body::template run<vec16::Vec8>(args...);
}
}  // namespace per_isa_detail

template <class Body, class... Args>
auto run_per_isa(Args... args) {
#if KVPRESS_HAVE_TILE_KERNELS
  switch (cpu_tile_isa()) {
    case TileIsa::kAvx512: return per_isa_detail::run_avx512<Body>(args...);
    case TileIsa::kAvx2: return per_isa_detail::run_avx2<Body>(args...);
    case TileIsa::kNone: break;
  }
#endif
  return Body::template run<vec16::Vec>(args...);
}
}  // namespace kvpress::kernels
