// Utf8Prefix: a string cut to at most `max_bytes` bytes without splitting a UTF-8 sequence, so that bounded messages
// (errors echoing untrusted input, reasons sent to engramd) stay valid UTF-8. Printable: a client's text as logs and
// status show it, control characters (newlines, escapes) replaced, so that no client can forge lines or drive an
// operator's terminal. LogQuoted / LogValue: an untrusted value as one logfmt value (quoted, with `\` and `"` escaped;
// LogValue leaves a value bare when it holds nothing that could end it), so that no text forges another key such as
// event=. Header-only: every library uses them.
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
  auto u = [&](size_t i) { return i < s.size() ? static_cast<unsigned char>(s[i]) : 0u; };
  for (size_t i = 0; i < s.size(); ++i) {
    if (u(i) < 0x20 || u(i) == 0x7f) {
      s[i] = '?';
    } else if (u(i) == 0xC2 && u(i + 1) >= 0x80 && u(i + 1) <= 0x9F) {  // C1 controls (U+0080..U+009F: CSI...)
      s.replace(i, 2, "?");
    } else if (u(i) == 0xE2 && ((u(i + 1) == 0x80 && u(i + 2) >= 0xA8 && u(i + 2) <= 0xAE) ||
                                (u(i + 1) == 0x81 && u(i + 2) >= 0xA6 && u(i + 2) <= 0xA9))) {
      // The line and paragraph separators (U+2028, U+2029: line ends to some viewers), bidirectional overrides and
      // isolates (U+202A..U+202E, U+2066..U+2069).
      s.replace(i, 3, "?");
    }
  }
  return s;
}

inline std::string LogQuoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  out += '"';
  return out;
}

inline std::string LogValue(std::string_view s) {
  if (s.empty()) return "\"\"";
  for (char c : s) {
    if (c == ' ' || c == '"' || c == '\\' || c == '=' || static_cast<unsigned char>(c) < 0x20) return LogQuoted(s);
  }
  return std::string(s);
}

}  // namespace engram
