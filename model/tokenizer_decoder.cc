// The decoder pipeline of a tokenizer.json (model/tokenizer_decoder.h): parsing the `decoder` object into steps and
// applying them to one id's token list.
#include "model/tokenizer_decoder.h"

#include <unicode/unistr.h>

#include <array>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/json_util.h"
#include "model/normalize.h"

namespace engram {
namespace tokenizer_internal {

using nlohmann::json;

namespace {

// ICU calls this once per time unit of a match; returning false stops the match (U_REGEX_STOPPED_BY_CALLER).
UBool U_CALLCONV SpendRegexUnit(const void* context, int32_t /*steps*/) {
  auto* budget = static_cast<RegexBudget*>(const_cast<void*>(context));
  return --budget->units_left > 0;
}

// GPT-2's bytes_to_unicode table, inverted: code point -> byte, -1 when not a byte-level char.
const std::array<int, 512>& ByteLevelInverse() {
  static const std::array<int, 512> table = [] {
    std::array<int, 512> t{};
    t.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      if (printable) {
        t[b] = b;
      } else {
        t[256 + extra] = b;
        ++extra;
      }
    }
    return t;
  }();
  return table;
}

// Decodes one UTF-8 code point at s[i]; returns -1 on malformed input (pieces from JSON are valid UTF-8).
int32_t NextCodePoint(const std::string& s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t len = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : 4;
  if (i + len > s.size()) {
    i = s.size();
    return -1;
  }
  uint32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return static_cast<int32_t>(cp);
}

std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  while (true) {
    size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

bool ParseByteToken(const std::string& t, unsigned char* byte) {
  // "<0xXX>" exactly, hex digits in either case.
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return false;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return false;
  *byte = static_cast<unsigned char>(hi * 16 + lo);
  return true;
}

absl::StatusOr<std::unique_ptr<DecoderStep>> ParseStep(const json& d, const std::string& origin);

}  // namespace

// The member `key` of object `d`, or nullptr (never inserts, never asserts).
const json* Member(const json& d, const char* key) {
  if (!d.is_object()) return nullptr;
  auto it = d.find(key);
  return it == d.end() ? nullptr : &*it;
}

absl::Status ParseDecoder(const json& d, const std::string& origin, std::vector<std::unique_ptr<DecoderStep>>& out) {
  if (d.is_null()) return absl::OkStatus();
  const json* type = Member(d, "type");
  if (type == nullptr || !type->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": decoder has no `type`"));
  }
  if (*type == "Sequence") {
    const json* subs = Member(d, "decoders");
    if (subs == nullptr || !subs->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": Sequence decoder without `decoders`"));
    }
    for (const auto& sub : *subs) RETURN_IF_ERROR(ParseDecoder(sub, origin, out));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(auto step, ParseStep(d, origin));
  out.push_back(std::move(step));
  return absl::OkStatus();
}

namespace {

absl::StatusOr<std::unique_ptr<DecoderStep>> ParseStep(const json& d, const std::string& origin) {
  const std::string type = Member(d, "type")->get<std::string>();  // checked by ParseDecoder
  auto step = std::make_unique<DecoderStep>();
  auto str = [&](const char* key, const std::string& fallback) {
    const json* v = Member(d, key);
    return v != nullptr && v->is_string() ? v->get<std::string>() : fallback;
  };
  // An optional integer field: absent or null gives `fallback`, anything but an int64 is an error naming it.
  auto integer = [&](const char* key, int64_t fallback) -> absl::StatusOr<int64_t> {
    const json* v = Member(d, key);
    if (v == nullptr || v->is_null()) return fallback;
    return JsonInt64(*v, origin, absl::StrCat(type, " decoder field `", key, "`"));
  };
  if (type == "ByteLevel") {
    step->kind = DecoderStep::kByteLevel;
  } else if (type == "Metaspace") {
    step->kind = DecoderStep::kMetaspace;
    step->replacement = str("replacement", "\u2581");
    const json* scheme = Member(d, "prepend_scheme");
    const json* prefix = Member(d, "add_prefix_space");
    if (scheme != nullptr && scheme->is_string()) {
      step->strip_first_space = *scheme != "never";
    } else if (prefix != nullptr && prefix->is_boolean()) {
      step->strip_first_space = prefix->get<bool>();
    }
  } else if (type == "ByteFallback") {
    step->kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step->kind = DecoderStep::kFuse;
  } else if (type == "Replace") {
    step->kind = DecoderStep::kReplace;
    const json* p = Member(d, "pattern");
    const json* literal = p == nullptr ? nullptr : Member(*p, "String");
    const json* regex = p == nullptr ? nullptr : Member(*p, "Regex");
    step->content = str("content", "");
    if (literal != nullptr && literal->is_string()) {
      step->pattern = literal->get<std::string>();
    } else if (regex != nullptr && regex->is_string()) {
      step->pattern = regex->get<std::string>();
      step->is_regex = true;
      UErrorCode e = U_ZERO_ERROR;
      UParseError pe;
      step->regex.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(step->pattern), 0, pe, e));
      if (U_FAILURE(e) || step->regex == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(origin, ": Replace decoder regex `", TextExcerpt(step->pattern),
                                                       "` does not compile: ", u_errorName(e)));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": Replace decoder without a String or Regex pattern"));
    }
  } else if (type == "Strip") {
    step->kind = DecoderStep::kStrip;
    step->strip_content = str("content", " ");
    ASSIGN_OR_RETURN(step->strip_start, integer("start", 0));
    ASSIGN_OR_RETURN(step->strip_stop, integer("stop", 0));
  } else {
    return absl::UnimplementedError(absl::StrCat(origin, ": decoder type `", TextExcerpt(type),
                                                 "` is not supported (supported: ByteLevel, Metaspace, ByteFallback, "
                                                 "Fuse, Replace, Strip, Sequence)"));
  }
  return step;
}

