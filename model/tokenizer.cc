// Tokenizer (model/tokenizer.h). One concern kept whole: the tokenizer.json parser, the pre-tokenizer and the
// byte-level BPE decode are one format's reader.
#include "model/tokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <array>
#include <exception>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/file_util.h"
#include "model/json_util.h"
#include "model/normalize.h"
#include "nlohmann/json.hpp"

namespace engram {

using nlohmann::json;

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
constexpr int32_t kRegexTimeLimit = 200;
constexpr int64_t kRegexLoadBudget = 10000;
constexpr int32_t kRegexStackLimitKiB = 1024;

// Units of regex work left for a sequence of decodes (shared by the matches of one Parse check).
struct RegexBudget {
  int64_t units_left = kRegexLoadBudget;
};

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

// The member `key` of object `d`, or nullptr (never inserts, never asserts).
const json* Member(const json& d, const char* key) {
  if (!d.is_object()) return nullptr;
  auto it = d.find(key);
  return it == d.end() ? nullptr : &*it;
}

// Recursion is bounded by the JSON nesting limit (json_util.h).
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

// Applies one step to the token list (the library's decode_chain); `lossy` records U+FFFD substitutions. Only a
// regex Replace can fail (over its limits).
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

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, size_t{512} << 20));
  return Parse(text, path);
}

absl::StatusOr<Tokenizer> Tokenizer::Parse(const std::string& json_text, const std::string& origin) {
  // Every field is checked before it is read; the catch is a last line of defence (e.g. std::bad_alloc), so that
  // no exception leaves the parser.
  try {
    return ParseChecked(json_text, origin);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": cannot parse: ", TextExcerpt(e.what())));
  }
}

