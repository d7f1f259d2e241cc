// The independent row oracle (tools/row_oracle.h) against the synthetic generator's formula (SyntheticByte), and
// the production shard reader (io/shard_records.h) against the oracle: a reader that drops or shifts the scale
// bytes, or reads the wrong row, fails here. Also the oracle's own error paths and its bf16 dequantisation against
// hand-computed constants.
#include <gtest/gtest.h>
#include <algorithm>

#include <random>
#include <set>

#include "io/shard_records.h"
#include "model/checkpoint.h"
#include "model/fp8.h"
#include "tests/test_util.h"
#include "tools/row_oracle.h"
#include "tools/synthetic.h"
#include "xxhash.h"

namespace engram {
namespace {

using engram::oracle::RowOracle;
using engram::testing::TempDir;

// The record of (layer_id, row) as the generator's formula says it must be.
std::vector<uint8_t> FormulaRecord(uint64_t seed, int64_t layer_id, int64_t row, int64_t D) {
  const std::string base = "layers." + std::to_string(layer_id) + ".engram.";
  std::vector<uint8_t> rec;
  for (int64_t j = 0; j < D; ++j) {
    rec.push_back(tools::SyntheticByte(seed, base + "embed.weight", static_cast<uint64_t>(row * D + j), false, false));
  }
  for (int64_t j = 0; j < D / 32; ++j) {
    rec.push_back(
        tools::SyntheticByte(seed, base + "embed.scale", static_cast<uint64_t>(row * (D / 32) + j), true, false));
  }
  return rec;
}

struct Variant {
  int64_t shards;
  bool model_prefix;
  int64_t head_dim;
};

class RowOracleTest : public ::testing::TestWithParam<Variant> {};

TEST_P(RowOracleTest, OracleEqualsFormulaAndProductionReaderEqualsOracle) {
  const Variant v = GetParam();
  TempDir tmp;
  tools::SyntheticSpec spec;
  spec.out_dir = tmp.path();
  spec.table_mib = 2;
  spec.seed = 7;
  spec.shards = v.shards;
  spec.model_prefix = v.model_prefix;
  spec.head_dim = v.head_dim;
  spec.threads = 2;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());

  std::string error;
  auto oracle = RowOracle::Open(tmp.path(), &error);
  ASSERT_NE(oracle, nullptr) << error;
  EXPECT_EQ(oracle->head_dim(), v.head_dim);
  EXPECT_EQ(oracle->record_bytes(), v.head_dim + v.head_dim / 32);
  ASSERT_EQ(oracle->layer_ids(), (std::vector<int64_t>{1, 3}));

