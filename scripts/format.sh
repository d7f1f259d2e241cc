#!/usr/bin/env bash
# Formats engram's C++, C and CUDA sources with clang-format (.clang-format: Google style, 120 columns).
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   change nothing; list the files that differ and exit 1 when any does
# Generated code, third-party sources and the engines' source caches are not ours and are left alone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ! command -v clang-format >/dev/null; then
  echo "format: clang-format is not installed (scripts/bootstrap.sh installs it)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.c' '*.cu' '*.cuh' | grep -v '^tests/fuzz/corpus/')
if [ "${1:-}" = "--check" ]; then
  bad=0
  for f in "${files[@]}"; do
    if ! clang-format --style=file "$f" | cmp -s - "$f"; then
      echo "format: $f differs from .clang-format (run scripts/format.sh)"
      bad=1
    fi
  done
  [ "$bad" = 0 ] && echo "format: ${#files[@]} files follow .clang-format"
  exit "$bad"
fi
clang-format --style=file -i "${files[@]}"
echo "format: ${#files[@]} files formatted"
