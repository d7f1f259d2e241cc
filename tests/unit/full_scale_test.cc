// The real scale on the CPU: a sparse checkpoint of DeepSeek-V4.1-Flash's geometry (engram-mkckpt --like), checked
// against the model's published numbers (SPEC: engram_num_embeddings [384006168, 384016682], 202,758,032,400 bytes
// of tables, 94.4 / 47.2 / 23.6 GiB shards at TP 2 / 4 / 8); its pattern regions read back through the independent
// row oracle (tools/row_oracle.h) against the generator's byte function, holes as zero rows; the production reader
// (io/shard_records.h) at the last rows and across 2^31 .. 2^36 bytes equal to the oracle; the segment layout at
// full size (layer offsets past 2^36); and the pieces of the full-scale policy: page-cache handling of a publish,
// the mapping overhead and the 4 KiB-page warning.
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "daemon/publisher.h"
#include "gtest/gtest.h"
#include "io/shard_records.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "nlohmann/json.hpp"
#include "shm/capacity.h"
#include "shm/segment.h"
#include "tests/test_util.h"
#include "tools/row_oracle.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using nlohmann::json;

constexpr int64_t kRows0 = 384006168, kRows1 = 384016682;  // DeepSeek-V4.1-Flash's engram_num_embeddings
constexpr uint64_t kRecord = 264;

// One full-size checkpoint (both layers) for the whole suite: about 310 MB of real data in ~190 GB of files.
class FullScale : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    auto like = tools::LikeModel("deepseek-v4.1-flash");
    ASSERT_TRUE(like.ok()) << like.status();
    spec_ = *like;
    spec_.out_dir = *dir_ / "v41";
    spec_.seed = 7;
    spec_.threads = 2;
    auto r = tools::WriteSyntheticCheckpoint(spec_);
    ASSERT_TRUE(r.ok()) << r.status();
    result_ = *r;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static testing::TempDir* dir_;
  static tools::SyntheticSpec spec_;
  static tools::SyntheticResult result_;
};
testing::TempDir* FullScale::dir_ = nullptr;
tools::SyntheticSpec FullScale::spec_;
tools::SyntheticResult FullScale::result_;

TEST(LikeModel, KnowsDeepSeekV41FlashAndRefusesOthersByName) {
  auto s = tools::LikeModel("deepseek-v4.1-flash");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->layers, (std::vector<int64_t>{1, 14}));
  EXPECT_TRUE(s->sparse);
  auto bad = tools::LikeModel("deepseek-v9");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("deepseek-v4.1-flash"), std::string::npos) << "names the known models";
}

