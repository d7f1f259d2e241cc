// libengram_client through engram-replica processes against a real engramd: replicas share one copy (DP 4 x TP 1
// and DP 2 x TP 2) with lookups equal to the checkpoint's rows; every fallback is reached with its reason and still
// serves correct rows from a private table; explicit dp_shared_memory true turns a fallback into an error; a replica
// cannot write the shared table; host memory: one copy per node when shared, one per replica otherwise (PSS); the
// client checks a granted segment's header against the grant (a changed fingerprint falls back); the cpu_offload
// precedence (explicit flag, else VLLM_PLE_CPU_OFFLOAD, else true). Rows are checked by engram-replica against the
// independent row oracle (tools/row_oracle.h). Each test has its own daemon, shm directory and socket.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cstddef>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "engram/client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"
#include "tools/synthetic.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;

json LastJson(const std::string& out) { return testing::JsonLine(out, true); }
// The mode on a holding replica's {"attached": true, "mode": ...} line.
std::string JsonLineMode(const std::string& out) {
  json j = testing::JsonLine(out, false);
  return j.is_object() && j.contains("mode") ? j["mode"].get<std::string>() : "";
}
std::set<std::string> Reasons(const json& j) { return testing::ReasonSet(j); }

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shm_ = dir_ / "shm";
    ::mkdir(shm_.c_str(), 0755);
    ckpt_ = dir_ / "ck";
    ASSERT_EQ(RunCmd(BinPath("engram-mkckpt") + " --out " + ckpt_ + " --table-mib 96").exit_code, 0);
    socket_ = dir_ / "engramd.sock";
    daemon_ = Process(
        {BinPath("../daemon/engramd"), "--checkpoint", ckpt_, "--tp", "1,2", "--shm-dir", shm_, "--socket", socket_},
        dir_ / "engramd.log");
    ASSERT_TRUE(WaitFor(
        [&] {
          auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
          if (r.exit_code != 0) return false;
          json s = json::parse(r.out);
          for (const auto& g : s["segments"]) {
            if (g["state"] != "READY") return false;
          }
          return s["segments"].size() == 3;
        },
        std::chrono::seconds(60)))
        << daemon_.Output();
  }
  std::vector<std::string> Replica(const std::string& args) const {
    std::vector<std::string> argv = {BinPath("engram-replica"),
                                     "--socket",
                                     socket_,
                                     "--checkpoint",
                                     ckpt_,
                                     "--shm-dir",
                                     shm_,
                                     "--timeout-ms",
                                     "3000"};
    std::istringstream ss(args);
    for (std::string w; ss >> w;) argv.push_back(w);
    return argv;
  }
  json Run(const std::string& args, int* code = nullptr) {
    Process p(Replica(args), dir_ / ("replica-" + std::to_string(n_++) + ".log"));
    const int c = p.Wait();
    if (code) *code = c;
    return LastJson(p.Output());
  }
  TempDir dir_;
  std::string shm_, ckpt_, socket_;
  Process daemon_;
  int n_ = 0;
};

TEST_F(ClientTest, ReplicasShareOneCopyAndLookUpTheCheckpointsRows) {
  for (const auto& topo : std::vector<std::pair<int, int>>{{4, 1}, {2, 2}}) {  // (dp, tp)
    std::vector<Process> ps;
    for (int dp = 0; dp < topo.first; ++dp) {
      for (int tp = 0; tp < topo.second; ++tp) {
        ps.emplace_back(
            Replica("--dp-size " + std::to_string(topo.first) + " --dp-rank " + std::to_string(dp) + " --tp-size " +
                    std::to_string(topo.second) + " --tp-rank " + std::to_string(tp) + " --verify 200 --write-probe"),
            dir_ / ("r" + std::to_string(dp) + std::to_string(tp) + ".log"));
      }
    }
    for (auto& p : ps) {
      EXPECT_EQ(p.Wait(), 0) << p.Output();
      json j = LastJson(p.Output());
      EXPECT_EQ(j["mode"], "SHARED") << p.Output();
      EXPECT_EQ(j["backend"], "cpu");
      EXPECT_EQ(Reasons(j), std::set<std::string>{"NO_CUDA_DEVICE"});
      EXPECT_GT(j["verified"].get<int>(), 200);
      EXPECT_EQ(j["mismatches"], 0);
      EXPECT_EQ(j["write_faulted"], true) << "a replica must not be able to write the shared table";
    }
  }
  EXPECT_TRUE(daemon_.Running());
}

