// The decoder pipeline of a tokenizer.json (model/tokenizer.h): the steps Tokenizer supports (ByteLevel, Metaspace,
// ByteFallback, Fuse, Replace with a String or Regex pattern, Strip; a Sequence is flattened into its steps), their
// parse from the `decoder` object, and their application to the token list of one id as the reference library's
// `decode_chain` does. A Replace regex runs under ICU's time and stack limits and a RegexBudget shared by a sequence
// of decodes, so that a catastrophically backtracking pattern fails instead of running for minutes.
//
// Internal to model/tokenizer*.cc. Ownership: a DecoderStep owns its compiled regex; the Tokenizer owns its steps.
// Thread-safety: a parsed step is immutable and may be applied from several threads at once, each with its own
// RegexBudget; ParseDecoder and Member are pure.
#pragma once

#include <unicode/regex.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace engram {

// One step of the decoder pipeline. Each works on the list of token strings, as `decode_chain` does.
struct DecoderStep {
  enum Kind { kByteLevel, kMetaspace, kByteFallback, kFuse, kReplace, kStrip } kind;
  // Metaspace
  std::string replacement;  // UTF-8 of the replacement char
  bool strip_first_space = true;
  // Replace
  std::string pattern;  // String pattern (UTF-8), or regex source
  bool is_regex = false;
  std::string content;
  std::unique_ptr<icu::RegexPattern> regex;
  // Strip
  std::string strip_content;
  int64_t strip_start = 0, strip_stop = 0;
};

// Bounds on the regex engine's work (ICU RegexMatcher limits), so that a catastrophically backtracking pattern in
// a hostile tokenizer.json fails the load instead of running for minutes. ICU counts time in units of 10,000
// backtracking steps (about 0.2 ms on current CPUs): kRegexTimeLimit bounds one match operation (~50 ms);
// kRegexLoadBudget bounds the units spent by all matches while Parse checks every id; kRegexStackLimitKiB bounds
// the backtrack stack. Real Replace decoders (literal-like patterns on short pieces) use a handful of units; a
// hostile one costs the load at most ~2 s of CPU before it fails.
inline constexpr int32_t kRegexTimeLimit = 200;
inline constexpr int64_t kRegexLoadBudget = 10000;
inline constexpr int32_t kRegexStackLimitKiB = 1024;

// Units of regex work left for a sequence of decodes (shared by the matches of one Parse check).
struct RegexBudget {
  int64_t units_left = kRegexLoadBudget;
};

namespace tokenizer_internal {

// The member `key` of object `d`, or nullptr (never inserts, never asserts).
const nlohmann::json* Member(const nlohmann::json& d, const char* key);

// Appends the steps of decoder `d` (a Sequence flattened; null: none) to `out`; errors name `origin`.
// Recursion is bounded by the JSON nesting limit (json_util.h).
absl::Status ParseDecoder(const nlohmann::json& d, const std::string& origin,
                          std::vector<std::unique_ptr<DecoderStep>>& out);

// Applies one step to the token list (the library's decode_chain); `lossy` records U+FFFD substitutions. Only a
// regex Replace can fail (over its limits).
absl::Status Apply(const DecoderStep& s, std::vector<std::string>& toks, bool& lossy, RegexBudget& budget);

}  // namespace tokenizer_internal
}  // namespace engram
