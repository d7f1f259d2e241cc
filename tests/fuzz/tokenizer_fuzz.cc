// Fuzz target: Tokenizer::Parse (model/tokenizer.h) and, for accepted tokenizers, decoding and the token-map key
// of the first ids (model/token_map.h).
#include <string>

#include "model/token_map.h"
#include "model/tokenizer.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto tok = engram::Tokenizer::Parse(text, "fuzz/tokenizer.json");
  if (!tok.ok()) return 0;
  const int64_t n = tok->size() < 64 ? tok->size() : 64;
  for (int64_t id = -1; id <= n; ++id) {
    (void)tok->Decode(id);
    if (id >= 0 && id < tok->size()) (void)engram::TokenMapKey(*tok, id);
  }
  return 0;
}