TEST_F(ClientTest, EveryFallbackServesCorrectRowsAndSaysWhy) {
  struct Case {
    std::string args, reason, mode;
  } cases[] = {
      {"--dp-size 4 --elastic-ep", "ELASTIC_EP", "PRIVATE_PINNED"},
      {"--dp-size 4 --cpu-offload false", "CPU_OFFLOAD_DISABLED", "DEVICE"},
      {"--dp-size 4 --no-descriptor --shm-dir /tmp", "SHM_NOT_VISIBLE", "PRIVATE_PINNED"},  // neither way reaches it
      {"--dp-size 4 --tp-size 3", "SEGMENT_NOT_READY", "PRIVATE_PINNED"},
      // Tables on the GPU and a DP group of one: no group to split over.
      {"--embedding-across-dp --dp-size 1 --cpu-offload false", "DP_SIZE_ONE", "DEVICE"},
      {"--embedding-across-dp --dp-size 3 --local-dp-size 2 --cpu-offload false", "NOT_COLOCATED", "DEVICE"},
      {"--dp-size 4 --dp-shared-memory false", "DP_SHARED_MEMORY_DISABLED", "PRIVATE_PINNED"},
  };
  for (const auto& c : cases) {
    int code = -1;
    json j = Run(c.args + " --verify 100", &code);
    EXPECT_EQ(code, 0) << c.args << ": " << j.dump();
    EXPECT_EQ(j["mode"], c.mode) << c.args;
    EXPECT_TRUE(Reasons(j).count(c.reason)) << c.args << ": " << j.dump();
    EXPECT_EQ(j["mismatches"], 0) << c.args;
  }
  // A fallback replica stays visible in engramctl status, with its mode and reason, while it runs.
  Process holder(Replica("--dp-size 4 --elastic-ep --hold 600 --verify 4"), dir_ / "holder.log");
  ASSERT_TRUE(
      WaitFor([&] { return holder.Output().find("\"attached\"") != std::string::npos; }, std::chrono::seconds(20)));
  // The replica reports its outcome on its session and goes on without waiting for the daemon to read it: status
  // lists it once the daemon has (an event to wait for, not a race to win).
  testing::CommandResult st;
  json status;
  EXPECT_TRUE(WaitFor(
      [&] {
        st = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
        status = json::parse(st.out, nullptr, false);
        return !status.is_discarded() && status["replicas"].size() == 1;
      },
      std::chrono::seconds(20)));
  ASSERT_EQ(status["replicas"].size(), 1u) << st.out;
  EXPECT_EQ(status["replicas"][0]["mode"], "PRIVATE_PINNED");
  EXPECT_TRUE(Reasons(status["replicas"][0]).count("ELASTIC_EP")) << st.out;
  EXPECT_EQ(status["replicas"][0]["pid"], holder.pid());
  holder.Signal(SIGTERM);
  holder.Wait();
  // No daemon at all.
  std::vector<std::string> argv = Replica("--dp-size 4");
  argv[2] = dir_ / "nobody.sock";
  Process p(argv, dir_ / "nodaemon.log");
  EXPECT_EQ(p.Wait(), 0) << p.Output();
  EXPECT_TRUE(Reasons(LastJson(p.Output())).count("DAEMON_UNAVAILABLE")) << p.Output();
  // Explicit dp_shared_memory true: a fallback is an error that carries the reasons.
  int code = 0;
  json err = Run("--dp-size 4 --elastic-ep --dp-shared-memory true", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(err["error"].get<std::string>().find("ELASTIC_EP"), std::string::npos) << err.dump();
  for (const char* dp : {"--dp-size 4", "--dp-size 1"}) {  // a DP 1 engine asking for sharing gets it
    json ok = Run(std::string(dp) + " --dp-shared-memory true", &code);
    EXPECT_EQ(code, 0) << dp << ": " << ok.dump();
    EXPECT_EQ(ok["mode"], "SHARED") << dp;
  }
}

// Registration fails (no CAP_IPC_LOCK and a zero memlock limit: the CPU backend's pin fails, as cudaHostRegister
// would): REGISTER_FAILED, a private table with correct rows, and status shows it. Needs root (setpriv drops
// CAP_IPC_LOCK from the bounding set; without root there is nothing to drop and mlock may still work).
TEST_F(ClientTest, RegistrationFailureFallsBackWithRegisterFailed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: setpriv --bounding-set and prlimit set up the failing pin";
  const auto probe = RunCmd("prlimit --memlock=0:0 setpriv --bounding-set=-ipc_lock true");
  if (probe.exit_code != 0) GTEST_SKIP() << "prlimit/setpriv unavailable here: " << probe.err;
  std::vector<std::string> argv = {"/usr/bin/prlimit", "--memlock=0:0", "/usr/bin/setpriv", "--bounding-set=-ipc_lock"};
  for (const auto& a : Replica("--dp-size 4 --hold 600 --verify 50")) argv.push_back(a);
  Process reg(argv, dir_ / "regfail.log");
  ASSERT_TRUE(WaitFor([&] { return reg.Output().find("\"attached\"") != std::string::npos; }, std::chrono::seconds(30)))
      << reg.Output();
  auto st2 = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
  json s2 = json::parse(st2.out);
  ASSERT_EQ(s2["replicas"].size(), 1u) << st2.out;
  EXPECT_TRUE(Reasons(s2["replicas"][0]).count("REGISTER_FAILED")) << st2.out;
  reg.Signal(SIGKILL);
  reg.Wait();
  // The same again without holding: the final line has the rows' verdict.
  argv.clear();
  argv = {"/usr/bin/prlimit", "--memlock=0:0", "/usr/bin/setpriv", "--bounding-set=-ipc_lock"};
  for (const auto& a : Replica("--dp-size 4 --verify 50")) argv.push_back(a);
  Process again(argv, dir_ / "regfail2.log");
  EXPECT_EQ(again.Wait(), 0) << again.Output();
  json j = LastJson(again.Output());
  EXPECT_EQ(j["mode"], "PRIVATE_PINNED");
  EXPECT_TRUE(Reasons(j).count("REGISTER_FAILED")) << j.dump();
  EXPECT_GT(j["verified"].get<int>(), 0);
  EXPECT_EQ(j["mismatches"], 0);
}

// The client checks the granted segment's header against the grant: a segment whose fingerprint field no longer
// matches (overwritten here, as its owner) makes the replica fall back with FINGERPRINT_MISMATCH instead of sharing,
// and its private rows are still the checkpoint's.
TEST_F(ClientTest, GrantedSegmentWithAnotherFingerprintIsNotShared) {
  json ok = Run("--dp-size 4 --verify 20");
  ASSERT_EQ(ok["mode"], "SHARED") << ok.dump();
  auto st = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
  std::string tp1;
  const json status = json::parse(st.out);
  for (const auto& g : status["segments"]) {
    if (g["tp_size"] == 1) tp1 = shm_ + "/" + g["name"].get<std::string>();
  }
  ASSERT_FALSE(tp1.empty()) << st.out;
  const int fd = ::open(tp1.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  uint64_t fp = 0;
  ASSERT_EQ(::pread(fd, &fp, 8, offsetof(SegmentHeader, fingerprint)), 8);
  fp ^= 0x1;
  ASSERT_EQ(::pwrite(fd, &fp, 8, offsetof(SegmentHeader, fingerprint)), 8);
  ::close(fd);
  int code = -1;
  json j = Run("--dp-size 4 --verify 50", &code);
  EXPECT_EQ(code, 0) << j.dump();
  EXPECT_EQ(j["mode"], "PRIVATE_PINNED") << j.dump();
  EXPECT_TRUE(Reasons(j).count("FINGERPRINT_MISMATCH")) << j.dump();
  EXPECT_GT(j["verified"].get<int>(), 0);
  EXPECT_EQ(j["mismatches"], 0);
}

// cpu_offload precedence (docs/math.md section 9): an explicit flag wins, else VLLM_PLE_CPU_OFFLOAD, else true.
TEST_F(ClientTest, CpuOffloadFlagBeatsEnvironmentWhichBeatsDefault) {
  struct Case {
    const char* env;  // null: unset
    std::string args, mode;
  } cases[] = {
      {nullptr, "", "SHARED"},
      {"false", "", "DEVICE"},
      {"0", "", "DEVICE"},
      {"false", "--cpu-offload true", "SHARED"},
      {"true", "--cpu-offload false", "DEVICE"},
      {"true", "", "SHARED"},
  };
  for (const auto& c : cases) {
    if (c.env) {
      ::setenv("VLLM_PLE_CPU_OFFLOAD", c.env, 1);
    } else {
      ::unsetenv("VLLM_PLE_CPU_OFFLOAD");
    }
    int code = -1;
    json j = Run("--dp-size 4 --verify 20 " + c.args, &code);
    ::unsetenv("VLLM_PLE_CPU_OFFLOAD");
    EXPECT_EQ(code, 0) << j.dump();
    EXPECT_EQ(j["mode"], c.mode) << "env " << (c.env ? c.env : "(unset)") << " args '" << c.args << "': " << j.dump();
    if (c.mode == "DEVICE") {
      EXPECT_TRUE(Reasons(j).count("CPU_OFFLOAD_DISABLED")) << j.dump();
    }
    EXPECT_EQ(j["mismatches"], 0);
  }
}

// The bytes a replica is served, in-process through libengram_client: from the daemon's shared segment (SHARED) and
// from a private fallback table (no daemon: PRIVATE_PINNED), for TP 1 and both TP 2 shards, equal the generator's
// own formula (SyntheticByte, default seed 1 as engram-mkckpt writes) at the first, last and sampled rows.
TEST_F(ClientTest, SharedAndPrivateRowsEqualTheGeneratorsFormula) {
  auto expect_formula = [](const client::Table& t, const std::string& what) {
    const int64_t D = t.head_dim(), S = D / 32, rb = D + S;
    std::mt19937_64 rng(9);
    for (size_t l = 0; l < t.layers().size(); ++l) {
      const auto& li = t.layers()[l];
      const uint8_t* base = t.records(static_cast<int>(l));
      ASSERT_NE(base, nullptr) << what;
      const std::string name = "layers." + std::to_string(li.layer_id) + ".engram.";
      std::vector<int64_t> rows = {li.row_begin, li.row_end - 1};
      for (int i = 0; i < 30; ++i) {
        rows.push_back(li.row_begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(li.row_end - li.row_begin)));
      }
      for (int64_t row : rows) {
        const uint8_t* rec = base + (row - li.row_begin) * rb;
        for (int64_t j = 0; j < D; ++j) {
          ASSERT_EQ(rec[j],
                    tools::SyntheticByte(1, name + "embed.weight", static_cast<uint64_t>(row * D + j), false, false))
              << what << " layer " << li.layer_id << " row " << row << " byte " << j;
        }
        for (int64_t j = 0; j < S; ++j) {
          ASSERT_EQ(rec[D + j],
                    tools::SyntheticByte(1, name + "embed.scale", static_cast<uint64_t>(row * S + j), true, false))
              << what << " layer " << li.layer_id << " row " << row << " scale " << j;
        }
      }
    }
  };
  for (const auto& [tp, rank] : std::vector<std::pair<int, int>>{{1, 0}, {2, 0}, {2, 1}}) {
    for (bool shared : {true, false}) {
      client::ClientOptions opts;
      opts.socket = shared ? socket_ : dir_ / "nobody.sock";
      opts.timeout = std::chrono::milliseconds(shared ? 30000 : 200);
      opts.use_gpu = false;
      auto c = client::Client::Create(opts);
      ASSERT_TRUE(c.ok()) << c.status();
      client::AttachRequest req;
      req.checkpoint = ckpt_;
      req.shm_dir = shm_;
      req.dp_size = 2;
      req.tp_size = tp;
      req.tp_rank = rank;
      auto t = (*c)->Attach(req);
      ASSERT_TRUE(t.ok()) << t.status();
      ASSERT_EQ((*t)->mode(), shared ? client::Mode::kShared : client::Mode::kPrivatePinned);
      expect_formula(
          **t, std::string(shared ? "shared" : "private") + " tp" + std::to_string(rank) + "of" + std::to_string(tp));
    }
  }
}

// The common deployments that are not one DP group on one node: engines started separately (each DP 1), and one
// node's half of a DP 16 group that spans two nodes. Every replica shares the daemon's segment, with no reason but
// the missing GPU, and reads the checkpoint's rows.
TEST_F(ClientTest, EveryDpLayoutSharesTheNodesCopy) {
  std::vector<Process> ps;
  for (int r = 0; r < 2; ++r) {
    ps.emplace_back(Replica("--dp-size 16 --local-dp-size 8 --dp-rank " + std::to_string(8 + r) + " --verify 200"),
                    dir_ / ("dp16-" + std::to_string(r) + ".log"));
  }
  ps.emplace_back(Replica("--dp-size 1 --verify 200"), dir_ / "dp1.log");
  ps.emplace_back(Replica("--dp-size 1 --tp-size 2 --tp-rank 1 --verify 200"), dir_ / "dp1-tp2.log");
  for (auto& p : ps) {
    EXPECT_EQ(p.Wait(), 0) << p.Output();
    json j = LastJson(p.Output());
    EXPECT_EQ(j["mode"], "SHARED") << p.Output();
    EXPECT_EQ(Reasons(j), std::set<std::string>{"NO_CUDA_DEVICE"}) << p.Output();
    EXPECT_GT(j["verified"].get<int>(), 100);
    EXPECT_EQ(j["mismatches"], 0);
  }
}

long PssKib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string k;
  long v = 0;
  while (in >> k) {
    if (k == "Pss:") {
      in >> v;
      return v;
    }
  }
  return -1;
}