absl::StatusOr<Tokenizer> Tokenizer::ParseChecked(const std::string& json_text, const std::string& origin) {
  ASSIGN_OR_RETURN(const json root, ParseUntrustedJson(json_text, origin));
  if (!root.is_object()) return absl::InvalidArgumentError(absl::StrCat(origin, ": not a JSON object"));
  const json* model_ptr = Member(root, "model");
  if (model_ptr == nullptr || !model_ptr->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": no `model` object"));
  }
  const json& model = *model_ptr;
  constexpr int64_t kMaxIds = int64_t{1} << 24;
  std::vector<std::pair<int64_t, std::string>> entries;
  static const json kNull;
  const json* vocab_ptr = Member(model, "vocab");
  const json& vocab = vocab_ptr != nullptr ? *vocab_ptr : kNull;
  if (vocab.is_object()) {  // BPE, WordLevel, WordPiece
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer()) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ": vocab entry `", TextExcerpt(it.key()), "` has a non-integer id"));
      }
      ASSIGN_OR_RETURN(int64_t id,
                       JsonInt64(it.value(), origin, absl::StrCat("vocab entry `", TextExcerpt(it.key()), "`")));
      entries.emplace_back(id, it.key());
    }
  } else if (vocab.is_array()) {  // Unigram: [[piece, score], ...], id = position
    int64_t id = 0;
    for (const auto& e : vocab) {
      if (!e.is_array() || e.empty() || !e[0].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(origin, ": Unigram vocab entry ", id, " is not [piece, score]"));
      }
      entries.emplace_back(id++, e[0].get<std::string>());
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": model has no `vocab`"));
  }
  std::vector<std::pair<int64_t, std::string>> added;
  if (const json* added_json = Member(root, "added_tokens"); added_json != nullptr && added_json->is_array()) {
    for (const auto& a : *added_json) {
      const json* id = Member(a, "id");
      const json* content = Member(a, "content");
      if (id == nullptr || !id->is_number_integer() || content == nullptr || !content->is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ": malformed added_tokens entry ", added.size(), " (", JsonExcerpt(a), ")"));
      }
      added.emplace_back(id->get<int64_t>(), content->get<std::string>());
    }
  }
  for (const auto& [id, piece] : entries) {
    if (id < 0 || id >= kMaxIds) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": token `", TextExcerpt(piece), "` has id ", id, " out of range"));
    }
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(origin, ": empty vocabulary"));
  // Added tokens get their ids the way the reference library assigns them on load (the ids written in the JSON are
  // not used): a content already in the model vocab takes that id; a new content takes the next id after the model
  // vocab (or after the largest added id, once that is past it). Empty or repeated contents are skipped.
  std::unordered_map<std::string, int64_t> model_ids, added_ids;
  int64_t max_model_id = -1;
  for (const auto& [id, piece] : entries) {
    model_ids.emplace(piece, id);
    max_model_id = std::max(max_model_id, id);
  }
  const auto vocab_len = static_cast<int64_t>(entries.size());
  int64_t max_added = -1;
  std::vector<std::pair<int64_t, std::string>> added_final;
  for (const auto& [json_id, content] : added) {
    if (content.empty() || added_ids.count(content)) continue;
    int64_t id;
    if (auto m = model_ids.find(content); m != model_ids.end()) {
      id = m->second;
    } else if (max_added < 0) {
      id = vocab_len;
    } else {
      id = max_added >= vocab_len ? max_added + 1 : vocab_len;
    }
    if (id >= kMaxIds) return absl::InvalidArgumentError(absl::StrCat(origin, ": too many added tokens"));
    added_ids.emplace(content, id);
    max_added = std::max(max_added, id);
    added_final.emplace_back(id, content);
  }
  Tokenizer t;
  t.pieces_.resize(static_cast<size_t>(std::max(max_model_id, max_added) + 1));
  for (const auto& [id, piece] : entries) t.pieces_[static_cast<size_t>(id)] = piece;
  for (const auto& [id, piece] : added_final) t.pieces_[static_cast<size_t>(id)] = piece;  // added vocabulary wins
  // len(tokenizer) in the reference library: distinct contents over the model vocab and the added tokens.
  t.size_ = static_cast<int64_t>(model_ids.size());
  for (const auto& [content, id] : added_ids) t.size_ += model_ids.count(content) ? 0 : 1;
  const json* decoder = Member(root, "decoder");
  RETURN_IF_ERROR(ParseDecoder(decoder != nullptr ? *decoder : kNull, origin, t.decoder_));
  // A regex can backtrack catastrophically: decode every id now, within ICU's limits and one budget for the whole
  // load, so that a hostile pattern fails the load (Decode later repeats exactly this work, deterministically).
  bool has_regex = false;
  for (const auto& step : t.decoder_) has_regex |= step->is_regex;
  if (has_regex) {
    RegexBudget budget;
    for (int64_t id = 0; id < static_cast<int64_t>(t.pieces_.size()); ++id) {
      DecodedToken ignored;
      absl::Status st = t.DecodeWithin(id, budget, &ignored);
      if (!st.ok()) return absl::Status(st.code(), absl::StrCat(origin, ": id ", id, ": ", st.message()));
    }
  }
  return t;
}

std::optional<std::string> Tokenizer::IdToToken(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(pieces_.size())) return std::nullopt;
  return pieces_[static_cast<size_t>(id)];
}

absl::Status Tokenizer::DecodeWithin(int64_t id, RegexBudget& budget, DecodedToken* out) const {
  auto piece = IdToToken(id);
  if (!piece) return absl::OkStatus();  // no token: the library decodes an empty list to ""
  std::vector<std::string> toks = {*piece};
  for (const auto& step : decoder_) RETURN_IF_ERROR(Apply(*step, toks, out->lossy, budget));
  for (const auto& t : toks) out->text += t;
  return absl::OkStatus();
}

DecodedToken Tokenizer::Decode(int64_t id) const {
  // Parse decoded every id within the same limits, so this cannot fail for a loaded tokenizer; should it anyway,
  // the piece is returned undecoded and marked lossy (its key becomes the raw piece).
  DecodedToken out;
  RegexBudget budget;
  if (!DecodeWithin(id, budget, &out).ok()) {
    out.text = IdToToken(id).value_or("");
    out.lossy = true;
  }
  return out;
}

}  // namespace engram
