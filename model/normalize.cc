#include "model/normalize.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <cstdint>

namespace engram {
namespace {

const icu::Normalizer2* Nfkc() {
  static const icu::Normalizer2* n = [] {
    UErrorCode e = U_ZERO_ERROR;
    return icu::Normalizer2::getNFKCInstance(e);
  }();
  return n;
}

const icu::Normalizer2* Nfd() {
  static const icu::Normalizer2* n = [] {
    UErrorCode e = U_ZERO_ERROR;
    return icu::Normalizer2::getNFDInstance(e);
  }();
  return n;
}

void AppendLower(UChar32 c, icu::UnicodeString& out) {
  if (c < 0x80) {
    out.append(static_cast<UChar32>(c >= 'A' && c <= 'Z' ? c + 32 : c));
    return;
  }
  UChar src[2];
  int32_t len = 0;
  U16_APPEND_UNSAFE(src, len, c);
  UChar dst[16];
  UErrorCode e = U_ZERO_ERROR;
  int32_t n = u_strToLower(dst, 16, src, len, "", &e);
  if (U_FAILURE(e)) {
    out.append(c);
    return;
  }
  out.append(dst, n);
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((b & 0xE0) == 0xC0) {
      len = 2;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      len = 3;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      len = 4;
      cp = b & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(len) > n) return false;
    for (int k = 1; k < len; ++k) {
      const auto c = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return false;
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<size_t>(len);
  }
  return true;
}

std::string NormalizeEngramKey(std::string_view utf8) {
  UErrorCode e = U_ZERO_ERROR;
  icu::UnicodeString s = icu::UnicodeString::fromUTF8(icu::StringPiece(utf8.data(), static_cast<int32_t>(utf8.size())));
  icu::UnicodeString t = Nfkc()->normalize(s, e);
  s = Nfd()->normalize(t, e);
  // StripAccents, Lowercase (per code point) and whitespace collapsing in one pass.
  icu::UnicodeString out;
  bool in_ws = false;
  for (int32_t i = 0; i < s.length();) {
    UChar32 c = s.char32At(i);
    i += U16_LENGTH(c);
    if (U_GET_GC_MASK(c) & U_GC_M_MASK) continue;
    icu::UnicodeString lower;
    AppendLower(c, lower);
    for (int32_t j = 0; j < lower.length();) {
      UChar32 d = lower.char32At(j);
      j += U16_LENGTH(d);
      if (d == ' ' || d == '\t' || d == '\r' || d == '\n') {
        if (!in_ws) out.append(static_cast<UChar32>(' '));
        in_ws = true;
      } else {
        out.append(d);
        in_ws = false;
      }
    }
  }
  // "^ $" -> U+E000: a lone space survives the strip that follows.
  if (out.length() == 1 && out.charAt(0) == ' ') out.setTo(static_cast<UChar32>(0xE000));
  int32_t begin = 0, end = out.length();
  while (begin < end) {
    UChar32 c = out.char32At(begin);
    if (!u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) break;
    begin += U16_LENGTH(c);
  }
  while (end > begin) {
    UChar32 c = out.char32At(end - 1);
    if (!u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) break;
    end -= U16_LENGTH(c);
  }
  icu::UnicodeString stripped = out.tempSubStringBetween(begin, end);
  stripped.findAndReplace(icu::UnicodeString(static_cast<UChar32>(0xE000)),
                          icu::UnicodeString(static_cast<UChar32>(' ')));
  std::string result;
  stripped.toUTF8String(result);
  return result;
}

}  // namespace engram
