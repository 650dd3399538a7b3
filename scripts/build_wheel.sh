#!/usr/bin/env bash
# Builds the Python package's wheel (python/, docs/PYTHON.md) against the project venv's torch into
# OUT_DIR (default dist/) and prints its path. The wheel needs that torch version at run time.
# The CMake build folder python/build/ is kept, so a build after `pip install ./python` is quick.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup.sh" | tail -n 1)"
out="${1:-$root/dist}"
mkdir -p "$out"
# $KVPRESS_PREBUILT_LIBRARY: package a libkvpress.so the project's build made against the venv's
# torch (e.g. build/libkvpress.so) instead of compiling it (python/CMakeLists.txt).
prebuilt=()
if [ -n "${KVPRESS_PREBUILT_LIBRARY:-}" ]; then
  prebuilt=(-C "cmake.define.KVPRESS_PREBUILT_LIBRARY=$KVPRESS_PREBUILT_LIBRARY")
elif command -v ccache >/dev/null 2>&1; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
fi
"$venv/bin/python" -m pip wheel --no-deps --quiet --disable-pip-version-check "${prebuilt[@]}" -w "$out" "$root/python" >&2
ls -t "$out"/kvpress_cpp-*.whl | head -n 1
