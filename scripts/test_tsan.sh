#!/usr/bin/env bash
# ThreadSanitizer: builds the library, kvpress::llama and the concurrency tests
# (tests/test_concurrency.cpp: every registry press shared by 8 threads, ragged attention read from
# 8 threads, one Llama model generating 8 sequences, the registry's first use from 8 threads) with
# clang's -fsanitize=thread into their own build folder, and runs them, halting on the first report
# (docs/RELIABILITY.md). No CUDA kernels are compiled (KVPRESS_WITH_CUDA=OFF), but they run: the
# CUDA kernels' emulated tests (tests/test_cuda_emulation.cpp) execute every block's threads as
# fibers that ThreadSanitizer sees as threads, so a race between them is reported here (and a
# kernel with its barrier removed must be: docs/RELIABILITY.md, "CUDA kernels without a GPU").
# Folder: $KVPRESS_TSAN_BUILD_DIR, default build-tsan/.
#
# Only these tests: they are the only ones that start threads. libtorch's intra-op parallelism is
# OpenMP (libgomp), whose barriers ThreadSanitizer cannot see (it reports races between libgomp's
# workers and the thread that started them, inside libtorch), so every test process runs with one
# intra-op thread (OMP_NUM_THREADS=1): at::parallel_for runs inline and the only threads are the
# tests' own. The other tests are then single-threaded, with nothing for ThreadSanitizer to check.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVPRESS_BUILD_DIR="${KVPRESS_TSAN_BUILD_DIR:-$here/../build-tsan}"
source "$here/common.sh"

# clang at -O1, no OpenMP (common.sh, kvpress_configure_sanitized_tree). Only the library,
# kvpress::llama, the concurrency tests and the CUDA kernels' emulated tests are built.
kvpress_configure_sanitized_tree thread -DKVPRESS_BUILD_TOOLS=OFF
cmake --build "$build" -j "$jobs" --target kvpress_concurrency_tests kvpress_cuda_emulation_tests

export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp"
(cd "$build" && OMP_NUM_THREADS=1 ctest --output-on-failure -j "$jobs" -R '^(Concurrency|CudaEmulation)\.')

# The CUDA execution model must make a missing __syncthreads() a race that ThreadSanitizer sees
# (tests/test_cuda_emulation.cpp, CudaEmulationRaceDemo): the run must fail with that report.
demo="$build/cuda_emulation_race_demo.log"
if OMP_NUM_THREADS=1 "$build/tests/kvpress_cuda_emulation_tests" --gtest_filter='CudaEmulationRaceDemo.*' \
    >"$demo" 2>&1 || ! grep -q 'WARNING: ThreadSanitizer: data race' "$demo"; then
  echo "test_tsan.sh: ThreadSanitizer did not report the emulated kernel's missing barrier (log: $demo)" >&2
  exit 1
fi
echo "test_tsan.sh: the emulated kernel without its barrier was reported as a data race, as it must be"
