// Layout against NumPy's goldens (tests/data/goldens/multipliers-*.json, from tests/data/golden_multipliers.py):
// multipliers, primes, offsets and row counts for every committed config; TP shard ranges; prime testing.
#include <filesystem>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "model/fast_mod.h"
#include "model/layout.h"
#include "model/numpy_random.h"
#include "model/primes.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::DataPath;
using testing::ReadFile;

std::vector<std::string> GoldenConfigs() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(DataPath("configs"))) {
    names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(LayoutTest, AtLeastFourGoldenConfigs) { EXPECT_GE(GoldenConfigs().size(), 4u); }

TEST(LayoutTest, MatchesNumpyGoldens) {
  for (const auto& name : GoldenConfigs()) {
    SCOPED_TRACE(name);
    auto cfg = LoadEngramConfig(DataPath("configs/" + name + ".json"));
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto layout = Layout::Build(*cfg);
    ASSERT_TRUE(layout.ok()) << layout.status();
    json gold = json::parse(ReadFile(DataPath("goldens/multipliers-" + name + ".json")));
    EXPECT_EQ(layout->multiplier_bound(), gold["bound"].get<int64_t>());
    ASSERT_EQ(static_cast<size_t>(layout->n_layers()), gold["layers"].size());
    for (int64_t l = 0; l < layout->n_layers(); ++l) {
      const json& g = gold["layers"][static_cast<size_t>(l)];
      EXPECT_EQ(cfg->layer_ids[l], g["layer"].get<int64_t>());
      EXPECT_EQ(layout->multipliers(l), g["multipliers"].get<std::vector<int64_t>>());
      EXPECT_EQ(layout->primes(l), g["primes"].get<std::vector<int64_t>>());
      EXPECT_EQ(layout->offsets(l), g["offsets"].get<std::vector<int64_t>>());
      EXPECT_EQ(layout->rows(l), g["rows"].get<int64_t>());
    }
  }
}

TEST(LayoutTest, FlashFactsFromTheSpec) {
  auto cfg = LoadEngramConfig(DataPath("configs/v41-flash.json"));
  ASSERT_TRUE(cfg.ok());
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->multipliers(0)[0], 76632096046245);
  EXPECT_EQ(layout->n_cols(), 24);
  EXPECT_EQ(layout->record_bytes(), 264);
  EXPECT_EQ(layout->table_bytes(), 202758032400);
  // The 48 primes are the 48 smallest primes >= 16,000,000.
  std::vector<int64_t> all;
  for (int64_t l = 0; l < 2; ++l) all.insert(all.end(), layout->primes(l).begin(), layout->primes(l).end());
  std::sort(all.begin(), all.end());
  int64_t p = 16000000 - 1;
  for (int64_t v : all) {
    p = static_cast<int64_t>(NextPrime(static_cast<uint64_t>(p)));
    EXPECT_EQ(v, p);
  }
  // Per-shard bytes: TP1 188.8 GiB, TP2 94.4, TP4 47.2, TP8 23.6.
  const double gib = 1024.0 * 1024 * 1024;
  for (auto [tp, want] : std::vector<std::pair<int, double>>{{1, 188.8}, {2, 94.4}, {4, 47.2}, {8, 23.6}}) {
    for (int r = 0; r < tp; ++r) {
      auto s = layout->Shard(tp, r);
      ASSERT_TRUE(s.ok());
      EXPECT_NEAR(static_cast<double>(s->bytes(264)) / gib, want, 0.06) << "tp " << tp << " rank " << r;
    }
  }
  auto bad = layout->Shard(16, 0);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("without columns"), std::string::npos) << bad.status();
}

