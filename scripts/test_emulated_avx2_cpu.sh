#!/usr/bin/env bash
# The leverage-score parity runs on an emulated AVX2-only AMD EPYC (Zen 3, "EPYC-Milan": AVX2 + FMA,
# no AVX-512), for machines that have AVX-512. Unlike scripts/test_avx2_path.sh (which caps
# libtorch, MKL and our kernels by switches), every library here asks the CPU what it has and
# gets a Zen 3's answer: qemu's user-mode emulator runs kvpress (making the fixtures) and
# kvpress_tests (replaying them) on that CPU model. Slow (about 4 minutes for these 56 runs), so
# it covers the presses whose bf16 parity failed on a real Zen 3 (LeverageScorePress, and
# CompactorPress, which shares its leverage), on the real model. Not part of scripts/test.sh.
# Needs the build of scripts/test.sh ($KVPRESS_BUILD_DIR, default build/) and qemu-user (Debian's
# qemu-user package; installed here if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if ! command -v qemu-x86_64 >/dev/null; then
  sudo_if_needed=()
  [ "$(id -u)" = 0 ] || sudo_if_needed=(sudo)
  "${sudo_if_needed[@]}" apt-get install -y -q qemu-user >/dev/null
fi
cpu=EPYC-Milan-v1
emulate=(qemu-x86_64 -cpu "$cpu")
# qemu warns once per CPU feature its TCG lacks (none that the libraries use); keep the log short.
quiet() { grep -v "TCG doesn't support requested feature" || true; }
echo "emulated $cpu: $("${emulate[@]}" "$python" -c 'import torch; print("torch CPU capability", torch.backends.cpu.get_cpu_capability())' 2>&1 | quiet)"
fixtures="$build/fixtures-emulated-zen3"
"${emulate[@]}" "$python" "$root/tests/reference/make_fixtures.py" --out "$fixtures" --only real \
  --presses LeverageScorePress,CompactorPress 2>&1 | quiet
KVPRESS_FIXTURES="$fixtures" OMP_NUM_THREADS=1 "${emulate[@]}" "$build/tests/kvpress_tests" \
  --gtest_filter='Kvpress/ParityRun.*' 2>&1 | quiet | grep -E '^\[  (PASSED|FAILED) |^\[==========\] .* ran|Failure' 
exit "${PIPESTATUS[0]}"
