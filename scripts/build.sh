#!/usr/bin/env bash
# Installs what is missing (scripts/bootstrap.sh), configures and builds engram into ./build (or $ENGRAM_BUILD_DIR).
# Extra arguments go to CMake's configure step, e.g. -DENGRAM_CUDA=OFF.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/bootstrap.sh"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja "$@" > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)"
