#include "model/reference.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/fast_mod.h"
#include "model/fp8.h"

namespace engram {
namespace {

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError(what); }

constexpr int32_t kDead = -1;  // internal marker for a position outside every n-gram

// e4m3 byte -> float, all 256 values.
const struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) v[b] = E4M3ToFloat(static_cast<uint8_t>(b));
  }
  float operator[](uint8_t b) const { return v[b]; }
} kE4M3;

}  // namespace

absl::Status HashIdsCpu(const Layout& layout, const TokenMap& token_map, const HashBatch& b, std::span<int32_t> out) {
  const int64_t T = static_cast<int64_t>(b.tokens.size());
  const int64_t N = layout.max_ngram();
  const int64_t L = layout.n_layers();
  const int64_t C = layout.n_cols();
  const int64_t H = layout.config().n_heads;
  if (static_cast<int64_t>(b.positions.size()) != T) {
    return Invalid(absl::StrCat("positions has ", b.positions.size(), " entries for ", T, " tokens"));
  }
  if (b.query_start_loc.size() < 2) return Invalid("query_start_loc needs at least two entries");
  const int64_t R = static_cast<int64_t>(b.query_start_loc.size()) - 1;
  if (b.query_start_loc[0] != 0 || b.query_start_loc[static_cast<size_t>(R)] != T) {
    return Invalid(absl::StrCat("query_start_loc must run from 0 to ", T));
  }
  if (!b.lookback.empty() && static_cast<int64_t>(b.lookback.size()) != R * (N - 1)) {
    return Invalid(absl::StrCat("lookback has ", b.lookback.size(), " entries, expected ", R, " x ", N - 1));
  }
  if (!b.lookback_dead.empty() && b.lookback.empty()) return Invalid("lookback dead mask given without lookback ids");
  if (!b.lookback_dead.empty() && static_cast<int64_t>(b.lookback_dead.size()) != R * (N - 1)) {
    return Invalid(
        absl::StrCat("lookback dead mask has ", b.lookback_dead.size(), " entries, expected ", R, " x ", N - 1));
  }
  if (!b.dead.empty() && static_cast<int64_t>(b.dead.size()) != T) {
    return Invalid(absl::StrCat("dead mask has ", b.dead.size(), " entries for ", T, " tokens"));
  }
  if (static_cast<int64_t>(out.size()) != T * L * C) {
    return Invalid(absl::StrCat("output has ", out.size(), " entries, expected ", T, " x ", L, " x ", C));
  }
  // Every boundary is checked before any token is read or any id written: a boundary past T in the middle of the
  // list must not make one request read or write past the arrays.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t begin = b.query_start_loc[static_cast<size_t>(r)];
    const int64_t end = b.query_start_loc[static_cast<size_t>(r + 1)];
    if (end < begin) return Invalid(absl::StrCat("query_start_loc decreases at request ", r));
    if (begin < 0 || end > T)
      return Invalid(absl::StrCat("query_start_loc[", r + 1, "] = ", end, " outside [0, ", T, "]"));
  }
  const int64_t raw = token_map.raw_size();
  if (layout.config().pad_token_id >= raw) return Invalid("pad token id is outside the token map");
  const int64_t pad_c = token_map[layout.config().pad_token_id];
  auto compress = [&](int64_t raw_id, int32_t* c) -> absl::Status {
    if (raw_id < 0 || raw_id >= raw) return Invalid(absl::StrCat("token id ", raw_id, " outside [0, ", raw, ")"));
    *c = token_map[raw_id];
    return absl::OkStatus();
  };

  std::vector<int32_t> src(static_cast<size_t>(N));  // compressed ids at position - s, or kDead
  for (int64_t r = 0; r < R; ++r) {
    const int64_t begin = b.query_start_loc[static_cast<size_t>(r)];
    const int64_t end = b.query_start_loc[static_cast<size_t>(r + 1)];
    if (end < begin) return Invalid(absl::StrCat("query_start_loc decreases at request ", r));
    if (begin == end) continue;
    const int64_t start_pos = b.positions[static_cast<size_t>(begin)];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = b.positions[static_cast<size_t>(t)];
      if (pos != start_pos + (t - begin) || pos < 0) {
        return Invalid(
            absl::StrCat("positions of request ", r, " are not contiguous from ", start_pos, " at token ", t));
      }
      for (int64_t s = 0; s < N; ++s) {
        const int64_t lb = pos - s;
        int32_t c = kDead;
        if (lb < 0) {
          c = kDead;
        } else if (lb >= start_pos) {
          const int64_t tt = begin + (lb - start_pos);
          if (b.dead.empty() || b.dead[static_cast<size_t>(tt)] == 0) {
            auto st = compress(b.tokens[static_cast<size_t>(tt)], &c);
            if (!st.ok()) return Invalid(absl::StrCat("token ", tt, ": ", st.message()));
          }
        } else if (!b.lookback.empty()) {
          const int64_t k = lb - start_pos + (N - 1);  // index into this request's lookback, oldest first
          const auto kk = static_cast<size_t>(r * (N - 1) + k);
          const int32_t id = b.lookback[kk];
          if (id == -1) {
            // unknown: hashes as the pad token and does not block older ids, whatever its dead flag says
            c = static_cast<int32_t>(pad_c);
          } else {
            auto st = compress(id, &c);
            if (!st.ok()) return Invalid(absl::StrCat("lookback of request ", r, ": ", st.message()));
            if (!b.lookback_dead.empty() && b.lookback_dead[kk] != 0) c = kDead;  // blocks as a dead token does
          }
        } else {
          c = static_cast<int32_t>(pad_c);  // no lookback given: every lookback id is unknown
        }
        src[static_cast<size_t>(s)] = c;
      }
      for (int64_t l = 0; l < L; ++l) {
        const auto& mult = layout.multipliers(l);
        const auto& primes = layout.primes(l);
        const auto& offsets = layout.offsets(l);
        const auto& magics = layout.mod_magics(l);
        int32_t* row = out.data() + (t * L + l) * C;
        int64_t rolling = 0;
        bool blocked = false;
        for (int64_t s = 0; s < N; ++s) {
          blocked = blocked || src[static_cast<size_t>(s)] == kDead;
          const int64_t v = blocked ? pad_c : src[static_cast<size_t>(s)];
          rolling ^= v * mult[static_cast<size_t>(s)];
          if (s == 0) continue;
          for (int64_t h = 0; h < H; ++h) {
            const int64_t c = (s - 1) * H + h;
            const auto cc = static_cast<size_t>(c);
            const uint64_t bucket =
                FastMod(static_cast<uint64_t>(rolling), static_cast<uint64_t>(primes[cc]), magics[cc]);
            row[c] = static_cast<int32_t>(static_cast<int64_t>(bucket) + offsets[cc]);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

void PackRecords(const uint8_t* weight, const uint8_t* scale, int64_t n_rows, int64_t head_dim, uint8_t* out) {
  const int64_t ns = head_dim / 32;
  const int64_t rb = head_dim + ns;
  for (int64_t r = 0; r < n_rows; ++r) {
    std::memcpy(out + r * rb, weight + r * head_dim, static_cast<size_t>(head_dim));
    std::memcpy(out + r * rb + head_dim, scale + r * ns, static_cast<size_t>(ns));
  }
}

namespace {

absl::Status CheckTable(const RecordTable& t) {
  if (t.records == nullptr && t.row_end > t.row_begin) return Invalid("record table has no data");
  if (t.head_dim <= 0 || t.head_dim % 32 != 0) return Invalid("head_dim must be a positive multiple of 32");
  if (t.row_begin < 0 || t.row_end < t.row_begin) return Invalid("record table row range is invalid");
  return absl::OkStatus();
}

}  // namespace

absl::Status LookupBf16Cpu(const RecordTable& t, std::span<const int32_t> ids, std::span<uint16_t> out) {
  if (auto st = CheckTable(t); !st.ok()) return st;
  const int64_t D = t.head_dim;
  if (static_cast<int64_t>(out.size()) != static_cast<int64_t>(ids.size()) * D) {
    return Invalid(absl::StrCat("lookup output has ", out.size(), " values, expected ", ids.size(), " x ", D));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    uint16_t* dst = out.data() + static_cast<int64_t>(i) * D;
    const int64_t id = ids[i];
    if (id < t.row_begin || id >= t.row_end) {
      std::memset(dst, 0, static_cast<size_t>(D) * 2);
      continue;
    }
    const uint8_t* rec = t.records + (id - t.row_begin) * t.record_bytes();
    for (int64_t b = 0; b < D / 32; ++b) {
      const float scale = Ue8m0ToFloat(rec[D + b]);
      for (int64_t j = b * 32; j < b * 32 + 32; ++j) dst[j] = FloatToBf16(kE4M3[rec[j]] * scale);
    }
  }
  return absl::OkStatus();
}

absl::Status LookupPackedCpu(const RecordTable& t, std::span<const int32_t> ids, std::span<uint8_t> out) {
  if (auto st = CheckTable(t); !st.ok()) return st;
  const int64_t rb = t.record_bytes();
  if (static_cast<int64_t>(out.size()) != static_cast<int64_t>(ids.size()) * rb) {
    return Invalid(absl::StrCat("packed output has ", out.size(), " bytes, expected ", ids.size(), " x ", rb));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    uint8_t* dst = out.data() + static_cast<int64_t>(i) * rb;
    const int64_t id = ids[i];
    if (id < t.row_begin || id >= t.row_end) {
      std::memset(dst, 0, static_cast<size_t>(rb));
    } else {
      std::memcpy(dst, t.records + (id - t.row_begin) * rb, static_cast<size_t>(rb));
    }
  }
  return absl::OkStatus();
}

absl::Status GateCpu(const GateShape& s, std::span<const uint16_t> hidden, std::span<const uint16_t> kv,
                     std::span<const uint16_t> q_weight, std::span<const uint16_t> k_weight,
                     std::span<const uint8_t> mask, std::span<uint16_t> out) {
  const int64_t T = s.tokens, HC = s.hc_mult, D = s.dim;
  if (T < 0 || HC < 1 || D < 1) return Invalid("gate shape must have tokens >= 0, hc_mult >= 1, dim >= 1");
  auto want = [&](const char* name, size_t got, int64_t expect) -> absl::Status {
    if (static_cast<int64_t>(got) != expect) {
      return Invalid(absl::StrCat(name, " has ", got, " values, expected ", expect));
    }
    return absl::OkStatus();
  };
  for (auto st : {want("hidden", hidden.size(), T * HC * D), want("kv", kv.size(), T * (HC + 1) * D),
                  want("q_weight", q_weight.size(), HC * D), want("k_weight", k_weight.size(), HC * D),
                  want("out", out.size(), T * HC * D)}) {
    if (!st.ok()) return st;
  }
  if (!mask.empty() && static_cast<int64_t>(mask.size()) != T) return Invalid("mask must have one entry per token");
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* value = kv.data() + (t * (HC + 1) + HC) * D;
    const bool dead = !mask.empty() && mask[static_cast<size_t>(t)] != 0;
    for (int64_t c = 0; c < HC; ++c) {
      const uint16_t* h = hidden.data() + (t * HC + c) * D;
      const uint16_t* key = kv.data() + (t * (HC + 1) + c) * D;
      const uint16_t* q = q_weight.data() + c * D;
      const uint16_t* k = k_weight.data() + c * D;
      float g = 0.0f;
      if (!dead) {
        float dot = 0.0f, hh = 0.0f, kk = 0.0f;
        for (int64_t j = 0; j < D; ++j) {
          const float hj = Bf16ToFloat(h[j]), kj = Bf16ToFloat(key[j]);
          dot += hj * Bf16ToFloat(q[j]) * Bf16ToFloat(k[j]) * kj;
          hh += hj * hj;
          kk += kj * kj;
        }
        const float Df = static_cast<float>(D);
        dot = dot / std::sqrt(hh / Df + s.eps) / std::sqrt(kk / Df + s.eps) * inv_sqrt_d;
        const float mag = std::sqrt(std::max(std::fabs(dot), 1e-6f));
        const float x = dot > 0 ? mag : (dot < 0 ? -mag : 0.0f);
        g = 1.0f / (1.0f + std::exp(-x));
      }
      uint16_t* o = out.data() + (t * HC + c) * D;
      for (int64_t j = 0; j < D; ++j) o[j] = FloatToBf16(Bf16ToFloat(h[j]) + g * Bf16ToFloat(value[j]));
    }
  }
  return absl::OkStatus();
}

}  // namespace engram
