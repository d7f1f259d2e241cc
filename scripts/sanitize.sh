#!/usr/bin/env bash
# Builds the host code under a sanitizer (CMakePresets.json: asan-ubsan or tsan; CUDA off, so no GPU code) into
# build-asan / build-tsan and runs the CPU tests there. Any report fails the run (the runtimes halt on the first).
#   scripts/sanitize.sh asan-ubsan   AddressSanitizer + UndefinedBehaviorSanitizer: every unit and integration test,
#                                    then the Python package's tests with the runtime preloaded into python3
#   scripts/sanitize.sh tsan         ThreadSanitizer: the tests labelled `unit` (the daemon's and client's threads
#                                    against their own locks; gRPC, uninstrumented, stays outside). In CI.
#   scripts/sanitize.sh tsan integration
#                                    the same build, then the integration tests (real engramd and replica processes,
#                                    all instrumented) minus those the instrument breaks (below). 12 min on two
#                                    cores alone, 28 beside a build; by hand, not in CI: next to ASan it would take
#                                    CI to about 70 of its 90 minutes, and its timed waits under a 5-15x slowdown
#                                    are the kind of failure that turns CI red without a bug
# Suppressions (tests/sanitizers/*.supp) name only third-party code.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
preset=${1:-asan-ubsan}
case "$preset" in
  asan-ubsan) build=$root/build-asan ;;
  tsan) build=$root/build-tsan ;;
  *) echo "sanitize: unknown preset '$preset' (asan-ubsan | tsan)" >&2; exit 2 ;;
esac
"$root/scripts/bootstrap.sh"
cd "$root"
cmake --preset "$preset" -DENGRAM_WERROR="${ENGRAM_WERROR:-OFF}" > /dev/null
cmake --build --preset "$preset" -j "$(nproc)"
supp=$root/tests/sanitizers
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
# handle_segv=0, handle_sigbus=0: some tests fault on purpose (a write probe into a read-only segment must die of
# SIGSEGV, a truncated mapping of SIGBUS) and check the signal; ASan would turn it into its own report and exit code.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=0:handle_segv=0:handle_sigbus=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
# handle_segv=0, handle_sigbus=0 as for ASan: a write probe must die of its own SIGSEGV (under TSan's handler it
# spun instead).
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:handle_segv=0:handle_sigbus=0:suppressions=$supp/tsan.supp"
if [ "$preset" = tsan ]; then
  ctest --test-dir "$build" -L unit -j "$(nproc)" --output-on-failure
  if [ "${2:-}" = integration ]; then
    # Left out, each for the instrument: the memory-footprint and memlock checks (as under ASan); the tests that
    # wait a fixed time for a 1-2 GiB publish, which TSan's 5-15x slowdown runs past; and the oversized-message
    # check, whose refusal gRPC (uninstrumented) delivers as a dropped connection under TSan's timing.
    tsan_skip='SoakSessionsKillsAndStatusLeakNothing|FourSharedReplicasHoldOneCopyOfTheTable|FourSeparateDpOneEnginesShareOneCopy'
    tsan_skip+='|RegistrationFailureFallsBackWithRegisterFailed|PublishesSharesAndHoldsLeases'
    tsan_skip+='|CrashDebrisIsRemovedAndRestartAdoptsWithoutReadingTables|HostileClientsAndForeignUsersDoNotHurtIt'
    ctest --test-dir "$build" -L integration -E "$tsan_skip" -j "$(nproc)" --output-on-failure
  fi
  exit 0
fi
# Left out under ASan, each for a reason of the instrument, not of the code: the memory-footprint checks (the
# daemon's RSS over a soak, replicas' PSS against one copy of the table) measure the process, which ASan's shadow
# memory and quarantine inflate; and the memlock-refusal check, whose replica pins anyway under ASan (to be
# understood: the plain build refuses as expected).
asan_skip='SoakSessionsKillsAndStatusLeakNothing|FourSharedReplicasHoldOneCopyOfTheTable|FourSeparateDpOneEnginesShareOneCopy'
asan_skip+='|RegistrationFailureFallsBackWithRegisterFailed'
ctest --test-dir "$build" -L "unit|integration" -E "$asan_skip" -j "$(nproc)" --output-on-failure
# The Python package loads build-asan's libengram_c.so into Debian's uninstrumented python3: the runtime must come
# first in the process; python3's own allocations at exit are not ours (leak detection off there).
ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
  PYTHONPATH="$root/python" ENGRAM_LIB="$build/client/libengram_c.so" ENGRAM_BUILD_DIR="$build" \
  /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/tests/python"
