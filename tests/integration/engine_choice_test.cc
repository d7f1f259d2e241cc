// What a replica's lookup engine chose, as engramd shows it: a real replica process (engram-replica) makes its engine
// and status lists the engine's choice for it (JSON and the engramctl text); through raw sessions, a choice sent
// before the outcome or longer than the bound ends that session with a clear error, another replica's session goes
// on, and control characters are replaced.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <string>

#include "engram/v1/engram.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_harness.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using json = nlohmann::json;
using testing::BinPath;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using Stream = grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>;

TEST(EngineChoice, AReplicasEngineChoiceIsInStatus) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  const std::string shm = MakeShm(dir);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  Process replica({BinPath("engram-replica"), "--socket", d.socket(), "--checkpoint", ckpt, "--dp-size", "2",
                   "--tokens", "16", "--batches", "1", "--hold", "600"},
                  dir / "replica.log");
  std::string engine;
  ASSERT_TRUE(WaitFor(
      [&] {
        const json s = d.Status();
        if (s.is_null() || s["replicas"].size() != 1) return false;
        engine = s["replicas"][0]["engine"];
        return !engine.empty();
      },
      std::chrono::seconds(60)))
      << d.Status().dump() << replica.Output();
  // This machine's engine: the CPU one without a GPU, the calibrated CUDA one with.
  EXPECT_TRUE(engine.rfind("backend=cpu", 0) == 0 || (engine.rfind("backend=cuda lookup_path=", 0) == 0 &&
                                                      engine.find("host_gather_threads=") != std::string::npos))
      << engine;
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  EXPECT_NE(text.out.find("engine: " + engine), std::string::npos) << text.out;
  replica.Signal(SIGTERM);
  replica.Wait();
}

TEST(EngineChoice, AMalformedChoiceEndsOnlyItsOwnSession) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  const std::string shm = MakeShm(dir);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  engram::v1::ClientMessage outcome;
  outcome.mutable_outcome()->set_mode(engram::v1::PRIVATE_PINNED);
  outcome.mutable_outcome()->set_backend("cpu");
  auto open = [&](grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto s = stub->Session(ctx);
    engram::v1::ServerMessage m;
    EXPECT_TRUE(s->Write(testing::SharingHello(ckpt, shm, 2)) && s->Read(&m) && m.has_grant());
    EXPECT_TRUE(m.grant().takes_engine_choice()) << "the grant says this daemon takes EngineChoice";
    return s;
  };
  auto choice = [](const std::string& text) {
    engram::v1::ClientMessage m;
    m.mutable_engine_choice()->set_text(text);
    return m;
  };
  auto ended_with = [](Stream* s, grpc::StatusCode code, const std::string& needle) {
    engram::v1::ServerMessage m;
    while (s->Read(&m)) {
    }
    const grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), code) << st.error_message();
    EXPECT_NE(st.error_message().find(needle), std::string::npos) << st.error_message();
  };
  // A good one: printable in status.
  grpc::ClientContext good_ctx;
  auto good = open(&good_ctx);
  ASSERT_TRUE(good->Write(outcome) && good->Write(choice("backend=cpu \x1b[2Jnote")));
  ASSERT_TRUE(WaitFor(
      [&] {
        const json s = d.Status();
        return !s.is_null() && s["replicas"].size() == 1 && s["replicas"][0]["engine"] == "backend=cpu ?[2Jnote";
      },
      std::chrono::seconds(30)))
      << d.Status().dump();
  // Before the outcome.
  {
    grpc::ClientContext ctx;
    auto s = open(&ctx);
    ASSERT_TRUE(s->Write(choice("backend=cpu")));
    ended_with(s.get(), grpc::StatusCode::FAILED_PRECONDITION, "engine choice sent before the outcome");
  }
  // Past the bound.
  {
    grpc::ClientContext ctx;
    auto s = open(&ctx);
    ASSERT_TRUE(s->Write(outcome) && s->Write(choice(std::string(2049, 'x'))));
    ended_with(s.get(), grpc::StatusCode::INVALID_ARGUMENT, "engine_choice.text");
  }
  // The good session and its choice are still there; a later choice replaces it.
  ASSERT_TRUE(good->Write(choice("backend=cpu second")));
  ASSERT_TRUE(WaitFor(
      [&] {
        const json s = d.Status();
        return !s.is_null() && s["replicas"].size() == 1 && s["replicas"][0]["engine"] == "backend=cpu second";
      },
      std::chrono::seconds(30)))
      << d.Status().dump();
  good->WritesDone();
  good_ctx.TryCancel();
}

}  // namespace
}  // namespace engram
