#!/usr/bin/env bash
# Installs, builds and runs the main demo on the bundled TinyStories-656K model.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
kvpress_build
kvpress_fixtures --only real
"$build/examples/kvpress_demo" "$@"
