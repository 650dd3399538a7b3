#!/usr/bin/env bash
# Builds the Python package's wheel (python/, docs/PYTHON.md) against the project venv's torch into
# OUT_DIR (default dist/) and prints its path. The wheel needs that torch version at run time.
# The CMake build folder python/build/ is kept, so a build after `pip install ./python` is quick.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup.sh" | tail -n 1)"
out="${1:-$root/dist}"
mkdir -p "$out"
# ccache, when installed, lets the package's build reuse the project build's objects.
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
fi
"$venv/bin/python" -m pip wheel --no-deps --quiet --disable-pip-version-check -w "$out" "$root/python" >&2
ls -t "$out"/kvpress_cpp-*.whl | head -n 1
