// Utf8Prefix: a string cut to at most `max_bytes` bytes without splitting a UTF-8 sequence, so that bounded messages
// (errors echoing untrusted input, reasons sent to engramd) stay valid UTF-8. Printable: a client's text as logs and
// status show it, control characters (newlines, escapes) replaced, so that no client can forge lines or drive an
// operator's terminal. Header-only: every library uses them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace engram {

inline std::string Utf8Prefix(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // back to a code point boundary
  return std::string(s.substr(0, cut));
}

inline std::string Printable(std::string s) {
  for (char& ch : s) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
  }
  return s;
}

}  // namespace engram
