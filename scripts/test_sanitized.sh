#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: builds the library, kvpress::llama, kvpress-cli and
# the tests with -fsanitize=address,undefined,float-cast-overflow (the last: float-to-integer
# conversions out of range, undefined behaviour that gcc's `undefined` group leaves out), halting on
# the first report, into their own build folder, and runs the whole ctest suite: unit, parity, CLI
# and Python tests but the 16 GiB large-indices test and three Python tests that load no kvpress code
# (below; docs/RELIABILITY.md).
# No CUDA kernels are compiled (KVPRESS_WITH_CUDA=OFF): nvcc's host pass is not instrumented, and
# the run is on CPU. Benchmarks and examples are not built: ctest runs none of them. -O1 (the
# sanitizers' recommended level) compiles the instrumented tests in half the time of -O3.
#   Folder: $KVPRESS_ASAN_BUILD_DIR, default build-asan/.
#   Parity fixtures: regenerated into that folder, unless $KVPRESS_REUSE_FIXTURES names a folder
#   that kvpress_fixtures filled from this checkout (.ci/run passes build/fixtures, which
#   scripts/test.sh has just made; they do not depend on how the library is built).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVPRESS_BUILD_DIR="${KVPRESS_ASAN_BUILD_DIR:-$here/../build-asan}"
source "$here/common.sh"

fixtures="${KVPRESS_REUSE_FIXTURES:-$build/fixtures}"
kvpress_build -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DKVPRESS_SANITIZE="address;undefined;float-cast-overflow" \
  -DKVPRESS_WITH_CUDA=OFF -DKVPRESS_BUILD_BENCHMARKS=OFF -DKVPRESS_BUILD_EXAMPLES=OFF \
  -DKVPRESS_FIXTURES_DIR="$fixtures"
if [ -z "${KVPRESS_REUSE_FIXTURES:-}" ]; then
  kvpress_fixtures
fi

# Halt on the first report of any kind. The suppression files may hold only reports inside
# libtorch or the runtime libraries, one comment per entry (none are needed today).
supp="$root/tests/sanitizers"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
# One intra-op thread per test process, as scripts/test.sh. Every test but four:
# large.indices_beyond_2_31 allocates 16 GiB of tensors (plus ASan's shadow and quarantine) and runs
# alone for about 170 s instrumented. Its purpose, offsets past 2^31, is checked by its results in
# scripts/test.sh (a wrapped 32-bit offset reads or writes the wrong rows, which the test compares
# row by row), and its kernels run instrumented here in every other kernel test at small shapes.
# Also left out: the Python tests that load no kvpress code (python.plot, python.lukv_curve,
# python.restorekv_recipe: scripts/plot.py and scripts/make_artifact.py on torch alone), whose
# checks scripts/test.sh has made, with nothing instrumented to run here.
(cd "$build" && OMP_NUM_THREADS=1 ctest --output-on-failure -j "$jobs" \
  -E '^(large\.indices_beyond_2_31|python\.plot|python\.lukv_curve|python\.restorekv_recipe)$')