// Host memory with 4 replicas holding their tables: shared, each replica's PSS carries a quarter of the one copy;
// private, each carries a whole copy. Printed for bench/RESULTS.md.
TEST_F(ClientTest, FourSharedReplicasHoldOneCopyOfTheTable) {
  std::vector<Process> shared, priv;
  for (int r = 0; r < 4; ++r) {
    shared.emplace_back(Replica("--dp-size 4 --dp-rank " + std::to_string(r) + " --hold 600 --verify 4"),
                        dir_ / ("s" + std::to_string(r) + ".log"));
    priv.emplace_back(
        Replica("--dp-size 4 --dp-rank " + std::to_string(r) + " --dp-shared-memory false --hold 600 --verify 4"),
        dir_ / ("p" + std::to_string(r) + ".log"));
  }
  for (auto* set : {&shared, &priv}) {
    for (auto& p : *set) {
      ASSERT_TRUE(
          WaitFor([&] { return p.Output().find("\"attached\"") != std::string::npos; }, std::chrono::seconds(30)))
          << p.Output();
    }
  }
  // PSS is read only from live processes holding their tables (a process that exited would read as 0 or -1).
  long shared_pss = 0, private_pss = 0;
  for (auto* set : {&shared, &priv}) {
    for (auto& p : *set) {
      ASSERT_TRUE(p.Running()) << p.Output();
      const long pss = PssKib(p.pid());
      ASSERT_GT(pss, 0) << p.Output();
      (set == &shared ? shared_pss : private_pss) += pss;
      ASSERT_TRUE(p.Running()) << "exited while its PSS was read: " << p.Output();
    }
  }
  const double table_mib = 96.0;
  std::cout << "[ memory ] 4 replicas, " << table_mib << " MiB table: shared PSS total " << shared_pss / 1024
            << " MiB, private PSS total " << private_pss / 1024 << " MiB\n";
  // Shared: about one copy in total; private: about four.
  EXPECT_LT(shared_pss / 1024.0, 2.0 * table_mib);
  EXPECT_GT(private_pss / 1024.0, 3.5 * table_mib);
  for (auto* set : {&shared, &priv}) {
    for (auto& p : *set) {
      EXPECT_EQ(JsonLineMode(p.Output()), set == &shared ? "SHARED" : "PRIVATE_PINNED") << p.Output();
      p.Signal(SIGKILL);
      p.Wait();
    }
  }
}

