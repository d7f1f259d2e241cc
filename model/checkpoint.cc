#include "model/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/file_util.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace engram {
namespace {

using nlohmann::json;

// Whether something exists at `p` (following symlinks). What is there is checked when it is opened: a FIFO or a
// directory in a file's place is refused with an error rather than skipped (OpenRegularFile, file_util.h).
bool Exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

// model.safetensors.index.json: the shard files in first-appearance order and the tensor -> file map.
absl::Status ReadIndexChecked(const std::string& index_path, std::vector<std::string>& names,
                              std::map<std::string, std::string>& weight_map) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, size_t{256} << 20));
  auto parsed = ParseUntrustedJson(text, index_path);
  if (!parsed.ok()) return absl::DataLossError(parsed.status().message());
  const json& idx = *parsed;
  auto wm = idx.is_object() ? idx.find("weight_map") : idx.end();
  if (!idx.is_object() || wm == idx.end() || !wm->is_object()) {
    return absl::DataLossError(absl::StrCat(index_path, ": not a safetensors index (no `weight_map` object)"));
  }
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(
          absl::StrCat(index_path, ": weight_map entry `", TextExcerpt(it.key()), "` is not a string"));
    }
    const std::string& f = it.value().get_ref<const std::string&>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
      return absl::DataLossError(absl::StrCat(index_path, ": weight_map entry `", TextExcerpt(it.key()),
                                              "` names file `", TextExcerpt(f),
                                              "`, which is not a file in the checkpoint directory"));
    }
    weight_map[it.key()] = f;
    if (std::find(names.begin(), names.end(), f) == names.end()) names.push_back(f);
  }
  return absl::OkStatus();
}

absl::Status ReadIndex(const std::string& index_path, std::vector<std::string>& names,
                       std::map<std::string, std::string>& weight_map) {
  // Every field is checked before it is read; the catch is a last line of defence (e.g. std::bad_alloc), so that
  // no exception leaves the parser.
  try {
    return ReadIndexChecked(index_path, names, weight_map);
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(index_path, ": cannot parse: ", TextExcerpt(e.what())));
  }
}

std::string Shape(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

absl::Status CheckTensor(const TensorRef& ref, const std::string& name, DType dtype,
                         const std::vector<int64_t>& shape) {
  if (!ref) return absl::NotFoundError(absl::StrCat("checkpoint has no tensor `", name, "` (nor `model.", name, "`)"));
  const TensorInfo& t = *ref.info;
  if (t.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(ref.file->path(), ": tensor `", t.name, "` has dtype ",
                                                   DTypeName(t.dtype), ", expected ", DTypeName(dtype)));
  }
  if (t.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(ref.file->path(), ": tensor `", t.name, "` has shape ",
                                                   Shape(t.shape), ", the config implies ", Shape(shape)));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CanonicalTensorName(const std::string& name) {
  return absl::StartsWith(name, "model.") ? name.substr(6) : name;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ck = std::make_shared<Checkpoint>();
  ck->dir_ = dir;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a checkpoint directory"));
  }
  ASSIGN_OR_RETURN(ck->config_, LoadEngramConfig(ck->config_path()));

  // Which files hold the tensors, and (with an index) which tensor each must hold.
  std::vector<std::string> names;
  std::map<std::string, std::string> weight_map;
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (Exists(index_path)) {
    RETURN_IF_ERROR(ReadIndex(index_path, names, weight_map));
  } else if (Exists(dir + "/model.safetensors")) {
    names.push_back("model.safetensors");
  } else {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot list"));
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (absl::EndsWith(n, ".safetensors")) names.push_back(n);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
  }
  if (names.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no safetensors files"));

  std::map<std::string, std::shared_ptr<const SafetensorsFile>> by_name;
  for (const auto& n : names) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(dir + "/" + n));
    by_name[n] = f;
    ck->files_.push_back(f);
    for (const auto& [tname, info] : f->tensors()) {
      std::string canon = CanonicalTensorName(tname);
      if (ck->tensors_.count(canon)) {
        return absl::DataLossError(absl::StrCat(f->path(), ": tensor `", TextExcerpt(tname), "` also appears in ",
                                                ck->tensors_[canon].file->path()));
      }
      ck->tensors_[canon] = TensorRef{f, &info};
    }
  }
  for (const auto& [tname, fname] : weight_map) {
    auto ref = ck->Find(CanonicalTensorName(tname));
    if (!ref || ref.file->path() != dir + "/" + fname) {
      return absl::DataLossError(absl::StrCat(index_path, ": says tensor `", TextExcerpt(tname), "` is in ", fname,
                                              ", but that file does not hold it"));
    }
  }
  RETURN_IF_ERROR(ck->ComputeFingerprint());
  return std::shared_ptr<const Checkpoint>(std::move(ck));
}

TensorRef Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? TensorRef{} : it->second;
}

