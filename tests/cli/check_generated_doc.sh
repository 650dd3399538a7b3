#!/usr/bin/env bash
# Fails when a generated doc differs from what its command prints now, showing the difference and
# how to regenerate it (usage: $0 DOC COMMAND [ARG...]).
set -euo pipefail
doc=$1
shift
generated=$(mktemp)
trap 'rm -f "$generated"' EXIT
"$@" >"$generated"
if ! diff -u "$doc" "$generated"; then
  echo "$doc is out of date: regenerate it with: $(basename "$1") ${*:2} > $doc"
  exit 1
fi
