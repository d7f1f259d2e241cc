// DP_SHARDED on two GPUs: a real engramd brokers the group, two engram-replica processes (one per
// GPU, --device 0/1) form it, exchange over NCCL (the all-to-all path: as a replayed CUDA graph and enqueued call by
// call, each with the default chunks and with chunks so small that they split layers and tokens unevenly, and the
// sequential form) or read each other's shards over NVLink (the peer path, forced with ENGRAM_DP_PEER_MAX_SLOT), and
// check every sampled row against the checkpoint through the independent row oracle: T = 1, 3, 127, 4096, 8192
// tokens on rank 0 and about two thirds of that on rank 1. The shards live in GPU memory (cpu_offload false); one
// case keeps them in pinned host memory (read through UVA) with a rank that has no tokens, on every all-to-all form;
// one kills or stops a member in the middle of its steps.
// Own main(): exits 77 (ctest: skipped) without two GPUs.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Process;
using testing::TempDir;

class DpGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shm_ = dir_ / "shm";
    ::mkdir(shm_.c_str(), 0755);
    ckpt_ = dir_ / "ck";
    ASSERT_EQ(testing::RunCmd(BinPath("engram-mkckpt") + " --out " + ckpt_ + " --table-mib 64").exit_code, 0);
    daemon_ =
        Process({BinPath("../daemon/engramd"), "--checkpoint", ckpt_, "--shm-dir", shm_, "--socket", dir_ / "d.sock"},
                dir_ / "engramd.log");
    ASSERT_TRUE(
        testing::WaitFor([&] { return ::access((dir_ / "d.sock").c_str(), F_OK) == 0; }, std::chrono::seconds(60)));
  }
  // One group of two replicas, one per GPU; returns each replica's last JSON line.
  // `env1`: one NAME=VALUE in rank 1's environment only (a fault point: rank 1 then runs engram-replica-faults, the
  // same tool with the test fault hook, tests/support/fault_from_env.cc).
  std::vector<json> RunPair(int t0, int t1, const std::string& extra, const std::string& tag,
                            const std::string& env1 = "") {
    std::vector<Process> ps;
    const int tokens[2] = {t0, t1};
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> argv;
      if (r == 1 && !env1.empty()) argv = {"/usr/bin/env", env1};
      const std::string tool = r == 1 && !env1.empty() ? "engram-replica-faults" : "engram-replica";
      for (const std::string& a : std::vector<std::string>{BinPath(tool),
                                                           "--socket",
                                                           dir_ / "d.sock",
                                                           "--checkpoint",
                                                           ckpt_,
                                                           "--embedding-across-dp",
                                                           "--dp-shared-memory",
                                                           "false",
                                                           "--dp-size",
                                                           "2",
                                                           "--dp-rank",
                                                           std::to_string(r),
                                                           "--device",
                                                           std::to_string(r),
                                                           "--tokens",
                                                           std::to_string(tokens[r]),
                                                           "--batches",
                                                           "2",
                                                           "--verify",
                                                           "3000"}) {
        argv.push_back(a);
      }
      std::istringstream ss(extra);
      for (std::string w; ss >> w;) argv.push_back(w);
      ps.emplace_back(argv, dir_ / (tag + "-r" + std::to_string(r) + ".log"));
    }
    std::vector<json> out;
    for (auto& p : ps) {
      const int code = p.Wait(std::chrono::seconds(300));
      EXPECT_EQ(code, 0) << tag << ": " << p.Output();
      out.push_back(testing::JsonLine(p.Output(), true));
      std::printf("%s: %s\n", tag.c_str(), out.back().dump().c_str());
    }
    return out;
  }
  TempDir dir_;
  std::string shm_, ckpt_;
  Process daemon_;
};

// One all-to-all form or the peer path: the environment the replicas get and what their log says they took.
struct PathCase {
  const char* name;
  const char* peer_max_slot;
  const char* chunk_kib;  // null: the default
  const char* a2a;        // ENGRAM_DP_A2A (null: the default)
  std::vector<std::string> log_has;
};

