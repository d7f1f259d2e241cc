// safetensors and checkpoint directories as hostile input: every malformed header or layout gets a precise error
// that names the file and, where there is one, the tensor.
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::TempDir;

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A file with the given header text and `data_bytes` bytes of data.
std::string FileWith(const std::string& header, size_t data_bytes) {
  return Le64(header.size()) + header + std::string(data_bytes, '\x11');
}

std::string OpenError(const TempDir& dir, const std::string& contents) {
  const std::string path = dir / "x.safetensors";
  testing::WriteFile(path, contents);
  auto f = SafetensorsFile::Open(path);
  return f.ok() ? "" : std::string(f.status().message());
}

TEST(SafetensorsTest, ReadsAValidFile) {
  TempDir dir;
  json h = {{"a", {{"dtype", "F8_E4M3"}, {"shape", {2, 4}}, {"data_offsets", {0, 8}}}},
            {"b", {{"dtype", "BF16"}, {"shape", {3}}, {"data_offsets", {8, 14}}}},
            {"__metadata__", {{"format", "pt"}}}};
  const std::string path = dir / "ok.safetensors";
  std::string data = "ABCDEFGH" + std::string("123456");
  testing::WriteFile(path, Le64(h.dump().size()) + h.dump() + data);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 2u);
  const TensorInfo* b = (*f)->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  EXPECT_EQ(b->bytes(), 6u);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  char buf[4] = {};
  ASSERT_TRUE((*f)->ReadRange(*b, 2, buf, 4).ok());
  EXPECT_EQ(std::string(buf, 4), "3456");
  auto oob = (*f)->ReadRange(*b, 4, buf, 4);
  EXPECT_EQ(oob.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(oob.message().find("`b`"), std::string::npos);
}

TEST(SafetensorsTest, HostileHeaders) {
  TempDir dir;
  auto t = [](json shape, json offsets, const char* dtype = "F8_E4M3") {
    return json{{"w", {{"dtype", dtype}, {"shape", shape}, {"data_offsets", offsets}}}};
  };
  struct Case {
    std::string name;
    std::string contents;
    std::string expect;
  } cases[] = {
      {"short file", "abc", "no header length"},
      {"header past EOF", Le64(1000) + "{}", "runs past the end of the file"},
      {"header absurd", Le64(uint64_t{1} << 62) + std::string(16, ' '), "runs past the end"},
      {"bad json", FileWith("{\"w\": ", 0), "not valid JSON"},
      {"not an object", FileWith("[1, 2]", 0), "not a JSON object"},
      {"entry not object", FileWith("{\"w\": 3}", 0), "tensor `w`: entry is not an object"},
      {"unknown dtype", FileWith(t({2}, {0, 2}, "F4").dump(), 2), "tensor `w`: unknown dtype \"F4\""},
      {"missing dtype", FileWith(R"({"w": {"shape": [1], "data_offsets": [0, 1]}})", 1), "missing or non-string"},
      {"negative shape", FileWith(t({-2}, {0, 2}).dump(), 2), "shape entry -2"},
      {"shape not list", FileWith(R"({"w": {"dtype": "U8", "shape": 3, "data_offsets": [0, 3]}})", 3), "shape"},
      {"one offset", FileWith(t({2}, {0}).dump(), 2), "data_offsets"},
      {"backwards offsets", FileWith(t({0}, {4, 2}).dump(), 4), "run backwards"},
      {"byte count lies", FileWith(t({2, 3}, {0, 5}).dump(), 8), "needs 6 bytes but data_offsets span 5"},
      {"bf16 count lies", FileWith(t({4}, {0, 4}, "BF16").dump(), 8), "needs 8 bytes"},
      {"shape overflows", FileWith(t({uint64_t{1} << 40, uint64_t{1} << 40}, {0, 0}).dump(), 0), "absurd"},
      {"truncated data", FileWith(t({64}, {0, 64}).dump(), 10), "the file has only"},
      {"metadata not strings", FileWith(R"({"__metadata__": {"a": 1}})", 0), "`__metadata__.a` is not a string"},
  };
  for (const auto& c : cases) {
    std::string err = OpenError(dir, c.contents);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.name << ": '" << err << "'";
    EXPECT_NE(err.find("x.safetensors"), std::string::npos) << c.name << " does not name the file: " << err;
  }
  json overlap = {{"a", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}},
                  {"b", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {2, 6}}}}};
  std::string err = OpenError(dir, FileWith(overlap.dump(), 6));
  EXPECT_NE(err.find("overlaps tensor `a`"), std::string::npos) << err;
  EXPECT_NE(OpenError(dir, ""), "");  // empty file
}

