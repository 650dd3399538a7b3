#!/usr/bin/env bash
# GPU check of issue 7: builds the CUDA kernels (if needed), runs every CUDA test (CPU-vs-CUDA
# parity; a skip counts as a failure here) and kvpress_bench_gpu (every press on CUDA tensors,
# float32 and bfloat16, S=16384). Under 8 minutes on one GPU with a warm ccache or an existing
# build; see docs/PERFORMANCE.md ("GPU check").
#
#   benchmarks/gpu_check.sh [build-dir]        # default: $KVPRESS_BUILD_DIR, else build-gpu/
#
# Needs nvcc, a CUDA torch (libtorch through $KVPRESS_PYTHON, else the project venv, else python3)
# and the Debian packages of scripts/setup.sh. Only the device's own architecture is compiled.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-${KVPRESS_BUILD_DIR:-$root/build-gpu}}"
start=$SECONDS
step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - start)); }

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU (nvidia-smi)" >&2; exit 1; }
arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')"
python="${KVPRESS_PYTHON:-}"
if [ -z "$python" ]; then
  python="$HOME/.cache/kvpress-cpp/venv/bin/python"
  [ -x "$python" ] || python=python3
fi

step "configure + build in $build (sm_$arch)"
if [ ! -f "$build/CMakeCache.txt" ]; then
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVPRESS_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" "${launcher[@]}" \
    -DCMAKE_PREFIX_PATH="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
    -DPython3_EXECUTABLE="$python" >/dev/null
fi
grep -q '^KVPRESS_WITH_CUDA:BOOL=ON' "$build/CMakeCache.txt" ||
  { echo "gpu_check: $build is configured without CUDA (KVPRESS_WITH_CUDA=OFF)" >&2; exit 1; }
timeout 300 cmake --build "$build" -j "$(nproc)" --target kvpress_tests kvpress_bench_gpu

step "CUDA tests (CPU vs CUDA parity)"
log="$(mktemp)"
timeout 120 "$build/tests/kvpress_tests" --gtest_filter='*Cuda*' --gtest_brief=0 | tee "$log"
if grep -q '\[  SKIPPED \]' "$log"; then
  echo "gpu_check: CUDA tests were skipped on a GPU machine" >&2
  exit 1
fi

step "kvpress_bench_gpu, float32"
timeout 90 "$build/benchmarks/kvpress_bench_gpu" --seq 16384 --dtype fp32
step "kvpress_bench_gpu, bfloat16"
timeout 90 "$build/benchmarks/kvpress_bench_gpu" --seq 16384 --dtype bf16
step "done"
