#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: builds the library, kvpress::llama, kvpress-cli and
# the tests with clang's -fsanitize=address,undefined,float-cast-overflow (the last named for gcc's
# sake, where `undefined` leaves out float-to-integer conversions out of range; clang's includes
# it), halting on the first report, in the tree that scripts/fuzz.sh shares (common.sh,
# kvpress_configure_asan_tree: one instrumented library for both), and runs the whole suite: unit,
# parity, CUDA-model, concurrency, CLI and Python tests but the 16 GiB large-indices test and three
# Python tests that load no kvpress code (below; docs/RELIABILITY.md).
#   Folder: $KVPRESS_ASAN_BUILD_DIR, default build-asan/.
#   Parity fixtures: regenerated into that folder, unless $KVPRESS_REUSE_FIXTURES names a folder
#   that kvpress_fixtures filled from this checkout (.ci/run passes build/fixtures, which
#   scripts/test.sh has just made; they do not depend on how the library is built).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVPRESS_BUILD_DIR="${KVPRESS_ASAN_BUILD_DIR:-$here/../build-asan}"
source "$here/common.sh"

fixtures="${KVPRESS_REUSE_FIXTURES:-$build/fixtures}"
kvpress_configure_asan_tree -DKVPRESS_FIXTURES_DIR="$fixtures"
cmake --build "$build" -j "$jobs"
if [ -z "${KVPRESS_REUSE_FIXTURES:-}" ]; then
  kvpress_fixtures
fi

# Halt on the first report of any kind. The suppression files may hold only reports inside
# libtorch or the runtime libraries, one comment per entry (none are needed today).
supp="$root/tests/sanitizers"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
# The GoogleTest binaries whole, kvpress_tests in $jobs shards, beside ctest running the other
# entries (CLI, Python, examples, headers) $jobs at a time (common.sh, kvpress_run_suite): the
# shards end long before ctest's entries, which would otherwise leave a core idle. Every test
# but four:
# large.indices_beyond_2_31 allocates 16 GiB of tensors (plus ASan's shadow and quarantine) and runs
# alone for about 170 s instrumented. Its purpose, offsets past 2^31, is checked by its results in
# scripts/test.sh (a wrapped 32-bit offset reads or writes the wrong rows, which the test compares
# row by row), and its kernels run instrumented here in every other kernel test at small shapes.
# Also left out: the Python tests that load no kvpress code (python.plot, python.lukv_curve,
# python.restorekv_recipe: scripts/plot.py and scripts/make_artifact.py on torch alone), whose
# checks scripts/test.sh has made, with nothing instrumented to run here.
kvpress_run_suite sanitized "$jobs" "$fixtures" -E '^(python\.plot|python\.lukv_curve|python\.restorekv_recipe)$'