// Replaces every match of `s.regex` in `t`, within ICU's time and stack limits and `budget`.
absl::Status ReplaceRegex(const DecoderStep& s, std::string& t, RegexBudget& budget) {
  UErrorCode e = U_ZERO_ERROR;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(t);
  std::unique_ptr<icu::RegexMatcher> m(s.regex->matcher(u, e));
  if (m != nullptr && U_SUCCESS(e)) m->setTimeLimit(kRegexTimeLimit, e);
  if (m != nullptr && U_SUCCESS(e)) m->setStackLimit(kRegexStackLimitKiB * 1024, e);
  if (m != nullptr && U_SUCCESS(e)) m->setMatchCallback(SpendRegexUnit, &budget, e);
  // Not replaceAll(): it matches with the status-less find(), which reports a time-out as "no more matches".
  icu::UnicodeString r;
  const icu::UnicodeString replacement = icu::UnicodeString::fromUTF8(s.content);
  if (m != nullptr && U_SUCCESS(e)) {
    while (m->find(e) && U_SUCCESS(e)) {
      m->appendReplacement(r, replacement, e);
      if (U_FAILURE(e)) break;
    }
    if (U_SUCCESS(e)) m->appendTail(r);
  }
  if (m == nullptr || U_FAILURE(e)) {
    std::string limit;
    if (e == U_REGEX_TIME_OUT) {
      limit = absl::StrCat(": over ICU's time limit of ", kRegexTimeLimit, " units for one match");
    } else if (e == U_REGEX_STOPPED_BY_CALLER) {
      limit = absl::StrCat(": over the budget of ", kRegexLoadBudget, " ICU time units for all matches of a load");
    } else if (e == U_REGEX_STACK_OVERFLOW) {
      limit = absl::StrCat(": over the backtrack stack limit of ", kRegexStackLimitKiB, " KiB");
    }
    return absl::ResourceExhaustedError(absl::StrCat("Replace decoder regex `", TextExcerpt(s.pattern),
                                                     "` failed on a ", t.size(), "-byte token (", u_errorName(e), ")",
                                                     limit));
  }
  t.clear();
  r.toUTF8String(t);
  return absl::OkStatus();
}

}  // namespace

absl::Status Apply(const DecoderStep& s, std::vector<std::string>& toks, bool& lossy, RegexBudget& budget) {
  switch (s.kind) {
    case DecoderStep::kByteLevel: {
      std::string bytes;
      const auto& inv = ByteLevelInverse();
      for (const auto& t : toks) {
        std::string mapped;
        bool all = true;
        for (size_t i = 0; i < t.size();) {
          int32_t cp = NextCodePoint(t, i);
          if (cp < 0 || cp >= 512 || inv[static_cast<size_t>(cp)] < 0) {
            all = false;
            break;
          }
          mapped.push_back(static_cast<char>(inv[static_cast<size_t>(cp)]));
        }
        bytes += all ? mapped : t;
      }
      if (!IsValidUtf8(bytes)) lossy = true;
      toks = {bytes};
      break;
    }
    case DecoderStep::kMetaspace:
      // As the reference library (tokenizers, pinned by tests/data/golden_tokenmap.js) does: in the first token every
      // replacement char is dropped when a prefix space is prepended; elsewhere each becomes a space.
      for (size_t i = 0; i < toks.size(); ++i) {
        toks[i] = ReplaceAll(toks[i], s.replacement, i == 0 && s.strip_first_space ? "" : " ");
      }
      break;
    case DecoderStep::kByteFallback: {
      std::vector<std::string> out;
      std::string pending;
      size_t pending_count = 0;
      auto flush = [&] {
        if (pending_count == 0) return;
        if (IsValidUtf8(pending)) {
          out.push_back(pending);
        } else {
          std::string repl;
          for (size_t k = 0; k < pending_count; ++k) repl += "\xEF\xBF\xBD";
          out.push_back(repl);
          lossy = true;
        }
        pending.clear();
        pending_count = 0;
      };
      for (const auto& t : toks) {
        unsigned char b;
        if (ParseByteToken(t, &b)) {
          pending.push_back(static_cast<char>(b));
          ++pending_count;
        } else {
          flush();
          out.push_back(t);
        }
      }
      flush();
      toks = out;
      break;
    }
    case DecoderStep::kFuse: {
      std::string all;
      for (const auto& t : toks) all += t;
      toks = {all};
      break;
    }
    case DecoderStep::kReplace:
      for (auto& t : toks) {
        if (!s.is_regex) {
          t = ReplaceAll(t, s.pattern, s.content);
        } else {
          RETURN_IF_ERROR(ReplaceRegex(s, t, budget));
        }
      }
      break;
    case DecoderStep::kStrip:
      for (auto& t : toks) {
        icu::UnicodeString u = icu::UnicodeString::fromUTF8(t);
        UChar32 c = icu::UnicodeString::fromUTF8(s.strip_content).char32At(0);
        int32_t begin = 0, end = u.length();
        for (int64_t k = 0; k < s.strip_start && begin < end && u.char32At(begin) == c; ++k) begin += U16_LENGTH(c);
        for (int64_t k = 0; k < s.strip_stop && end > begin && u.char32At(end - 1) == c; ++k) end -= U16_LENGTH(c);
        t.clear();
        u.tempSubStringBetween(begin, end).toUTF8String(t);
      }
      break;
  }
  return absl::OkStatus();
}

}  // namespace tokenizer_internal
}  // namespace engram