EngramTensors Checkpoint::engram(int64_t l) const {
  EngramTensors t;
  t.layer_id = config_.layer_ids[l];
  const std::string p = absl::StrCat("layers.", t.layer_id, ".engram.");
  t.embed_weight = Find(p + "embed.weight");
  t.embed_scale = Find(p + "embed.scale");
  t.wkv_weight = Find(p + "wkv.weight");
  t.wkv_scale = Find(p + "wkv.scale");
  t.q_weight = Find(p + "q_weight");
  t.k_weight = Find(p + "k_weight");
  return t;
}

absl::Status Checkpoint::ValidateEngramTensors() const {
  const EngramConfig& c = config_;
  if (c.kind != ModelKind::kEngram) {
    return absl::UnimplementedError(
        absl::StrCat(c.architecture, ": PLE tensors are not validated (layout not public)"));
  }
  const int64_t kv_rows = c.hidden_size * (c.hc_mult + 1);
  const int64_t kv_cols = c.n_cols() * c.head_dim;
  for (int64_t l = 0; l < c.n_layers(); ++l) {
    EngramTensors t = engram(l);
    const std::string p = absl::StrCat("layers.", t.layer_id, ".engram.");
    const int64_t rows = c.num_embeddings[l];
    RETURN_IF_ERROR(CheckTensor(t.embed_weight, p + "embed.weight", DType::kF8E4M3, {rows, c.head_dim}));
    RETURN_IF_ERROR(CheckTensor(t.embed_scale, p + "embed.scale", DType::kF8E8M0, {rows, c.head_dim / 32}));
    RETURN_IF_ERROR(CheckTensor(t.wkv_weight, p + "wkv.weight", DType::kF8E4M3, {kv_rows, kv_cols}));
    RETURN_IF_ERROR(
        CheckTensor(t.wkv_scale, p + "wkv.scale", DType::kF8E8M0, {(kv_rows + 31) / 32, (kv_cols + 31) / 32}));
    RETURN_IF_ERROR(CheckTensor(t.q_weight, p + "q_weight", DType::kBF16, {c.hc_mult, c.hidden_size}));
    RETURN_IF_ERROR(CheckTensor(t.k_weight, p + "k_weight", DType::kBF16, {c.hc_mult, c.hidden_size}));
  }
  return absl::OkStatus();
}

uint64_t Checkpoint::Fingerprint() const { return fingerprint_; }

absl::Status Checkpoint::ComputeFingerprint() {
  const EngramConfig& c = config_;
  std::string s =
      absl::StrCat(c.architecture, "|", absl::StrJoin(c.layer_ids, ","), "|", absl::StrJoin(c.num_embeddings, ","), "|",
                   c.max_ngram_size, "|", c.n_heads, "|", c.head_dim, "|", c.vocab_size_engram, "|",
                   c.compressed_vocab_size, "|", c.pad_token_id, "|", c.hidden_size, "|", c.hc_mult);
  std::set<const SafetensorsFile*> table_files;
  for (const auto& [name, ref] : tensors_) {
    if (name.find(".engram.") == std::string::npos) continue;
    absl::StrAppend(&s, "|", name, ":", DTypeName(ref.info->dtype), ":", Shape(ref.info->shape), ":",
                    ref.info->bytes());
    table_files.insert(ref.file.get());
  }
  // The identity of the exact files (README "Segment identity"): the contents of config.json and tokenizer.json,
  // and for every file holding an Engram tensor its name, size, modification time and header bytes. No table
  // bytes are read, so adoption stays cheap; a rewritten or different checkpoint with equal shapes differs here.
  ASSIGN_OR_RETURN(std::string config_text, ReadSmallFile(config_path(), size_t{64} << 20));
  absl::StrAppend(&s, "|config:", XXH3_64bits(config_text.data(), config_text.size()));
  auto tokenizer_text = ReadSmallFile(tokenizer_path(), size_t{1} << 30);
  if (tokenizer_text.ok()) {
    absl::StrAppend(&s, "|tokenizer:", XXH3_64bits(tokenizer_text->data(), tokenizer_text->size()));
  } else if (tokenizer_text.status().code() != absl::StatusCode::kNotFound) {
    return tokenizer_text.status();
  }
  for (const auto& f : files_) {
    if (!table_files.count(f.get())) continue;
    ASSIGN_OR_RETURN(int fd, OpenRegularFile(f->path()));
    struct stat st {};
    std::string header(f->header_bytes(), '\0');
    const bool ok =
        ::fstat(fd, &st) == 0 && ::pread(fd, header.data(), header.size(), 0) == static_cast<ssize_t>(header.size());
    ::close(fd);
    if (!ok) return absl::DataLossError(absl::StrCat(f->path(), ": cannot re-read its header"));
    const std::string base = f->path().substr(f->path().rfind('/') + 1);
    absl::StrAppend(&s, "|file:", base, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ":",
                    XXH3_64bits(header.data(), header.size()));
  }
  fingerprint_ = XXH3_64bits(s.data(), s.size());
  return absl::OkStatus();
}

}  // namespace engram
