// libengram_client in this process against a real engramd process, with the OS seam (shm/env.h) failing what only
// root could make fail for real: mlock refused (REGISTER_FAILED), mmap refused for a private table. Also: the mode
// the daemon lists in status is the mode the table runs (one decision, the outcome reported back), reasons are one
// enum from the wire to the C API, and every row served is checked against the synthetic generator's formula (an
// oracle that shares no code with the readers under test).
#include <sys/mman.h>
#include <sys/stat.h>

#include <set>

#include "engram/client.h"
#include "engram/engram_c.h"
#include "engram/v1/engram.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shm/env.h"
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

class FaultEnv : public PosixEnv {
 public:
  int mlock_errno = 0;
  bool fail_anonymous_mmap = false;
  int Mlock(const void* addr, size_t len) override {
    if (mlock_errno != 0) {
      errno = mlock_errno;
      return -1;
    }
    return PosixEnv::Mlock(addr, len);
  }
  void* Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) override {
    if (fail_anonymous_mmap && (flags & MAP_ANONYMOUS)) {
      errno = ENOMEM;
      return MAP_FAILED;
    }
    return PosixEnv::Mmap(addr, len, prot, flags, fd, off);
  }
};

constexpr uint64_t kSeed = 11;

// Every row of every layer the table holds, record by record, against the generator's formula.
int64_t RowMismatches(const client::Table& t, uint64_t seed = kSeed) {
  int64_t bad = 0;
  const int64_t D = t.head_dim(), sb = D / 32;
  for (size_t l = 0; l < t.layers().size(); ++l) {
    const auto& li = t.layers()[l];
    const std::string base = "layers." + std::to_string(li.layer_id) + ".engram.";
    const uint8_t* rec = t.records(static_cast<int>(l));
    for (int64_t row = li.row_begin; row < li.row_end; row += 7) {
      const uint8_t* got = rec + (row - li.row_begin) * (D + sb);
      for (int64_t j = 0; j < D; ++j) {
        bad += got[j] !=
               tools::SyntheticByte(seed, base + "embed.weight", static_cast<uint64_t>(row * D + j), false, false);
      }
      for (int64_t j = 0; j < sb; ++j) {
        bad += got[D + j] !=
               tools::SyntheticByte(seed, base + "embed.scale", static_cast<uint64_t>(row * sb + j), true, false);
      }
    }
  }
  return bad;
}

class ClientFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::mkdir((dir_ / "shm").c_str(), 0755);
    tools::SyntheticSpec spec;
    spec.out_dir = dir_ / "ck";
    spec.table_mib = 8;
    spec.seed = kSeed;
    spec.threads = 2;
    ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
    socket_ = dir_ / "engramd.sock";
    daemon_ = Process(
        {BinPath("../daemon/engramd"), "--checkpoint", dir_ / "ck", "--shm-dir", dir_ / "shm", "--socket", socket_},
        dir_ / "engramd.log");
    ASSERT_TRUE(WaitFor(
        [&] {
          json s = Status();
          if (s.is_null() || s["segments"].empty()) return false;
          for (const auto& g : s["segments"]) {
            if (g["state"] != "READY") return false;
          }
          return true;
        },
        std::chrono::seconds(60)))
        << daemon_.Output();
  }
  json Status() const {
    auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + socket_);
    return r.exit_code == 0 ? json::parse(r.out) : json();
  }
  // This process's entry in status (null when it is not listed).
  json Me() const {
    const json s = Status();
    if (!s.is_object() || !s.contains("replicas")) return json();  // not answering (e.g. restarting)
    for (const auto& r : s["replicas"]) {
      if (r["pid"] == ::getpid()) return r;
    }
    return json();
  }
  client::ClientOptions Options(Env* env) const {
    client::ClientOptions o;
    o.socket = socket_;
    o.use_gpu = false;
    o.env = env;
    return o;
  }
  client::AttachRequest Request(int dp_size) const {
    client::AttachRequest r;
    r.checkpoint = dir_ / "ck";
    r.dp_size = dp_size;
    r.shm_dir = dir_ / "shm";
    r.threads = 2;
    return r;
  }
  static std::set<std::string> Names(const std::vector<client::Reason>& reasons) {
    std::set<std::string> s;
    for (const auto& r : reasons) s.insert(client::ReasonName(r.code));
    return s;
  }

  TempDir dir_;
  std::string socket_;
  Process daemon_;
};

