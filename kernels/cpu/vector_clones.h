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
