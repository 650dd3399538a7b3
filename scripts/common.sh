# Sourced by the entry scripts: installs dependencies, then configures and builds into build/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup.sh" | tail -n 1)"
python="$venv/bin/python"
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
build="${KVPRESS_BUILD_DIR:-$root/build}"
jobs="${KVPRESS_JOBS:-$(nproc)}"

# Every build tree (build/, build-asan/, build-tsan/, python/build/) is configured
# by these flags: Ninja, and ccache (scripts/setup.sh installs both) so that a rebuild after a change
# recompiles only what changed, in whichever tree. The sloppiness lets ccache cache the files that
# include the precompiled ATen header (cmake/PrecompiledATen.cmake).
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-12G}"
# Paths inside the checkout hashed relative to it: another clone (CI's) finds the same objects.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
common_cmake_flags=(-G Ninja -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)

# A tree configured before the switch to Ninja cannot be reconfigured with it: start it afresh.
kvpress_reset_if_not_ninja() {
  if [ -f "$1/CMakeCache.txt" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$1/CMakeCache.txt"; then
    echo "build: $1 was configured for another generator; configuring it afresh for Ninja" >&2
    rm -rf "$1/CMakeCache.txt" "$1/CMakeFiles"
  fi
}

kvpress_build() {
  kvpress_reset_if_not_ninja "$build"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${common_cmake_flags[@]}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$python" "$@" >/dev/null
  cmake --build "$build" -j "$jobs"
}

# The sanitized trees: clang, -O1 (the sanitizers' recommended level), no CUDA (nvcc's host pass is
# not instrumented), no OpenMP (clang's needs libomp, a second runtime beside libtorch's libgomp;
# the sanitized runs use one intra-op thread, so at::parallel_for runs its whole range inline
# either way), no benchmarks or examples (no sanitized run uses them). clang, not gcc: libFuzzer
# needs it, and it builds these trees in about 60% of gcc's time.
#   kvpress_configure_sanitized_tree SANITIZERS [cmake argument...]
# build-asan/ (SANITIZERS "address;undefined;float-cast-overflow", KVPRESS_FUZZ=ON) is shared by
# scripts/fuzz.sh (the libFuzzer targets) and scripts/test_sanitized.sh (the whole suite): one
# instrumented library for both, which also carries libFuzzer's coverage counters
# (-fsanitize=fuzzer-no-link; in the test binaries they count into the runtime's no-op hooks).
# build-tsan/ ("thread") is scripts/test_tsan.sh's.
kvpress_configure_sanitized_tree() {
  local sanitizers="$1"
  shift
  # clang, its sanitizer and libFuzzer runtimes (libclang-rt-dev), llvm-symbolizer (llvm).
  bash "$root/scripts/setup.sh" --apt clang libclang-rt-dev llvm
  kvpress_reset_if_not_ninja "$build"
  if [ -f "$build/CMakeCache.txt" ] && ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++$' "$build/CMakeCache.txt"; then
    echo "build: $build was configured for another compiler; configuring it afresh for clang" >&2
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
  fi
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${common_cmake_flags[@]}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$python" \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
    -DKVPRESS_SANITIZE="$sanitizers" -DKVPRESS_WITH_CUDA=OFF -DKVPRESS_OPENMP=OFF \
    -DKVPRESS_BUILD_BENCHMARKS=OFF -DKVPRESS_BUILD_EXAMPLES=OFF "$@" >/dev/null
}

# The AddressSanitizer tree's configuration (above), the one fact scripts/fuzz.sh and
# scripts/test_sanitized.sh share.
kvpress_configure_asan_tree() {  # [cmake argument...]
  kvpress_configure_sanitized_tree "address;undefined;float-cast-overflow" -DKVPRESS_FUZZ=ON "$@"
}

# Regenerates the parity fixtures from the pinned kvpress package: every script of tests/reference,
# each forked from one process that has imported torch, transformers and kvpress (make_all_fixtures.py).
kvpress_fixtures() {
  "$python" "$root/tests/reference/make_all_fixtures.py" --out "$build/fixtures" \
    --smollm2 "$(bash "$root/scripts/setup.sh" --smollm2-path)"
}

# ---- Running the GoogleTest binaries ----------------------------------------------------------
# Every test run (scripts/test.sh, test_sanitized.sh, test_avx2_path.sh) runs the GoogleTest
# binaries whole, a few processes each, rather than as ctest's one-process-per-test entries: each
# process starts libtorch (about 0.6 s; 0.8 s under AddressSanitizer, whose trees link its CPU half
# alone), 330 times over for kvpress_tests' unit tests. The ctest entries (label "gtest") stay for
# running one test by name.

# kvpress_run_gtest LOG BINARY FILTER [VAR=VALUE...]: $build/tests/BINARY with --gtest_filter=FILTER
# and the given environment (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX for one shard), one intra-op
# thread, under ctest's default per-test limit (1,500 s), its output in LOG. A failure prints the
# failing tests and any sanitizer report and returns 1.
kvpress_run_gtest() {
  local log="$1" binary="$2" filter="$3"
  shift 3
  if ! (cd "$build/tests" && env OMP_NUM_THREADS=1 "$@" timeout 1500 "./$binary" --gtest_filter="$filter" >"$log" 2>&1); then
    echo "$binary ($*): FAILED (whole log: $log):" >&2
    grep -B2 -A20 -E 'Failure$|^\[  FAILED  \]|ERROR: (Address|Undefined|Leak|Thread)Sanitizer|runtime error:' "$log" |
      head -n 300 >&2 || true
    return 1
  fi
}

# kvpress_gtest_totals LOG...: each log's totals, then the skipped tests with their reasons.
kvpress_gtest_totals() {
  local log
  for log in "$@"; do
    grep -h -E '^\[==========\] .* ran|^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test' "$log" |
      sed "s|^|$(basename "$log" .log): |" || true
  done
  grep -h -B1 '^\[  SKIPPED \] .*(' "$@" | grep -v -E '^--$|^\[  SKIPPED' | sort -u || true
}

# kvpress_run_suite NAME CTEST_JOBS FIXTURES [ctest argument...]: every test of $build but the
# large-indices one (scripts/test.sh runs it alone): kvpress_tests in $jobs shards, each followed by
# one of the small GoogleTest binaries (concurrency, CUDA model), beside ctest running the entries
# that are not GoogleTest's (CLI, Python, examples, headers, gpu_check) CTEST_JOBS at a time with
# the given arguments. Parity fixtures from FIXTURES. Logs: $build/NAME-*.log. Returns 1 if any
# test failed, after every process has ended and the totals are printed.
kvpress_run_suite() {
  local name="$1" ctest_jobs="$2" fixtures="$3"
  shift 3
  local others_log="$build/$name-ctest.log" pids=() shard i status=0
  (cd "$build" && OMP_NUM_THREADS=1 ctest --output-on-failure -j "$ctest_jobs" -LE '^gtest$' "$@" >"$others_log" 2>&1) &
  pids+=($!)
  local small=(kvpress_concurrency_tests)
  [ -x "$build/tests/kvpress_cuda_emulation_tests" ] && small+=(kvpress_cuda_emulation_tests)
  for ((shard = 0; shard < jobs; shard++)); do
    (
      failed=0
      kvpress_run_gtest "$build/$name-kvpress_tests-$shard.log" kvpress_tests '-LargeIndices.*' \
        KVPRESS_FIXTURES="$fixtures" GTEST_TOTAL_SHARDS="$jobs" GTEST_SHARD_INDEX="$shard" || failed=1
      for ((i = shard; i < ${#small[@]}; i += jobs)); do
        kvpress_run_gtest "$build/$name-${small[$i]}.log" "${small[$i]}" '-CudaEmulationRaceDemo.*' || failed=1
      done
      exit $failed
    ) &
    pids+=($!)
  done
  if ! wait "${pids[0]}"; then
    status=1
    echo "$name: ctest (CLI, Python, examples, headers, gpu_check) FAILED:" >&2
  fi
  for i in "${pids[@]:1}"; do
    wait "$i" || status=1
  done
  local logs=()
  for ((shard = 0; shard < jobs; shard++)); do logs+=("$build/$name-kvpress_tests-$shard.log"); done
  for i in "${small[@]}"; do logs+=("$build/$name-$i.log"); done
  kvpress_gtest_totals "${logs[@]}"
  tail -n 40 "$others_log"
  return $status
}
