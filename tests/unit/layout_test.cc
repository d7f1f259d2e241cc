// Layout against NumPy's goldens (tests/data/goldens/multipliers-*.json, from ../shared/tools/golden-multipliers.py):
// multipliers, primes, offsets and row counts for every committed config; TP shard ranges; prime testing.
#include <filesystem>
#include <random>
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
  EXPECT_FALSE(IsPrime(3215031751ull));        // strong pseudoprime to bases 2, 3, 5, 7
  EXPECT_FALSE(IsPrime(3825123056546413051ull));  // strong pseudoprime to bases 2..23
  EXPECT_FALSE(IsPrime(561));                  // Carmichael
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
