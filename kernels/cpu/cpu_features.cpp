// The one place that decides whether the AVX-512 register-tile kernels run (vector_clones.h).
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "checks.h"
#include "cpu/vector_clones.h"
#include "kvpress/ops.h"

namespace kvpress::kernels {
namespace {

// KVPRESS_DISABLE_AVX512=1 turns the AVX-512 kernels off where the CPU has AVX-512F.
bool avx512_disabled_by_environment() { return checks::env_flag("KVPRESS_DISABLE_AVX512", "kvpress CPU kernels"); }

// What the CPU offers, by the tests gcc's target_clones resolver makes (KVPRESS_VECTOR_CLONES
// picks its clone by them).
#if defined(__x86_64__) && defined(__GNUC__)
bool cpu_supports_avx512f() { return __builtin_cpu_supports("avx512f"); }
bool cpu_supports_avx2() { return __builtin_cpu_supports("avx2"); }
#else
bool cpu_supports_avx512f() { return false; }
bool cpu_supports_avx2() { return false; }
#endif

bool avx512_kernels_run() {
  return KVPRESS_HAVE_AVX512_KERNELS && !avx512_disabled_by_environment() && cpu_supports_avx512f();
}

}  // namespace

bool cpu_has_avx512() {
  static const bool run = avx512_kernels_run();  // read once: a process runs one path
  return run;
}

}  // namespace kvpress::kernels

namespace kvpress::ops {

std::string cpu_kernel_isa() {
  if (kernels::cpu_has_avx512()) return "avx512";
  if (kernels::cpu_supports_avx512f()) return "avx512-clones";
  return kernels::cpu_supports_avx2() ? "avx2" : "baseline";
}

}  // namespace kvpress::ops
