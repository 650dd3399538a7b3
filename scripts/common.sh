# Sourced by the entry scripts: installs dependencies, then configures and builds into build/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup.sh" | tail -n 1)"
python="$venv/bin/python"
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
build="${KVPRESS_BUILD_DIR:-$root/build}"
jobs="${KVPRESS_JOBS:-$(nproc)}"

# ccache, when installed, makes rebuilds in several build folders cheap (optional).
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

kvpress_build() {
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
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
