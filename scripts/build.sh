#!/usr/bin/env bash
# Installs what is missing (scripts/bootstrap.sh), configures and builds engram into ./build (or $ENGRAM_BUILD_DIR).
# Extra arguments go to CMake's configure step, e.g. -DENGRAM_CUDA=OFF. ENGRAM_WERROR=ON in the environment makes
# warnings errors (CI sets it; the default build must work on any compiler Debian ships).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/bootstrap.sh"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DENGRAM_WERROR="${ENGRAM_WERROR:-OFF}" "$@" > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)"
