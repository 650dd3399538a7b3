#!/usr/bin/env bash
# The GPU check (issue 31): the CUDA tests (CPU vs CUDA parity, and kvpress::distributed's NCCL group
# running a ShardedPress's exchanges on the device; a skip is a failure on a GPU) and
# kvpress_bench_gpu (every press on CUDA tensors, float32 and bfloat16, S=16384, against its floor
# at the device's copy bandwidth). Every step runs under its own timeout and the next one runs
# whatever happened; each writes its log to the output folder, and summary.txt lists every step's
# status and time. The whole run stays under 450 s. Exit status 1 when a step failed.
#
# The device machine has a CUDA torch but none of the build's other dependencies and no network,
# so the binaries are built here and carried there:
#
#   benchmarks/gpu_check.sh --prepare DIR [--build TREE]   # here: copy TREE's binaries (built with
#                                                          # CUDA kernels for sm_90) into DIR
#   benchmarks/gpu_check.sh --carried DIR [--out OUT]      # there: run them (OUT defaults to $OUT)
#   benchmarks/gpu_check.sh --emulated [--build TREE] [--out OUT] [--skip-model]
#                                                          # anywhere: the same steps without a GPU
#
# --emulated rehearses every step but the GPU itself: the CUDA kernels through the CPU model of
# CUDA's execution (kvpress_cuda_emulation_tests), the CUDA tests' CPU halves, and the benchmark's
# whole loop on the CPU at S=2048. ctest runs it (gpu_check.emulated) with --skip-model: the CUDA
# model's tests are ctest entries of their own, which every test run runs (no second run of the
# same tests, about 70 s on 2 cores). TREE defaults to $KVPRESS_BUILD_DIR, else build/
# (scripts/test.sh's tree); OUT to $OUT, else TREE/gpu_check.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="" dir="" tree="${KVPRESS_BUILD_DIR:-$root/build}" out="${OUT:-}" skip_model=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare | --carried) mode="${1#--}" dir="${2:?$1 needs a folder}"; shift 2 ;;
    --emulated) mode=emulated; shift ;;
    --build) tree="${2:?--build needs a folder}"; shift 2 ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --skip-model) skip_model=1; shift ;;
    *) echo "usage: gpu_check.sh --prepare DIR [--build TREE] | --carried DIR [--out OUT] | --emulated [--build TREE] [--out OUT] [--skip-model]" >&2; exit 2 ;;
  esac
done
[ -n "$mode" ] || { echo "gpu_check.sh: give --prepare DIR, --carried DIR or --emulated" >&2; exit 2; }

# The binaries a run needs, and the libraries beside them that the device machine lacks.
binaries=(tests/kvpress_tests benchmarks/kvpress_bench_gpu)

if [ "$mode" = prepare ]; then
  grep -q '^KVPRESS_WITH_CUDA:BOOL=ON' "$tree/CMakeCache.txt" 2>/dev/null ||
    { echo "gpu_check.sh: $tree is not a build with CUDA kernels (KVPRESS_WITH_CUDA=ON)" >&2; exit 1; }
  cmake --build "$tree" --target kvpress_tests kvpress_bench_gpu >/dev/null || exit 1
  # nvcc's flags in the tree name the code it compiled (the toolkit here has no cuobjdump).
  grep -q 'code=\[compute_90,sm_90\]\|code=sm_90' "$tree/build.ninja" ||
    { echo "gpu_check.sh: $tree compiles no sm_90 code (CMAKE_CUDA_ARCHITECTURES)" >&2; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/lib"
  for b in "${binaries[@]}"; do cp "$tree/$b" "$dir/bin/"; done
  cp -P "$tree"/libkvpress.so* "$tree"/src/llama/libkvpress_llama.so* "$dir/lib/"
  # The CUDA runtime the library was linked with (the torch wheel's own may be another build).
  cudart="$(ldd "$tree/libkvpress.so" | awk '/libcudart/ {print $3}')"
  [ -n "$cudart" ] && cp -L "$cudart" "$dir/lib/"
  python="${KVPRESS_PYTHON:-$HOME/.cache/kvpress-cpp/venv/bin/python}"
  {
    echo "commit $(git -C "$root" rev-parse --short HEAD)"
    echo "torch $("$python" -c 'import torch; print(torch.__version__)')"
    echo "cuda code $(grep -o 'code=[^ ]*sm_[0-9]*[^ ]*' "$tree/build.ninja" | sort -u | tr '\n' ' ')"
  } >"$dir/manifest.txt"
  du -sh "$dir"
  exit 0
fi

case "$mode" in
  carried) bin="$dir/bin"; out="${out:-$dir/out}" ;;
  emulated) bin="$tree"; out="${out:-$tree/gpu_check}" ;;
esac
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
start=$SECONDS
failed=0
# record NAME WHAT SECONDS: one line of the summary.
record() {
  printf '%-16s %-34s %4ds\n' "$1" "$2" "$3" | tee -a "$summary"
}
# step NAME TIMEOUT CMD...: runs CMD under TIMEOUT seconds into $out/NAME.log, records the result.
step() {
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS rc
  printf '\n== %s (at %ds, limit %ds)\n' "$name" $((SECONDS - start)) "$limit"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 40 "$out/$name.log"
  local what=ok
  [ "$rc" = 0 ] || { what="FAILED (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"; failed=1; }
  record "$name" "$what" $((SECONDS - t0))
}

if [ "$mode" = carried ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "gpu_check.sh: no NVIDIA GPU (nvidia-smi)" >&2; exit 1; }
  python="${KVPRESS_PYTHON:-/opt/torch/.venv/bin/python}"
  torch_lib="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  export LD_LIBRARY_PATH="$dir/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  {
    cat "$dir/manifest.txt"
    echo "device torch $("$python" -c 'import torch; print(torch.__version__)')"
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  } >"$out/environment.log" 2>&1
  # Every library resolves (the carried ones, torch's, the system's): else nothing can run.
  step libraries 20 bash -c 'for f in "$0"/bin/* "$0"/lib/*.so; do ldd "$f"; done | tee /dev/stderr | (! grep "not found")' "$dir"
  # A skip on a GPU machine means a CUDA half did not run: a failure here.
  step cuda_tests 150 bash -c '"$0" --gtest_filter="*Cuda*" | tee /dev/stderr | (! grep -q "^\[  SKIPPED \]")' \
    "$bin/kvpress_tests"
  step bench_fp32 110 "$bin/kvpress_bench_gpu" --seq 16384 --dtype fp32
  step bench_bf16 110 "$bin/kvpress_bench_gpu" --seq 16384 --dtype bf16
else
  {
    grep -m1 'model name' /proc/cpuinfo
    echo "commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  } >"$out/environment.log" 2>&1
  if [ "$skip_model" = 1 ]; then
    record cuda_model "skipped (--skip-model)" 0
  else
    step cuda_model 300 "$bin/tests/kvpress_cuda_emulation_tests"
  fi
  # On a machine without a GPU the CUDA halves skip; their CPU halves must pass.
  step cuda_tests 150 "$bin/tests/kvpress_tests" --gtest_filter='*Cuda*'
  step bench_fp32 110 "$bin/benchmarks/kvpress_bench_gpu" --device cpu --seq 2048 --repeats 1 --dtype fp32
  step bench_bf16 110 "$bin/benchmarks/kvpress_bench_gpu" --device cpu --seq 2048 --repeats 1 --dtype bf16
fi
record total "$([ "$failed" = 0 ] && echo ok || echo FAILED)" $((SECONDS - start))
exit "$failed"
