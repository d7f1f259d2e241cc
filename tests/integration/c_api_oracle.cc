#include "tests/integration/c_api_oracle.h"

#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "nlohmann/json.hpp"
#include "tools/row_oracle.h"

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int Fail(const std::string& what) {
  std::cerr << "oracle: " << what << "\n";
  return -1;
}

}  // namespace

extern "C" int oracle_hash_ids(const char* checkpoint_dir, const char* plan_json, const char* tokenmap_bin,
                               const int32_t* tokens, int64_t n, int32_t* out, int64_t out_len) {
  using nlohmann::json;
  const json plan = json::parse(Slurp(plan_json), nullptr, false);
  json cfg = json::parse(Slurp(std::string(checkpoint_dir) + "/config.json"), nullptr, false);
  if (plan.is_discarded() || cfg.is_discarded()) return Fail("plan or config is not JSON");
  if (cfg.contains("text_config")) cfg = cfg["text_config"];
  const std::string raw = Slurp(tokenmap_bin);
  std::vector<int32_t> tmap(raw.size() / 4);
  for (size_t i = 0; i < tmap.size(); ++i) {  // little-endian int32 per raw id
    const auto* b = reinterpret_cast<const uint8_t*>(raw.data() + 4 * i);
    tmap[i] = static_cast<int32_t>(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24);
  }
  const int64_t ngram = cfg["engram_max_ngram_size"], heads = cfg["engram_n_heads"];
  const int64_t pad = cfg["engram_pad_token_id"];
  if (pad < 0 || pad >= static_cast<int64_t>(tmap.size())) return Fail("pad id outside the token map");
  const int64_t pad_c = tmap[static_cast<size_t>(pad)];
  const auto& layers = plan["layers"];
  const int64_t L = static_cast<int64_t>(layers.size()), C = (ngram - 1) * heads;
  if (out_len != n * L * C) return Fail("output size");
  for (int64_t pos = 0; pos < n; ++pos) {
    for (int64_t l = 0; l < L; ++l) {
      const auto& lay = layers[static_cast<size_t>(l)];
      // docs/math.md section 5: a rolling XOR of (compressed token x multiplier) over the n-gram ending here; once a
      // position is missing (before the request), it and everything older count as the pad token.
      int64_t rolling = 0;
      bool blocked = false;
      for (int64_t s = 0; s < ngram; ++s) {
        const int64_t q = pos - s;
        blocked = blocked || q < 0;
        int64_t v = pad_c;
        if (!blocked) {
          const int32_t t = tokens[q];
          if (t < 0 || t >= static_cast<int32_t>(tmap.size())) return Fail("token outside the vocabulary");
          v = tmap[static_cast<size_t>(t)];
        }
        rolling ^= v * lay["multipliers"][static_cast<size_t>(s)].get<int64_t>();
        if (s == 0) continue;
        for (int64_t h = 0; h < heads; ++h) {
          const size_t c = static_cast<size_t>((s - 1) * heads + h);
          const int64_t id = rolling % lay["primes"][c].get<int64_t>() + lay["offsets"][c].get<int64_t>();
          out[(pos * L + l) * C + static_cast<int64_t>(c)] = static_cast<int32_t>(id);
        }
      }
    }
  }
  return 0;
}

extern "C" int oracle_row_bf16(const char* checkpoint_dir, int layer, int64_t row, uint16_t* out, int64_t head_dim) {
  std::string error;
  auto o = engram::oracle::RowOracle::Open(checkpoint_dir, &error);
  if (!o) return Fail(error);
  auto rec = o->RecordAt(layer, row, &error);
  if (!rec) return Fail(error);
  if (o->head_dim() != head_dim) return Fail("head_dim differs");
  const auto bf16 = engram::oracle::DequantBf16Row(*rec, head_dim);
  for (int64_t j = 0; j < head_dim; ++j) out[j] = bf16[static_cast<size_t>(j)];
  return 0;
}

extern "C" int oracle_record(const char* checkpoint_dir, int layer, int64_t row, uint8_t* out, int64_t record_bytes) {
  if (row < 0) {
    for (int64_t j = 0; j < record_bytes; ++j) out[j] = 0;
    return 0;
  }
  std::string error;
  auto o = engram::oracle::RowOracle::Open(checkpoint_dir, &error);
  if (!o) return Fail(error);
  auto rec = o->RecordAt(layer, row, &error);
  if (!rec) return Fail(error);
  if (static_cast<int64_t>(rec->size()) != record_bytes) return Fail("record size differs");
  for (int64_t j = 0; j < record_bytes; ++j) out[j] = (*rec)[static_cast<size_t>(j)];
  return 0;
}
