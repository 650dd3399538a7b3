// The one place that decides which register-tile kernels run (vector_clones.h).
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "checks.h"
#include "cpu/vector_clones.h"
#include "kvpress/ops.h"

namespace kvpress::kernels {
namespace {

// What the CPU offers, by the tests gcc's target_clones resolver makes (KVPRESS_VECTOR_CLONES
// picks its clone by them).
#if defined(__x86_64__) && defined(__GNUC__)
bool cpu_supports_avx512f() { return __builtin_cpu_supports("avx512f"); }
bool cpu_supports_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool cpu_supports_avx2() { return __builtin_cpu_supports("avx2"); }
#else
bool cpu_supports_avx512f() { return false; }
bool cpu_supports_avx2_fma() { return false; }
bool cpu_supports_avx2() { return false; }
#endif

TileIsa tile_isa_of_this_process() {
  if (!KVPRESS_HAVE_TILE_KERNELS) return TileIsa::kNone;
  const bool avx2_disabled = checks::env_flag("KVPRESS_DISABLE_AVX2", "kvpress CPU kernels");
  const bool avx512_disabled = avx2_disabled || checks::env_flag("KVPRESS_DISABLE_AVX512", "kvpress CPU kernels");
  if (!avx512_disabled && cpu_supports_avx512f()) return TileIsa::kAvx512;
  if (!avx2_disabled && cpu_supports_avx2_fma()) return TileIsa::kAvx2;
  return TileIsa::kNone;
}

// The ISA of the KVPRESS_VECTOR_CLONES loops: the clone the loader picks (none without the clones).
TileIsa clone_isa() {
  if (!KVPRESS_HAVE_VECTOR_CLONES) return TileIsa::kNone;
  if (cpu_supports_avx512f()) return TileIsa::kAvx512;
  return cpu_supports_avx2() ? TileIsa::kAvx2 : TileIsa::kNone;
}

}  // namespace

TileIsa cpu_tile_isa() {
  static const TileIsa isa = tile_isa_of_this_process();  // read once: a process runs one path
  return isa;
}

const char* tile_isa_name(TileIsa isa) {
  switch (isa) {
    case TileIsa::kAvx512: return "avx512";
    case TileIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace kvpress::kernels

namespace kvpress::ops {

std::string cpu_kernel_isa() {
  const kernels::TileIsa tiles = kernels::cpu_tile_isa(), clones = kernels::clone_isa();
  std::string name = kernels::tile_isa_name(tiles);
  if (clones != tiles) name += std::string("+") + kernels::tile_isa_name(clones) + "-clones";
  return name;
}

}  // namespace kvpress::ops
