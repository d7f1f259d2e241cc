#!/usr/bin/env bash
# The README's first command: build, generate a small real checkpoint, start engramd on it, attach 4 replica
# sessions (DP 4, TP 1) that share one table and check rows against the checkpoint, show `engramctl status`, then
# start one more replica in a private mount namespace with its own /dev/shm (what a container without --ipc=host
# gets) and show it falling back with SHM_NOT_VISIBLE. Cleans up after itself.
# The replicas here are `engramctl attach` sessions (CPU verification); libengram_client replaces them when it lands.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/build.sh" > /dev/null
bin=$build/tools
work=${ENGRAM_DEMO_DIR:-/tmp/engram-demo}
shm=${ENGRAM_DEMO_SHM:-/dev/shm}
sock=$work/engramd.sock
rm -rf "$work"
mkdir -p "$work"
pids=()
cleanup() {
  "$bin/engramctl" unload --socket "$sock" --checkpoint "$work/ckpt" > /dev/null 2>&1 || true
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  wait 2> /dev/null || true
}
trap cleanup EXIT

echo "== engram-mkckpt: a 256 MiB DeepseekV41ForCausalLM checkpoint"
"$bin/engram-mkckpt" --out "$work/ckpt" --table-mib 256
echo
echo "== engramctl plan --tp 1"
"$bin/engramctl" plan --checkpoint "$work/ckpt" --tp 1 --shm-dir "$shm" | tail -3
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
echo "== 4 replicas (DP 4, TP 1) attach and verify 256 random rows per layer against the checkpoint"
for r in 0 1 2 3; do
  "$bin/engramctl" attach --socket "$sock" --checkpoint "$work/ckpt" --shm-dir "$shm" --dp-size 4 --dp-rank $r \
    --ticket --verify 256 --hold 30 > "$work/replica$r.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$(cat "$work"/replica*.log 2> /dev/null | grep -c decision)" -ge 4 ] && break
  sleep 0.1
done
for r in 0 1 2 3; do echo "  replica $r: $(head -1 "$work/replica$r.log")"; done
echo
echo "== one more replica in a private mount namespace with its own /dev/shm (no --ipc=host)"
if unshare -m --propagation private true 2> /dev/null; then
  unshare -m --propagation private sh -c "mount -t tmpfs -o size=64m tmpfs /dev/shm && \
    '$bin/engramctl' attach --socket '$sock' --checkpoint '$work/ckpt' --shm-dir /dev/shm --dp-size 4 --dp-rank 3 \
    --hold 30" > "$work/private.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -q decision "$work/private.log" 2> /dev/null && break; sleep 0.1; done
  echo "  $(head -1 "$work/private.log")"
else
  echo "  (skipped: creating a mount namespace needs root)"
fi
echo
echo "== engramctl status"
"$bin/engramctl" status --socket "$sock"
