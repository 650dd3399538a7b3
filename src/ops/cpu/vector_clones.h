// KVPRESS_VECTOR_CLONES: compile a hot loop for AVX-512, AVX2 and the baseline x86-64, chosen at load
// time (gcc's target_clones; the library itself is built for the baseline). Put it on plain
// (non-template, non-inline) functions defined in one .cpp file.
//
// Not under ThreadSanitizer: gcc instruments the clones' ifunc resolver, which the dynamic loader
// runs before the TSan runtime is initialised (the library crashes as it loads), so a TSan build
// (scripts/test_tsan.sh) runs the baseline loops. Not with clang (the fuzz build): its
// target_clones differs, and nothing fuzzed runs these loops.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define KVPRESS_HAVE_VECTOR_CLONES 1
#define KVPRESS_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVPRESS_HAVE_VECTOR_CLONES 0
#define KVPRESS_VECTOR_CLONES
#endif

// KVPRESS_AVX512_KERNEL and KVPRESS_AVX2_KERNEL: the register-tile loops (cpu/register_tile.h),
// each compiled twice from one template: for AVX-512 (32 zmm registers) and for AVX2 + FMA (16 ymm
// registers, smaller tiles), and called only for the ISA cpu_tile_isa() names; where it names none
// the caller takes the ATen composite. Plain function attributes, no ifunc, so they are fine under
// every sanitizer. gcc only: clang (the fuzz build) refuses the always-inlined vec16 helpers,
// compiled for the baseline, inside a target function (a 64-byte vector's ABI differs), and
// nothing fuzzed runs these loops.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPRESS_HAVE_TILE_KERNELS 1
#define KVPRESS_AVX512_KERNEL __attribute__((target("avx512f")))
#define KVPRESS_AVX2_KERNEL __attribute__((target("avx2,fma")))
#else
#define KVPRESS_HAVE_TILE_KERNELS 0
#define KVPRESS_AVX512_KERNEL
#define KVPRESS_AVX2_KERNEL
#endif

namespace kvpress::kernels {
// Which register-tile loops run in this process, decided once (src/ops/cpu/cpu_features.cpp):
// kAvx512 where they are compiled in and the CPU has AVX-512F, kAvx2 where it has AVX2 and FMA,
// kNone elsewhere (the composites). The environment caps it for tests and benchmarks:
// KVPRESS_DISABLE_AVX512=1 gives the path an AVX2-only CPU takes, KVPRESS_DISABLE_AVX2=1 (which
// implies the other) the path of a CPU with neither. The KVPRESS_VECTOR_CLONES loops are chosen by
// the loader from the CPU alone and ignore both.
enum class TileIsa { kNone, kAvx2, kAvx512 };
TileIsa cpu_tile_isa();
const char* tile_isa_name(TileIsa isa);  // "baseline", "avx2", "avx512"
}  // namespace kvpress::kernels
