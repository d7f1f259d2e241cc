// The Engram key normaliser of docs/math.md section 2 step 3, built on ICU so that it equals the Hugging Face
// `tokenizers` normalizer sequence NFKC, NFD, StripAccents, Lowercase, Replace([ \t\r\n]+ -> " "),
// Replace(^ $ -> U+E000), Strip, Replace(U+E000 -> " "):
//   - StripAccents drops every code point of General_Category Mark (Mn, Mc, Me), as the library does;
//   - Lowercase maps each code point on its own (full mapping, no final-sigma context), as the library does;
//   - Strip removes Unicode White_Space from both ends.
// Input must be valid UTF-8. Pure function; thread-safe (ICU normalizer instances are shared and immutable).
#pragma once

#include <string>
#include <string_view>

namespace engram {

std::string NormalizeEngramKey(std::string_view utf8);

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool IsValidUtf8(std::string_view s);

}  // namespace engram
