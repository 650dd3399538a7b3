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
#define KVPRESS_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVPRESS_VECTOR_CLONES
#endif

// KVPRESS_AVX512_KERNEL: a loop written for AVX-512's 32 vector registers (a register tile that
// would spill under AVX2), compiled for AVX-512 alone and called only where cpu_has_avx512() holds;
// elsewhere its caller takes the ATen composite. Plain function attribute, no ifunc, so it is fine
// under every sanitizer. gcc only: clang (the fuzz build) refuses the always-inlined vec16 helpers,
// compiled for the baseline, inside an AVX-512 function (a 64-byte vector's ABI differs), and
// nothing fuzzed runs these loops.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPRESS_HAVE_AVX512_KERNELS 1
#define KVPRESS_AVX512_KERNEL __attribute__((target("avx512f")))
#else
#define KVPRESS_HAVE_AVX512_KERNELS 0
#define KVPRESS_AVX512_KERNEL
#endif

namespace kvpress::kernels {
// Whether the KVPRESS_AVX512_KERNEL loops run in this process: compiled in, the CPU has AVX-512F,
// and the environment does not turn them off (KVPRESS_DISABLE_AVX512=1: the path an AVX2-only CPU
// takes, for tests and benchmarks on an AVX-512 machine; kernels/cpu/cpu_features.cpp). The
// KVPRESS_VECTOR_CLONES loops are chosen by the loader from the CPU alone and ignore it.
bool cpu_has_avx512();
}  // namespace kvpress::kernels