// Four engines started separately, each with dp_size 1 (one `vllm serve` per GPU group): all SHARED on the one
// segment, and together they hold one copy of the table (PSS), not four.
TEST_F(ClientTest, FourSeparateDpOneEnginesShareOneCopy) {
  std::vector<Process> ps;
  for (int r = 0; r < 4; ++r) {
    ps.emplace_back(Replica("--dp-size 1 --hold 600 --verify 4"), dir_ / ("e" + std::to_string(r) + ".log"));
  }
  for (auto& p : ps) {
    ASSERT_TRUE(WaitFor([&] { return p.Output().find("\"attached\"") != std::string::npos; }, std::chrono::seconds(30)))
        << p.Output();
  }
  long pss = 0;
  for (auto& p : ps) {
    ASSERT_TRUE(p.Running()) << p.Output();
    const long k = PssKib(p.pid());
    ASSERT_GT(k, 0) << p.Output();
    pss += k;
    ASSERT_TRUE(p.Running()) << "exited while its PSS was read: " << p.Output();
  }
  auto st = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
  json status = json::parse(st.out);
  ASSERT_EQ(status["replicas"].size(), 4u) << st.out;
  std::set<std::string> segments;
  for (const auto& r : status["replicas"]) {
    EXPECT_EQ(r["mode"], "SHARED") << st.out;
    EXPECT_EQ(r["dp_size"], 1) << st.out;
    segments.insert(r["segment"].get<std::string>());
  }
  EXPECT_EQ(segments.size(), 1u) << "every engine maps the one segment: " << st.out;
  std::cout << "[ memory ] 4 separate DP 1 engines, 96 MiB table: PSS total " << pss / 1024 << " MiB\n";
  EXPECT_LT(pss / 1024.0, 2.0 * 96.0) << "four DP 1 engines must hold one copy between them";
  for (auto& p : ps) {
    EXPECT_EQ(JsonLineMode(p.Output()), "SHARED") << p.Output();
    p.Signal(SIGKILL);
    p.Wait();
  }
}

