#!/usr/bin/env bash
# Installs everything kvpress-cpp needs to build and test; idempotent and fast when already done.
#   - Debian packages (fmt, nlohmann-json, PCRE2 and utf8proc (the tokenizer's Unicode regexes and
#     NFC), GoogleTest, Google Benchmark, cmake, pkg-config, clang-format)
#   - a Python venv with the pinned torch wheel (provides libtorch + its CMake config) and the
#     pinned reference stack used only by tests (kvpress 0.5.5 + transformers), and matplotlib
#     for the charts (scripts/plot.py: kvpress-cli eval --png, benchmarks/compare_kvpress.py)
# The venv lives outside the source tree so fresh clones reuse it: $KVPRESS_VENV or
# ~/.cache/kvpress-cpp/venv. Prints the venv path on its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVPRESS_VENV:-$HOME/.cache/kvpress-cpp/venv}"
requirements="$here/scripts/requirements.txt"

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

# `setup.sh --apt PACKAGE...`: only those packages (the sanitized trees' clang, scripts/common.sh).
if [ "${1:-}" = --apt ]; then
  shift
  install_debian_packages "$@"
  exit 0
fi

install_debian_packages cmake g++ make ninja-build ccache pkg-config libfmt-dev nlohmann-json3-dev libpcre2-dev \
  libutf8proc-dev libgtest-dev libgmock-dev libbenchmark-dev clang-format

stamp="$venv/.kvpress-requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$stamp"; then
  echo "setup: creating Python environment in $venv (torch wheel is large; first run takes minutes)" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$stamp"
fi
echo "$venv"