void SetCase(const PathCase& c) {
  ::setenv("ENGRAM_DP_PEER_MAX_SLOT", c.peer_max_slot, 1);
  if (c.chunk_kib != nullptr)
    ::setenv("ENGRAM_DP_CHUNK_KIB", c.chunk_kib, 1);
  else
    ::unsetenv("ENGRAM_DP_CHUNK_KIB");
  if (c.a2a != nullptr)
    ::setenv("ENGRAM_DP_A2A", c.a2a, 1);
  else
    ::unsetenv("ENGRAM_DP_A2A");
}

void UnsetCase() {
  for (const char* v : {"ENGRAM_DP_PEER_MAX_SLOT", "ENGRAM_DP_CHUNK_KIB", "ENGRAM_DP_A2A"}) ::unsetenv(v);
}

const std::vector<PathCase>& AllToAllCases() {
  static const std::vector<PathCase> cases = {
      // The CUDA-graph form (captured for the slot, the token count from the device: rank 1's smaller counts and
      // the rank without tokens read it), default chunks and 7 KiB chunks.
      {"all-to-all-graph", "0", nullptr, "graph", {"path=all-to-all", "a2a=graph"}},
      {"all-to-all-graph-chunks", "0", "7", "graph", {"path=all-to-all", "a2a=graph"}},
      {"all-to-all", "0", nullptr, "pipelined", {"path=all-to-all", "a2a=pipelined"}},
      // 7 KiB chunks: up to 16 per step, boundaries inside layers and between tokens of uneven counts.
      {"all-to-all-chunks", "0", "7", "pipelined", {"path=all-to-all", "a2a=pipelined"}},
      {"all-to-all-sequential", "0", nullptr, "sequential", {"path=all-to-all", "a2a=sequential"}},
  };
  return cases;
}

TEST_F(DpGpuTest, EveryPathReturnsTheCheckpointsRows) {
  std::vector<PathCase> cases = AllToAllCases();
  cases.push_back({"nvlink-peer", "1000000", nullptr, nullptr, {"path=nvlink-peer"}});
  for (const PathCase& c : cases) {
    SetCase(c);
    for (int T : {1, 3, 127, 4096, 8192}) {
      const int T1 = T - T / 3;
      const std::string tag = std::string(c.name) + "-T" + std::to_string(T);
      for (const json& j : RunPair(T, T1, "--cpu-offload false", tag)) {
        EXPECT_EQ(j["mode"], "DP_SHARDED") << tag << j.dump();
        EXPECT_EQ(j["backend"], "cuda") << tag;
        EXPECT_EQ(j["mismatches"], 0) << tag;
        EXPECT_GT(j["verified"].get<int64_t>(), 0) << tag;
      }
      // The path the group took is in the replicas' logs.
      for (int r = 0; r < 2; ++r) {
        const std::string log = testing::ReadFile(dir_ / (tag + "-r" + std::to_string(r) + ".log"));
        for (const std::string& want : c.log_has) EXPECT_NE(log.find(want), std::string::npos) << tag << log;
      }
    }
  }
  UnsetCase();
}

TEST_F(DpGpuTest, PinnedHostShardsAndARankWithoutTokens) {
  // cpu_offload true: each shard in pinned host memory (UVA), the all-to-all path (every form); rank 1 has no tokens.
  for (const PathCase& c : AllToAllCases()) {
    SetCase(c);
    const std::string tag = std::string("pinned-") + c.name;
    for (const json& j : RunPair(127, 0, "", tag)) {
      EXPECT_EQ(j["mode"], "DP_SHARDED") << tag << j.dump();
      EXPECT_EQ(j["mismatches"], 0) << tag;
    }
    const std::string log = testing::ReadFile(dir_ / (tag + "-r1.log"));
    for (const std::string& want : c.log_has) EXPECT_NE(log.find(want), std::string::npos) << tag << log;
  }
  UnsetCase();
}