  auto ckpt = Checkpoint::Open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const int64_t D = v.head_dim, rb = D + D / 32;
  std::mt19937_64 rng(3);
  for (size_t l = 0; l < oracle->layer_ids().size(); ++l) {
    const int64_t layer_id = oracle->layer_ids()[l];
    const int64_t rows = (*ckpt)->config().num_embeddings[l];
    ASSERT_GT(rows, 2);
    // The whole layer through the production reader, with two threads: read-then-packed in place (the default, in
    // 37-row steps that end mid-chunk and in 1024-row steps) and packed in the cache then streamed out
    // (stream_stores, 37-row steps, into a destination 5 bytes off alignment, and 1024-row steps) give the same
    // bytes and the same checksums, and write nothing outside the records.
    std::vector<uint8_t> table(static_cast<size_t>(rows * rb), 0xEE);
    std::vector<uint64_t> sums;
    ASSERT_TRUE(ReadShardRecords(**ckpt, {{static_cast<int64_t>(l), 0, rows, 0}}, table.data(), 2, &sums).ok());
    // The checksum format recomputed here with libxxhash's plain XXH3 (the fill hashes through its runtime dispatch
    // where it links: the same hashes, or every segment published before would fail its verification): XXH3 of each
    // 64K-row chunk's records, then XXH3 of those hashes.
    {
      std::vector<uint64_t> chunk_hashes;
      for (int64_t r0 = 0; r0 < rows; r0 += kChecksumChunkRows) {
        const int64_t n = std::min(kChecksumChunkRows, rows - r0);
        chunk_hashes.push_back(XXH3_64bits(table.data() + r0 * rb, static_cast<size_t>(n * rb)));
      }
      ASSERT_EQ(sums.size(), 1u);
      EXPECT_EQ(sums[0], XXH3_64bits(chunk_hashes.data(), chunk_hashes.size() * sizeof(uint64_t)));
    }
    struct Fill {
      const char* name;
      bool stream;
      int64_t sub_rows, offset;
    };
    for (const Fill& f : {Fill{"packed", false, 37, 0}, Fill{"packed", false, 1024, 0},
                          Fill{"stream_stores", true, 37, 5}, Fill{"stream_stores", true, 1024, 0}}) {
      ShardFillOptions fill;
      fill.stream_stores = f.stream;
      fill.sub_rows = f.sub_rows;
      std::vector<uint8_t> other(table.size() + 16, 0x11);
      std::vector<uint64_t> other_sums;
      ASSERT_TRUE(ReadShardRecords(**ckpt, {{static_cast<int64_t>(l), 0, rows, 0}}, other.data() + f.offset, 2,
                                   &other_sums, nullptr, fill)
                      .ok());
      const auto first = other.begin() + f.offset, last = first + static_cast<int64_t>(table.size());
      EXPECT_TRUE(std::equal(first, last, table.begin())) << f.name << " " << f.sub_rows << " gave other bytes";
      EXPECT_EQ(other_sums, sums) << f.name << " " << f.sub_rows;
      EXPECT_TRUE(std::all_of(other.begin(), first, [](uint8_t b) { return b == 0x11; })) << f.name;
      EXPECT_TRUE(std::all_of(last, other.end(), [](uint8_t b) { return b == 0x11; })) << f.name;
    }
    std::vector<int64_t> sample = {0, 1, rows - 1};
    for (int i = 0; i < 40; ++i) sample.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(rows)));
    for (int64_t row : sample) {
      auto rec = oracle->Record(layer_id, row, &error);
      ASSERT_TRUE(rec.has_value()) << error;
      ASSERT_EQ(*rec, FormulaRecord(spec.seed, layer_id, row, D)) << "layer " << layer_id << " row " << row;
      auto at = oracle->RecordAt(static_cast<int64_t>(l), row, &error);
      ASSERT_TRUE(at.has_value()) << error;
      EXPECT_EQ(*at, *rec);
      const std::vector<uint8_t> prod(table.begin() + row * rb, table.begin() + (row + 1) * rb);
      ASSERT_EQ(prod, *rec) << "production reader, layer " << layer_id << " row " << row;
    }
    // The scales are not all one value (a reader that zeroes or skips them cannot pass by luck).
    std::set<uint8_t> scales;
    for (int64_t row = 0; row < std::min<int64_t>(rows, 64); ++row) {
      for (int64_t j = 0; j < D / 32; ++j) scales.insert(table[static_cast<size_t>(row * rb + D + j)]);
    }
    EXPECT_GT(scales.size(), 4u);
    EXPECT_EQ(scales.count(0), 0u);
    // Out of range rows and unknown layers are errors, not zero rows.
    error.clear();
    EXPECT_FALSE(oracle->Record(layer_id, rows, &error).has_value());
    EXPECT_NE(error.find("out of range"), std::string::npos) << error;
    EXPECT_FALSE(oracle->Record(layer_id, -1, &error).has_value());
  }
  error.clear();
  EXPECT_FALSE(oracle->Record(2, 0, &error).has_value());
  EXPECT_NE(error.find("not found"), std::string::npos) << error;
  EXPECT_FALSE(oracle->RecordAt(2, 0, &error).has_value());
}

INSTANTIATE_TEST_SUITE_P(Variants, RowOracleTest,
                         ::testing::Values(Variant{2, false, 256}, Variant{1, true, 256}, Variant{2, true, 128}));

