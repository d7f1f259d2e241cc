// The DP-sharded topology (embedding_across_dp) on the CPU path, with real processes: a real engramd
// brokers the groups, real engram-replica processes form them over their sessions and exchange rows through the
// host transport every step. Rows are checked by each replica against the checkpoint through the independent row
// oracle (tools/row_oracle.h): every row of every token, for DP 2, DP 4 and TP 2 x DP 2, with uneven token counts
// and a rank with zero tokens. A member SIGKILLed in the middle of its steps: the others fail with an error naming
// it (no hang) and status shows the group BROKEN and who left. Malformed group requests are refused without
// harming the daemon. Precedence: where dp_shared_memory can share, SHARED wins over embedding_across_dp.
// Lifecycle (DpLifecycleTest, with scripted members: tests/integration/dp_member_helper.cc): a member that closes its
// engine, gives up before mapping the host region or gives up forming leaves the group (GroupLeave) while its
// session lives on: the others stop at once naming it and why, status says so, and the session joins again; rank 0
// killed while the group forms or right after creating the region leaves nothing in /dev/shm; leave requests that
// are not the session's to make are refused without harm.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>

#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engram/v1/engram.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "tests/integration/daemon_harness.h"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Daemon;
using testing::Process;
using testing::TempDir;
using testing::WaitFor;

class DpGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shm_ = testing::MakeShm(dir_);
    ckpt_ = testing::MakeCheckpoint(dir_, 6);
    daemon_ = std::make_unique<Daemon>(dir_, std::vector<std::string>{"--checkpoint", ckpt_, "--shm-dir", shm_});
    ASSERT_TRUE(daemon_->WaitReady()) << daemon_->Log();
  }
  Process Replica(const std::string& args, const std::string& log) {
    std::vector<std::string> argv = {
        BinPath("engram-replica"), "--socket", daemon_->socket(), "--checkpoint", ckpt_, "--timeout-ms", "10000"};
    std::istringstream ss(args);
    for (std::string w; ss >> w;) argv.push_back(w);
    return Process(argv, dir_ / log);
  }
  // One group step per batch in every replica of a TP x DP topology; tokens[dp] tokens on DP rank dp.
  void RunTopology(int tp, int dp, const std::vector<int>& tokens, const std::string& extra) {
    std::vector<Process> ps;
    std::vector<std::string> names;
    for (int t = 0; t < tp; ++t) {
      for (int d = 0; d < dp; ++d) {
        const std::string name = "tp" + std::to_string(t) + "dp" + std::to_string(d) + "-" + std::to_string(runs_);
        ps.push_back(Replica("--embedding-across-dp --tp-size " + std::to_string(tp) + " --tp-rank " +
                                 std::to_string(t) + " --dp-size " + std::to_string(dp) + " --dp-rank " +
                                 std::to_string(d) + " --tokens " + std::to_string(tokens[static_cast<size_t>(d)]) +
                                 " --batches 3 --verify 1000000 " + extra,
                             name + ".log"));
        names.push_back(name);
      }
    }
    ++runs_;
    for (size_t i = 0; i < ps.size(); ++i) {
      const int code = ps[i].Wait(std::chrono::seconds(120));
      const std::string out = ps[i].Output();
      json j = testing::JsonLine(out, true);
      EXPECT_EQ(code, 0) << names[i] << ": " << out;
      EXPECT_EQ(j["mode"], "DP_SHARDED") << names[i] << ": " << out;
      EXPECT_EQ(j["mismatches"], 0) << names[i];
      EXPECT_EQ(j["edp"], dp);
      const int d = static_cast<int>(i) % dp;
      // Every row of every token of both layers was compared with the checkpoint (zero rows outside the group).
      EXPECT_EQ(j["verified"].get<int64_t>(), 3LL * tokens[static_cast<size_t>(d)] * ColsAndLayers()) << names[i];
    }
  }
  int64_t ColsAndLayers() {
    auto ck = Checkpoint::Open(ckpt_);
    EXPECT_TRUE(ck.ok());
    return (*ck)->config().n_layers() * (*ck)->config().n_cols();
  }
  json Groups() {
    json s = daemon_->Status();
    return s.is_null() ? json() : s["groups"];
  }
  TempDir dir_;
  std::string shm_, ckpt_;
  std::unique_ptr<Daemon> daemon_;
  int runs_ = 0;
};

TEST_F(DpGroupTest, Dp2RowsMatchTheCheckpointWithUnevenTokens) {
  RunTopology(1, 2, {5, 37}, "--dp-shared-memory false");
  EXPECT_TRUE(daemon_->proc().Running());
}

TEST_F(DpGroupTest, Dp4WithARankOfZeroTokens) { RunTopology(1, 4, {0, 3, 64, 17}, "--dp-shared-memory false"); }

TEST_F(DpGroupTest, Tp2TimesDp2FormsOneGroupPerTpPosition) {
  RunTopology(2, 2, {9, 1}, "--dp-shared-memory false");
  // Both groups were formed and are listed (now broken or gone: their members finished).
  std::set<std::string> keys;
  for (const auto& g : Groups()) {
    keys.insert(g["group"].get<std::string>());
    EXPECT_EQ(g["size"], 2);
    EXPECT_EQ(g["tp_size"], 2);
  }
  EXPECT_EQ(keys.size(), 2u) << Groups().dump();
}

TEST_F(DpGroupTest, SharingRefusedFallsBackToDpSharded) {
  // cpu_offload false: no host sharing; embedding_across_dp makes it DP_SHARDED (tables of the shard in "HBM",
  // here the CPU backend's memory), not a private copy each.
  RunTopology(1, 2, {8, 8}, "--cpu-offload false");
}

