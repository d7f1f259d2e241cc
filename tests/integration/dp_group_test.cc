// The DP-sharded topology (embedding_across_dp, issue 12) on the CPU path, with real processes: a real engramd
// brokers the groups, real engram-replica processes form them over their sessions and exchange rows through the
// host transport every step. Rows are checked by each replica against the checkpoint through the independent row
// oracle (tools/row_oracle.h): every row of every token, for DP 2, DP 4 and TP 2 x DP 2, with uneven token counts
// and a rank with zero tokens. A member SIGKILLed in the middle of its steps: the others fail with an error naming
// it (no hang) and status shows the group BROKEN and who left. Malformed group requests are refused without
// harming the daemon. Precedence: where dp_shared_memory can share, SHARED wins over embedding_across_dp.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>

#include <set>
#include <sstream>
#include <string>
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
    shm_ = dir_ / "shm";
    ::mkdir(shm_.c_str(), 0755);
    ckpt_ = testing::MakeCheckpoint(dir_, 6);
    daemon_ = std::make_unique<Daemon>(dir_, std::vector<std::string>{"--checkpoint", ckpt_, "--shm-dir", shm_});
    ASSERT_TRUE(daemon_->WaitReady()) << daemon_->Log();
  }
  Process Replica(const std::string& args, const std::string& log) {
    std::vector<std::string> argv = {BinPath("engram-replica"), "--socket", daemon_->socket(), "--checkpoint", ckpt_,
                                     "--timeout-ms", "10000"};
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

TEST_F(DpGroupTest, Dp4WithARankOfZeroTokens) {
  RunTopology(1, 4, {0, 3, 64, 17}, "--dp-shared-memory false");
}

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
    ps.push_back(Replica("--embedding-across-dp --dp-shared-memory false --dp-size 3 --dp-rank " +
                             std::to_string(d) + " --tokens 16 --batches 1000000000 --verify 0",
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
  ASSERT_TRUE(WaitFor([&] { return ps[1].Output().find("dp_group_formed") != std::string::npos; },
                      std::chrono::seconds(30)));
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
  EXPECT_EQ(g[0]["left"]["dp_rank"], 1);
  EXPECT_EQ(g[0]["left"]["pid"], victim);
  EXPECT_NE(g[0]["detail"].get<std::string>().find("dp rank 1"), std::string::npos);
  // The text status says it too.
  auto text = testing::RunCmd(BinPath("engramctl") + " status --socket " + daemon_->socket());
  EXPECT_NE(text.out.find("BROKEN"), std::string::npos) << text.out;
  EXPECT_TRUE(daemon_->proc().Running());
}

TEST(DpPlanTest, EngramctlPlanShowsEachRanksShardAndStepBytes) {
  // V4.1-Flash, TP 2 x DP 4: 8 shards of 3 columns, 1/8 of the table each; per-step bytes from client/dp_sharded.h's
  // formula, checked here against the arithmetic of SPEC 5 (ids: T*L*C*4 each way; records: 264 bytes per row).
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

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>> stream_;
  bool answered_ = false;
  engram::v1::Mode mode_ = engram::v1::MODE_UNSPECIFIED;
};

TEST_F(DpGroupTest, MalformedGroupRequestsAreRefusedWithoutHarm) {
  auto stub = engram::v1::Engram::NewStub(
      grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
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
    RawSession b(stub.get(), hello(0, true));
    b.Outcome(engram::v1::DP_SHARDED);
    b.Join(good(0));
    const grpc::Status sb = b.End();
    EXPECT_EQ(sb.error_code(), grpc::StatusCode::ALREADY_EXISTS) << sb.error_message();
    a.Join(good(0));
    const grpc::Status sa = a.End();
    EXPECT_EQ(sa.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << sa.error_message();
  }
  {
    // Members that disagree on the transport.
    RawSession a(stub.get(), hello(0, true));
    a.Outcome(engram::v1::DP_SHARDED);
    a.Join(good(0));
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

}  // namespace
}  // namespace engram
