// Hostile-input JSON helpers for the checkpoint parsers (config.json, safetensors headers, tokenizer.json, the
// safetensors index): a parse that bounds nesting depth and never throws, and short excerpts of untrusted values
// for error messages.
//
// ParseUntrustedJson refuses text nested deeper than kMaxJsonDepth before nlohmann sees it (a cheap scan of
// brackets outside strings), because nlohmann's dump(), copy and comparison recurse once per level: a file of
// a million `[` would overflow the stack in an error path. Real Hugging Face files nest fewer than 10 levels
// (tokenizer.json's Sequence-of-Sequence normalizers are the deepest, about 6); 128 leaves an order of magnitude
// of headroom while bounding any recursion over a parsed value to a few hundred stack frames. The returned
// status is InvalidArgument and names `origin`; nothing escapes as an exception (std::bad_alloc included).
//
// JsonExcerpt / TextExcerpt give at most ~100 characters of an untrusted value or string (arrays and objects
// are described by size, never dumped), so an error message stays short whatever the file holds.
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace engram {

inline constexpr int kMaxJsonDepth = 128;
inline constexpr size_t kMaxExcerptChars = 100;

// The deepest nesting of `[`/`{` outside strings, stopping early once it exceeds `limit` (returns limit + 1).
int JsonNestingDepth(absl::string_view text, int limit = kMaxJsonDepth);

// Parses `text`; fails (naming `origin`) on invalid JSON, on nesting deeper than kMaxJsonDepth, or when memory
// runs out.
absl::StatusOr<nlohmann::json> ParseUntrustedJson(absl::string_view text, absl::string_view origin);

// A short rendering of an untrusted value: scalars as JSON (strings truncated), arrays and objects by size.
std::string JsonExcerpt(const nlohmann::json& v, size_t max_chars = kMaxExcerptChars);
// `s` itself when short, else its first `max_chars` bytes (cut at a UTF-8 boundary) and a note of its length.
std::string TextExcerpt(absl::string_view s, size_t max_chars = kMaxExcerptChars);

// Reads an integer field as int64: InvalidArgument naming `origin` and `what` when `v` is not an integer or does
// not fit in int64 (an unsigned JSON number above INT64_MAX would otherwise wrap to a negative value).
absl::StatusOr<int64_t> JsonInt64(const nlohmann::json& v, absl::string_view origin, absl::string_view what);

}  // namespace engram
