#!/usr/bin/env bash
# Installs, builds and runs the main demo on the bundled TinyStories-656K model: a story
# continuation with and without compression, then the quality table (examples/demo.cpp).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
kvpress_build
"$build/examples/kvpress_demo" "$@"
