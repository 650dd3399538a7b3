#!/usr/bin/env bash
# Installs, builds and runs every test: the C++/CUDA format check, unit, parity against the pinned
# kvpress, CLI, Python, and a consumer project built against the installed package.
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
