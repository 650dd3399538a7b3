#!/usr/bin/env bash
# The C++ suite on the path an AVX2-only CPU takes (docs/ARCHITECTURE.md, "Register tiles"), on a
# machine with AVX-512: our AVX2 register tiles instead of the AVX-512 ones (KVPRESS_DISABLE_AVX512=1), libtorch's own
# CPU kernels capped at AVX2 (ATEN_CPU_CAPABILITY=avx2), and MKL's and oneDNN's too
# (MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2). oneDNN's cap is needed on CPUs with AMX
# (Intel Sapphire Rapids onwards): without it torch's bfloat16 attention, capped at AVX2, still asks
# oneDNN whether to pack for AMX, is told yes, and stops ("pack_vnni2 is only supported when
# avx512 is supported"); an AVX2-only CPU has no AMX either.
# The parity fixtures are made again by kvpress under the same caps (they are the reference an
# AVX2 machine would make), then the unit tests and the press parity runs of kvpress_tests, in two
# shards side by side. The tests of the register tiles check the AVX2 ones here.
# On a CPU without AVX-512 the main run already took this path: this script says so and stops.
# Needs the build of scripts/test.sh ($KVPRESS_BUILD_DIR, default build/).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "avx2 path: this CPU has no AVX-512F, so the main test run took the AVX2 path already"
  exit 0
fi
caps=(KVPRESS_DISABLE_AVX512=1 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
fixtures="$build/fixtures-avx2"
env "${caps[@]}" "$python" "$root/tests/reference/make_fixtures.py" --out "$fixtures"
# Everything but the model-level parity suites (their fixtures come from the other reference
# scripts, made without the caps; tests/CMakeLists.txt lists them) and the 16 GiB large-indices test
# (scripts/test.sh runs it).
filter="-$(cat "$build/tests/model_level_parity.filter"):LargeIndices.*"
pids=()
for shard in 0 1; do
  kvpress_run_gtest "$build/avx2-shard$shard.log" kvpress_tests "$filter" "${caps[@]}" KVPRESS_FIXTURES="$fixtures" \
    GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$shard &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
kvpress_gtest_totals "$build"/avx2-shard*.log
exit $status
