// engramd hardening, as real processes: client strings are bounded. Long strings in a hello cannot break status, and a
// hello's client version is bounded printable text that status shows per replica (with the daemon's own).
//
// See tests/integration/daemon_hardening.h for what the hardening tests share.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engram/v1/engram.grpc.pb.h"
#include "engram/version.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"
#include "shm/segment.h"
#include "tests/integration/daemon_hardening.h"
#include "tests/integration/daemon_harness.h"
#include "tests/integration/json_lines.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using nlohmann::json;
using testing::BinPath;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

// --- client strings are bounded ----------------------------------------------------------------------------------

TEST(DaemonHardeningTest, LongClientStringsCannotBreakStatus) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  auto hello_with = [&](size_t checkpoint_bytes) {
    engram::v1::ClientMessage m;
    auto* h = m.mutable_hello();
    h->set_fingerprint(0x1234);  // not served: FINGERPRINT_MISMATCH, whose hint quotes the checkpoint
    h->set_checkpoint(std::string(checkpoint_bytes, 'c'));
    h->set_tp_size(1);
    h->set_dp_size(2);
    return m;
  };
  // Five sessions with a 1 MB checkpoint string: refused.
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    s->Write(hello_with(1000000));
    s->WritesDone();
    engram::v1::ServerMessage m;
    EXPECT_FALSE(s->Read(&m) && m.has_fallback()) << "a 1 MB hello was accepted";
    const grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("hello.checkpoint"), std::string::npos) << st.error_message();
  }
  // Five held sessions with the longest accepted checkpoint: their hints quote at most ~200 bytes of it.
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>>> held;
  for (int i = 0; i < 5; ++i) {
    ctx.push_back(std::make_unique<grpc::ClientContext>());
    held.push_back(stub->Session(ctx.back().get()));
    ASSERT_TRUE(held.back()->Write(hello_with(4096)));
    engram::v1::ServerMessage m;
    ASSERT_TRUE(held.back()->Read(&m));
    ASSERT_TRUE(m.has_fallback());
    for (const auto& r : m.fallback().reasons()) EXPECT_LT(r.hint().size(), 600u) << r.hint().size();
  }
  // A registration error and a Load path beyond the bound are refused too.
  {
    grpc::ClientContext lctx;
    engram::v1::LoadRequest req;
    req.set_checkpoint(std::string(5000, 'p'));
    engram::v1::LoadReply reply;
    EXPECT_EQ(stub->Load(&lctx, req, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const json s = d.Status();
  ASSERT_FALSE(s.is_null()) << "status fails";
  ASSERT_EQ(s["replicas"].size(), 5u);
  for (const auto& r : s["replicas"]) {
    for (const auto& h : r["hints"]) EXPECT_LT(h["hint"].get<std::string>().size(), 600u) << h.dump().size();
  }
  for (auto& c : ctx) c->TryCancel();
  for (auto& h : held) h->Finish();
  EXPECT_TRUE(d.proc().Running());
}

// --- versions: the daemon's own and each replica's, as its hello said it ------------------------------------------

TEST(DaemonHardeningTest, ClientVersionsAreBoundedAndStatusShowsEachReplicas) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  EXPECT_NE(d.Log().find(std::string("event=listening version=") + ENGRAM_VERSION_STRING + " "), std::string::npos)
      << d.Log();
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  auto hello_with = [&](const std::string* version) {
    engram::v1::ClientMessage m = testing::SharingHello(ckpt, shm, 2);
    if (version != nullptr) m.mutable_hello()->set_client_version(*version);
    return m;
  };
  // Refused: longer than 64 bytes, or a byte that is not printable ASCII (status prints the version as it is).
  for (const std::string& bad :
       {std::string(65, '1'), std::string("0.2.0\n"), std::string("0.2\x1b[2J"), std::string("0.2.0\xc3\xa9")}) {
    grpc::ClientContext ctx;
    auto s = stub->Session(&ctx);
    s->Write(hello_with(&bad));
    s->WritesDone();
    engram::v1::ServerMessage m;
    EXPECT_FALSE(s->Read(&m) && m.has_grant()) << "client_version of " << bad.size() << " bytes was accepted";
    const grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("hello.client_version"), std::string::npos) << st.error_message();
  }
  // Held: a version of 64 bytes, none (a client that predates the field), and a real client (engramctl attach).
  const std::string longest = "9.8.7-rc1+" + std::string(54, 'g');
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<engram::v1::ClientMessage, engram::v1::ServerMessage>>> held;
  for (const std::string* v : {&longest, static_cast<const std::string*>(nullptr)}) {
    ctx.push_back(std::make_unique<grpc::ClientContext>());
    held.push_back(stub->Session(ctx.back().get()));
    ASSERT_TRUE(held.back()->Write(hello_with(v)));
    engram::v1::ServerMessage m;
    ASSERT_TRUE(held.back()->Read(&m));
    ASSERT_TRUE(m.has_grant());
  }
  Process holder({BinPath("engramctl"), "attach", "--socket", d.socket(), "--checkpoint", ckpt, "--shm-dir", shm,
                  "--dp-size", "2", "--hold", "600"},
                 dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(holder.Output(), false).is_null(); }, 30s)) << holder.Output();
  const json s = d.Status();
  ASSERT_FALSE(s.is_null());
  EXPECT_EQ(s["daemon_version"], ENGRAM_VERSION_STRING);
  std::multiset<std::string> versions;
  for (const auto& r : s["replicas"]) {
    versions.insert(r["client_version"].get<std::string>());
    if (r["pid"] == holder.pid()) {
      EXPECT_EQ(r["client_version"], ENGRAM_VERSION_STRING) << r.dump();
    }
  }
  EXPECT_EQ(versions, (std::multiset<std::string>{longest, "", ENGRAM_VERSION_STRING})) << s.dump();
  // The text view: the daemon's version in its first line, each replica's in its column ("-": none sent).
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  ASSERT_EQ(text.exit_code, 0) << text.err;
  std::istringstream lines(text.out);
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line, std::string("engramd ") + ENGRAM_VERSION_STRING + " on " + d.socket());
  std::multiset<std::string> shown;
  bool in_replicas = false;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::vector<std::string> w{std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
    if (!w.empty() && w[0] == "pid") {
      ASSERT_GE(w.size(), 9u);
      EXPECT_EQ(w[8], "client") << line;
      in_replicas = true;
    } else if (in_replicas && (w.empty() || line[0] == ' ')) {
      if (w.empty()) in_replicas = false;  // hint lines (indented) belong to the row above
    } else if (in_replicas && w.size() >= 9) {
      shown.insert(w[8]);
    }
  }
  EXPECT_EQ(shown, (std::multiset<std::string>{longest, "-", ENGRAM_VERSION_STRING})) << text.out;
  for (auto& c : ctx) c->TryCancel();
  for (auto& h : held) h->Finish();
  holder.Signal(SIGKILL);
  holder.Wait();
}

}  // namespace
}  // namespace engram
