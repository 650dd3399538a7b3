#!/usr/bin/env bash
# Fails, naming them, when the umbrella header include/kvpress/kvpress.h misses a public header of
# the core library: kvpress/*.h and kvpress/io/*.h directly, kvpress/presses/*.h through the
# kvpress/presses.h that CMake generates from KVPRESS_PRESSES (usage: $0 SOURCE_INCLUDE BUILD_INCLUDE).
set -euo pipefail
source_include=$1
generated=$2/kvpress/presses.h
cd "$source_include"
status=0
check() {  # check HEADER FILE: FILE includes HEADER
  if ! grep -qF "#include \"$1\"" "$2"; then
    echo "$2 does not include $1"
    status=1
  fi
}
for header in kvpress/*.h kvpress/io/*.h; do
  [ "$header" = kvpress/kvpress.h ] || check "$header" kvpress/kvpress.h
done
check kvpress/presses.h kvpress/kvpress.h
for header in kvpress/presses/*.h; do
  check "$header" "$generated"
done
exit $status
