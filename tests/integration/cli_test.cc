// engramctl and engram-mkckpt as real processes: the exact --json shapes, exit codes (0 / 1 failure / 2 usage),
// and agreement with the goldens; every installed binary's --version (engram/version.h) and its usage naming it.
#include <set>
#include <string>

#include "engram/version.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::DataPath;
using testing::RunCmd;
using testing::TempDir;

std::string Ctl() { return BinPath("engramctl"); }

std::set<std::string> Keys(const json& j) {
  std::set<std::string> k;
  for (auto it = j.begin(); it != j.end(); ++it) k.insert(it.key());
  return k;
}

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    auto r = RunCmd(BinPath("engram-mkckpt") + " --out " + (*dir_ / "ck") + " --table-mib 2 --head-dim 64 --hidden 32");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_NE(r.out.find("compressed vocab"), std::string::npos);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string Ckpt() { return *dir_ / "ck"; }
  static TempDir* dir_;
};
TempDir* CliTest::dir_ = nullptr;

TEST_F(CliTest, PlanJsonHasExactlyTheDocumentedShape) {
  auto r = RunCmd(Ctl() + " plan --checkpoint " + Ckpt() + " --tp 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(Keys(j), (std::set<std::string>{"architecture", "compressed_vocab", "table_bytes", "tp", "layers", "shards",
                                            "node_shm", "node_memory"}));
  EXPECT_EQ(Keys(j["node_memory"]), (std::set<std::string>{"total_bytes", "available_bytes", "tables_bytes",
                                                           "dp_replicas", "huge_pages", "mapping_bytes", "fits"}));
  EXPECT_EQ(j["node_memory"]["tables_bytes"], j["table_bytes"]);
  EXPECT_EQ(j["node_memory"]["dp_replicas"], 1);
  EXPECT_EQ(j["architecture"], "DeepseekV41ForCausalLM");
  EXPECT_EQ(j["tp"], 2);
  ASSERT_EQ(j["layers"].size(), 2u);
  EXPECT_EQ(Keys(j["layers"][0]), (std::set<std::string>{"layer_id", "rows", "primes", "offsets", "multipliers"}));
  EXPECT_EQ(j["layers"][0]["multipliers"].size(), 3u);
  ASSERT_EQ(j["shards"].size(), 2u);
  EXPECT_EQ(Keys(j["shards"][0]), (std::set<std::string>{"tp_rank", "columns", "rows", "bytes"}));
  EXPECT_EQ(j["shards"][0]["columns"], json({0, 4}));
  EXPECT_EQ(j["shards"][1]["columns"], json({4, 8}));
  EXPECT_EQ(j["shards"][0]["bytes"].get<int64_t>() + j["shards"][1]["bytes"].get<int64_t>(),
            j["table_bytes"].get<int64_t>());
  EXPECT_EQ(Keys(j["node_shm"]), (std::set<std::string>{"path", "total_bytes", "free_bytes", "needed_bytes", "fits"}));
  EXPECT_EQ(j["node_shm"]["needed_bytes"], j["table_bytes"]);
}

