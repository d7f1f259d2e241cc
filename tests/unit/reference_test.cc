// The CPU reference kernels: hash ids against the independent Python golden (tests/data/golden_hash.py), FP8/bf16
// conversions against their definitions in float64, lookups on fresh random tables with poisoned outputs, and the
// gate against a float64 oracle.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "model/fp8.h"
#include "model/reference.h"
#include "nlohmann/json.hpp"
#include "tests/oracle.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;

uint64_t FreshSeed() {
  uint64_t s = std::random_device{}();
  std::cout << "[ seed ] " << s << "\n";
  return s;
}

TokenMap GoldenMap() {
  std::string raw = testing::ReadFile(testing::DataPath("goldens/tokenmap-bytelevel-mixed.bin"));
  std::vector<int32_t> ids(raw.size() / 4);
  std::memcpy(ids.data(), raw.data(), ids.size() * 4);
  return TokenMap::FromIds(ids);
}

TEST(HashReferenceTest, MatchesTheIndependentGolden) {
  auto cfg = LoadEngramConfig(testing::DataPath("configs/bytelevel-hash.json"));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok()) << layout.status();
  TokenMap map = GoldenMap();
  json gold = json::parse(testing::ReadFile(testing::DataPath("goldens/hash-bytelevel.json")));
  ASSERT_GE(gold["cases"].size(), 5u);
  int dead_lookback_cases = 0;
  for (const auto& c : gold["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto tokens = c["tokens"].get<std::vector<int32_t>>();
    auto positions = c["positions"].get<std::vector<int64_t>>();
    auto qsl = c["query_start_loc"].get<std::vector<int32_t>>();
    auto lookback = c["lookback"].get<std::vector<int32_t>>();
    auto dead = c["dead"].get<std::vector<uint8_t>>();
    auto lookback_dead = c["lookback_dead"].get<std::vector<uint8_t>>();
    dead_lookback_cases += std::any_of(lookback_dead.begin(), lookback_dead.end(), [](uint8_t f) { return f != 0; });
    const size_t per_token = static_cast<size_t>(layout->n_layers() * layout->n_cols());
    std::vector<int32_t> out(tokens.size() * per_token, -7);
    ASSERT_TRUE(HashIdsCpu(*layout, map, {tokens, positions, qsl, lookback, dead, lookback_dead}, out).ok());
    for (size_t t = 0; t < tokens.size(); ++t) {
      for (size_t l = 0; l < 2; ++l) {
        auto want = c["ids"][t][l].get<std::vector<int32_t>>();
        std::vector<int32_t> got(out.begin() + static_cast<long>(t * per_token + l * want.size()),
                                 out.begin() + static_cast<long>(t * per_token + (l + 1) * want.size()));
        ASSERT_EQ(got, want) << "token " << t << " layer " << l;
      }
    }
  }
  EXPECT_GE(dead_lookback_cases, 3);  // the golden's cases with DEAD lookback ids
}

TEST(HashReferenceTest, IdsStayInsideTheirColumnBuckets) {
  auto cfg = LoadEngramConfig(testing::DataPath("configs/bytelevel-hash.json"));
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok());
  TokenMap map = GoldenMap();
  std::mt19937_64 rng(FreshSeed());
  const int T = 500;
  std::vector<int32_t> tokens(T);
  std::vector<int64_t> pos(T);
  std::vector<uint8_t> dead(T);
  for (int i = 0; i < T; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(map.raw_size()));
    pos[i] = i;
    dead[i] = rng() % 10 == 0;
  }
  std::vector<int32_t> qsl = {0, T};
  std::vector<int32_t> out(static_cast<size_t>(T * layout->n_layers() * layout->n_cols()));
  ASSERT_TRUE(HashIdsCpu(*layout, map, {tokens, pos, qsl, {}, dead}, out).ok());
  for (int t = 0; t < T; ++t) {
    for (int64_t l = 0; l < layout->n_layers(); ++l) {
      for (int64_t c = 0; c < layout->n_cols(); ++c) {
        const int32_t id = out[static_cast<size_t>((t * layout->n_layers() + l) * layout->n_cols() + c)];
        EXPECT_GE(id, layout->offsets(l)[c]);
        EXPECT_LT(id, layout->offsets(l)[c] + layout->primes(l)[c]);
      }
    }
  }
}

