#!/usr/bin/env bash
# The README's test command: install what is missing, build, run every test (labels unit, integration, gpu;
# gpu tests skip without a GPU and say so). Exits non-zero when anything fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
