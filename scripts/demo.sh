#!/usr/bin/env bash
# The README's first command: build, generate a small real checkpoint, and show what engram derives from it:
# the plan for TP 1 and 2 on this node's /dev/shm, the compressed token map, and the hash ids of a request.
# (The daemon and replicas join this demo when they land; see README "Status".)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ENGRAM_BUILD_DIR:-$root/build}
"$root/scripts/build.sh" > /dev/null
work=${ENGRAM_DEMO_DIR:-/tmp/engram-demo}
rm -rf "$work"
mkdir -p "$work"
echo "== engram-mkckpt: a 256 MiB DeepseekV41ForCausalLM checkpoint in $work/ckpt"
"$build/tools/engram-mkckpt" --out "$work/ckpt" --table-mib 256
echo
echo "== engramctl plan --tp 2"
"$build/tools/engramctl" plan --checkpoint "$work/ckpt" --tp 2
echo
echo "== engramctl tokenmap"
"$build/tools/engramctl" tokenmap --tokenizer "$work/ckpt/tokenizer.json"
echo
echo "== engramctl hash (tokens 300..305, the 4th one DEAD)"
"$build/tools/engramctl" hash --checkpoint "$work/ckpt" --tokens 300,301,302,303,304,305 --dead 0,0,0,1,0,0
