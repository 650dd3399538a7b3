#!/usr/bin/env bash
# Installs, builds and runs every test: the C++/CUDA format check, unit, parity against the pinned
# kvpress, CLI, Python, a consumer project built against the installed package, the Python package
# (pip install ./python, its wheel, docs/PYTHON.md), then the
# reliability runs (docs/RELIABILITY.md): libFuzzer (30 s per target) and the whole suite under
# AddressSanitizer + UndefinedBehaviorSanitizer (one clang tree for both), the concurrency tests and
# the CUDA kernels' CPU model under ThreadSanitizer.
# This is what CI runs (.ci/run). KVPRESS_TEST_QUICK=1 stops after the Python package (the
# reliability runs build two more instrumented trees: docs/RELIABILITY.md, "Cost in CI").
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$root/scripts/check_format.sh"
# The parity fixtures come from the pinned kvpress alone (not from this build), so they are made
# beside the main build: the build cannot keep both cores busy all the time (its links, nvcc's
# single-threaded passes), and the fixtures' scripts fill those gaps.
mkdir -p "$build"
fixtures_log="$build/fixtures.log"
kvpress_fixtures >"$fixtures_log" 2>&1 &
fixtures_pid=$!
trap 'kill "$fixtures_pid" 2>/dev/null || true' EXIT
kvpress_build
if ! wait "$fixtures_pid"; then
  echo "test.sh: making the parity fixtures FAILED; the end of $fixtures_log:" >&2
  tail -n 60 "$fixtures_log" >&2
  exit 1
fi
trap - EXIT
cat "$fixtures_log"
# One intra-op thread per test process: $jobs GoogleTest shards run beside ctest's $jobs entries
# (common.sh, kvpress_run_suite). Then the large-indices test, alone (its 16 GiB of tensors) and so
# with $jobs intra-op threads, which its kernels split rows past 2^31 among.
kvpress_run_suite suite "$jobs" "$build/fixtures"
(cd "$build" && OMP_NUM_THREADS="$jobs" ctest --output-on-failure -R '^large\.indices_beyond_2_31$')
# The same C++ suite on the path of an AVX2-only CPU, where this one has AVX-512 (about a minute).
"$root/scripts/test_avx2_path.sh"

# The installed package must be usable through find_package(kvpress).
cmake --install "$build" --prefix "$build/install" >/dev/null
cmake -S "$root/tests/consumer" -B "$build/consumer" \
  -DCMAKE_PREFIX_PATH="$build/install;$torch_prefix" >/dev/null
cmake --build "$build/consumer" -j "$jobs"
"$build/consumer/kvpress_consumer"

# The Python package as a user installs it (README), then its wheel (docs/PYTHON.md), both packaging
# the libkvpress.so built above (python/CMakeLists.txt: KVPRESS_PREBUILT_LIBRARY) instead of
# compiling the library again.
export KVPRESS_PREBUILT_LIBRARY="$build/libkvpress.so"
"$python" -m pip install --quiet --disable-pip-version-check \
  -C cmake.define.KVPRESS_PREBUILT_LIBRARY="$KVPRESS_PREBUILT_LIBRARY" "$root/python"
wheel="$("$root/scripts/build_wheel.sh" "$build/dist")"
(cd "$root/tests/python" && "$python" test_package.py "$wheel")
# kvpress 0.5.5's own test suite with acceleration on, offline on the bundled model (docs/PYTHON.md).
"$python" "$root/tests/kvpress_suite/run.py" --models "${KVPRESS_MODELS:-$root/../shared/models}" --work "$build/kvpress_suite"

[ "${KVPRESS_TEST_QUICK:-0}" = 1 ] && exit 0
"$root/scripts/fuzz.sh" 30
# The sanitized suite reuses the parity fixtures made above.
KVPRESS_REUSE_FIXTURES="$build/fixtures" "$root/scripts/test_sanitized.sh"
"$root/scripts/test_tsan.sh"
