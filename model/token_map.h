// TokenMap: the many-to-one compression of a tokenizer's raw ids (docs/math.md, section 2). Every raw id gets a dense
// compressed id, in order of first appearance of its key; the key is the normalised decode of the id alone, or the raw
// piece when the decode is lossy (contains U+FFFD), or the decode itself when normalising leaves nothing.
//
//   ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::Load(path));
//   TokenMap map = TokenMap::Build(tokenizer);
//   RETURN_IF_ERROR(map.CheckAgainst(config));      // compressed size must equal engram_compressed_vocab_size
//
// Immutable value; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/tokenizer.h"

namespace engram {

class TokenMap {
 public:
  static TokenMap Build(const Tokenizer& tokenizer);
  static TokenMap FromIds(std::vector<int32_t> ids);  // e.g. read back from a segment

  int64_t raw_size() const { return static_cast<int64_t>(ids_.size()); }
  int64_t compressed_size() const { return compressed_; }
  const std::vector<int32_t>& ids() const { return ids_; }
  int32_t operator[](int64_t raw) const { return ids_[static_cast<size_t>(raw)]; }

  // The map as little-endian int32 bytes, and its SHA-256 in lower-case hex.
  std::string Bytes() const;
  std::string Sha256Hex() const;

  // Fails, naming both numbers, when the compressed size differs from the config's: every hash multiplier derives
  // from it, so the tables would be silently rehashed.
  absl::Status CheckAgainst(const EngramConfig& config) const;

 private:
  std::vector<int32_t> ids_;
  int64_t compressed_ = 0;
};

// The key of one raw id (exposed for tests and diagnostics).
std::string TokenMapKey(const Tokenizer& tokenizer, int64_t id);

}  // namespace engram
