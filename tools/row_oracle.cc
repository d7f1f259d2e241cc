#include "tools/row_oracle.h"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "nlohmann/json.hpp"

namespace engram::oracle {
namespace {

using nlohmann::json;

bool Fail(std::string* error, const std::string& what) {
  if (error) *error = what;
  return false;
}

std::optional<std::string> Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Reads exactly n bytes at offset; false on any short read.
bool PreadAll(int fd, uint8_t* dst, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, dst, n, static_cast<off_t>(offset));
    if (got <= 0) return false;
    dst += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

double E4m3(uint8_t v) {
  const int exp = (v >> 3) & 0xF, man = v & 0x7;
  if (exp == 0xF && man == 0x7) return std::nan("");
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return (v & 0x80) ? -mag : mag;
}

double Ue8m0(uint8_t v) {
  if (v == 0) return 0.0;  // the float whose bits are 0 << 23
  if (v == 255) return INFINITY;
  return std::ldexp(1.0, v - 127);
}

uint16_t ToBf16(double x) {
  if (std::isnan(x)) return 0x7FFF;
  const float f = static_cast<float>(x);  // exact: an e4m3 value times a power of two (or 0 / inf)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t upper = bits >> 16, lower = bits & 0xFFFF;
  // Round to nearest, ties to even.
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) return static_cast<uint16_t>(upper + 1);
  return static_cast<uint16_t>(upper);
}

}  // namespace

std::vector<uint16_t> DequantBf16Row(const std::vector<uint8_t>& record, int64_t head_dim) {
  std::vector<uint16_t> out(static_cast<size_t>(head_dim));
  for (int64_t j = 0; j < head_dim; ++j) {
    out[static_cast<size_t>(j)] =
        ToBf16(E4m3(record[static_cast<size_t>(j)]) * Ue8m0(record[static_cast<size_t>(head_dim + j / 32)]));
  }
  return out;
}

std::unique_ptr<RowOracle> RowOracle::Open(const std::string& checkpoint_dir, std::string* error) {
  auto fail = [error](const std::string& what) -> std::unique_ptr<RowOracle> {
    Fail(error, what);
    return nullptr;
  };
  auto o = std::unique_ptr<RowOracle>(new RowOracle());
  o->dir_ = checkpoint_dir;
  auto cfg_text = Slurp(checkpoint_dir + "/config.json");
  if (!cfg_text) return fail("oracle: cannot read config.json");
  json cfg = json::parse(*cfg_text, nullptr, false);
  if (!cfg.is_object()) return fail("oracle: config.json is not a JSON object");
  const json* text = &cfg;
  if (!cfg.contains("engram_layer_ids") && cfg.contains("text_config")) text = &cfg["text_config"];
  if (!text->contains("engram_layer_ids") || !text->contains("engram_head_dim") ||
      !(*text)["engram_layer_ids"].is_array() || !(*text)["engram_head_dim"].is_number_integer()) {
    return fail("oracle: config.json lacks engram_layer_ids / engram_head_dim");
  }
  o->head_dim_ = (*text)["engram_head_dim"].get<int64_t>();
  if (o->head_dim_ <= 0 || o->head_dim_ % 32 != 0) return fail("oracle: bad engram_head_dim");
  for (const auto& v : (*text)["engram_layer_ids"]) {
    if (!v.is_number_integer()) return fail("oracle: bad engram_layer_ids");
    o->layer_ids_.push_back(v.get<int64_t>());
  }
  if (auto idx = Slurp(checkpoint_dir + "/model.safetensors.index.json")) {
    json index = json::parse(*idx, nullptr, false);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return fail("oracle: model.safetensors.index.json has no weight_map");
    }
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string()) return fail("oracle: weight_map entry is not a string");
      o->weight_map_[name] = file.get<std::string>();
    }
  }
  return o;
}