TEST(SafetensorsTest, FileTruncatedAfterOpenIsDataLoss) {
  TempDir dir;
  json h = {{"w", {{"dtype", "U8"}, {"shape", {100}}, {"data_offsets", {0, 100}}}}};
  const std::string path = dir / "t.safetensors";
  testing::WriteFile(path, FileWith(h.dump(), 100));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(::truncate(path.c_str(), 8 + static_cast<off_t>(h.dump().size()) + 50), 0);
  char buf[100];
  auto st = (*f)->ReadRange(*(*f)->Find("w"), 0, buf, 100);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st;
}

tools::SyntheticSpec SmallSpec(const std::string& dir) {
  tools::SyntheticSpec s;
  s.out_dir = dir;
  s.table_mib = 1;
  s.head_dim = 64;
  s.hidden = 32;
  s.threads = 2;
  return s;
}

TEST(CheckpointTest, OpensShardedAndPrefixedCheckpoints) {
  for (bool prefix : {false, true}) {
    for (int shards : {1, 2, 3}) {
      TempDir dir;
      auto spec = SmallSpec(dir.path());
      spec.model_prefix = prefix;
      spec.shards = shards;
      ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
      auto ck = Checkpoint::Open(dir.path());
      ASSERT_TRUE(ck.ok()) << ck.status();
      EXPECT_TRUE((*ck)->ValidateEngramTensors().ok()) << (*ck)->ValidateEngramTensors();
      EXPECT_EQ((*ck)->files().size(), static_cast<size_t>(std::min(shards, 2)));  // never more files than layers
      EXPECT_TRUE((*ck)->engram(1).embed_weight);
    }
  }
}

// The fingerprint is the identity of the exact files (model/checkpoint.h; tests/unit/fingerprint_test.cc): the same
// tables split into other shard files, or another layout, are other checkpoints; reopening the same files is not.
TEST(CheckpointTest, FingerprintFollowsTheFiles) {
  TempDir a, b, c;
  auto sa = SmallSpec(a.path()), sb = SmallSpec(b.path()), sc = SmallSpec(c.path());
  sb.shards = 1;
  sc.heads = 2;
  for (auto* s : {&sa, &sb, &sc}) ASSERT_TRUE(tools::WriteSyntheticCheckpoint(*s).ok());
  auto ca = Checkpoint::Open(a.path()), cb = Checkpoint::Open(b.path()), cc = Checkpoint::Open(c.path());
  ASSERT_TRUE(ca.ok() && cb.ok() && cc.ok());
  EXPECT_NE((*ca)->Fingerprint(), (*cb)->Fingerprint());
  EXPECT_NE((*ca)->Fingerprint(), (*cc)->Fingerprint());
  EXPECT_EQ((*ca)->Fingerprint(), (*Checkpoint::Open(a.path()))->Fingerprint());
}

// Rewrites one tensor's header entry in a single-file checkpoint.
void Tamper(const std::string& dir, const std::string& tensor, const std::function<void(json&)>& edit) {
  const std::string path = dir + "/model.safetensors";
  std::string all = testing::ReadFile(path);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(all[static_cast<size_t>(i)]);
  json h = json::parse(all.substr(8, len));
  edit(h[tensor]);
  std::string text = h.dump();
  text.resize(len, ' ');  // keep the data where it was
  ASSERT_LE(h.dump().size(), len);
  testing::WriteFile(path, all.substr(0, 8) + text + all.substr(8 + len));
}

