#!/usr/bin/env bash
# Fails, naming them, when include/kvpress/kvpress.h misses a public header of the core library
# (kvpress/*.h, kvpress/presses/*.h, kvpress/io/*.h).
set -euo pipefail
cd "$1"
status=0
for header in kvpress/*.h kvpress/presses/*.h kvpress/io/*.h; do
  [ "$header" = kvpress/kvpress.h ] && continue
  if ! grep -qF "#include \"$header\"" kvpress/kvpress.h; then
    echo "kvpress/kvpress.h does not include $header"
    status=1
  fi
done
exit $status