const std::map<std::string, RowOracle::Tensor>* RowOracle::Header(const std::string& file, std::string* error) {
  if (auto it = headers_.find(file); it != headers_.end()) return &it->second;
  const std::string path = dir_ + "/" + file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    Fail(error, "oracle: cannot open " + path);
    return nullptr;
  }
  uint8_t len_bytes[8];
  uint64_t len = 0;
  bool ok = PreadAll(fd, len_bytes, 8, 0);
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];  // little-endian
  std::string text;
  if (ok && len > 0 && len < (uint64_t{1} << 30)) {
    text.resize(len);
    ok = PreadAll(fd, reinterpret_cast<uint8_t*>(text.data()), len, 8);
  } else {
    ok = false;
  }
  ::close(fd);
  if (!ok) {
    Fail(error, "oracle: cannot read the header of " + path);
    return nullptr;
  }
  json h = json::parse(text, nullptr, false);
  if (!h.is_object()) {
    Fail(error, "oracle: header of " + path + " is not JSON");
    return nullptr;
  }
  std::map<std::string, Tensor> tensors;
  try {
    for (const auto& [name, v] : h.items()) {
      if (name == "__metadata__") continue;
      if (!v.is_object() || !v.contains("data_offsets") || !v["data_offsets"].is_array() ||
          v["data_offsets"].size() != 2 || !v.contains("shape") || !v.contains("dtype")) {
        Fail(error, "oracle: malformed entry " + name + " in " + path);
        return nullptr;
      }
      Tensor t;
      t.file = path;
      t.data_begin = 8 + len + v["data_offsets"][0].get<uint64_t>();
      t.data_end = 8 + len + v["data_offsets"][1].get<uint64_t>();
      t.shape = v["shape"].get<std::vector<int64_t>>();
      t.dtype = v["dtype"].get<std::string>();
      tensors[name] = t;
    }
  } catch (const json::exception& e) {
    Fail(error, "oracle: malformed header of " + path + ": " + e.what());
    return nullptr;
  }
  return &(headers_[file] = std::move(tensors));
}

std::optional<RowOracle::Tensor> RowOracle::Find(int64_t layer_id, const std::string& suffix, std::string* error) {
  const std::string base = "layers." + std::to_string(layer_id) + ".engram." + suffix;
  for (const std::string& name : {base, "model." + base}) {
    std::string file = "model.safetensors";
    if (!weight_map_.empty()) {
      auto it = weight_map_.find(name);
      if (it == weight_map_.end()) continue;
      file = it->second;
    }
    const auto* header = Header(file, error);
    if (!header) return std::nullopt;
    if (auto t = header->find(name); t != header->end()) return t->second;
  }
  Fail(error, "oracle: tensor " + base + " not found");
  return std::nullopt;
}

std::optional<std::vector<uint8_t>> RowOracle::Record(int64_t layer_id, int64_t row, std::string* error) {
  const int64_t D = head_dim_, S = head_dim_ / 32;
  auto w = Find(layer_id, "embed.weight", error);
  if (!w) return std::nullopt;
  auto s = Find(layer_id, "embed.scale", error);
  if (!s) return std::nullopt;
  if (w->shape.size() != 2 || w->shape[1] != D || s->shape.size() != 2 || s->shape[1] != S ||
      w->shape[0] != s->shape[0] || w->dtype != "F8_E4M3" || s->dtype != "F8_E8M0") {
    Fail(error, "oracle: layer " + std::to_string(layer_id) + " table tensors have unexpected shapes or dtypes");
    return std::nullopt;
  }
  if (row < 0 || row >= w->shape[0]) {
    Fail(error, "oracle: row " + std::to_string(row) + " out of range");
    return std::nullopt;
  }
  const uint64_t w_off = w->data_begin + static_cast<uint64_t>(row * D);
  const uint64_t s_off = s->data_begin + static_cast<uint64_t>(row * S);
  if (w_off + static_cast<uint64_t>(D) > w->data_end || s_off + static_cast<uint64_t>(S) > s->data_end) {
    Fail(error, "oracle: row beyond the tensor's data_offsets");
    return std::nullopt;
  }
  std::vector<uint8_t> rec(static_cast<size_t>(D + S));
  const int wfd = ::open(w->file.c_str(), O_RDONLY | O_CLOEXEC);
  const int sfd = s->file == w->file ? -1 : ::open(s->file.c_str(), O_RDONLY | O_CLOEXEC);
  const bool ok = wfd >= 0 && (s->file == w->file || sfd >= 0) &&
                  PreadAll(wfd, rec.data(), static_cast<uint64_t>(D), w_off) &&
                  PreadAll(sfd >= 0 ? sfd : wfd, rec.data() + D, static_cast<uint64_t>(S), s_off);
  if (wfd >= 0) ::close(wfd);
  if (sfd >= 0) ::close(sfd);
  if (!ok) {
    Fail(error, "oracle: short read of layer " + std::to_string(layer_id) + " row " + std::to_string(row));
    return std::nullopt;
  }
  return rec;
}

std::optional<std::vector<uint8_t>> RowOracle::RecordAt(int64_t layer_index, int64_t row, std::string* error) {
  if (layer_index < 0 || layer_index >= static_cast<int64_t>(layer_ids_.size())) {
    Fail(error, "oracle: layer index out of range");
    return std::nullopt;
  }
  return Record(layer_ids_[static_cast<size_t>(layer_index)], row, error);
}

}  // namespace engram::oracle