TEST_F(ClientFaultsTest, SharedTableServesTheCheckpointsRows) {
  FaultEnv env;
  auto c = client::Client::Create(Options(&env));
  auto t = (*c)->Attach(Request(2));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->mode(), client::Mode::kShared);
  EXPECT_EQ(Names((*t)->reasons()), std::set<std::string>{"NO_CUDA_DEVICE"});
  EXPECT_EQ(RowMismatches(**t), 0);
  json me = Me();
  ASSERT_FALSE(me.is_null()) << Status().dump();
  EXPECT_EQ(me["mode"], "SHARED");
  EXPECT_EQ(me["backend"], "cpu");
}

TEST_F(ClientFaultsTest, FailedPinIsRegisterFailedWithAPrivateTableAndStatusSaysSo) {
  FaultEnv env;
  env.mlock_errno = ENOMEM;  // what a zero RLIMIT_MEMLOCK without CAP_IPC_LOCK gives
  auto c = client::Client::Create(Options(&env));
  auto t = (*c)->Attach(Request(2));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->mode(), client::Mode::kPrivatePinned);
  EXPECT_TRUE(Names((*t)->reasons()).count("REGISTER_FAILED")) << ::testing::PrintToString(Names((*t)->reasons()));
  EXPECT_EQ(RowMismatches(**t), 0);
  json me = Me();
  ASSERT_FALSE(me.is_null()) << Status().dump();
  EXPECT_EQ(me["mode"], "PRIVATE_PINNED");
  std::set<std::string> listed;
  for (const auto& r : me["reasons"]) listed.insert(r.get<std::string>());
  EXPECT_EQ(listed, Names((*t)->reasons())) << "status lists exactly the reasons the replica runs with";
  // The registration ticket went back: a second replica shares.
  FaultEnv ok_env;
  auto c2 = client::Client::Create(Options(&ok_env));
  auto t2 = (*c2)->Attach(Request(2));
  ASSERT_TRUE(t2.ok()) << t2.status();
  EXPECT_EQ((*t2)->mode(), client::Mode::kShared);
}

TEST_F(ClientFaultsTest, StatusShowsTheModeTheReplicaRuns) {
  struct Case {
    int dp_size;
    bool across_dp;
    client::Choice shared;
    std::string mode;
    std::set<std::string> must;
  } cases[] = {
      {1, true, client::Choice::kAuto, "SHARED", {}},  // a DP 1 engine shares the node's copy
      {1, false, client::Choice::kAuto, "SHARED", {}},
      {1, false, client::Choice::kTrue, "SHARED", {}},
  };
  for (const auto& k : cases) {
    FaultEnv env;
    auto c = client::Client::Create(Options(&env));
    auto req = Request(k.dp_size);
    req.embedding_across_dp = k.across_dp;
    req.dp_shared_memory = k.shared;
    auto t = (*c)->Attach(req);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(client::ModeName((*t)->mode()), k.mode);
    for (const auto& m : k.must) EXPECT_TRUE(Names((*t)->reasons()).count(m)) << m;
    EXPECT_EQ(RowMismatches(**t), 0);
    json me = Me();
    ASSERT_FALSE(me.is_null()) << Status().dump();
    EXPECT_EQ(me["mode"], k.mode) << "status must show the mode this process runs";
  }
}

