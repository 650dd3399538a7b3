#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, KVPRESS_FUZZ=ON) in the AddressSanitizer tree
# that scripts/test_sanitized.sh shares (build-asan/; common.sh, kvpress_configure_asan_tree) and runs
# each for SECONDS (default 30) on its seed corpus and dictionary. Fails on any crash, leak, timeout,
# out-of-memory or sanitizer report; the input that caused it is kept in build-asan/artifacts/.
#   scripts/fuzz.sh [SECONDS] [TARGET...]     TARGET: safetensors gguf tokenizer config make_press
# Environment: KVPRESS_ASAN_BUILD_DIR (default build-asan), KVPRESS_FUZZ_CORPUS (keep the working
# corpora there instead of a temporary folder), KVPRESS_JOBS (build jobs, default nproc).
# The committed seeds stay as they are: libFuzzer writes new inputs only to the working corpus.
set -euo pipefail
seconds="${1:-30}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors gguf tokenizer config make_press)
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVPRESS_BUILD_DIR="${KVPRESS_ASAN_BUILD_DIR:-$here/../build-asan}"
source "$here/common.sh"

build_start=$SECONDS
kvpress_configure_asan_tree
cmake --build "$build" -j "$jobs" --target "${targets[@]/#/kvpress_fuzz_}"
echo "fuzz: built in $((SECONDS - build_start)) s"

fuzz_dir="$root/tests/fuzz"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
# One intra-op thread: the inputs are tiny, and libtorch's pool would only add start-up noise.
export OMP_NUM_THREADS=1
artifacts="$build/artifacts"
mkdir -p "$artifacts"
corpus_root="${KVPRESS_FUZZ_CORPUS:-$(mktemp -d)}"
[ -n "${KVPRESS_FUZZ_CORPUS:-}" ] || trap 'rm -rf "$corpus_root"' EXIT

summary=()
failed=()
# The targets run $jobs at a time (each fuzzer is one process on one core, so each still gets its
# whole ${seconds}s of a core), then their logs are read in order.
for target in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  work="$corpus_root/$target"
  log="$build/fuzz-$target.log"
  mkdir -p "$work"
  echo "fuzz: $target for ${seconds}s (log: $log)"
  # -timeout: seconds one input may take; -rss_limit_mb also bounds any single allocation.
  (
    status=0
    "$build/tests/fuzz/kvpress_fuzz_$target" "$work" "$fuzz_dir/$target" -dict="$fuzz_dir/$target.dict" \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$target-" >"$log" 2>&1 || status=$?
    echo "$status" >"$build/fuzz-$target.status"
  ) &
done
wait
for target in "${targets[@]}"; do
  log="$build/fuzz-$target.log"
  status="$(cat "$build/fuzz-$target.status")"
  if [ "$status" -ne 0 ] || grep -qE "ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:" "$log"; then
    failed+=("$target")
    echo "fuzz: $target FAILED (exit $status); the end of $log:" >&2
    tail -n 60 "$log" >&2
    ls "$artifacts" | sed -n "/^$target-/s|^|  input: $artifacts/|p" >&2
    continue
  fi
  # libFuzzer's final figures: executions, exec/s, coverage (cov: edges, ft: features), corpus.
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
  last=$(grep -E "^#[0-9]+.*cov: " "$log" | tail -n 1)
  cov=$(sed -E 's/.*cov: ([0-9]+).*/\1/' <<<"$last")
  ft=$(sed -E 's/.*ft: ([0-9]+).*/\1/' <<<"$last")
  corp=$(sed -E 's/.*corp: ([^ ]+).*/\1/' <<<"$last")
  summary+=("$(printf '%-12s %10s %8s %7s %7s %14s %7s' "$target" "$runs" "$speed" "$cov" "$ft" "$corp" "$rss")")
done

printf '%-12s %10s %8s %7s %7s %14s %7s\n' target executions exec/s cov ft corpus rss_mb
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} target(s) ran ${seconds}s each with no crash, leak, timeout or sanitizer report"
