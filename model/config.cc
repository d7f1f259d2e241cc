#include "model/config.h"

#include <exception>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/file_util.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"

namespace engram {
namespace {

using nlohmann::json;

absl::StatusOr<int64_t> GetInt(const json& obj, const char* key, bool required, int64_t fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("config.json: missing field `", key, "`"));
    return fallback;
  }
  return JsonInt64(*it, "config.json", absl::StrCat("field `", key, "`"));
}

absl::StatusOr<std::vector<int64_t>> GetIntList(const json& obj, const char* key, bool required) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("config.json: missing field `", key, "`"));
    return std::vector<int64_t>{};
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: field `", key, "` must be a list of integers"));
  }
  std::vector<int64_t> out;
  out.reserve(it->size());
  for (const auto& v : *it) {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: field `", key, "` must be a list of integers, got element ", out.size(), ": ", JsonExcerpt(v)));
    }
    ASSIGN_OR_RETURN(int64_t x, JsonInt64(v, "config.json", absl::StrCat("field `", key, "[", out.size(), "]`")));
    out.push_back(x);
  }
  return out;
}

absl::Status Check(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InvalidArgumentError(absl::StrCat("config.json: ", what));
}

}  // namespace

std::string ModelKindName(ModelKind kind) { return kind == ModelKind::kEngram ? "engram" : "ple"; }

