#!/usr/bin/env bash
# The README's test command: install what is missing, build, run every test (labels unit, integration, gpu; a gpu
# test exits 77, reported as skipped, only when there is no GPU; any CUDA error fails it). Ends with one line saying
# how many GPU tests actually ran and how many were skipped. Exits non-zero when anything fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
log=$(mktemp /tmp/engram-ctest.XXXXXX)
trap 'rm -f "$log"' EXIT
rc=0
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@" 2>&1 | tee "$log" || rc=$?
# GPU tests: the names ctest lists under the gpu label, and how each ended in this run.
ran=0 skipped=0 failed=0 absent=0
while read -r name; do
  line=$(grep -E "Test +#[0-9]+: ${name} " "$log" | tail -1 || true)
  case "$line" in
    *"Passed"*) ran=$((ran + 1)) ;;
    *"Skipped"*) skipped=$((skipped + 1)) ;;
    "") absent=$((absent + 1)) ;;
    *) ran=$((ran + 1)); failed=$((failed + 1)) ;;
  esac
done < <(ctest --test-dir "$build" -N -L gpu | sed -nE 's/^ *Test +#[0-9]+: ([^ ]+).*/\1/p')
echo "GPU tests: ${ran} ran (${failed} failed), ${skipped} skipped (no GPU), ${absent} not run in this selection"
exit "$rc"