// A chunk whose lookback holds the N-1 tokens before it, with the dead flags the whole request gives them, hashes as
// the same positions of the whole request hashed in one piece (fresh random requests, dead spans and chunk starts).
TEST(HashReferenceTest, AChunkWithDeadLookbackIdsHashesAsTheWholeRequest) {
  auto cfg = LoadEngramConfig(testing::DataPath("configs/bytelevel-hash.json"));
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok());
  TokenMap map = GoldenMap();
  const int64_t N = layout->max_ngram(), per = layout->n_layers() * layout->n_cols();
  std::mt19937_64 rng(FreshSeed());
  int differs_without_mask = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int T = 2 + static_cast<int>(rng() % 30);
    const int P = 1 + static_cast<int>(rng() % static_cast<uint64_t>(T - 1));  // the chunk is [P, T)
    std::vector<int32_t> tokens(T);
    std::vector<int64_t> pos(T);
    std::vector<uint8_t> dead(T);
    for (int i = 0; i < T; ++i) {
      tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(map.raw_size()));
      pos[i] = i;
      dead[i] = rng() % 3 == 0;
    }
    std::vector<int32_t> qsl = {0, T}, chunk_qsl = {0, T - P};
    std::vector<int32_t> whole(static_cast<size_t>(T * per), -7);
    ASSERT_TRUE(HashIdsCpu(*layout, map, {tokens, pos, qsl, {}, dead}, whole).ok());
    std::vector<int32_t> lookback(static_cast<size_t>(N - 1));
    std::vector<uint8_t> lookback_dead(static_cast<size_t>(N - 1));
    for (int64_t k = 0; k < N - 1; ++k) {  // oldest first: positions P - (N - 1) .. P - 1
      const int64_t p = P - (N - 1) + k;
      lookback[static_cast<size_t>(k)] = p >= 0 ? tokens[static_cast<size_t>(p)] : -1;
      // A flag before position 0 is on an unknown id: not read.
      lookback_dead[static_cast<size_t>(k)] = p >= 0 ? dead[static_cast<size_t>(p)] : static_cast<uint8_t>(rng() % 2);
    }
    std::span<const int32_t> ct(tokens.data() + P, static_cast<size_t>(T - P));
    std::span<const int64_t> cp(pos.data() + P, static_cast<size_t>(T - P));
    std::span<const uint8_t> cd(dead.data() + P, static_cast<size_t>(T - P));
    std::vector<int32_t> chunk(static_cast<size_t>((T - P) * per), -7), plain(chunk.size(), -7);
    ASSERT_TRUE(HashIdsCpu(*layout, map, {ct, cp, chunk_qsl, lookback, cd, lookback_dead}, chunk).ok());
    ASSERT_TRUE(std::equal(chunk.begin(), chunk.end(), whole.begin() + static_cast<long>(P * per)))
        << "T " << T << " chunk from " << P;
    ASSERT_TRUE(HashIdsCpu(*layout, map, {ct, cp, chunk_qsl, lookback, cd}, plain).ok());
    differs_without_mask += plain != chunk;
  }
  EXPECT_GT(differs_without_mask, 0);  // the mask changed some chunk's ids
}

TEST(HashReferenceTest, MalformedBatchesAreErrors) {
  auto cfg = LoadEngramConfig(testing::DataPath("configs/bytelevel-hash.json"));
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok());
  TokenMap map = GoldenMap();
  std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<int64_t> pos = {0, 1, 2};
  std::vector<int32_t> qsl = {0, 3};
  std::vector<int32_t> out(3 * 2 * 9);
  struct Case {
    const char* name;
    HashBatch b;
    size_t out_size;
    const char* expect;
  };
  std::vector<int64_t> gap = {0, 1, 3}, neg = {-1, 0, 1}, short_pos = {0, 1};
  std::vector<int32_t> bad_qsl = {0, 2}, dec_qsl = {0, 2, 1, 3}, one = {0}, past_qsl = {0, 9, 3};
  std::vector<int32_t> big = {1, 999999, 3}, lb_short = {1};
  std::vector<uint8_t> dead_short = {0}, lb_dead_short = {0, 1};
  std::vector<int32_t> lb_ok = {1, 2, 3};
  std::vector<uint8_t> lb_dead_ok = {0, 0, 1};
  Case cases[] = {
      {"positions count", {tokens, short_pos, qsl, {}, {}}, out.size(), "positions has 2"},
      {"gap in positions", {tokens, gap, qsl, {}, {}}, out.size(), "not contiguous"},
      {"negative position", {tokens, neg, qsl, {}, {}}, out.size(), "not contiguous"},
      {"qsl end", {tokens, pos, bad_qsl, {}, {}}, out.size(), "must run from 0 to 3"},
      {"qsl decreasing", {tokens, pos, dec_qsl, {}, {}}, out.size(), "decreases"},
      {"qsl too short", {tokens, pos, one, {}, {}}, out.size(), "at least two"},
      // A middle boundary past T: refused before the first request reads tokens 0..8 (a check request by request
      // would hash it first: reads past tokens and positions, writes past out). The guarded output shows it.
      {"qsl past the tokens", {tokens, pos, past_qsl, {}, {}}, out.size(), "outside [0, 3]"},
      {"token out of range", {big, pos, qsl, {}, {}}, out.size(), "token id 999999"},
      {"lookback size", {tokens, pos, qsl, lb_short, {}}, out.size(), "lookback has 1"},
      {"dead size", {tokens, pos, qsl, {}, dead_short}, out.size(), "dead mask has 1"},
      {"lookback dead size", {tokens, pos, qsl, lb_ok, {}, lb_dead_short}, out.size(), "lookback dead mask has 2"},
      {"lookback dead without lookback", {tokens, pos, qsl, {}, {}, lb_dead_ok}, out.size(), "without lookback ids"},
      {"output size", {tokens, pos, qsl, {}, {}}, out.size() - 1, "output has"},
  };
  for (auto& c : cases) {
    std::fill(out.begin(), out.end(), -7);  // poison: a refusal writes nothing
    auto st = HashIdsCpu(*layout, map, c.b, std::span<int32_t>(out.data(), c.out_size));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << c.name << ": " << st;
    if (std::string(c.name) == "qsl past the tokens") {
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](int32_t v) { return v == -7; })) << "written before refusing";
    }
  }
}