TEST(LayoutTest, ShardsTileEveryLayer) {
  auto cfg = LoadEngramConfig(DataPath("configs/v41-flash.json"));
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok());
  for (int tp : {1, 2, 3, 4, 5, 6, 8, 12, 24}) {
    int64_t next_col = 0;
    std::vector<int64_t> next_row(2, 0);
    for (int r = 0; r < tp; ++r) {
      auto s = layout->Shard(tp, r);
      ASSERT_TRUE(s.ok()) << "tp " << tp << ": " << s.status();
      EXPECT_EQ(s->col_begin, next_col);
      EXPECT_GT(s->col_end, s->col_begin);
      next_col = s->col_end;
      for (int l = 0; l < 2; ++l) {
        EXPECT_EQ(s->row_begin[l], next_row[l]);
        next_row[l] = s->row_end[l];
      }
    }
    EXPECT_EQ(next_col, 24);
    EXPECT_EQ(next_row[0], layout->rows(0));
    EXPECT_EQ(next_row[1], layout->rows(1));
  }
  EXPECT_FALSE(layout->Shard(0, 0).ok());
  EXPECT_FALSE(layout->Shard(2, 2).ok());
  EXPECT_FALSE(layout->Shard(2, -1).ok());
  EXPECT_FALSE(layout->Shard(9, 0).ok()) << "24 columns in parts of 3 leave the 9th shard empty";
  EXPECT_FALSE(layout->Shard(7, 0).ok()) << "24 columns in parts of 4 leave the 7th shard empty";
}

TEST(LayoutTest, RejectsRowsThatDoNotMatchThePrimes) {
  auto cfg = LoadEngramConfig(DataPath("configs/small-two-layers.json"));
  ASSERT_TRUE(cfg.ok());
  cfg->num_embeddings[1] += 1;
  auto layout = Layout::Build(*cfg);
  ASSERT_FALSE(layout.ok());
  EXPECT_NE(layout.status().message().find("engram_num_embeddings[1]"), std::string::npos) << layout.status();
}

// docs/math.md section 4 as written: every search restarts at engram_vocab_size - 1 and skips the primes already seen.
// Primality from a sieve, so that this stays independent of IsPrime / NextPrime.
std::vector<std::vector<int64_t>> SpecPrimes(int64_t n_layers, int64_t max_ngram, int64_t n_heads, int64_t vocab,
                                             int64_t sieve_limit) {
  std::vector<bool> composite(static_cast<size_t>(sieve_limit) + 1, false);
  composite[0] = composite[1] = true;
  for (int64_t i = 2; i * i <= sieve_limit; ++i) {
    if (!composite[static_cast<size_t>(i)]) {
      for (int64_t j = i * i; j <= sieve_limit; j += i) composite[static_cast<size_t>(j)] = true;
    }
  }
  std::set<int64_t> seen;
  std::vector<std::vector<int64_t>> out;
  for (int64_t layer = 0; layer < n_layers; ++layer) {
    std::vector<int64_t> primes;
    for (int64_t n = 2; n <= max_ngram; ++n) {
      int64_t cur = vocab - 1;
      for (int64_t h = 0; h < n_heads; ++h) {
        do {
          ++cur;
          if (cur > sieve_limit) return {};  // the sieve is too small: the caller's assertion fails
        } while (composite[static_cast<size_t>(cur)] || seen.count(cur));
        seen.insert(cur);
        primes.push_back(cur);
      }
    }
    out.push_back(std::move(primes));
  }
  return out;
}

// A config of `n_layers` Engram layers whose tables match docs/math.md section 4's primes.
EngramConfig ManyLayers(int64_t n_layers, const std::vector<std::vector<int64_t>>& primes) {
  auto cfg = LoadEngramConfig(DataPath("configs/small-two-layers.json"));
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  EngramConfig c = *cfg;
  c.layer_ids.clear();
  c.num_embeddings.clear();
  for (int64_t l = 0; l < n_layers; ++l) {
    c.layer_ids.push_back(2 * l + 1);
    int64_t sum = 0;
    if (static_cast<size_t>(l) < primes.size()) {
      for (int64_t p : primes[static_cast<size_t>(l)]) sum += p;
    }
    c.num_embeddings.push_back(sum);
  }
  return c;
}

