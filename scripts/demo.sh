#!/usr/bin/env bash
# The README's first command: build, generate a small real checkpoint, start engramd on it, run 4 replicas (DP 4,
# TP 1) that share one table, show `engramctl status`, then one more replica in private mount and IPC namespaces
# with its own /dev/shm and the daemon's shm directory hidden (what a container without --ipc=host gets) that still
# shares, through the read-only descriptor engramd passes over its socket. Cleans up.
# The replicas are engram-replica processes (libengram_client; the CPU backend where there is no GPU): each hashes
# and looks up random token batches, gates them, and checks rows against the checkpoint files.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/build.sh" > /dev/null
bin=$build/tools
work=${ENGRAM_DEMO_DIR:-/tmp/engram-demo}
# The demo's daemon gets its own directory on the shm tmpfs (never /dev/shm itself, which a production engramd may own).
shm=${ENGRAM_DEMO_SHM:-$(mktemp -d /dev/shm/engram-demo.XXXXXX)}
sock=$work/engramd.sock
rm -rf "$work"
mkdir -p "$work"
pids=()
cleanup() {
  "$bin/engramctl" unload --socket "$sock" --checkpoint "$work/ckpt" > /dev/null 2>&1 || true
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  wait 2> /dev/null || true
  [ -n "${ENGRAM_DEMO_SHM:-}" ] || rm -rf "$shm"  # the directory this run made
}
trap cleanup EXIT
replica() {  # replica LOG ARGS...: starts one engram-replica in the background
  local log=$1
  shift
  "$bin/engram-replica" --socket "$sock" --checkpoint "$work/ckpt" --tokens 512 --batches 4 --verify 256 \
    --hold 5 "$@" > "$log" 2>&1 &
  pids+=($!)
}
wait_for() {  # wait_for FILE PATTERN
  for _ in $(seq 300); do grep -q "$2" "$1" 2> /dev/null && return 0; sleep 0.1; done
  return 1
}

echo "== engram-mkckpt: a 256 MiB DeepseekV41ForCausalLM checkpoint"
"$bin/engram-mkckpt" --out "$work/ckpt" --table-mib 256
echo
echo "== engramctl plan --tp 1 --dp 4"
"$bin/engramctl" plan --checkpoint "$work/ckpt" --tp 1 --dp 4 --shm-dir "$shm" | tail -4
echo
echo "== engramd (log: $work/engramd.log)"
"$build/daemon/engramd" --checkpoint "$work/ckpt" --tp 1 --shm-dir "$shm" --socket "$sock" > "$work/engramd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  "$bin/engramctl" status --socket "$sock" --json 2> /dev/null | grep -q '"state":"READY"' && break
  sleep 0.1
done
grep -E "publish_done|ready" "$work/engramd.log" | sed 's/^/  /'
echo
echo "== 4 replicas (DP 4, TP 1) attach and share"
for r in 0 1 2 3; do replica "$work/replica$r.log" --dp-size 4 --dp-rank $r; done
echo
echo "== one more replica in its own mount and IPC namespaces, /dev/shm and $shm hidden (no --ipc=host)"
if unshare -m -i --propagation private true 2> /dev/null; then
  hide=""  # the daemon's directory is gone with /dev/shm when it lives there; else hide it too
  case "$shm" in /dev/shm/*) ;; *) hide="mount -t tmpfs -o size=1m tmpfs '$shm' &&" ;; esac
  unshare -m -i --propagation private sh -c "mount -t tmpfs -o size=64m tmpfs /dev/shm && $hide \
    exec '$bin/engram-replica' \
    --socket '$sock' --checkpoint '$work/ckpt' --dp-size 4 --dp-rank 3 --tokens 512 \
    --batches 4 --verify 256 --hold 5" > "$work/private.log" 2>&1 &
  pids+=($!)
  wait_for "$work/private.log" '"attached"' || true
  grep -o "event=attached.*" "$work/private.log" | sed 's/^/  /' | cut -c1-160
else
  echo "  (skipped: creating mount and IPC namespaces needs root)"
fi
for r in 0 1 2 3; do wait_for "$work/replica$r.log" '"attached"' || true; done
echo
echo "== engramctl status"
"$bin/engramctl" status --socket "$sock"
echo
echo "== the replicas' results"
for f in "$work"/replica*.log "$work/private.log"; do
  [ -f "$f" ] || continue
  wait_for "$f" '"verified"' || true
  echo "  $(basename "$f" .log): $(grep '"verified"' "$f")"
done
