#!/usr/bin/env bash
# Installs, builds and runs every test: the C++/CUDA format check, unit, parity against the pinned
# kvpress, CLI, Python, a consumer project built against the installed package, then the
# reliability runs (docs/RELIABILITY.md): libFuzzer (30 s per target), the whole suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, the concurrency tests under ThreadSanitizer.
# This is what CI runs (.ci/run). KVPRESS_TEST_QUICK=1 stops after the consumer project (the
# reliability runs build three more instrumented trees: about 18 of CI's 29 minutes).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$root/scripts/check_format.sh"
kvpress_build
kvpress_fixtures
# One intra-op thread per test process: ctest already runs $jobs of them side by side.
(cd "$build" && OMP_NUM_THREADS=1 ctest --output-on-failure -j "$jobs")

# The installed package must be usable through find_package(kvpress).
cmake --install "$build" --prefix "$build/install" >/dev/null
cmake -S "$root/tests/consumer" -B "$build/consumer" \
  -DCMAKE_PREFIX_PATH="$build/install;$torch_prefix" >/dev/null
cmake --build "$build/consumer" -j "$jobs"
"$build/consumer/kvpress_consumer"

[ "${KVPRESS_TEST_QUICK:-0}" = 1 ] && exit 0
"$root/scripts/fuzz.sh" 30
# The sanitized suite reuses the parity fixtures made above.
KVPRESS_REUSE_FIXTURES="$build/fixtures" "$root/scripts/test_sanitized.sh"
"$root/scripts/test_tsan.sh"