// A sparse checkpoint (engram-mkckpt --sparse): engram-replica --verify checks rows of every pattern region and the
// holes next to them through a real engramd, and fails when the pattern file claims rows the checkpoint does not
// hold, or when the checkpoint's bytes differ from what the node serves.
TEST(SparseCheckpointTest, ReplicaChecksEveryRegionAndCatchesALieAndAChangedRow) {
  TempDir dir;
  const std::string ck = dir / "ck", shm = dir / "shm", sock = dir / "engramd.sock";
  ::mkdir(shm.c_str(), 0755);
  ASSERT_EQ(RunCmd(BinPath("engram-mkckpt") + " --out " + ck + " --sparse --table-mib 64 --shards 1").exit_code, 0);
  Process daemon({BinPath("../daemon/engramd"), "--checkpoint", ck, "--shm-dir", shm, "--socket", sock},
                 dir / "engramd.log");
  ASSERT_TRUE(WaitFor(
      [&] {
        auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + sock);
        return r.exit_code == 0 && r.out.find("\"state\":\"READY\"") != std::string::npos;
      },
      std::chrono::seconds(60)))
      << daemon.Output();
  auto replica = [&](const std::string& name, int* code) {
    Process p({BinPath("engram-replica"), "--socket", sock, "--checkpoint", ck, "--dp-size", "2", "--verify", "64",
               "--tokens", "64"},
              dir / (name + ".log"));
    *code = p.Wait();
    return LastJson(p.Output());
  };
  // engramd's start-up check of its directory: this test's directory is on a tmpfs (small tables: no warning) or on
  // a disk (the warning that it is not in memory), whichever this machine gives.
  struct statfs fs {};
  ASSERT_EQ(::statfs(shm.c_str(), &fs), 0);
  const bool in_memory = fs.f_type == 0x01021994 /* TMPFS_MAGIC */;
  EXPECT_EQ(daemon.Output().find("event=shm_small_pages") == std::string::npos, in_memory) << daemon.Output();
  if (!in_memory) {
    EXPECT_NE(daemon.Output().find("not in memory (tmpfs or hugetlbfs)"), std::string::npos);
  }
  int code = -1;
  json ok = replica("clean", &code);
  EXPECT_EQ(code, 0) << ok.dump();
  EXPECT_EQ(ok["mode"], "SHARED");
  EXPECT_GT(ok["pattern_rows"].get<int>(), 60);
  EXPECT_GT(ok["pattern_nonzero_rows"].get<int>(), 40);
  EXPECT_EQ(ok["pattern_mismatches"], 0);

  // A region the pattern file claims inside the holes: those rows read as zero rows.
  const std::string pattern_path = ck + "/" + tools::kPatternFileName;
  const std::string honest = testing::ReadFile(pattern_path);
  json p = json::parse(honest);
  const int64_t hole = p["layers"][0]["regions"][0]["row_end"].get<int64_t>() + 10;
  p["layers"][0]["regions"].insert(p["layers"][0]["regions"].begin() + 1,
                                   json{{"row_begin", hole}, {"row_end", hole + 4}, {"why", "not written"}});
  testing::WriteFile(pattern_path, p.dump());
  json lie = replica("lie", &code);
  EXPECT_EQ(code, 1) << lie.dump();
  EXPECT_GE(lie["pattern_mismatches"].get<int>(), 1);
  // Pattern files that are malformed or check nothing: a clear failure, never a crash and never a pass.
  const int64_t rows = p["layers"][0]["rows"].get<int64_t>();
  for (const std::string& hostile : std::vector<std::string>{
           std::string(R"({"layers":[{"layer_id":"1","regions":[{"row_begin":0,"row_end":10}]}]})"),
           std::string(R"({"layers":[[1,2]]})"), std::string(R"({"layers":[{"layer_id":1,"regions":[5]}]})"),
           std::string(R"({"layers":[{"layer_id":1,"regions":[{"row_begin":"0","row_end":10}]}]})"),
           std::string(R"({"layers":[]})"), std::string(R"({"layers":[{"layer_id":99,"regions":[]}]})"),
           std::string(R"({"layers":[{"layer_id":1}]})"),
           std::string(R"({"layers":[{"layer_id":1,"regions":[{"row_begin":0,"row_end":18446744073709551615}]}]})"),
           std::string(R"({"layers":[{"layer_id":1,"regions":[{"row_begin":-9223372036854775808,)") +
               R"("row_end":9223372036854775807}]}]})",
           std::string(R"({"layers":[{"layer_id":1,"regions":[{"row_begin":5,"row_end":5}]}]})"),
           R"({"layers":[{"layer_id":1,"regions":[{"row_begin":0,"row_end":)" + std::to_string(rows + 1) + "}]}]}",
           std::string("[1, 2"), std::string("42")}) {
    testing::WriteFile(pattern_path, hostile);
    json j = replica("hostile", &code);
    EXPECT_EQ(code, 1) << hostile << ": " << j.dump();
    EXPECT_GE(j.value("pattern_mismatches", 0), 1) << hostile << ": " << j.dump();
  }
  // A FIFO where the pattern file goes: refused as not a regular file, never opened (an open would block forever).
  ASSERT_EQ(::unlink(pattern_path.c_str()), 0);
  ASSERT_EQ(::mkfifo(pattern_path.c_str(), 0600), 0);
  json fifo = replica("fifo", &code);
  EXPECT_EQ(code, 1) << fifo.dump();
  EXPECT_GE(fifo.value("pattern_mismatches", 0), 1) << fifo.dump();
  ASSERT_EQ(::unlink(pattern_path.c_str()), 0);
  testing::WriteFile(pattern_path, honest);

  // One byte of row 0 of layer 1 changed in the checkpoint after the publish, its modification time put back (the
  // fingerprint cannot see it, as model/checkpoint.h says): the node serves the old row, and --verify says so.
  const std::string file = ck + "/model.safetensors";
  std::ifstream in(file, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  const uint64_t at =
      8 + header_len + json::parse(header)["layers.1.engram.embed.weight"]["data_offsets"][0].get<uint64_t>();
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(at)), 1);
  b ^= 0x11;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(at)), 1);
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::futimens(fd, times), 0);
  ::close(fd);
  json changed = replica("changed", &code);
  EXPECT_EQ(code, 1) << changed.dump();
  EXPECT_GE(changed["pattern_mismatches"].get<int>(), 1);
  EXPECT_TRUE(daemon.Running());
}