TEST_F(CliTest, PlanOfTheRealFlashConfig) {
  auto r =
      RunCmd(Ctl() + " plan --config " + DataPath("configs/v41-flash.json") + " --tp 8 --shm-dir /nonexistent --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["table_bytes"], 202758032400);
  EXPECT_EQ(j["layers"][0]["multipliers"][0], 76632096046245);
  EXPECT_EQ(j["shards"].size(), 8u);
  EXPECT_EQ(j["shards"][7]["columns"], json({21, 24}));
  EXPECT_EQ(j["node_shm"]["fits"], false);
  auto human =
      RunCmd(Ctl() + " plan --config " + DataPath("configs/v41-flash.json") + " --tp 2 --shm-dir /nonexistent");
  ASSERT_EQ(human.exit_code, 0);
  EXPECT_NE(human.out.find("188.83 GiB"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("SHM_MISSING"), std::string::npos) << human.out;
}

TEST_F(CliTest, PlanSaysWhetherDpSharedMemoryWorksAndWhy) {
  auto r = RunCmd(Ctl() + " plan --checkpoint " + Ckpt() + " --tp 1 --dp 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["dp_shared_memory"]["works"], true) << r.out;
  EXPECT_EQ(j["dp_shared_memory"]["mode"], "SHARED");
  r = RunCmd(Ctl() + " plan --checkpoint " + Ckpt() + " --tp 1 --dp 4 --local-dp 2 --elastic-ep --json");
  j = json::parse(r.out);
  EXPECT_EQ(j["dp_shared_memory"]["works"], false);
  EXPECT_EQ(j["dp_shared_memory"]["reasons"], json({"ELASTIC_EP"}));
  // Any DP layout shares: a DP 1 engine, and one node's half of a DP 16 group.
  for (const char* dp : {"--dp 1", "--dp 16 --local-dp 8"}) {
    r = RunCmd(Ctl() + " plan --checkpoint " + Ckpt() + " --tp 1 " + dp + " --json");
    j = json::parse(r.out);
    EXPECT_EQ(j["dp_shared_memory"]["works"], true) << dp << ": " << r.out;
    EXPECT_EQ(j["dp_shared_memory"]["reasons"], json::array()) << dp;
  }
  r = RunCmd(Ctl() + " plan --config " + DataPath("configs/v41-flash.json") + " --dp 2 --shm-dir /nonexistent");
  EXPECT_NE(r.out.find("dp_shared_memory: would fall back to PRIVATE_PINNED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("SHM_MISSING"), std::string::npos) << r.out;
  r = RunCmd(Ctl() + " plan --checkpoint " + Ckpt() + " --dp 1 --cpu-offload false --json");
  j = json::parse(r.out);
  EXPECT_EQ(j["dp_shared_memory"]["mode"], "DEVICE");
  // Without --dp the JSON keeps exactly the documented keys (PlanJsonHasExactlyTheDocumentedShape).
}

TEST_F(CliTest, PlanRefusesBrokenCheckpointsAndPle) {
  TempDir bad;
  auto r = RunCmd(BinPath("engram-mkckpt") + " --out " + (bad / "ck") +
                  " --table-mib 1 --head-dim 64 --hidden 32 --shards 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Cut the file short: the header now promises more data than there is.
  ASSERT_EQ(RunCmd("truncate -s -100 " + (bad / "ck/model.safetensors")).exit_code, 0);
  r = RunCmd(Ctl() + " plan --checkpoint " + (bad / "ck") + " --json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("model.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());

  testing::WriteFile(bad / "ple.json", R"({"architectures": ["Qwen4ExpForCausalLM"], "ple_layer_ids": [0, 1]})");
  r = RunCmd(Ctl() + " plan --config " + (bad / "ple.json"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("MODEL_NOT_SHAREABLE"), std::string::npos) << r.err;
}

TEST_F(CliTest, BadArgumentsExitTwoWithOneLine) {
  for (const std::string args : {"", "frobnicate", "plan", "plan --checkpoint a --config b", "plan --tp x --config c",
                                 "plan --config c --bogus 1", "tokenmap", "hash --config c", "hash --checkpoint d",
                                 "hash --checkpoint d --tokens 1,x", "hash --checkpoint d --tokens 1,2 --dead 1"}) {
    auto r = RunCmd(Ctl() + " " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
  EXPECT_EQ(RunCmd(BinPath("engram-mkckpt") + " --table-mib 1").exit_code, 2);
  EXPECT_EQ(RunCmd(BinPath("engram-mkckpt") + " --out /tmp/x --heads seven").exit_code, 2);
}

// Every binary `install(TARGETS` installs: `--version` prints "<name> <version>" alone on stdout and exits 0, and
// its usage text lists the option.
TEST(VersionTest, EveryInstalledBinaryPrintsTheBuildsVersion) {
  struct Binary {
    std::string name, path, usage;  // usage: the arguments that print the usage text (stdout or stderr)
  };
  for (const Binary& b :
       {Binary{"engramd", BinPath("../daemon/engramd"), "--help"}, Binary{"engramctl", Ctl(), "--help"},
        Binary{"engram-mkckpt", BinPath("engram-mkckpt"), "--help"},
        Binary{"engram-replica", BinPath("engram-replica"), ""}}) {
    auto r = RunCmd(b.path + " --version");
    EXPECT_EQ(r.exit_code, 0) << b.name << ": " << r.err;
    EXPECT_EQ(r.out, b.name + " " + ENGRAM_VERSION_STRING + "\n") << b.name;
    EXPECT_TRUE(r.err.empty()) << b.name << ": " << r.err;
    auto usage = RunCmd(b.path + " " + b.usage);
    EXPECT_NE((usage.out + usage.err).find("--version"), std::string::npos) << b.name << ": " << usage.out << usage.err;
  }
  EXPECT_EQ(std::string(ENGRAM_VERSION_STRING), std::to_string(ENGRAM_VERSION_MAJOR) + "." +
                                                    std::to_string(ENGRAM_VERSION_MINOR) + "." +
                                                    std::to_string(ENGRAM_VERSION_PATCH));
}

TEST_F(CliTest, TokenMapJsonMatchesTheGoldenBytes) {
  TempDir t;
  for (const std::string name : {"bytelevel-mixed", "llama-bytefallback"}) {
    auto r = RunCmd(Ctl() + " tokenmap --tokenizer " + DataPath("tokenizers/" + name + ".json") + " --json --out " +
                    (t / "map.bin"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    json j = json::parse(r.out);
    EXPECT_EQ(Keys(j), (std::set<std::string>{"raw", "compressed", "sha256"}));
    auto sum = RunCmd("sha256sum " + DataPath("goldens/tokenmap-" + name + ".bin"));
    EXPECT_EQ(sum.out.substr(0, 64), j["sha256"].get<std::string>());
    EXPECT_EQ(testing::ReadFile(t / "map.bin"), testing::ReadFile(DataPath("goldens/tokenmap-" + name + ".bin")));
  }
  auto r = RunCmd(Ctl() + " tokenmap --tokenizer /nonexistent.json");
  EXPECT_EQ(r.exit_code, 1);
}

TEST_F(CliTest, HashJsonMatchesTheGolden) {
  json gold = json::parse(testing::ReadFile(DataPath("goldens/hash-bytelevel.json")));
  for (const auto& c : gold["cases"]) {
    if (c["query_start_loc"].size() != 2 || c["positions"][0] != 0 || c["tokens"].size() > 20) continue;
    std::string tokens, dead;
    for (size_t i = 0; i < c["tokens"].size(); ++i) {
      tokens += (i ? "," : "") + std::to_string(c["tokens"][i].get<int>());
      dead += (i ? "," : "") + std::to_string(c["dead"][i].get<int>());
    }
    auto r =
        RunCmd(Ctl() + " hash --config " + DataPath("configs/bytelevel-hash.json") + " --tokenizer " +
               DataPath("tokenizers/bytelevel-mixed.json") + " --tokens " + tokens + " --dead " + dead + " --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    json j = json::parse(r.out);
    ASSERT_EQ(j["layers"].size(), 2u);
    for (size_t l = 0; l < 2; ++l) {
      EXPECT_EQ(j["layers"][l]["layer_id"], l == 0 ? 2 : 5);
      for (size_t t = 0; t < c["tokens"].size(); ++t) EXPECT_EQ(j["layers"][l]["ids"][t], c["ids"][t][l]) << c["name"];
    }
  }
}

TEST_F(CliTest, HashRefusesAMismatchedVocabulary) {
  auto r = RunCmd(Ctl() + " hash --config " + DataPath("configs/small-two-layers.json") + " --tokenizer " +
                  DataPath("tokenizers/bytelevel-mixed.json") + " --tokens 1,2,3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("256"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("500"), std::string::npos) << r.err;
  auto ok = RunCmd(Ctl() + " hash --checkpoint " + Ckpt() + " --tokens 1,2,3 --json");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(json::parse(ok.out)["layers"][0]["ids"].size(), 3u);
}

}  // namespace
}  // namespace engram