TEST_F(ClientFaultsTest, SharingTurnedOffNeverAsksTheDaemon) {
  FaultEnv env;
  auto c = client::Client::Create(Options(&env));
  auto req = Request(4);
  req.dp_shared_memory = client::Choice::kFalse;
  auto t = (*c)->Attach(req);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->mode(), client::Mode::kPrivatePinned);
  EXPECT_TRUE(Names((*t)->reasons()).count("DP_SHARED_MEMORY_DISABLED"));
  EXPECT_EQ(RowMismatches(**t), 0);
  EXPECT_TRUE(Me().is_null());
}

TEST_F(ClientFaultsTest, PrivateTableThatCannotBeMappedIsAClearError) {
  FaultEnv env;
  env.fail_anonymous_mmap = true;
  auto c = client::Client::Create(Options(&env));
  auto req = Request(1);
  req.elastic_ep = true;  // a fallback to a private table, which cannot be mapped
  auto t = (*c)->Attach(req);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  EXPECT_NE(t.status().message().find("private table"), std::string::npos) << t.status();
  EXPECT_TRUE(daemon_.Running());
}

// A new revision (same config, tokenizer and shapes, other rows) written into the served directory while the daemon
// is down: on restart the old segment is not adopted (its fingerprint is the old files'), the new one is
// published, and a replica reads the new rows.
TEST(SegmentIdentityTest, ARewrittenCheckpointIsRepublishedNotAdopted) {
  TempDir dir;
  ::mkdir((dir / "shm").c_str(), 0755);
  auto make = [&](uint64_t seed) {
    tools::SyntheticSpec spec;
    spec.out_dir = dir / "ck";
    spec.table_mib = 4;
    spec.seed = seed;
    spec.threads = 2;
    ASSERT_TRUE(tools::WriteSyntheticCheckpoint(spec).ok());
  };
  const std::string socket = dir / "engramd.sock";
  auto status = [&] {
    auto r = RunCmd(BinPath("engramctl") + " status --json --socket " + socket);
    return r.exit_code == 0 ? json::parse(r.out) : json();
  };
  auto ready = [&] {
    json s = status();
    if (s.is_null() || s["segments"].size() != 1) return false;
    return s["segments"][0]["state"] == "READY" && s["segments"][0]["checksum_state"] == "ok";
  };
  const std::vector<std::string> argv = {
      BinPath("../daemon/engramd"), "--checkpoint", dir / "ck", "--shm-dir", dir / "shm", "--socket", socket};
  make(1);
  {
    Process d(argv, dir / "engramd1.log");
    ASSERT_TRUE(WaitFor(ready, std::chrono::seconds(60))) << d.Output();
    d.Signal(SIGTERM);
    ASSERT_EQ(d.Wait(), 0) << d.Output();
  }
  // A "fine-tune": the same config.json and tokenizer.json, the same shapes, other table bytes.
  const std::string config = testing::ReadFile(dir / "ck/config.json");
  const std::string tokenizer = testing::ReadFile(dir / "ck/tokenizer.json");
  make(2);
  testing::WriteFile(dir / "ck/config.json", config);
  testing::WriteFile(dir / "ck/tokenizer.json", tokenizer);
  Process d(argv, dir / "engramd2.log");
  ASSERT_TRUE(WaitFor(ready, std::chrono::seconds(60))) << d.Output();
  EXPECT_EQ(status()["segments"][0]["origin"], "published") << d.Output();
  client::ClientOptions o;
  o.socket = socket;
  o.use_gpu = false;
  client::AttachRequest r;
  r.checkpoint = dir / "ck";
  r.dp_size = 2;
  r.shm_dir = dir / "shm";
  auto t = (*client::Client::Create(o))->Attach(r);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->mode(), client::Mode::kShared);
  EXPECT_EQ(RowMismatches(**t, 2), 0) << "the replica must read the new revision's rows";
  EXPECT_GT(RowMismatches(**t, 1), 0) << "the two revisions must differ for this test to mean anything";
}