// engram-mkckpt --like: the model sets the geometry; a geometry flag beside it, an unknown model or a layer id the
// model does not have is a usage error naming the problem, and nothing is written.
TEST(SparseCheckpointTest, MkckptLikeRefusesConflictingOrUnknownArguments) {
  TempDir dir;
  const std::string mk = BinPath("engram-mkckpt") + " --out " + (dir / "x");
  struct Case {
    std::string args, says;
  } cases[] = {{" --like deepseek-v4.1-flash --table-mib 64", "--table-mib conflicts with --like"},
               {" --like deepseek-v4.1-flash --heads 4", "--heads conflicts with --like"},
               {" --like deepseek-v9", "no geometry is known for 'deepseek-v9'"},
               {" --like deepseek-v4.1-flash --layers 3", "3 is not one of deepseek-v4.1-flash's Engram layers"},
               // Layer 14 alone would get layer 1's primes and rows: not the model's layer 14.
               {" --like deepseek-v4.1-flash --layers 14", "the first layers of the model in order"},
               {" --sparse --engram-vocab-size -5", "--engram-vocab-size must be positive"}};
  for (const auto& c : cases) {
    auto r = RunCmd(mk + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << ": " << r.err;
  }
  struct stat st {};
  EXPECT_NE(::stat((dir / "x/config.json").c_str(), &st), 0) << "nothing written";
}

}  // namespace
}  // namespace engram