namespace {

absl::StatusOr<EngramConfig> Parse(const std::string& json_text) {
  ASSIGN_OR_RETURN(const json root, ParseUntrustedJson(json_text, "config.json"));
  if (!root.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  // Multimodal checkpoints nest the text model's config.
  const json* text = &root;
  if (auto tc = root.find("text_config");
      !root.contains("engram_layer_ids") && !root.contains("ple_layer_ids") && tc != root.end() && tc->is_object()) {
    text = &*tc;
  }
  EngramConfig c;
  auto arch_it = root.find("architectures");
  if (arch_it == root.end() || !arch_it->is_array() || arch_it->empty() || !(*arch_it)[0].is_string()) {
    arch_it = text->find("architectures");
    if (arch_it == text->end() || !arch_it->is_array() || arch_it->empty() || !(*arch_it)[0].is_string()) {
      return absl::InvalidArgumentError("config.json: missing `architectures[0]`");
    }
  }
  c.architecture = (*arch_it)[0].get<std::string>();
  const char* layer_field = nullptr;
  if (c.architecture == "DeepseekV41ForCausalLM") {
    c.kind = ModelKind::kEngram;
    layer_field = "engram_layer_ids";
  } else if (c.architecture == "Qwen4ExpForCausalLM" || c.architecture == "Qwen4ExpForConditionalGeneration") {
    c.kind = ModelKind::kPle;
    layer_field = "ple_layer_ids";
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: architecture ", TextExcerpt(c.architecture),
                     " has no n-gram embedding layers (supported: DeepseekV41ForCausalLM, Qwen4ExpForCausalLM, "
                     "Qwen4ExpForConditionalGeneration); an Engram config cannot apply to it"));
  }
  ASSIGN_OR_RETURN(c.layer_ids, GetIntList(*text, layer_field, /*required=*/false));
  if (c.layer_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", c.architecture, " declares no Engram layers (`",
                                                   layer_field, "` missing or empty)"));
  }
  if (c.layer_ids.size() > static_cast<size_t>(kMaxEngramLayers)) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: `", layer_field, "` lists ", c.layer_ids.size(),
                                                   " layers, more than the ", kMaxEngramLayers, " allowed"));
  }
  if (c.kind == ModelKind::kPle) {
    // The PLE lookup math is not public: keep what we can read, callers refuse to serve it.
    ASSIGN_OR_RETURN(c.hidden_size, GetInt(*text, "hidden_size", false, 0));
    ASSIGN_OR_RETURN(c.vocab_size, GetInt(*text, "vocab_size", false, 0));
    return c;
  }
  ASSIGN_OR_RETURN(c.num_embeddings, GetIntList(*text, "engram_num_embeddings", true));
  ASSIGN_OR_RETURN(c.max_ngram_size, GetInt(*text, "engram_max_ngram_size", true, 0));
  ASSIGN_OR_RETURN(c.n_heads, GetInt(*text, "engram_n_heads", true, 0));
  ASSIGN_OR_RETURN(c.head_dim, GetInt(*text, "engram_head_dim", true, 0));
  ASSIGN_OR_RETURN(c.vocab_size_engram, GetInt(*text, "engram_vocab_size", true, 0));
  ASSIGN_OR_RETURN(c.compressed_vocab_size, GetInt(*text, "engram_compressed_vocab_size", true, 0));
  if (text->contains("engram_pad_token_id")) {
    ASSIGN_OR_RETURN(c.pad_token_id, GetInt(*text, "engram_pad_token_id", true, 0));
  } else {
    ASSIGN_OR_RETURN(c.pad_token_id, GetInt(*text, "engram_pad_id", true, 0));
  }
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(*text, "hidden_size", true, 0));
  ASSIGN_OR_RETURN(c.hc_mult, GetInt(*text, "hc_mult", true, 0));
  ASSIGN_OR_RETURN(c.vocab_size, GetInt(*text, "vocab_size", false, 0));
  if (auto it = text->find("rms_norm_eps"); it != text->end()) {
    if (!it->is_number()) return absl::InvalidArgumentError("config.json: `rms_norm_eps` must be a number");
    c.rms_norm_eps = it->get<double>();
  }

  std::set<int64_t> seen;
  for (int64_t id : c.layer_ids) {
    RETURN_IF_ERROR(Check(id >= 0 && id < 100000, absl::StrCat("layer id ", id, " out of range")));
    RETURN_IF_ERROR(Check(seen.insert(id).second, absl::StrCat("layer id ", id, " listed twice")));
  }
  RETURN_IF_ERROR(Check(c.num_embeddings.size() == c.layer_ids.size(),
                        absl::StrCat("`engram_num_embeddings` has ", c.num_embeddings.size(), " entries for ",
                                     c.layer_ids.size(), " Engram layers")));
  RETURN_IF_ERROR(Check(c.max_ngram_size >= 2 && c.max_ngram_size <= 16,
                        absl::StrCat("`engram_max_ngram_size` ", c.max_ngram_size, " not in [2, 16]")));
  RETURN_IF_ERROR(
      Check(c.n_heads >= 1 && c.n_heads <= 256, absl::StrCat("`engram_n_heads` ", c.n_heads, " not in [1, 256]")));
  RETURN_IF_ERROR(Check(c.head_dim >= 32 && c.head_dim % 32 == 0 && c.head_dim <= 8192,
                        absl::StrCat("`engram_head_dim` ", c.head_dim, " must be a positive multiple of 32")));
  RETURN_IF_ERROR(Check(c.vocab_size_engram >= 2 && c.vocab_size_engram < (int64_t{1} << 30),
                        absl::StrCat("`engram_vocab_size` ", c.vocab_size_engram, " not in [2, 2^30)")));
  RETURN_IF_ERROR(Check(c.compressed_vocab_size >= 1 && c.compressed_vocab_size < (int64_t{1} << 31),
                        absl::StrCat("`engram_compressed_vocab_size` ", c.compressed_vocab_size, " not positive")));
  RETURN_IF_ERROR(Check(c.pad_token_id >= 0, absl::StrCat("`engram_pad_token_id` ", c.pad_token_id, " < 0")));
  RETURN_IF_ERROR(Check(c.hidden_size >= 1, "`hidden_size` must be positive"));
  RETURN_IF_ERROR(Check(c.hc_mult >= 1 && c.hc_mult <= 64, "`hc_mult` not in [1, 64]"));
  RETURN_IF_ERROR(Check(c.rms_norm_eps >= 0, "`rms_norm_eps` must not be negative"));
  for (size_t i = 0; i < c.num_embeddings.size(); ++i) {
    // Hash ids are int32 global row indices: every table must stay below 2^31 rows.
    RETURN_IF_ERROR(Check(c.num_embeddings[i] >= 1 && c.num_embeddings[i] < (int64_t{1} << 31),
                          absl::StrCat("`engram_num_embeddings[", i, "]` = ", c.num_embeddings[i],
                                       " must be in [1, 2^31) (hash ids are int32)")));
  }
  return c;
}

}  // namespace

absl::StatusOr<EngramConfig> ParseEngramConfig(const std::string& json_text) {
  // Every field is checked before it is read; the catch is a last line of defence (e.g. std::bad_alloc), so that
  // no exception leaves the parser.
  try {
    return Parse(json_text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: cannot parse: ", TextExcerpt(e.what())));
  }
}

absl::StatusOr<EngramConfig> LoadEngramConfig(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, size_t{64} << 20));
  auto cfg = ParseEngramConfig(text);
  if (!cfg.ok()) return absl::Status(cfg.status().code(), absl::StrCat(path, ": ", cfg.status().message()));
  return cfg;
}

}  // namespace engram
