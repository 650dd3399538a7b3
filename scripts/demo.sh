#!/usr/bin/env bash
# Installs, builds and runs the main demo (examples/demo.cpp): SmolLM2-135M-Instruct (installed by
# scripts/setup.sh) asked for a code hidden in a long document with and without compression, then
# on the bundled TinyStories-656K model a story continuation and the quality table.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
kvpress_build
"$build/examples/kvpress_demo" "$@"
