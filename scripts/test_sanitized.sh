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
# One intra-op thread per test process, as scripts/test.sh. The GoogleTest binaries run whole, in
# as few processes as keep the cores busy (as ctest entries they would start libtorch once per
# test, about 1.3 s under ASan, 300 times over): kvpress_tests in $jobs shards (GoogleTest's
# GTEST_TOTAL_SHARDS, round-robin over the tests), each shard followed by one of the two small
# binaries, beside ctest running the other entries (CLI, Python, examples, headers). Every test but
# four:
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
pids=($!)
# run_binary NAME FILTER [SHARD]: one process (one shard of $jobs when SHARD is given), its log
# kept as sanitized-NAME[-SHARD].log; a failure prints its failing tests and sanitizer reports.
run_binary() {
  local name="$1" filter="$2" shard="${3:-}" log="$build/sanitized-$1${3:+-$3}.log"
  local shard_env=()
  [ -z "$shard" ] || shard_env=(GTEST_TOTAL_SHARDS="$jobs" GTEST_SHARD_INDEX="$shard")
  if ! (cd "$build/tests" && env KVPRESS_FIXTURES="$fixtures" "${shard_env[@]}" "./$name" --gtest_filter="$filter" >"$log" 2>&1); then
    echo "test_sanitized.sh: $name${shard:+ shard $shard} FAILED (whole log: $log):" >&2
    grep -B2 -A20 -E 'Failure$|^\[  FAILED  \]|ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:' "$log" | head -n 300 >&2 || true
    return 1
  fi
}
small_binaries=(kvpress_concurrency_tests)
[ -x "$build/tests/kvpress_cuda_emulation_tests" ] && small_binaries+=(kvpress_cuda_emulation_tests)
for ((shard = 0; shard < jobs; shard++)); do
  (
    status=0
    run_binary kvpress_tests '-LargeIndices.*' "$shard" || status=1
    # The small binaries after the shards, one each, in turn.
    for ((i = shard; i < ${#small_binaries[@]}; i += jobs)); do
      run_binary "${small_binaries[$i]}" '-CudaEmulationRaceDemo.*' || status=1
    done
    exit $status
  ) &
  pids+=($!)
done
status=0
if ! wait "${pids[0]}"; then
  status=1
  echo "test_sanitized.sh: ctest (CLI, Python, examples, headers) FAILED:" >&2
fi
for pid in "${pids[@]:1}"; do
  wait "$pid" || status=1
done
# Each binary's (each shard's) totals, then the end of ctest's.
logs=()
for ((shard = 0; shard < jobs; shard++)); do logs+=("$build/sanitized-kvpress_tests-$shard.log"); done
for name in "${small_binaries[@]}"; do logs+=("$build/sanitized-$name.log"); done
for log in "${logs[@]}"; do
  name="$(basename "$log" .log)"
  grep -h -E '^\[==========\] .* ran|^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test' "$log" |
    sed "s/^/${name#sanitized-}: /" || true
done
tail -n 40 "$others_log"
exit $status