// --hold with embedding_across_dp holds the DP_SHARDED replica (its group and lease) as it does every other mode:
// status lists both members while they hold.
TEST_F(DpGroupTest, HoldKeepsADpShardedReplicaAttached) {
  std::vector<Process> ps;
  for (int d = 0; d < 2; ++d) {
    ps.push_back(Replica("--embedding-across-dp --cpu-offload false --dp-size 2 --dp-rank " + std::to_string(d) +
                             " --verify 8 --hold 600",
                         "hold" + std::to_string(d) + ".log"));
  }
  for (auto& p : ps) {
    ASSERT_TRUE(WaitFor([&] { return p.Output().find("\"attached\"") != std::string::npos; }, std::chrono::seconds(60)))
        << p.Output();
    EXPECT_TRUE(p.Running()) << "--hold was ignored: " << p.Output();
  }
  const json s = daemon_->Status();
  int dp_sharded = 0;
  for (const auto& r : s["replicas"]) dp_sharded += r["mode"] == "DP_SHARDED";
  EXPECT_EQ(dp_sharded, 2) << s.dump();
  for (auto& p : ps) {
    p.Signal(SIGKILL);
    p.Wait();
  }
}

// The host exchange region is reserved when the group forms: on a /dev/shm too small for it (a container's
// default) both members get an error that names the cause, instead of dying of SIGBUS at their first step.
TEST_F(DpGroupTest, ADevShmTooSmallForTheRegionIsAClearError) {
  if (testing::RunCmd("unshare -m --propagation private true").exit_code != 0) {
    GTEST_SKIP() << "needs root: a private mount namespace with a small /dev/shm";
  }
  std::string cmd = "unshare -m --propagation private sh -c 'mount -t tmpfs -o size=16k tmpfs /dev/shm && ";
  for (int d = 0; d < 2; ++d) {
    cmd += "(" + BinPath("engram-replica") + " --socket " + daemon_->socket() + " --checkpoint " + ckpt_ +
           " --timeout-ms 10000 --embedding-across-dp --cpu-offload false --dp-size 2 --dp-rank " + std::to_string(d) +
           " --tokens 512 --verify 4; echo exit=$?) > " + (dir_ / ("small" + std::to_string(d) + ".log")) + " 2>&1 & ";
  }
  cmd += "wait'";
  auto r = testing::RunCmd(cmd);
  for (int d = 0; d < 2; ++d) {
    const std::string out = testing::ReadFile(dir_ / ("small" + std::to_string(d) + ".log"));
    EXPECT_EQ(out.find("exit=135"), std::string::npos) << "SIGBUS: " << out;  // 128 + SIGBUS (7)
    EXPECT_EQ(out.find("exit=0"), std::string::npos) << "member " << d << " stepped on a region it cannot hold";
    // The member that creates the region (DP rank 0) says why; the other learns that the group broke.
    if (d == 0) {
      EXPECT_NE(out.find("cannot hold the DP exchange region"), std::string::npos) << out;
    }
  }
  EXPECT_FALSE(daemon_->Status().is_null()) << "the daemon keeps serving";
}

TEST_F(DpGroupTest, SharingWinsWhereItCan) {
  std::vector<Process> ps;
  for (int d = 0; d < 2; ++d) {
    ps.push_back(Replica("--embedding-across-dp --dp-size 2 --dp-rank " + std::to_string(d) + " --verify 50",
                         "shared" + std::to_string(d) + ".log"));
  }
  for (auto& p : ps) {
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0) << p.Output();
    EXPECT_EQ(testing::JsonLine(p.Output(), true)["mode"], "SHARED") << p.Output();
  }
}

TEST_F(DpGroupTest, AKilledMemberBreaksTheGroupAndTheOthersFailFast) {
  std::vector<Process> ps;
  for (int d = 0; d < 3; ++d) {
    ps.push_back(Replica("--embedding-across-dp --dp-shared-memory false --dp-size 3 --dp-rank " + std::to_string(d) +
                             " --tokens 16 --batches 1000000000 --verify 0",
                         "kill" + std::to_string(d) + ".log"));
  }
  // The group formed and the members are stepping.
  ASSERT_TRUE(WaitFor(
      [&] {
        json g = Groups();
        return g.is_array() && g.size() == 1 && g[0]["state"] == "FORMED";
      },
      std::chrono::seconds(60)))
      << Groups().dump() << ps[0].Output();
  ASSERT_TRUE(
      WaitFor([&] { return ps[1].Output().find("dp_group_formed") != std::string::npos; }, std::chrono::seconds(30)));
  const pid_t victim = ps[1].pid();
  ps[1].Signal(SIGKILL);
  EXPECT_EQ(ps[1].Wait(), 128 + SIGKILL);
  // The others stop with an error naming the member that left (a bound for a hang, not a timing assertion).
  for (int d : {0, 2}) {
    const int code = ps[static_cast<size_t>(d)].Wait(std::chrono::seconds(30));
    const std::string out = ps[static_cast<size_t>(d)].Output();
    EXPECT_EQ(code, 1) << "dp rank " << d << " did not fail: " << out;
    json j = testing::JsonLine(out, true);
    ASSERT_TRUE(j.contains("error")) << out;
    EXPECT_NE(j["error"].get<std::string>().find("dp rank 1"), std::string::npos) << j.dump();
    EXPECT_NE(j["error"].get<std::string>().find(std::to_string(victim)), std::string::npos) << j.dump();
  }
  json g = Groups();
  ASSERT_TRUE(g.is_array() && !g.empty()) << g.dump();
  EXPECT_EQ(g[0]["state"], "BROKEN");
  EXPECT_EQ(g[0]["left_dp_rank"], 1);
  EXPECT_EQ(g[0]["left_pid"], victim);
  EXPECT_NE(g[0]["detail"].get<std::string>().find("dp rank 1"), std::string::npos);
  // The text status says it too.
  auto text = testing::RunCmd(BinPath("engramctl") + " status --socket " + daemon_->socket());
  EXPECT_NE(text.out.find("BROKEN"), std::string::npos) << text.out;
  EXPECT_TRUE(daemon_->proc().Running());
}

