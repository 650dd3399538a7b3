#!/usr/bin/env bash
# Installs, builds and runs the worked example of context-calibrated compression on
# TinyStories-656K (docs/CALIBRATION.md). Extra arguments go to the example, e.g. --press SnapKVPress.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
kvpress_build
"$build/examples/kvpress_calibrate_tinystories" "$@"