// The daemon dies and comes back: the replica notices, reconnects, is listed in status again, and its table (never
// remapped) still serves the checkpoint's rows.
TEST_F(ClientFaultsTest, ALostLeaseIsReestablishedAfterTheDaemonRestarts) {
  FaultEnv env;
  auto c = client::Client::Create(Options(&env));
  auto t = (*c)->Attach(Request(2));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ((*t)->mode(), client::Mode::kShared);
  const uint8_t* mapped = (*t)->records(0);
  ASSERT_FALSE(Me().is_null());
  daemon_.Signal(SIGKILL);
  daemon_.Wait();
  daemon_ = Process(
      {BinPath("../daemon/engramd"), "--checkpoint", dir_ / "ck", "--shm-dir", dir_ / "shm", "--socket", socket_},
      dir_ / "engramd-again.log");
  ASSERT_TRUE(WaitFor(
      [&] {
        json me = Me();
        return !me.is_null() && me["mode"] == "SHARED";
      },
      std::chrono::seconds(60)))
      << Status().dump() << daemon_.Output();
  EXPECT_EQ((*t)->records(0), mapped) << "nothing is remapped";
  EXPECT_EQ(RowMismatches(**t), 0);
}

// The daemon comes back serving another file under the same name (here: the old one was removed while no daemon ran,
// so it publishes anew): the replica keeps reading its own mapping, which no one shares any more, and says so.
TEST_F(ClientFaultsTest, AReconnectToAnotherFileReportsWhatTheReplicaReallyRuns) {
  FaultEnv env;
  auto c = client::Client::Create(Options(&env));
  auto t = (*c)->Attach(Request(2));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ((*t)->mode(), client::Mode::kShared);
  const json before = Status();
  ASSERT_TRUE(before.is_object()) << "status";
  const std::string segment = before["segments"][0]["name"];
  daemon_.Signal(SIGKILL);
  daemon_.Wait();
  ASSERT_EQ(::unlink((dir_ / "shm/" + segment).c_str()), 0);
  daemon_ = Process(
      {BinPath("../daemon/engramd"), "--checkpoint", dir_ / "ck", "--shm-dir", dir_ / "shm", "--socket", socket_},
      dir_ / "engramd-again.log");
  ASSERT_TRUE(WaitFor(
      [&] {
        json me = Me();
        return !me.is_null() && !me["reasons"].empty() && me["reasons"].back() == "SEGMENT_NOT_READY";
      },
      std::chrono::seconds(60)))
      << Status().dump() << daemon_.Output();
  EXPECT_EQ(Me()["mode"], "PRIVATE_PINNED") << "status must not claim the new file is shared by this replica";
  EXPECT_EQ(RowMismatches(**t), 0) << "the old mapping still holds the checkpoint's rows";
}

TEST(ReasonNamesTest, OneEnumFromTheWireToC) {
  // The wire's names (the daemon's, engramctl's), the C++ client's and the C API's agree for every code, and unknown
  // codes say so.
  EXPECT_EQ(client::kMaxReasonCode, engram::v1::FallbackReason_MAX) << "a reason was added to one enum only";
  for (int code = 1; code <= client::kMaxReasonCode; ++code) {
    EXPECT_EQ(engram::v1::FallbackReason_Name(static_cast<engram::v1::FallbackReason>(code)),
              client::ReasonName(static_cast<client::ReasonCode>(code)));
    EXPECT_STREQ(engram_reason_name(code), client::ReasonName(static_cast<client::ReasonCode>(code)));
    EXPECT_STRNE(engram_reason_name(code), "UNKNOWN");
  }
  EXPECT_STREQ(engram_reason_name(0), "UNKNOWN");
  EXPECT_STREQ(engram_reason_name(client::kMaxReasonCode + 1), "UNKNOWN");
  EXPECT_STREQ(engram_reason_name(ENGRAM_REASON_DP_SHARDED_NOT_BUILT), "DP_SHARDED_NOT_BUILT");
  EXPECT_STREQ(engram_reason_name(ENGRAM_REASON_SHM_NOT_VISIBLE), "SHM_NOT_VISIBLE");
}

}  // namespace
}  // namespace engram
