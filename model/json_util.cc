#include "model/json_util.h"

#include <exception>
#include <limits>
#include <new>

#include "absl/strings/str_cat.h"
#include "base/utf8.h"

namespace engram {

using nlohmann::json;

int JsonNestingDepth(absl::string_view text, int limit) {
  // Exact for valid JSON; for invalid JSON it over-approximates what the parser reaches before its first error,
  // since up to that point the text is a valid prefix scanned the same way.
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          max_depth = depth;
          if (max_depth > limit) return limit + 1;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
  return max_depth;
}

absl::StatusOr<json> ParseUntrustedJson(absl::string_view text, absl::string_view origin) {
  if (JsonNestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": JSON nested more than ", kMaxJsonDepth, " levels deep (refused, not parsed)"));
  }
  try {
    json v = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    if (v.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON"));
    return v;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(origin, ": out of memory parsing JSON"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON (", TextExcerpt(e.what()), ")"));
  }
}

std::string TextExcerpt(absl::string_view s, size_t max_chars) {
  if (s.size() <= max_chars) return std::string(s);
  return absl::StrCat(Utf8Prefix(std::string_view(s.data(), s.size()), max_chars), "... (", s.size(), " bytes)");
}

std::string JsonExcerpt(const json& v, size_t max_chars) {
  switch (v.type()) {
    case json::value_t::array: return absl::StrCat("an array of ", v.size(), " elements");
    case json::value_t::object: return absl::StrCat("an object of ", v.size(), " members");
    case json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      // Quote the excerpt, not the whole string: dump() of a 100 MB string would copy 100 MB.
      return absl::StrCat("\"", TextExcerpt(s, max_chars), "\"");
    }
    default: try { return TextExcerpt(v.dump(-1, ' ', false, json::error_handler_t::replace), max_chars);
      } catch (...) {
        return "(unprintable value)";
      }
  }
}

absl::StatusOr<int64_t> JsonInt64(const json& v, absl::string_view origin, absl::string_view what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what, " = ", u, " does not fit in int64"));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what, " must be an integer, got ", JsonExcerpt(v)));
}

}  // namespace engram