TEST(CheckpointTest, ValidationNamesFileAndTensor) {
  struct Case {
    std::string tensor;
    std::function<void(json&)> edit;
    std::string expect;
  } cases[] = {
      {"layers.1.engram.embed.weight", [](json& t) { t["dtype"] = "F8_E5M2"; }, "has dtype F8_E5M2, expected F8_E4M3"},
      {"layers.3.engram.embed.scale", [](json& t) { t["dtype"] = "U8"; }, "expected F8_E8M0"},
      {"layers.1.engram.q_weight", [](json& t) { t["dtype"] = "F16"; }, "expected BF16"},
      {"layers.3.engram.k_weight",
       [](json& t) {
         t["shape"] = {t["shape"][1], t["shape"][0]};
       },
       "the config implies"},
  };
  for (const auto& c : cases) {
    TempDir dir;
    auto spec = SmallSpec(dir.path());
    spec.shards = 1;
    ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
    Tamper(dir.path(), c.tensor, c.edit);
    auto ck = Checkpoint::Open(dir.path());
    ASSERT_TRUE(ck.ok()) << ck.status();
    auto st = (*ck)->ValidateEngramTensors();
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << c.tensor << ": " << st;
    EXPECT_NE(st.message().find(c.tensor), std::string::npos) << st;
    EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st;
  }
}

TEST(CheckpointTest, MissingTensorAndBrokenIndex) {
  TempDir dir;
  auto spec = SmallSpec(dir.path());
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  const std::string index_path = dir / "model.safetensors.index.json";
  json idx = json::parse(testing::ReadFile(index_path));

  json moved = idx;  // index claims a tensor lives in the other file
  moved["weight_map"]["layers.1.engram.q_weight"] = "model-00002-of-00002.safetensors";
  testing::WriteFile(index_path, moved.dump());
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("layers.1.engram.q_weight"), std::string::npos) << ck.status();

  json escape = idx;
  escape["weight_map"]["x"] = "../etc/passwd";
  testing::WriteFile(index_path, escape.dump());
  ck = Checkpoint::Open(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("not a file in the checkpoint directory"), std::string::npos);

  json missing = idx;
  missing["weight_map"]["y"] = "model-00009-of-00009.safetensors";
  testing::WriteFile(index_path, missing.dump());
  ck = Checkpoint::Open(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("model-00009-of-00009.safetensors"), std::string::npos);

  testing::WriteFile(index_path, "{\"weight_map\": 3}");
  EXPECT_FALSE(Checkpoint::Open(dir.path()).ok());

  // Without an index but with one file missing its tensors: validation names the absent tensor.
  ::unlink(index_path.c_str());
  ::unlink((dir / "model-00002-of-00002.safetensors").c_str());
  ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto st = (*ck)->ValidateEngramTensors();
  EXPECT_NE(st.message().find("no tensor `layers.3.engram.embed.weight`"), std::string::npos) << st;
}

TEST(CheckpointTest, TruncatedShardAndConfigMismatch) {
  TempDir dir;
  auto spec = SmallSpec(dir.path());
  spec.shards = 1;
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  const std::string f = dir / "model.safetensors";
  struct stat st {};
  ASSERT_EQ(::stat(f.c_str(), &st), 0);
  ASSERT_EQ(::truncate(f.c_str(), st.st_size - 1), 0);
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("truncated"), std::string::npos) << ck.status();

  TempDir dir2;
  auto spec2 = SmallSpec(dir2.path());
  ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec2).ok());
  json cfg = json::parse(testing::ReadFile(dir2 / "config.json"));
  cfg["engram_head_dim"] = 32;  // the tensors say 64
  testing::WriteFile(dir2 / "config.json", cfg.dump());
  ck = Checkpoint::Open(dir2.path());
  ASSERT_TRUE(ck.ok());
  auto v = (*ck)->ValidateEngramTensors();
  EXPECT_NE(v.message().find("the config implies"), std::string::npos) << v;
  EXPECT_FALSE(Checkpoint::Open(dir2 / "nope").ok());
}

}  // namespace
}  // namespace engram
