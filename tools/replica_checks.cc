// engram-replica's reference rows (tools/replica.h): a row straight from the checkpoint, and the rows a sparse
// checkpoint's pattern file selects.
#include <sys/stat.h>

#include <fstream>
#include <iostream>

#include "model/layout.h"
#include "nlohmann/json.hpp"
#include "tools/replica.h"

namespace engram::tools::replica {

using nlohmann::json;

std::vector<uint16_t> RowFromCheckpoint(engram::oracle::RowOracle* oracle, int64_t layer_id, int32_t id, int64_t D) {
  std::string error;
  auto rec = oracle ? oracle->Record(layer_id, id, &error) : std::nullopt;
  if (!rec || oracle->head_dim() != D) {
    if (!error.empty()) std::cerr << "engram-replica: " << error << "\n";
    return std::vector<uint16_t>(static_cast<size_t>(D), 0xFFFF);
  }
  return engram::oracle::DequantBf16Row(*rec, D);
}

std::vector<PatternRow> PatternRows(const std::string& checkpoint, const engram::client::Table& t, std::string* error) {
  auto bad = [&](const std::string& why) {
    *error = "engram-pattern.json: " + why;
    return std::vector<PatternRow>();
  };
  // Only a regular file of a sane size is read: a FIFO or a device there would block the read or never end.
  constexpr off_t kMaxPatternBytes = 64 << 20;
  const std::string path = checkpoint + "/engram-pattern.json";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  if (!S_ISREG(st.st_mode)) return bad("not a regular file");
  if (st.st_size > kMaxPatternBytes) return bad("larger than 64 MiB");
  std::ifstream in(path);
  if (!in) return bad("cannot be read");
  const json p = json::parse(in, nullptr, false);
  if (p.is_discarded() || !p.is_object() || !p.contains("layers") || !p["layers"].is_array()) {
    return bad("not a pattern file");
  }
  auto integer = [](const json& o, const char* key) {
    return o.is_object() && o.contains(key) && o[key].is_number_integer();
  };
  std::vector<PatternRow> out;
  for (const auto& jl : p["layers"]) {
    if (!integer(jl, "layer_id") || !jl.contains("regions") || !jl["regions"].is_array()) {
      return bad("a layer without an integer layer_id and a regions array");
    }
    const int64_t layer_id = jl["layer_id"].get<int64_t>();
    int l = -1;
    for (size_t i = 0; i < t.layers().size(); ++i) {
      if (t.layers()[i].layer_id == layer_id) l = static_cast<int>(i);
    }
    if (l < 0) return bad("layer " + std::to_string(layer_id) + " is not one of this table's layers");
    const auto& li = t.layers()[static_cast<size_t>(l)];
    const int64_t rows = t.layout().rows(l);
    for (const auto& r : jl["regions"]) {
      if (!integer(r, "row_begin") || !integer(r, "row_end")) return bad("a region without integer row_begin/row_end");
      const int64_t b = r["row_begin"].get<int64_t>(), e = r["row_end"].get<int64_t>();
      if (b < 0 || e <= b || e > rows) {
        return bad("region [" + r["row_begin"].dump() + ", " + r["row_end"].dump() + ") is not inside layer " +
                   std::to_string(layer_id) + "'s " + std::to_string(rows) + " rows");
      }
      for (int64_t row : {b, b + 1, b + (e - b) / 2, e - 2, e - 1, e}) {
        if (row < b || row >= rows || row < li.row_begin || row >= li.row_end || row > INT32_MAX) continue;
        out.push_back({l, static_cast<int32_t>(row), row < e});
      }
    }
  }
  if (out.empty()) return bad("selects no row of this shard");
  return out;
}

}  // namespace engram::tools::replica
