#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: builds the library, kvpress::llama, kvpress-cli and
# the tests with -fsanitize=address,undefined,float-cast-overflow (the last: float-to-integer
# conversions out of range, undefined behaviour that gcc's `undefined` group leaves out), halting on
# the first report, into their own build folder, and runs the whole suite: unit, parity, CUDA-model,
# concurrency, CLI and Python tests but the 16 GiB large-indices test and three Python tests that
# load no kvpress code (below; docs/RELIABILITY.md).
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
# One intra-op thread per test process, as scripts/test.sh. The GoogleTest binaries run whole, one
# process each (ctest's label "gtest": as ctest entries they would start libtorch once per test,
# about 1.3 s under ASan, 300 times over), beside ctest running the other entries (CLI, Python,
# examples, headers). Every test but four:
# large.indices_beyond_2_31 allocates 16 GiB of tensors (plus ASan's shadow and quarantine) and runs
# alone for about 170 s instrumented. Its purpose, offsets past 2^31, is checked by its results in
# scripts/test.sh (a wrapped 32-bit offset reads or writes the wrong rows, which the test compares
# row by row), and its kernels run instrumented here in every other kernel test at small shapes.
# Also left out: the Python tests that load no kvpress code (python.plot, python.lukv_curve,
# python.restorekv_recipe: scripts/plot.py and scripts/make_artifact.py on torch alone), whose
# checks scripts/test.sh has made, with nothing instrumented to run here.
export OMP_NUM_THREADS=1
others_log="$build/sanitized-ctest.log"
(cd "$build" && ctest --output-on-failure -j 1 -LE '^gtest$' \
  -E '^(python\.plot|python\.lukv_curve|python\.restorekv_recipe)$' >"$others_log" 2>&1) &
others=$!
status=0
run_binary() {  # name, gtest filter: one process, its log kept; a failure prints its failing tests
  local log="$build/sanitized-$1.log"
  if ! (cd "$build/tests" && KVPRESS_FIXTURES="$fixtures" "./$1" --gtest_filter="$2" >"$log" 2>&1); then
    status=1
    echo "test_sanitized.sh: $1 FAILED (whole log: $log):" >&2
    grep -B2 -A20 -E 'Failure$|^\[  FAILED  \]|ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:' "$log" | head -n 300 >&2 || true
  fi
  grep -h -E '^\[==========\] .* ran|^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test' "$log" |
    sed "s/^/$1: /" || true
}
run_binary kvpress_tests '-LargeIndices.*'
run_binary kvpress_concurrency_tests '*'
if [ -x "$build/tests/kvpress_cuda_emulation_tests" ]; then
  run_binary kvpress_cuda_emulation_tests '-CudaEmulationRaceDemo.*'
fi
if ! wait "$others"; then
  status=1
  echo "test_sanitized.sh: ctest (CLI, Python, examples, headers) FAILED:" >&2
fi
tail -n 40 "$others_log"
exit $status
