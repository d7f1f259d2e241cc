// Tokenizer (model/tokenizer.h): the id -> piece table read from tokenizer.json's model vocab and added tokens, and
// the decode of one id through the decoder pipeline (model/tokenizer_decoder.h).
#include "model/tokenizer.h"

#include <algorithm>
#include <exception>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/file_util.h"
#include "model/json_util.h"
#include "model/tokenizer_decoder.h"
#include "nlohmann/json.hpp"

namespace engram {

using nlohmann::json;
using tokenizer_internal::Apply;
using tokenizer_internal::Member;
using tokenizer_internal::ParseDecoder;

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