// GPUs that cannot map each other's memory (fault point dp_peer_open on rank 1 only, through engram-replica-faults: its
// cudaIpcOpenMemHandle fails): the whole group agrees on the all-to-all path instead of failing or splitting up, and
// the rows are still the checkpoint's.
TEST_F(DpGpuTest, APeerThatCannotMapTheOthersMovesTheGroupToTheAllToAll) {
  SetCase({"peer", "1000000", nullptr, nullptr, {}});
  for (const json& j : RunPair(300, 200, "--cpu-offload false", "no-peer", "ENGRAM_TEST_FAULT=dp_peer_open")) {
    EXPECT_EQ(j["mode"], "DP_SHARDED") << j.dump();
    EXPECT_EQ(j["mismatches"], 0) << j.dump();
    EXPECT_GT(j["verified"].get<int64_t>(), 0) << j.dump();
  }
  for (int r = 0; r < 2; ++r) {
    const std::string log = testing::ReadFile(dir_ / ("no-peer-r" + std::to_string(r) + ".log"));
    EXPECT_NE(log.find("dp_peer_reads_unavailable"), std::string::npos) << "rank " << r << ": " << log;
    EXPECT_NE(log.find("path=all-to-all"), std::string::npos) << "rank " << r << ": " << log;
    EXPECT_EQ(log.find("path=nvlink-peer"), std::string::npos) << "rank " << r << ": " << log;
  }
  UnsetCase();
}

// A member that goes away in the middle of its steps, on the NCCL transport: SIGKILL (its lease ends: the daemon
// breaks the group and the other's next step fails naming it) and SIGSTOP (alive, silent: the other's step times
// out, ENGRAM_DP_STEP_TIMEOUT_MS, and its collectives are aborted). Both for the all-to-all (pipelined) and the
// peer paths; the survivor exits 1 with an error, never hangs (the waits below bound a hang; no timing assertion).
TEST_F(DpGpuTest, AMemberThatGoesAwayFailsTheOtherWithAnError) {
  struct FaultCase {
    const char* name;
    int sig;
    PathCase path;
  } cases[] = {
      {"kill-a2a", SIGKILL, {"a2a", "0", nullptr, "pipelined", {}}},
      {"kill-peer", SIGKILL, {"peer", "1000000", nullptr, nullptr, {}}},
      {"stop-a2a", SIGSTOP, {"a2a", "0", nullptr, "pipelined", {}}},
  };
  ::setenv("ENGRAM_DP_STEP_TIMEOUT_MS", "5000", 1);
  for (const FaultCase& c : cases) {
    SCOPED_TRACE(c.name);
    SetCase(c.path);
    std::vector<Process> ps;
    for (int r = 0; r < 2; ++r) {
      ps.emplace_back(std::vector<std::string>{BinPath("engram-replica"),
                                               "--socket",
                                               dir_ / "d.sock",
                                               "--checkpoint",
                                               ckpt_,
                                               "--embedding-across-dp",
                                               "--dp-shared-memory",
                                               "false",
                                               "--cpu-offload",
                                               "false",
                                               "--dp-size",
                                               "2",
                                               "--dp-rank",
                                               std::to_string(r),
                                               "--device",
                                               std::to_string(r),
                                               "--tokens",
                                               "512",
                                               "--batches",
                                               "1000000000",
                                               "--verify",
                                               "0"},
                      dir_ / (std::string(c.name) + "-r" + std::to_string(r) + ".log"));
    }
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          return ps[0].Output().find("dp_group_formed") != std::string::npos &&
                 ps[1].Output().find("dp_group_formed") != std::string::npos;
        },
        std::chrono::seconds(120)))
        << ps[0].Output() << ps[1].Output();
    ps[1].Signal(c.sig);  // both formed: their steps follow at once (a member stopped before its first is the same)
    const int code = ps[0].Wait(std::chrono::seconds(120));
    const std::string out = ps[0].Output();
    EXPECT_EQ(code, 1) << "the survivor did not fail: " << out;
    json j = testing::JsonLine(out, true);
    ASSERT_TRUE(j.contains("error")) << out;
    std::printf("%s: survivor exit %d: %s\n", c.name, code, j.dump().c_str());
    // A killed member's session ends: the error names it, whichever side noticed first (NCCL or engramd).
    if (c.sig == SIGKILL) {
      EXPECT_NE(j["error"].get<std::string>().find("dp rank 1"), std::string::npos) << j.dump();
    }
    if (c.sig == SIGSTOP) ps[1].Signal(SIGKILL);
    ps[1].Wait(std::chrono::seconds(30));
  }
  ::unsetenv("ENGRAM_DP_STEP_TIMEOUT_MS");
  UnsetCase();
}

}  // namespace
}  // namespace engram

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    std::printf("DP_SHARDED GPU test needs two GPUs, found %d: skipped (exit 77)\n", n);
    return 77;
  }
  return RUN_ALL_TESTS();
}