TEST(LayoutTest, TheMostLayersAllowedGetTheSpecsPrimes) {
  // small-two-layers: N = 3, 4 heads, engram_vocab_size 1000 -> 8 primes per layer, 8192 in all (all below 10^5).
  const auto want = SpecPrimes(kMaxEngramLayers, 3, 4, 1000, 200'000);
  ASSERT_EQ(want.size(), static_cast<size_t>(kMaxEngramLayers));
  const EngramConfig c = ManyLayers(kMaxEngramLayers, want);
  EXPECT_EQ(EngramPrimes(c.layer_ids, c.max_ngram_size, c.n_heads, c.vocab_size_engram), want);
  auto layout = Layout::Build(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (int64_t l = 0; l < kMaxEngramLayers; ++l) {
    ASSERT_EQ(layout->primes(l), want[static_cast<size_t>(l)]) << "layer " << l;
    EXPECT_EQ(layout->rows(l), c.num_embeddings[static_cast<size_t>(l)]);
  }
}

TEST(LayoutTest, RefusesMoreLayersThanTheCap) {
  // Through config.json: refused while parsing, naming the field and the cap.
  json j = json::parse(ReadFile(DataPath("configs/small-two-layers.json")));
  j["engram_layer_ids"] = json::array();
  j["engram_num_embeddings"] = json::array();
  for (int64_t l = 0; l <= kMaxEngramLayers; ++l) {
    j["engram_layer_ids"].push_back(l);
    j["engram_num_embeddings"].push_back(8214);
  }
  auto cfg = ParseEngramConfig(j.dump());
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(cfg.status().message().find("`engram_layer_ids` lists 1025 layers, more than the 1024 allowed"),
            std::string::npos)
      << cfg.status();
  // A config built in code is refused by the layout too (before any prime search).
  const EngramConfig c = ManyLayers(kMaxEngramLayers + 1, {});
  auto layout = Layout::Build(c);
  ASSERT_FALSE(layout.ok());
  EXPECT_NE(layout.status().message().find("`engram_layer_ids` lists 1025 layers"), std::string::npos)
      << layout.status();
}

TEST(PrimesTest, AgreesWithASieve) {
  const int kN = 2'000'000;
  std::vector<bool> composite(kN + 1, false);
  for (int i = 2; static_cast<int64_t>(i) * i <= kN; ++i) {
    if (!composite[i]) {
      for (int j = i * i; j <= kN; j += i) composite[j] = true;
    }
  }
  for (int i = 0; i <= kN; ++i) ASSERT_EQ(IsPrime(static_cast<uint64_t>(i)), i >= 2 && !composite[i]) << i;
}

TEST(PrimesTest, LargeAndAdversarialNumbers) {
  EXPECT_TRUE(IsPrime((uint64_t{1} << 61) - 1));
  EXPECT_TRUE(IsPrime(18446744073709551557ull));  // largest 64-bit prime
  EXPECT_FALSE(IsPrime(18446744073709551615ull));
  EXPECT_FALSE(IsPrime(3215031751ull));           // strong pseudoprime to bases 2, 3, 5, 7
  EXPECT_FALSE(IsPrime(3825123056546413051ull));  // strong pseudoprime to bases 2..23
  EXPECT_FALSE(IsPrime(561));                     // Carmichael
  EXPECT_EQ(NextPrime(15999999), 16000057u);
}

TEST(NumpyRandomTest, SeedZeroAndStateWords) {
  // numpy: SeedSequence(0).generate_state(4, np.uint32)
  SeedSequence seq(0);
  auto w = seq.GenerateState32(4);
  EXPECT_EQ(w, (std::vector<uint32_t>{2968811710u, 3677149159u, 745650761u, 2884920346u}));
}

}  // namespace
}  // namespace engram

namespace engram {
namespace {

TEST(FastModTest, EqualsTheDivisionForEveryKindOfDivisor) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint64_t> divisors = {2, 3, 4, 7, 8, 1024, 65537, 16000057, 2147483647, 4294967291ull, 4294967295ull};
  for (int i = 0; i < 50; ++i) divisors.push_back(2 + rng() % 4294967294ull);
  for (uint64_t p : divisors) {
    const uint64_t m = FastModMagic(p);
    for (uint64_t x : {uint64_t{0}, p - 1, p, p + 1, ~uint64_t{0}, ~uint64_t{0} >> 1, (~uint64_t{0} / p) * p}) {
      ASSERT_EQ(FastMod(x, p, m), x % p) << x << " % " << p;
    }
    for (int k = 0; k < 20000; ++k) {
      const uint64_t x = rng();
      ASSERT_EQ(FastMod(x, p, m), x % p) << x << " % " << p;
    }
  }
}

}  // namespace
}  // namespace engram
