#include "model/token_map.h"

#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "model/normalize.h"
#include "model/sha256.h"

namespace engram {

std::string TokenMapKey(const Tokenizer& tokenizer, int64_t id) {
  DecodedToken d = tokenizer.Decode(id);
  if (d.lossy || d.text.find("\xEF\xBF\xBD") != std::string::npos) {
    return tokenizer.IdToToken(id).value_or("");
  }
  std::string key = NormalizeEngramKey(d.text);
  return key.empty() ? d.text : key;
}

TokenMap TokenMap::Build(const Tokenizer& tokenizer) {
  TokenMap m;
  m.ids_.resize(static_cast<size_t>(tokenizer.size()));
  std::unordered_map<std::string, int32_t> seen;
  seen.reserve(static_cast<size_t>(tokenizer.size()));
  for (int64_t id = 0; id < tokenizer.size(); ++id) {
    auto [it, inserted] = seen.try_emplace(TokenMapKey(tokenizer, id), static_cast<int32_t>(seen.size()));
    m.ids_[static_cast<size_t>(id)] = it->second;
  }
  m.compressed_ = static_cast<int64_t>(seen.size());
  return m;
}

TokenMap TokenMap::FromIds(std::vector<int32_t> ids) {
  TokenMap m;
  int32_t max_id = -1;
  for (int32_t v : ids) max_id = std::max(max_id, v);
  m.ids_ = std::move(ids);
  m.compressed_ = max_id + 1;
  return m;
}

std::string TokenMap::Bytes() const {
  std::string out(ids_.size() * 4, '\0');
  for (size_t i = 0; i < ids_.size(); ++i) {
    auto v = static_cast<uint32_t>(ids_[i]);
    for (int b = 0; b < 4; ++b) out[4 * i + static_cast<size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xFF);
  }
  return out;
}

std::string TokenMap::Sha256Hex() const { return engram::Sha256Hex(Bytes()); }

absl::Status TokenMap::CheckAgainst(const EngramConfig& config) const {
  if (compressed_ != config.compressed_vocab_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("the tokenizer compresses to ", compressed_,
                     " ids but config.json says engram_compressed_vocab_size = ", config.compressed_vocab_size,
                     ": every hash multiplier derives from it, the tables would be silently rehashed"));
  }
  if (config.pad_token_id >= raw_size()) {
    return absl::FailedPreconditionError(absl::StrCat("engram_pad_token_id ", config.pad_token_id,
                                                      " is not a token of the tokenizer (", raw_size(), " ids)"));
  }
  return absl::OkStatus();
}

}  // namespace engram
