// Tokenizer: the parts of a Hugging Face `tokenizer.json` that the Engram token map needs (docs/math.md, section 2):
// the id -> piece table (model vocab plus added tokens, added tokens taking precedence as in the `tokenizers` library)
// and the decoder pipeline applied to a single id, special tokens kept, no clean-up. Added tokens take the ids the
// reference library gives them on load (see Parse), which equal the JSON's ids in every well-formed tokenizer.
//
// Supported models: BPE, WordLevel (vocab maps) and Unigram (vocab list). Supported decoders: ByteLevel, Metaspace,
// ByteFallback, Fuse, Replace (String or Regex pattern), Strip and Sequence of these; a tokenizer.json with another
// decoder is refused with its name rather than decoded approximately.
//
// The file is hostile input: Parse never throws; nesting, field types and sizes are checked (errors name the file
// and the field). A Replace decoder's regex runs under ICU's time and stack limits; when the decoder has one, Parse
// decodes every id under those limits and one overall budget, and fails (naming the pattern and the limit) rather
// than letting a catastrophically backtracking pattern run for minutes later.
//
// Immutable after Load; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace engram {

struct DecoderStep;  // one step of the decoder pipeline (tokenizer_decoder.h)
struct RegexBudget;  // regex work left for a sequence of decodes (tokenizer_decoder.h)

// What decoding one id produced: UTF-8 bytes, and whether they were lossy (invalid UTF-8 replaced by U+FFFD in the
// reference library). `text` holds the bytes as produced; when `lossy` the reference's text contains U+FFFD.
struct DecodedToken {
  std::string text;
  bool lossy = false;
};

class Tokenizer {
 public:
  static absl::StatusOr<Tokenizer> Load(const std::string& path);
  static absl::StatusOr<Tokenizer> Parse(const std::string& json_text, const std::string& origin);

  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Number of raw ids, as the reference library's len(tokenizer): distinct contents over the model vocab and the
  // added tokens. For a dense vocabulary this is max id + 1; ids without a piece (holes) decode to "".
  int64_t size() const { return size_; }
  // The raw piece (`id_to_token`): added token content or vocab entry; nullopt for a hole.
  std::optional<std::string> IdToToken(int64_t id) const;
  DecodedToken Decode(int64_t id) const;

 private:
  static absl::StatusOr<Tokenizer> ParseChecked(const std::string& json_text, const std::string& origin);
  // Decode, failing when a regex step goes over its limits or `budget`.
  absl::Status DecodeWithin(int64_t id, RegexBudget& budget, DecodedToken* out) const;

  std::vector<std::optional<std::string>> pieces_;  // indexed by id, up to max id
  int64_t size_ = 0;
  std::vector<std::unique_ptr<DecoderStep>> decoder_;  // empty: tokens joined by " " (a single token as is)
};

}  // namespace engram
