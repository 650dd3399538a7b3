# Sourced by the entry scripts: installs dependencies, then configures and builds into build/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup.sh" | tail -n 1)"
python="$venv/bin/python"
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
build="${KVPRESS_BUILD_DIR:-$root/build}"
jobs="${KVPRESS_JOBS:-$(nproc)}"

# Every build tree (build/, build-fuzz/, build-asan/, build-tsan/, python/build/) is configured
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

# Regenerates the parity fixtures from the pinned kvpress package.
kvpress_fixtures() {
  "$python" "$root/tests/reference/make_fixtures.py" --out "$build/fixtures" "$@"
  "$python" "$root/tests/reference/make_model_fixtures.py" --out "$build/fixtures/llama"
  "$python" "$root/tests/reference/make_decoding_fixtures.py" --out "$build/fixtures/decoding"
  "$python" "$root/tests/reference/make_ragged_fixtures.py" --out "$build/fixtures/ragged"
  "$python" "$root/tests/reference/make_kvcompose_fixtures.py" --out "$build/fixtures/kvcompose"
  "$python" "$root/tests/reference/make_kvzip_fixtures.py" --out "$build/fixtures/kvzip"
  "$python" "$root/tests/reference/make_dms_fixtures.py" --out "$build/fixtures/dms"
  "$python" "$root/tests/reference/make_cam_fixtures.py" --out "$build/fixtures/cam"
  "$python" "$root/tests/reference/make_pipeline_fixtures.py" --out "$build/fixtures/pipeline"
}