double E4M3Definition(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 0xF, m = b & 7;
  if (e == 15 && m == 7) return std::nan("");
  double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -mag : mag;
}

// Round-to-nearest-even of a double onto bf16, by comparing the two neighbouring bf16 values in float64.
uint16_t Bf16Oracle(double x) {
  if (std::isnan(x)) return 0x7FFF;
  float f = static_cast<float>(x);  // exact for every product in these tests (few significant bits)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t lo = bits & 0xFFFF0000u, hi = lo + 0x10000u;
  float flo, fhi;
  std::memcpy(&flo, &lo, 4);
  std::memcpy(&fhi, &hi, 4);
  // Past the largest finite bf16 the upper neighbour is 2^128 (rounding there gives infinity).
  const double up = std::isinf(fhi) ? std::copysign(std::ldexp(1.0, 128), x) : static_cast<double>(fhi);
  double dlo = std::fabs(static_cast<double>(flo) - x), dhi = std::fabs(up - x);
  if (dlo < dhi) return static_cast<uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

TEST(Fp8Test, E4M3AndUe8m0MatchTheirDefinitions) {
  for (int b = 0; b < 256; ++b) {
    const double want = E4M3Definition(static_cast<uint8_t>(b));
    const float got = E4M3ToFloat(static_cast<uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
    }
  }
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Ue8m0ToFloat(0), 0.0f);
  EXPECT_EQ(Ue8m0ToFloat(127), 1.0f);
  EXPECT_EQ(Ue8m0ToFloat(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(Ue8m0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isinf(Ue8m0ToFloat(255)));
}

TEST(Fp8Test, Bf16RoundsToNearestEven) {
  std::mt19937_64 rng(FreshSeed());
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    if ((bits & 0x7F800000u) == 0x7F800000u) continue;  // inf/nan handled below
    float f;
    std::memcpy(&f, &bits, 4);
    ASSERT_EQ(FloatToBf16(f), Bf16Oracle(f)) << std::hex << bits;
  }
  EXPECT_EQ(FloatToBf16(std::nanf("")), 0x7FFF);
  EXPECT_EQ(FloatToBf16(-std::nanf("")), 0x7FFF);
  EXPECT_EQ(FloatToBf16(INFINITY), 0x7F80);
}

TEST(LookupReferenceTest, DequantisesOwnedRowsAndZeroesTheRest) {
  std::mt19937_64 rng(FreshSeed());
  const int64_t D = 256, rows = 1000, begin = 5000;
  const int64_t rb = D + D / 32;
  std::vector<uint8_t> weight(rows * D), scale(rows * D / 32), records(rows * rb);
  for (auto& b : weight) b = static_cast<uint8_t>(rng());
  for (auto& b : scale) b = static_cast<uint8_t>(rng() % 256);  // every scale, 0 and 255 included
  PackRecords(weight.data(), scale.data(), rows, D, records.data());
  RecordTable table{records.data(), begin, begin + rows, D};
  std::vector<int32_t> ids;
  for (int i = 0; i < 3000; ++i)
    ids.push_back(static_cast<int32_t>(begin - 50 + static_cast<int64_t>(rng() % (rows + 100))));
  ids.push_back(-1);
  ids.push_back(static_cast<int32_t>(begin));
  ids.push_back(static_cast<int32_t>(begin + rows - 1));
  ids.push_back(static_cast<int32_t>(begin + rows));
  std::vector<uint16_t> out(ids.size() * D, 0xFFFF);  // poisoned: NaN
  ASSERT_TRUE(LookupBf16Cpu(table, ids, out).ok());
  std::vector<uint8_t> packed(ids.size() * rb, 0xAB);
  ASSERT_TRUE(LookupPackedCpu(table, ids, packed).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    const bool owned = id >= begin && id < begin + rows;
    for (int64_t j = 0; j < D; ++j) {
      uint16_t want = 0;
      if (owned) {
        const int64_t r = id - begin;
        want =
            Bf16Oracle(E4M3Definition(weight[r * D + j]) *
                       std::ldexp(1.0, scale[r * D / 32 + j / 32] == 0 ? -100000 : scale[r * D / 32 + j / 32] - 127));
        if (scale[r * D / 32 + j / 32] == 255) {  // a scale of +inf, computed without the code under test
          const double e = E4M3Definition(weight[r * D + j]);
          want = std::isnan(e) || e == 0.0 ? uint16_t{0x7FFF} : e > 0 ? uint16_t{0x7F80} : uint16_t{0xFF80};
        }
      }
      ASSERT_EQ(out[i * D + j], want) << "id " << id << " j " << j;
    }
    for (int64_t k = 0; k < rb; ++k) {  // the record is the row's weight bytes, then its scale bytes
      const int64_t r = id - begin;
      const uint8_t want = !owned ? 0 : k < D ? weight[r * D + k] : scale[r * D / 32 + (k - D)];
      ASSERT_EQ(packed[i * rb + k], want) << "id " << id << " byte " << k;
    }
  }
  std::vector<uint16_t> small(3);
  EXPECT_FALSE(LookupBf16Cpu(table, ids, small).ok());
  EXPECT_FALSE(LookupPackedCpu(table, ids, std::span<uint8_t>(packed.data(), 5)).ok());
  EXPECT_FALSE(LookupBf16Cpu(RecordTable{records.data(), 0, 10, 48}, ids, out).ok());
}

using testing::RandomBf16;

TEST(GateReferenceTest, AgreesWithAFloat64Oracle) {
  std::mt19937_64 rng(FreshSeed());
  for (int64_t D : {64, 512, 5120}) {
    GateShape s{37, 4, D, 1e-6f};
    auto hidden = RandomBf16(rng, static_cast<size_t>(s.tokens * s.hc_mult * D), 1.0f);
    auto kv = RandomBf16(rng, static_cast<size_t>(s.tokens * (s.hc_mult + 1) * D), 0.5f);
    auto q = RandomBf16(rng, static_cast<size_t>(s.hc_mult * D), 1.0f);
    auto k = RandomBf16(rng, static_cast<size_t>(s.hc_mult * D), 1.0f);
    // Make some tokens strongly aligned so gates span (0, 1).
    for (int64_t t = 0; t < s.tokens; t += 3) {
      for (int64_t j = 0; j < D; ++j)
        kv[static_cast<size_t>(t * (s.hc_mult + 1) * D + j)] = hidden[static_cast<size_t>(t * s.hc_mult * D + j)];
    }
    std::vector<uint8_t> mask(static_cast<size_t>(s.tokens), 0);
    mask[5] = mask[6] = 1;
    std::vector<uint16_t> out(hidden.size(), 0xFFFF);
    ASSERT_TRUE(GateCpu(s, hidden, kv, q, k, mask, out).ok());
    EXPECT_LE(testing::GateViolation(s.tokens, s.hc_mult, D, 1e-6, hidden, kv, q, k, mask, out), 0.0) << "D " << D;
    for (int64_t t : {5, 6}) {  // masked tokens pass through unchanged
      for (int64_t j = 0; j < s.hc_mult * D; ++j) {
        ASSERT_EQ(out[static_cast<size_t>(t * s.hc_mult * D + j)], hidden[static_cast<size_t>(t * s.hc_mult * D + j)]);
      }
    }
  }
}

TEST(GateReferenceTest, ShapeErrors) {
  GateShape s{2, 2, 4, 1e-6f};
  std::vector<uint16_t> h(16), kv(24), q(8), k(8), out(16);
  EXPECT_TRUE(GateCpu(s, h, kv, q, k, {}, out).ok());
  std::vector<uint16_t> kv_bad(23);
  auto st = GateCpu(s, h, kv_bad, q, k, {}, out);
  EXPECT_NE(st.message().find("kv has 23 values, expected 24"), std::string::npos) << st;
  std::vector<uint8_t> mask(3);
  EXPECT_FALSE(GateCpu(s, h, kv, q, k, mask, out).ok());
  EXPECT_FALSE(GateCpu(GateShape{2, 0, 4}, h, kv, q, k, {}, out).ok());
}

}  // namespace
}  // namespace engram