TEST(RowOracle, MissingOrBrokenCheckpointIsAnError) {
  TempDir tmp;
  std::string error;
  EXPECT_EQ(RowOracle::Open(tmp.path(), &error), nullptr);
  EXPECT_NE(error.find("config.json"), std::string::npos);
  testing::WriteFile(tmp / "config.json", R"({"text_config": {"engram_layer_ids": [4], "engram_head_dim": 64}})");
  auto o = RowOracle::Open(tmp.path(), &error);
  ASSERT_NE(o, nullptr) << error;  // nested text_config is accepted
  EXPECT_EQ(o->layer_ids(), std::vector<int64_t>{4});
  EXPECT_FALSE(o->Record(4, 0, &error).has_value());  // no model.safetensors
  EXPECT_NE(error.find("model.safetensors"), std::string::npos) << error;
  // A shard whose header length points past the file.
  std::string bad(8, '\0');
  bad[0] = static_cast<char>(0xF0);
  testing::WriteFile(tmp / "model.safetensors", bad + "{}");
  auto o2 = RowOracle::Open(tmp.path(), &error);
  ASSERT_NE(o2, nullptr);
  EXPECT_FALSE(o2->Record(4, 0, &error).has_value());
  EXPECT_NE(error.find("header"), std::string::npos) << error;
}

TEST(RowOracle, DequantMatchesHandComputedValues) {
  // head_dim 32: one scale byte. Elements: 1.0, -1.0, 448 (max), 2^-9 (smallest subnormal), NaN, 0, -0, 1.125.
  std::vector<uint8_t> rec(33, 0x00);
  const uint8_t e[] = {0x38, 0xB8, 0x7E, 0x01, 0x7F, 0x00, 0x80, 0x39};
  for (size_t i = 0; i < sizeof(e); ++i) rec[i] = e[i];
  rec[32] = 127;  // scale 1.0
  auto row = oracle::DequantBf16Row(rec, 32);
  EXPECT_EQ(row[0], 0x3F80);
  EXPECT_EQ(row[1], 0xBF80);
  EXPECT_EQ(row[2], 0x43E0);
  EXPECT_EQ(row[3], 0x3B00);
  EXPECT_EQ(row[4], 0x7FFF);
  EXPECT_EQ(row[5], 0x0000);
  EXPECT_EQ(row[6], 0x8000);
  EXPECT_EQ(row[7], 0x3F90);
  rec[32] = 130;  // scale 8: 1.0 -> 8.0
  EXPECT_EQ(oracle::DequantBf16Row(rec, 32)[0], 0x4100);
  rec[32] = 0;  // scale byte 0 decodes as +0.0: 1.0 * 0 = 0, -1.0 * 0 = -0
  row = oracle::DequantBf16Row(rec, 32);
  EXPECT_EQ(row[0], 0x0000);
  EXPECT_EQ(row[1], 0x8000);
  rec[32] = 255;  // +inf: 1.0 -> inf, 0 * inf -> NaN
  row = oracle::DequantBf16Row(rec, 32);
  EXPECT_EQ(row[0], 0x7F80);
  EXPECT_EQ(row[5], 0x7FFF);
}

// Every (e4m3, ue8m0) pair: the production dequantisation (model/fp8.h, used by the CPU lookup and the kernels)
// equals the oracle's, so engram-replica's bf16 comparison through the oracle is exact.
TEST(RowOracle, DequantEqualsProductionForEveryBytepair) {
  std::vector<uint8_t> rec(33);
  for (int s = 0; s < 256; ++s) {
    rec[32] = static_cast<uint8_t>(s);
    for (int base = 0; base < 256; base += 32) {
      for (int j = 0; j < 32; ++j) rec[static_cast<size_t>(j)] = static_cast<uint8_t>(base + j);
      const auto row = oracle::DequantBf16Row(rec, 32);
      for (int j = 0; j < 32; ++j) {
        ASSERT_EQ(row[static_cast<size_t>(j)], DequantBf16(static_cast<uint8_t>(base + j), static_cast<uint8_t>(s)))
            << "e4m3 " << base + j << " scale " << s;
      }
    }
  }
}

}  // namespace
}  // namespace engram