TEST(DpPlanTest, EngramctlPlanShowsEachRanksShardAndStepBytes) {
  // V4.1-Flash, TP 2 x DP 4: 8 shards of 3 columns, 1/8 of the table each; per-step bytes from client/dp/plan.h's
  // formula, checked here against the arithmetic of docs/math.md section 8 (ids: T*L*C*4 each way; records: 264 bytes
  // per row).
  auto r = testing::RunCmd(BinPath("engramctl") + " plan --config " + testing::DataPath("configs/v41-flash.json") +
                           " --tp 2 --dp 4 --embedding-across-dp --tokens 100 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  const json& p = j["embedding_across_dp"];
  EXPECT_EQ(p["edp"], 4);
  EXPECT_EQ(p["shards"], 8);
  ASSERT_EQ(p["ranks"].size(), 8u);
  int64_t total = 0;
  for (const auto& rank : p["ranks"]) {
    EXPECT_EQ(rank["columns"][1].get<int64_t>() - rank["columns"][0].get<int64_t>(), 3);
    total += rank["shard_bytes"].get<int64_t>();
    const json& b = rank["step_bytes"];
    EXPECT_EQ(b["ids_sent"], 100 * 2 * 24 * 4);
    EXPECT_EQ(b["ids_received"], 300 * 2 * 24 * 4);
    EXPECT_EQ(b["records_sent"], 300 * 2 * 3 * 264);
    EXPECT_EQ(b["records_received"], 100 * 2 * 9 * 264);
  }
  EXPECT_EQ(total, j["table_bytes"].get<int64_t>()) << "the shards are one copy of the table";
  // The text form names the topology.
  auto text = testing::RunCmd(BinPath("engramctl") + " plan --config " + testing::DataPath("configs/v41-flash.json") +
                              " --tp 2 --dp 4 --embedding-across-dp");
  EXPECT_NE(text.out.find("embedding_across_dp: 8 shards"), std::string::npos) << text.out;
}

// Raw sessions sending malformed group joins: each is refused with a precise status, the daemon keeps serving.
class RawSession {
 public:
  RawSession(engram::v1::Engram::Stub* stub, const engram::v1::ClientMessage& hello) : stream_(stub->Session(&ctx_)) {
    stream_->Write(hello);
    engram::v1::ServerMessage m;
    answered_ = stream_->Read(&m);
    mode_ = m.has_fallback() ? m.fallback().mode() : engram::v1::SHARED;
  }
  bool answered() const { return answered_; }
  engram::v1::Mode mode() const { return mode_; }
  void Outcome(engram::v1::Mode mode) {
    engram::v1::ClientMessage m;
    m.mutable_outcome()->set_mode(mode);
    m.mutable_outcome()->set_backend("cpu");
    stream_->Write(m);
  }
  void Join(const engram::v1::GroupJoin& j) {
    engram::v1::ClientMessage m;
    *m.mutable_group_join() = j;
    stream_->Write(m);
  }
  // The status the daemon ended the session with (after the client is done writing).
  grpc::Status End() {
    stream_->WritesDone();
    engram::v1::ServerMessage m;
    while (stream_->Read(&m)) {
    }
    return stream_->Finish();
  }
  bool ReadUpdate(engram::v1::GroupUpdate* u) {
    engram::v1::ServerMessage m;
    while (stream_->Read(&m)) {
      if (m.has_group_update()) {
        *u = m.group_update();
        return true;
      }
    }
    return false;
  }
  // Sends a GroupLeave and reads until its answer (GroupLeft); updates read on the way are kept in `updates`.
  bool Leave(const engram::v1::GroupLeave& l, engram::v1::GroupLeft* left) {
    engram::v1::ClientMessage m;
    *m.mutable_group_leave() = l;
    if (!stream_->Write(m)) return false;
    engram::v1::ServerMessage r;
    while (stream_->Read(&r)) {
      if (r.has_group_left()) {
        *left = r.group_left();
        return true;
      }
      if (r.has_group_update()) updates.push_back(r.group_update());
    }
    return false;
  }
  std::vector<engram::v1::GroupUpdate> updates;

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>> stream_;
  bool answered_ = false;
  engram::v1::Mode mode_ = engram::v1::MODE_UNSPECIFIED;
};

TEST_F(DpGroupTest, MalformedGroupRequestsAreRefusedWithoutHarm) {
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
  auto ck = Checkpoint::Open(ckpt_);
  ASSERT_TRUE(ck.ok());
  auto hello = [&](int dp_rank, bool across) {
    engram::v1::ClientMessage m;
    auto* h = m.mutable_hello();
    h->set_fingerprint((*ck)->Fingerprint());
    h->set_tp_size(1);
    h->set_dp_size(2);
    h->set_dp_rank(dp_rank);
    h->set_local_dp_size(2);
    h->mutable_config()->set_embedding_across_dp(across);
    h->mutable_config()->set_dp_shared_memory(engram::v1::DISABLED);
    return m;
  };
  auto good = [](int rank) {
    engram::v1::GroupJoin j;
    j.set_transport("host");
    j.set_max_tokens(8);
    if (rank == 0) j.set_rendezvous("/engram-dp-test");
    return j;
  };
  struct Case {
    std::string what;
    bool across;
    bool outcome;
    engram::v1::GroupJoin join;
    grpc::StatusCode code;
    std::string needle;
  };
  std::vector<Case> cases;
  cases.push_back({"no outcome first", true, false, good(0), grpc::StatusCode::FAILED_PRECONDITION, "outcome"});
  {
    auto j = good(0);
    j.set_transport("carrier-pigeon");
    cases.push_back({"unknown transport", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "transport"});
  }
  {
    auto j = good(0);
    j.clear_rendezvous();
    cases.push_back({"rank 0 without rendezvous", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "rendezvous"});
  }
  {
    auto j = good(0);
    j.set_rendezvous(std::string(5000, 'x'));
    cases.push_back({"oversized rendezvous", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "rendezvous"});
  }
  {
    auto j = good(0);
    j.set_max_tokens(0);
    cases.push_back({"slot 0", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"});
  }
  {
    auto j = good(0);
    j.set_max_tokens(-5);
    cases.push_back({"negative slot", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"});
  }
  {
    auto j = good(0);
    j.set_name("../../etc\n\x01");
    cases.push_back({"hostile name", true, true, j, grpc::StatusCode::INVALID_ARGUMENT, "name"});
  }
  // Sessions are separate streams: a second member's join may reach the daemon first unless the test waits until
  // the first member holds its place (a forming group with one member).
  auto first_member_in = [&] {
    return WaitFor(
        [&] {
          json g = Groups();
          if (!g.is_array()) return false;
          for (const auto& x : g) {
            if (x["state"] == "FORMING" && x["members"].size() == 1) return true;
          }
          return false;
        },
        std::chrono::seconds(30));
  };
  for (const auto& c : cases) {
    RawSession s(stub.get(), hello(0, c.across));
    ASSERT_TRUE(s.answered()) << c.what;
    ASSERT_EQ(s.mode(), engram::v1::DP_SHARDED) << c.what;
    if (c.outcome) s.Outcome(engram::v1::DP_SHARDED);
    s.Join(c.join);
    const grpc::Status st = s.End();
    EXPECT_EQ(st.error_code(), c.code) << c.what << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(c.needle), std::string::npos) << c.what << ": " << st.error_message();
  }
  {
    // A replica that is not DP_SHARDED may not join.
    RawSession s(stub.get(), hello(0, false));
    s.Outcome(engram::v1::PRIVATE_PINNED);
    s.Join(good(0));
    EXPECT_EQ(s.End().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {
    // Twice in one session, and a second member claiming a taken edp rank.
    RawSession a(stub.get(), hello(0, true));
    a.Outcome(engram::v1::DP_SHARDED);
    a.Join(good(0));
    ASSERT_TRUE(first_member_in()) << Groups().dump();
    RawSession b(stub.get(), hello(0, true));
    b.Outcome(engram::v1::DP_SHARDED);
    b.Join(good(0));
    // The second learns why on its session, which goes on (its lease stays: status lists both).
    engram::v1::GroupUpdate u;
    ASSERT_TRUE(b.ReadUpdate(&u));
    EXPECT_EQ(u.state(), engram::v1::GroupUpdate::BROKEN);
    EXPECT_NE(u.detail().find("is taken by pid"), std::string::npos) << u.detail();
    EXPECT_EQ(daemon_->Status()["replicas"].size(), 2u) << "the refused member's session and lease stay";
    EXPECT_TRUE(b.End().ok());
    a.Join(good(0));
    const grpc::Status sa = a.End();
    EXPECT_EQ(sa.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << sa.error_message();
  }
  {
    // A host group's region goes with the group: when every member's session has ended, engramd removes the shm
    // object rank 0 named (its creator may have died before it could).
    const std::string region = "/engram-dp-" + std::to_string(::getpid()) + "-test";
    int fd = ::shm_open(region.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << region;
    ::close(fd);
    RawSession a(stub.get(), hello(0, true));
    a.Outcome(engram::v1::DP_SHARDED);
    auto j0 = good(0);
    j0.set_rendezvous(region);
    a.Join(j0);
    ASSERT_TRUE(first_member_in()) << Groups().dump();
    RawSession b(stub.get(), hello(1, true));
    b.Outcome(engram::v1::DP_SHARDED);
    b.Join(good(1));
    engram::v1::GroupUpdate u;
    ASSERT_TRUE(b.ReadUpdate(&u));
    EXPECT_EQ(u.state(), engram::v1::GroupUpdate::FORMED);
    EXPECT_TRUE(a.End().ok());
    EXPECT_TRUE(b.End().ok());
    EXPECT_TRUE(WaitFor(
        [&] {
          int f = ::shm_open(region.c_str(), O_RDONLY, 0);
          if (f >= 0) ::close(f);
          return f < 0 && errno == ENOENT;
        },
        std::chrono::seconds(20)))
        << "the broken group's region " << region << " was left in /dev/shm";
    ::shm_unlink(region.c_str());
  }
  {
    // Members that disagree on the transport.
    RawSession a(stub.get(), hello(0, true));
    a.Outcome(engram::v1::DP_SHARDED);
    a.Join(good(0));
    ASSERT_TRUE(first_member_in()) << Groups().dump();
    RawSession b(stub.get(), hello(1, true));
    b.Outcome(engram::v1::DP_SHARDED);
    auto j = good(1);
    j.set_transport("nccl");
    b.Join(j);
    EXPECT_EQ(b.End().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    // A proper second member forms the group: both get FORMED with rank 0's rendezvous and the slot.
    RawSession c(stub.get(), hello(1, true));
    c.Outcome(engram::v1::DP_SHARDED);
    auto k = good(1);
    k.set_max_tokens(100);
    c.Join(k);
    engram::v1::GroupUpdate ua, uc;
    ASSERT_TRUE(a.ReadUpdate(&ua));
    ASSERT_TRUE(c.ReadUpdate(&uc));
    EXPECT_EQ(ua.state(), engram::v1::GroupUpdate::FORMED);
    EXPECT_EQ(uc.rendezvous(), "/engram-dp-test");
    EXPECT_EQ(uc.slot(), 100);
    EXPECT_EQ(uc.members_size(), 2);
    // c leaves: a is told the group broke, naming dp rank 1.
    (void)c.End();
    engram::v1::GroupUpdate broken;
    ASSERT_TRUE(a.ReadUpdate(&broken));
    EXPECT_EQ(broken.state(), engram::v1::GroupUpdate::BROKEN);
    EXPECT_EQ(broken.left_dp_rank(), 1);
    (void)a.End();
  }
  EXPECT_TRUE(daemon_->proc().Running());
  EXPECT_EQ(testing::HealthCheck(daemon_->socket()), 1);
  // And real replicas still form groups on this daemon afterwards.
  RunTopology(1, 2, {4, 2}, "--dp-shared-memory false");
}

// --- Group lifecycle: leaving, giving up, rejoining, and the host region's name ---------------------------------

// The host-transport regions in /dev/shm that process `pid` created (their names start /engram-dp-<pid>-).
std::vector<std::string> RegionsOf(pid_t pid) {
  std::vector<std::string> found;
  const std::string prefix = "engram-dp-" + std::to_string(pid) + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back(name);
  }
  return found;
}
void RemoveRegions(const std::vector<std::string>& names) {
  for (const auto& n : names) std::filesystem::remove("/dev/shm/" + n);
}

class DpLifecycleTest : public DpGroupTest {
 protected:
  // A scripted member (tests/integration/dp_member_helper.cc) with `env` (VAR=value ...) set.
  Process Member(int dp_size, int dp_rank, int tokens, const std::string& commands, const std::string& log,
                 const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {"/usr/bin/env"};
    argv.insert(argv.end(), env.begin(), env.end());
    for (const std::string& a : {BinPath("dp_member_helper"), daemon_->socket(), ckpt_, std::to_string(dp_size),
                                 std::to_string(dp_rank), std::to_string(tokens)}) {
      argv.push_back(a);
    }
    std::istringstream ss(commands);
    for (std::string w; ss >> w;) argv.push_back(w);
    return Process(argv, dir_ / log);
  }
  // An engram-replica of dp rank `dp_rank` of `dp_size` running DP_SHARDED, with `env` set.
  Process EnvReplica(int dp_size, int dp_rank, const std::string& args, const std::string& log,
                     const std::vector<std::string>& env) {
    std::vector<std::string> argv = {"/usr/bin/env"};
    argv.insert(argv.end(), env.begin(), env.end());
    // A fault point needs the tool built with the test fault hook (tests/support/fault_from_env.cc).
    bool fault = false;
    for (const std::string& e : env) fault = fault || e.rfind("ENGRAM_TEST_FAULT=", 0) == 0;
    for (const std::string& a :
         {BinPath(fault ? "engram-replica-faults" : "engram-replica"), std::string("--socket"), daemon_->socket(),
          std::string("--checkpoint"), ckpt_, std::string("--timeout-ms"), std::string("10000"),
          std::string("--embedding-across-dp"), std::string("--dp-shared-memory"), std::string("false"),
          std::string("--dp-size"), std::to_string(dp_size), std::string("--dp-rank"), std::to_string(dp_rank)}) {
      argv.push_back(a);
    }
    std::istringstream ss(args);
    for (std::string w; ss >> w;) argv.push_back(w);
    return Process(argv, dir_ / log);
  }
  std::string Touch(const std::string& name) {
    const std::string path = dir_ / name;
    testing::WriteFile(path, "go");
    return path;
  }
  // The first group in status whose state is `state` (null when none).
  json GroupIn(const std::string& state) {
    json gs = Groups();
    if (!gs.is_array()) return json();
    for (const auto& g : gs) {
      if (g["state"] == state) return g;
    }
    return json();
  }
};

// A member closes its engine while its session lives on: engramd breaks the group naming it and why (status says
// so while the member's process still runs, so it is the leave and not a lease end), the other member's next step
// fails naming it, and both sessions make new engines that form a new group whose rows match the checkpoint.
TEST_F(DpLifecycleTest, ALeavingMemberBreaksTheGroupAndItsSessionJoinsAgain) {
  const std::string go0 = dir_ / "go0", go1 = dir_ / "go1";
  Process m0 = Member(2, 0, 6, "engine step wait " + go0 + " step close engine step step", "leave0.log");
  Process m1 = Member(2, 1, 3, "engine step close wait " + go1 + " engine step step", "leave1.log");
  ASSERT_TRUE(WaitFor([&] { return m1.Output().find("closed") != std::string::npos; }, std::chrono::seconds(60)))
      << m0.Output() << m1.Output();
  json broken;
  ASSERT_TRUE(WaitFor([&] { return !(broken = GroupIn("BROKEN")).is_null(); }, std::chrono::seconds(30)))
      << Groups().dump();
  EXPECT_TRUE(m1.Running()) << "the member that left still holds its session";
  EXPECT_EQ(broken["left_dp_rank"], 1);
  EXPECT_EQ(broken["left_pid"], m1.pid());
  const std::string detail = broken["detail"].get<std::string>();
  EXPECT_NE(
      detail.find("member dp rank 1 (edp rank 1, pid " + std::to_string(m1.pid()) + ") left: its DP engine was closed"),
      std::string::npos)
      << detail;
  ASSERT_EQ(broken["members"].size(), 2u);
  EXPECT_EQ(broken["members"][1]["left_reason"], "its DP engine was closed") << broken.dump();
  EXPECT_EQ(broken["members"][0]["left"], false) << broken.dump();
  const uint64_t first_generation = broken["generation"].get<uint64_t>();
  // The text status shows who left.
  auto text = testing::RunCmd(BinPath("engramctl") + " status --socket " + daemon_->socket());
  EXPECT_NE(text.out.find("left: its DP engine was closed"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("1:" + std::to_string(m1.pid()) + "(left)"), std::string::npos) << text.out;

  Touch("go0");
  Touch("go1");
  for (Process* p : {&m0, &m1}) EXPECT_EQ(p->Wait(std::chrono::seconds(90)), 0) << p->Output();
  const auto l0 = testing::JsonLines(m0.Output()), l1 = testing::JsonLines(m1.Output());
  ASSERT_EQ(l0.size(), 9u) << m0.Output();
  ASSERT_EQ(l1.size(), 8u) << m1.Output();
  EXPECT_EQ(l0[0]["engine"], "ok");
  EXPECT_EQ(l0[1]["step"], "ok");
  ASSERT_TRUE(l0[3].contains("step_error")) << l0[3].dump();
  EXPECT_NE(l0[3]["step_error"].get<std::string>().find("dp rank 1"), std::string::npos) << l0[3].dump();
  // The new engines: joined again in the same sessions, rows of every token and column against the checkpoint.
  EXPECT_EQ(l0[5]["engine"], "ok") << l0[5].dump();
  EXPECT_EQ(l1[4]["engine"], "ok") << l1[4].dump();
  for (const json& step : {l0[1], l0[6], l0[7], l1[1], l1[5], l1[6]}) {
    EXPECT_EQ(step["step"], "ok") << step.dump();
    EXPECT_EQ(step["mismatches"], 0) << step.dump();
    EXPECT_GT(step["verified"].get<int64_t>(), 0);
  }
  // Status lists both generations of the group.
  std::set<uint64_t> generations;
  for (const auto& g : Groups()) generations.insert(g["generation"].get<uint64_t>());
  EXPECT_TRUE(generations.count(first_generation)) << Groups().dump();
  EXPECT_GE(generations.size(), 2u) << Groups().dump();
  EXPECT_TRUE(daemon_->proc().Running());
}

// A member that gives up after the group formed but before it mapped the host region (fault injection) leaves the
// group: the others stop at once with its reason, well inside the step timeout they would otherwise wait out.
TEST_F(DpLifecycleTest, AMemberThatGivesUpBeforeMappingStopsTheOthersAtOnce) {
  const std::vector<std::string> patient = {"ENGRAM_DP_STEP_TIMEOUT_MS=600000"};
  Process r0 = EnvReplica(3, 0, "--tokens 4 --batches 2 --verify 0", "giveup0.log", patient);
  Process r2 = EnvReplica(3, 2, "--tokens 4 --batches 2 --verify 0", "giveup2.log", patient);
  Process m1 = Member(3, 1, 4, "engine hold", "giveup1.log", {"ENGRAM_TEST_FAULT=dp_give_up_before_mapping"});
  for (Process* p : {&r0, &r2}) {
    // A bound for a hang (the step timeout is 10 minutes), not a timing assertion.
    const int code = p->Wait(std::chrono::seconds(60));
    EXPECT_EQ(code, 1) << p->Output();
    json j = testing::JsonLine(p->Output(), true);
    ASSERT_TRUE(j.contains("error")) << p->Output();
    const std::string error = j["error"].get<std::string>();
    EXPECT_NE(error.find("member dp rank 1"), std::string::npos) << error;
    EXPECT_NE(error.find("pid " + std::to_string(m1.pid())), std::string::npos) << error;
    EXPECT_NE(error.find("gave up setting up the host exchange"), std::string::npos) << error;
  }
  EXPECT_TRUE(m1.Running());
  EXPECT_NE(m1.Output().find("fault injection"), std::string::npos) << m1.Output();
  json g = GroupIn("BROKEN");
  ASSERT_FALSE(g.is_null()) << Groups().dump();
  EXPECT_EQ(g["left_dp_rank"], 1);
  EXPECT_NE(g["detail"].get<std::string>().find("gave up"), std::string::npos) << g.dump();
  const auto left = RegionsOf(r0.pid());
  EXPECT_TRUE(left.empty()) << left.size() << " region(s) left in /dev/shm by rank 0";
  RemoveRegions(left);
}

// A member that gives up waiting for the group to form (its form timeout) leaves: the member that waits with a long
// timeout stops at once with the reason; the session that gave up may join again (it gets another timeout, not
// "joined already").
TEST_F(DpLifecycleTest, AMemberThatGivesUpFormingEndsTheOthersWait) {
  Process r0 = EnvReplica(3, 0, "--tokens 4 --batches 1 --verify 0", "form0.log", {"ENGRAM_DP_FORM_TIMEOUT_MS=600000"});
  ASSERT_TRUE(WaitFor([&] { return !GroupIn("FORMING").is_null(); }, std::chrono::seconds(30))) << r0.Output();
  Process m1 = Member(3, 1, 4, "engine engine hold", "form1.log", {"ENGRAM_DP_FORM_TIMEOUT_MS=1000"});
  const int code = r0.Wait(std::chrono::seconds(60));  // a bound for a hang: its own form timeout is 10 minutes
  EXPECT_EQ(code, 1) << r0.Output();
  json j = testing::JsonLine(r0.Output(), true);
  ASSERT_TRUE(j.contains("error")) << r0.Output();
  const std::string error = j["error"].get<std::string>();
  EXPECT_NE(error.find("member dp rank 1"), std::string::npos) << error;
  EXPECT_NE(error.find("gave up waiting for the group to form"), std::string::npos) << error;
  ASSERT_TRUE(WaitFor([&] { return m1.Output().find("holding") != std::string::npos; }, std::chrono::seconds(60)))
      << m1.Output();
  const auto lines = testing::JsonLines(m1.Output());
  ASSERT_GE(lines.size(), 2u) << m1.Output();
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(lines[i].contains("engine_error")) << lines[i].dump();
    EXPECT_EQ(lines[i]["code"], "DEADLINE_EXCEEDED") << lines[i].dump();
  }
  EXPECT_TRUE(daemon_->proc().Running());
}

// Two deployments of one checkpoint with one DP layout on a node, as one uid: the second, unnamed, is refused with
// a message that names ENGRAM_DP_GROUP; named, it forms a group of its own beside the first, which goes on.
TEST_F(DpLifecycleTest, TwoDeploymentsOfOneCheckpointFormSeparateGroupsByName) {
  auto holding = [](Process& p) {
    return WaitFor([&] { return p.Output().find("\"holding\"") != std::string::npos; }, std::chrono::seconds(60));
  };
  Process a0 = Member(2, 0, 4, "engine hold", "deploy-a0.log");
  Process a1 = Member(2, 1, 4, "engine hold", "deploy-a1.log");
  ASSERT_TRUE(holding(a0)) << a0.Output();
  ASSERT_TRUE(holding(a1)) << a1.Output();
  ASSERT_NE(a0.Output().find("\"engine\":\"ok\""), std::string::npos) << a0.Output();

  Process b0 = Member(2, 0, 4, "engine hold", "deploy-b0.log");
  ASSERT_TRUE(holding(b0)) << b0.Output();
  json refused = testing::JsonLines(b0.Output()).at(0);
  ASSERT_TRUE(refused.contains("engine_error")) << b0.Output();
  EXPECT_NE(refused["engine_error"].get<std::string>().find("ENGRAM_DP_GROUP"), std::string::npos) << refused.dump();
  b0.Signal(SIGKILL);
  (void)b0.Wait();

  Process c0 = Member(2, 0, 4, "engine hold", "deploy-c0.log", {"ENGRAM_DP_GROUP=second"});
  Process c1 = Member(2, 1, 4, "engine hold", "deploy-c1.log", {"ENGRAM_DP_GROUP=second"});
  ASSERT_TRUE(holding(c0)) << c0.Output();
  ASSERT_TRUE(holding(c1)) << c1.Output();
  EXPECT_NE(c0.Output().find("\"engine\":\"ok\""), std::string::npos) << c0.Output();
  int formed = 0, named = 0;
  for (const auto& g : Groups()) {
    if (g["state"] != "FORMED") continue;
    ++formed;
    named += g["group"].get<std::string>().rfind("second/", 0) == 0;
  }
  EXPECT_EQ(formed, 2) << Groups().dump();
  EXPECT_EQ(named, 1) << Groups().dump();
  for (Process* p : {&a0, &a1, &c0, &c1}) p->Signal(SIGKILL);
  for (Process* p : {&a0, &a1, &c0, &c1}) (void)p->Wait();
  EXPECT_TRUE(daemon_->proc().Running());
}

// Rank 0 SIGKILLed while its group forms (it has sent the region's name): nothing of it in /dev/shm.
TEST_F(DpLifecycleTest, Rank0KilledWhileTheGroupFormsLeavesNoRegion) {
  Process r0 = EnvReplica(2, 0, "--tokens 4 --batches 1 --verify 0", "forming0.log", {});
  ASSERT_TRUE(WaitFor(
      [&] {
        json g = GroupIn("FORMING");
        return !g.is_null() && g["members"].size() == 1 && g["members"][0]["pid"] == r0.pid();
      },
      std::chrono::seconds(30)))
      << Groups().dump() << r0.Output();
  r0.Signal(SIGKILL);
  EXPECT_EQ(r0.Wait(), 128 + SIGKILL);
  const auto left = RegionsOf(r0.pid());
  EXPECT_TRUE(left.empty()) << left.size() << " region(s) left in /dev/shm by the killed rank 0";
  RemoveRegions(left);
}

// Rank 0 SIGKILLs itself right after creating the region (fault injection), before anyone mapped it: the member
// left behind stops naming it and removes the name, so nothing is left in /dev/shm.
// A member stopped mid-steps (SIGSTOP) is named by the survivor: its edp rank, pid and the phase it reached, not
// only that "a member" did not reach a step.
TEST_F(DpLifecycleTest, AStalledMemberIsNamedByTheSurvivor) {
  Process r0 =
      EnvReplica(2, 0, "--tokens 4 --batches 100000 --verify 0", "stall0.log", {"ENGRAM_DP_STEP_TIMEOUT_MS=1500"});
  Process r1 =
      EnvReplica(2, 1, "--tokens 4 --batches 100000 --verify 0", "stall1.log", {"ENGRAM_DP_STEP_TIMEOUT_MS=1500"});
  ASSERT_TRUE(
      WaitFor([&] { return r1.Output().find("dp_group_formed") != std::string::npos; }, std::chrono::seconds(60)))
      << r1.Output();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // some steps
  r1.Signal(SIGSTOP);
  EXPECT_EQ(r0.Wait(std::chrono::seconds(60)), 1) << r0.Output();
  const json j = testing::JsonLine(r0.Output(), true);
  ASSERT_TRUE(j.contains("error")) << r0.Output();
  EXPECT_NE(j["error"].get<std::string>().find("edp rank 1 (pid " + std::to_string(r1.pid())), std::string::npos)
      << j.dump();
  // Status names the stopped member as what broke the group, not the survivor that gave up on it.
  json broken;
  ASSERT_TRUE(WaitFor([&] { return !(broken = GroupIn("BROKEN")).is_null(); }, std::chrono::seconds(30)))
      << Groups().dump();
  EXPECT_EQ(broken["left_pid"], r1.pid()) << broken.dump();
  EXPECT_EQ(broken["left_dp_rank"], 1) << broken.dump();
  EXPECT_NE(broken["detail"].get<std::string>().find("stalled"), std::string::npos) << broken.dump();
  for (const json& m : broken["members"]) {
    if (m["pid"] == r1.pid()) {
      EXPECT_EQ(m["stalled"], true) << broken.dump();
    }
    if (m["pid"] == r0.pid()) {
      EXPECT_EQ(m["stalled"], false) << broken.dump();
    }
  }
  r1.Signal(SIGCONT);
  r1.Signal(SIGKILL);
  r1.Wait();
}

TEST_F(DpLifecycleTest, Rank0KilledAfterCreatingTheRegionLeavesNoRegion) {
  Process r0 = EnvReplica(2, 0, "--tokens 4 --batches 1 --verify 0", "created0.log",
                          {"ENGRAM_TEST_FAULT=dp_rank0_dies_after_region"});
  Process r1 = EnvReplica(2, 1, "--tokens 4 --batches 1 --verify 0", "created1.log", {});
  EXPECT_EQ(r0.Wait(std::chrono::seconds(60)), 128 + SIGKILL) << r0.Output();
  EXPECT_EQ(r1.Wait(std::chrono::seconds(60)), 1) << r1.Output();
  json j = testing::JsonLine(r1.Output(), true);
  ASSERT_TRUE(j.contains("error")) << r1.Output();
  EXPECT_NE(j["error"].get<std::string>().find("member dp rank 0"), std::string::npos) << j.dump();
  const auto left = RegionsOf(r0.pid());
  EXPECT_TRUE(left.empty()) << left.size() << " region(s) left in /dev/shm after rank 0 died";
  RemoveRegions(left);
}

// GroupLeave requests that are not this session's to make are refused with a clear status and change nothing: the
// session goes on, its group and everyone else's stay as they were. A proper leave then breaks the group naming the
// member and its reason, and the session joins again.
TEST_F(DpLifecycleTest, LeaveRequestsAreCheckedAndRefusedWithoutHarm) {
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
  auto ck = Checkpoint::Open(ckpt_);
  ASSERT_TRUE(ck.ok());
  auto hello = [&](int dp_rank) {
    engram::v1::ClientMessage m;
    auto* h = m.mutable_hello();
    h->set_fingerprint((*ck)->Fingerprint());
    h->set_tp_size(1);
    h->set_dp_size(2);
    h->set_dp_rank(dp_rank);
    h->set_local_dp_size(2);
    h->mutable_config()->set_embedding_across_dp(true);
    h->mutable_config()->set_dp_shared_memory(engram::v1::DISABLED);
    return m;
  };
  auto join = [](int rank, const std::string& name, uint64_t id) {
    engram::v1::GroupJoin j;
    j.set_name(name);
    j.set_transport("host");
    j.set_max_tokens(8);
    j.set_join_id(id);
    if (rank == 0) j.set_rendezvous("/engram-dp-test");
    return j;
  };
  auto leave = [](const std::string& group, uint64_t generation, const std::string& reason) {
    engram::v1::GroupLeave l;
    l.set_group(group);
    l.set_generation(generation);
    l.set_reason(reason);
    return l;
  };
  auto session = [&](int rank) {
    auto s = std::make_unique<RawSession>(stub.get(), hello(rank));
    s->Outcome(engram::v1::DP_SHARDED);
    return s;
  };
  // Not in any group.
  auto loner = session(0);
  engram::v1::GroupLeft left;
  ASSERT_TRUE(loner->Leave(leave("", 0, "why not"), &left));
  EXPECT_EQ(left.code(), grpc::StatusCode::FAILED_PRECONDITION) << left.error();
  EXPECT_NE(left.error().find("not a member"), std::string::npos) << left.error();
  // Group "alpha" formed by a and b; c forming in group "beta".
  auto a = session(0), b = session(1), c = session(0);
  a->Join(join(0, "alpha", 11));
  b->Join(join(1, "alpha", 12));
  c->Join(join(0, "beta", 13));
  engram::v1::GroupUpdate formed;
  ASSERT_TRUE(a->ReadUpdate(&formed));
  ASSERT_EQ(formed.state(), engram::v1::GroupUpdate::FORMED);
  EXPECT_EQ(formed.join_id(), 11u);
  engram::v1::GroupUpdate formed_b;
  ASSERT_TRUE(b->ReadUpdate(&formed_b));
  EXPECT_EQ(formed_b.join_id(), 12u);
  ASSERT_TRUE(WaitFor([&] { return Groups().size() == 2; }, std::chrono::seconds(10))) << Groups().dump();
  const json before = Groups();
  struct Case {
    std::string what;
    RawSession* s;
    engram::v1::GroupLeave l;
    grpc::StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"another session's group", c.get(), leave(formed.group(), formed.generation(), "hostile"),
       grpc::StatusCode::PERMISSION_DENIED, "not a member of group"},
      {"no such group", c.get(), leave("no-such-group", 0, "x"), grpc::StatusCode::NOT_FOUND, "no group"},
      {"another generation", a.get(), leave(formed.group(), formed.generation() + 100, "x"),
       grpc::StatusCode::FAILED_PRECONDITION, "generation"},
      {"oversized reason", a.get(), leave("", 0, std::string(600, 'r')), grpc::StatusCode::INVALID_ARGUMENT, "reason"},
      {"oversized group", b.get(), leave(std::string(5000, 'g'), 0, "x"), grpc::StatusCode::INVALID_ARGUMENT, "group"},
  };
  for (const auto& k : cases) {
    ASSERT_TRUE(k.s->Leave(k.l, &left)) << k.what << ": the session ended";
    EXPECT_EQ(left.code(), k.code) << k.what << ": " << left.error();
    EXPECT_NE(left.error().find(k.needle), std::string::npos) << k.what << ": " << left.error();
  }
  // Nothing changed: the same groups, states and members; nobody was told anything.
  const json after = Groups();
  ASSERT_EQ(after.size(), before.size()) << after.dump();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i]["state"], before[i]["state"]) << after.dump();
    EXPECT_EQ(after[i]["members"], before[i]["members"]) << after.dump();
  }
  EXPECT_TRUE(a->updates.empty());
  EXPECT_TRUE(c->updates.empty());

  // b leaves properly (its reason has a newline: shown as '?'): a is told, naming it and why.
  ASSERT_TRUE(b->Leave(leave(formed.group(), formed.generation(), "draining\nfor maintenance"), &left));
  EXPECT_EQ(left.code(), 0) << left.error();
  EXPECT_EQ(left.group(), formed.group());
  engram::v1::GroupUpdate broken;
  ASSERT_TRUE(a->ReadUpdate(&broken));
  EXPECT_EQ(broken.state(), engram::v1::GroupUpdate::BROKEN);
  EXPECT_EQ(broken.left_dp_rank(), 1);
  EXPECT_EQ(broken.join_id(), 11u);
  EXPECT_NE(broken.detail().find("left: draining?for maintenance"), std::string::npos) << broken.detail();
  // Leaving twice: refused, harmless.
  ASSERT_TRUE(b->Leave(leave("", 0, "again"), &left));
  EXPECT_EQ(left.code(), grpc::StatusCode::FAILED_PRECONDITION);
  // c gives up forming: its group breaks (nobody else in it) and is listed with the reason.
  ASSERT_TRUE(c->Leave(leave("", 0, "no partner came"), &left));
  EXPECT_EQ(left.code(), 0) << left.error();
  bool listed = false;
  for (const auto& g : Groups()) {
    listed |= g["group"].get<std::string>().rfind("beta/", 0) == 0 && g["state"] == "BROKEN" &&
              g["detail"].get<std::string>().find("left before the group formed: no partner came") != std::string::npos;
  }
  EXPECT_TRUE(listed) << Groups().dump();
  // a and b join again in the same sessions and form a new generation of "alpha".
  ASSERT_TRUE(a->Leave(leave(formed.group(), formed.generation(), "partner left"), &left));
  EXPECT_EQ(left.code(), 0) << left.error();
  b->Join(join(1, "alpha", 22));
  a->Join(join(0, "alpha", 21));
  engram::v1::GroupUpdate again_a, again_b;
  ASSERT_TRUE(a->ReadUpdate(&again_a));
  ASSERT_TRUE(b->ReadUpdate(&again_b));
  EXPECT_EQ(again_a.state(), engram::v1::GroupUpdate::FORMED);
  EXPECT_EQ(again_a.join_id(), 21u);
  EXPECT_EQ(again_b.join_id(), 22u);
  EXPECT_EQ(again_a.group(), formed.group());
  EXPECT_GT(again_a.generation(), formed.generation());
  (void)a->End();
  (void)b->End();
  (void)c->End();
  (void)loner->End();
  EXPECT_TRUE(daemon_->proc().Running());
  EXPECT_EQ(testing::HealthCheck(daemon_->socket()), 1);
}

}  // namespace
}  // namespace engram