TEST_F(FullScale, TheGeometryIsTheModelsAndTheFilesAreSparse) {
  auto ckpt = Checkpoint::Open(spec_.out_dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const EngramConfig& c = (*ckpt)->config();
  EXPECT_EQ(c.num_embeddings, (std::vector<int64_t>{kRows0, kRows1}));
  auto layout = Layout::Build(c);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->table_bytes(), int64_t{202758032400});
  EXPECT_EQ(result_.table_bytes, uint64_t{202758032400});
  // Per-shard bytes (SPEC: TP1 188.8 GiB, TP2 94.4, TP4 47.2, TP8 23.6), and the shards tile every row.
  for (int64_t tp : {1, 2, 4, 8}) {
    int64_t rows = 0;
    for (int64_t r = 0; r < tp; ++r) {
      auto s = layout->Shard(tp, r);
      ASSERT_TRUE(s.ok());
      rows += s->rows();
      EXPECT_NEAR(static_cast<double>(s->bytes(264)) / 1073741824.0, 188.83 / static_cast<double>(tp), 0.05)
          << "TP " << tp << " rank " << r;
    }
    EXPECT_EQ(rows, kRows0 + kRows1);
  }
  // ~190 GB of files hold about 310 MB of data: holes everywhere but the pattern and the gate weights.
  uint64_t apparent = 0, allocated = 0;
  for (const auto& e : std::filesystem::directory_iterator(spec_.out_dir)) {
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    apparent += static_cast<uint64_t>(st.st_size);
    allocated += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  EXPECT_GT(apparent, uint64_t{202758032400});
  EXPECT_LT(allocated, uint64_t{1} << 30);
  EXPECT_LE(result_.file_bytes, apparent);
  EXPECT_LT(apparent - result_.file_bytes, uint64_t{1} << 20) << "the rest: config, tokenizer, index, pattern";
}

TEST_F(FullScale, EveryRegionHoldsThePatternAndEverythingElseIsAHole) {
  std::ifstream in(spec_.out_dir + "/" + tools::kPatternFileName);
  const json p = json::parse(in, nullptr, false);
  ASSERT_FALSE(p.is_discarded());
  ASSERT_EQ(p["layers"].size(), 2u);
  std::string error;
  auto oracle = oracle::RowOracle::Open(spec_.out_dir, &error);
  ASSERT_NE(oracle, nullptr) << error;
  const int64_t rows[] = {kRows0, kRows1};
  for (size_t l = 0; l < 2; ++l) {
    const json& jl = p["layers"][l];
    EXPECT_EQ(jl["rows"], rows[l]);
    const json& regions = jl["regions"];
    ASSERT_GE(regions.size(), 30u);
    EXPECT_EQ(regions.front()["row_begin"], 0) << "the first rows";
    EXPECT_EQ(regions.back()["row_end"], rows[l]) << "the last rows";
    std::string whys;
    int64_t prev_end = -1;
    for (const auto& r : regions) {
      const int64_t b = r["row_begin"], e = r["row_end"];
      EXPECT_GT(b, prev_end) << "sorted and disjoint, with a hole between";
      prev_end = e;
      whys += r["why"].get<std::string>() + ";";
      const std::string name = "layers." + std::to_string(spec_.layers[l]) + ".engram.";
      for (int64_t row : {b, b + (e - b) / 2, e - 1}) {
        auto rec = oracle->Record(spec_.layers[l], row, &error);
        ASSERT_TRUE(rec.has_value()) << error;
        for (int64_t j = 0; j < 256; j += 51) {
          ASSERT_EQ((*rec)[static_cast<size_t>(j)],
                    tools::SyntheticByte(spec_.seed, name + "embed.weight", static_cast<uint64_t>(row) * 256 + j, false,
                                         false))
              << "layer " << l << " row " << row;
        }
        for (int64_t j = 0; j < 8; ++j) {
          ASSERT_EQ(
              (*rec)[static_cast<size_t>(256 + j)],
              tools::SyntheticByte(spec_.seed, name + "embed.scale", static_cast<uint64_t>(row) * 8 + j, true, false));
        }
      }
      if (e < rows[l]) {  // the row after a region: a hole
        auto hole = oracle->Record(spec_.layers[l], e, &error);
        ASSERT_TRUE(hole.has_value()) << error;
        EXPECT_TRUE(std::all_of(hole->begin(), hole->end(), [](uint8_t v) { return v == 0; })) << "row " << e;
      }
    }
    // Every column boundary of the layer is in a region.
    for (int c = 1; c < 24; ++c) EXPECT_NE(whys.find("column " + std::to_string(c) + " starts"), std::string::npos);
    if (l == 0) {  // a TP 1 segment's first layer: its records cross 2^31 .. 2^36
      for (int k = 31; k <= 36; ++k) {
        EXPECT_NE(whys.find("record bytes cross 2^" + std::to_string(k)), std::string::npos) << k;
      }
    }
  }
}

TEST_F(FullScale, TheProductionReaderAgreesWithTheOracleAtTheFarRows) {
  auto ckpt = Checkpoint::Open(spec_.out_dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::string error;
  auto oracle = oracle::RowOracle::Open(spec_.out_dir, &error);
  ASSERT_NE(oracle, nullptr) << error;
  // The last 300 rows of each layer, and rows around the record byte 2^36 of a TP 1 segment (row 260,301,048) and
  // around 2^32 bytes of weights (row 16,777,216).
  const std::vector<std::pair<int64_t, int64_t>> spans = {{0, kRows0 - 300},
                                                          {1, kRows1 - 300},
                                                          {0, 260301048 - 150},
                                                          {0, 16777216 - 150},
                                                          {1, (int64_t{1} << 36) / 256 - 150}};
  for (const auto& [layer, first] : spans) {
    std::vector<uint8_t> got(300 * kRecord, 0xCD);
    ASSERT_TRUE(ReadShardRecords(**ckpt, {LayerRows{layer, first, first + 300, 0}}, got.data(), 2, nullptr).ok());
    for (int64_t i = 0; i < 300; i += 7) {
      auto rec = oracle->Record(spec_.layers[static_cast<size_t>(layer)], first + i, &error);
      ASSERT_TRUE(rec.has_value()) << error;
      ASSERT_TRUE(std::equal(rec->begin(), rec->end(), got.begin() + i * static_cast<int64_t>(kRecord)))
          << "layer " << layer << " row " << first + i;
    }
  }
}

TEST_F(FullScale, TheSegmentLayoutPlacesTheSecondLayerPast2To36) {
  auto ckpt = Checkpoint::Open(spec_.out_dir);
  ASSERT_TRUE(ckpt.ok());
  auto layout = Layout::Build((*ckpt)->config());
  ASSERT_TRUE(layout.ok());
  auto map = TokenMap::FromIds(std::vector<int32_t>((*ckpt)->config().compressed_vocab_size, 0));
  for (int64_t tp : {1, 2}) {
    auto shard = layout->Shard(tp, tp - 1);
    ASSERT_TRUE(shard.ok());
    const auto desc = daemon::MakeDescriptor(**ckpt, *layout, map, *shard, (*ckpt)->Fingerprint());
    ASSERT_EQ(desc.layers_size(), 2);
    const uint64_t first = static_cast<uint64_t>(shard->row_end[0] - shard->row_begin[0]) * kRecord;
    EXPECT_EQ(desc.layers(0).data_offset(), 0u);
    EXPECT_EQ(desc.layers(1).data_offset(), first);
    EXPECT_EQ(desc.layers(0).bytes() + desc.layers(1).bytes(), static_cast<uint64_t>(shard->bytes(264)));
    if (tp == 1) {
      EXPECT_GT(desc.layers(1).data_offset(), uint64_t{1} << 36);
    }
    EXPECT_GE(SegmentFileBytes(desc.ByteSizeLong(), static_cast<uint64_t>(shard->bytes(264))),
              static_cast<uint64_t>(shard->bytes(264)) + desc.ByteSizeLong());
  }
}

TEST(FullScalePolicy, APublishDropsTheCacheInlineOnlyWhereBothCopiesCannotFit) {
  using D = daemon::PublishTuning::DropCache;
  const uint64_t shard = uint64_t{94} << 30;
  EXPECT_EQ(daemon::ChooseDropCache(D::kAuto, shard, uint64_t{126} << 30), D::kInline);
  EXPECT_EQ(daemon::ChooseDropCache(D::kAuto, shard, uint64_t{2000} << 30), D::kAfterReady);
  EXPECT_EQ(daemon::ChooseDropCache(D::kAuto, shard, ~uint64_t{0}), D::kAfterReady) << "no bound known: the default";
  for (D d : {D::kAfterReady, D::kInline, D::kKeep}) {
    EXPECT_EQ(daemon::ChooseDropCache(d, shard, uint64_t{126} << 30), d) << "a setting stays";
  }
}

TEST(FullScalePolicy, MappingOverheadAndThe4KiBWarning) {
  // 8 bytes of page table and 8 of pinned-page list per page.
  EXPECT_EQ(MappingOverheadBytes(uint64_t{1} << 30, false), uint64_t{4} << 20);
  EXPECT_EQ(MappingOverheadBytes(uint64_t{1} << 30, true), uint64_t{8} << 10);
  EXPECT_EQ(MappingOverheadBytes(1, false), 16u);
  ShmCapacity c;
  c.path = "/dev/shm";
  c.fs_type = "tmpfs";
  c.huge_pages = "never";
  EXPECT_FALSE(SegmentsOnHugePages(c));
  auto w = ShmPagesWarning(c, uint64_t{189} << 30);
  ASSERT_TRUE(w.has_value());
  EXPECT_NE(w->find("4 KiB"), std::string::npos) << *w;
  EXPECT_NE(w->find("huge=always"), std::string::npos) << *w;
  EXPECT_FALSE(ShmPagesWarning(c, kSmallPagesWarnBytes).has_value()) << "small tables: no warning";
  c.huge_pages = "advise";  // reserved before any mapping advises it: 4 KiB pages
  EXPECT_FALSE(SegmentsOnHugePages(c));
  for (const char* h : {"always", "within_size"}) {
    c.huge_pages = h;
    EXPECT_TRUE(SegmentsOnHugePages(c)) << h;
    EXPECT_FALSE(ShmPagesWarning(c, uint64_t{189} << 30).has_value()) << h;
  }
  c.fs_type = "hugetlbfs";
  c.huge_pages = "hugetlbfs";
  EXPECT_TRUE(SegmentsOnHugePages(c));
  c.fs_type = "ext4";
  c.huge_pages = "never";
  auto disk = ShmPagesWarning(c, 1);
  ASSERT_TRUE(disk.has_value()) << "a directory not in memory is warned about at any size";
  EXPECT_NE(disk->find("ext4"), std::string::npos);
  const NodeMemory m = ReadNodeMemory();
  EXPECT_GT(m.total_bytes, 0u);
  EXPECT_LE(m.available_bytes, m.total_bytes);
}

}  // namespace
}  // namespace engram
