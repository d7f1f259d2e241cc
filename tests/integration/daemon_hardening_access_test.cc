// engramd hardening, as real processes: who may use the daemon, and how much. Refused uids get nothing from any service
// (health included), --group members map the segments (through the descriptor the daemon passes), idle reflection
// streams cannot starve the daemon, and connections are bounded per uid (a reload applies a new bound).
//
// See tests/integration/daemon_hardening.h for what the hardening tests share.
//
// The binary has its own main(): `daemon_hardening_access_test --health-probe SOCKET` prints the health status code (or
// the gRPC error code) and exits, so a test can run the probe as another uid through setpriv;
// `daemon_hardening_access_test --idle-streams SOCKET METHOD N` opens N bidirectional streams of METHOD, sends one
// request on each (a reflection list_services), prints {"answered": A, "failed": F} once each stream was answered or
// ended, and holds the answered ones open, idle, until killed; `daemon_hardening_access_test --hold-connections SOCKET
// N` connects N times to SOCKET (a gRPC channel each, no call), prints {"connected": C, "refused": R} (R: not connected
// after 3 s) and holds the open ones until killed.
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
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
using testing::AttachOnce;
using testing::BinPath;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::NoOtherUids;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

std::string g_self;  // this binary, for the --health-probe and --idle-streams modes

// --idle-streams: see the file comment. Ten channels, each its own connection, share the streams.
int IdleStreams(const std::string& socket, const std::string& method, int n) {
  constexpr int kChannels = 10;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int c = 0; c < kChannels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("engram.test.channel", c);  // distinct arguments: a connection of its own
    stubs.push_back(std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args)));
  }
  grpc::CompletionQueue cq;
  const char req_bytes[] = {0x3a, 0x00};  // ServerReflectionRequest{list_services: ""}
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call;
    grpc::ByteBuffer request, response;
    int step = 0;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < n; ++i) {
    auto s = std::make_unique<Stream>();
    grpc::Slice slice(req_bytes, sizeof(req_bytes));
    s->request = grpc::ByteBuffer(&slice, 1);
    s->call = stubs[static_cast<size_t>(i % kChannels)]->PrepareCall(&s->ctx, method, &cq);
    s->call->StartCall(s.get());
    streams.push_back(std::move(s));
  }
  int answered = 0, failed = 0;
  const auto end = std::chrono::system_clock::now() + 60s;
  while (answered + failed < n) {
    void* tag = nullptr;
    bool ok = false;
    if (cq.AsyncNext(&tag, &ok, end) != grpc::CompletionQueue::GOT_EVENT) break;
    auto* s = static_cast<Stream*>(tag);
    if (!ok) {
      ++failed;
      continue;
    }
    if (s->step == 0) {
      s->step = 1;
      s->call->Write(s->request, s);
    } else if (s->step == 1) {
      s->step = 2;
      s->call->Read(&s->response, s);
    } else {
      ++answered;
    }
  }
  std::cout << "{\"answered\": " << answered << ", \"failed\": " << failed << "}" << std::endl;
  while (true) std::this_thread::sleep_for(1h);
}

// --hold-connections: see the file comment.
int HoldConnections(const std::string& socket, int n) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("engram.test.channel", i);  // distinct arguments: a connection of its own
    channels.push_back(grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args));
    (void)channels.back()->GetState(/*try_to_connect=*/true);
  }
  const auto deadline = std::chrono::system_clock::now() + 5s;  // one deadline for all: a refused one waits no longer
  int connected = 0;
  for (auto& c : channels) connected += c->WaitForConnected(deadline) ? 1 : 0;
  std::cout << "{\"connected\": " << connected << ", \"refused\": " << n - connected << "}" << std::endl;
  // Polling a completion queue drives the channels' transports (the daemon's keepalive pings are answered), so the
  // connections stay open as an engine's would.
  grpc::CompletionQueue cq;
  while (true) {
    void* tag = nullptr;
    bool ok = false;
    (void)cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + 1s);
  }
}

// --- --group members can map the segments (through the descriptor the daemon passes) -----------------------------

TEST(DaemonHardeningTest, GroupMemberMapsTheSegments) {
  if (const std::string no = NoOtherUids("setpriv changes uid", true); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const json s = d.Status();
  ASSERT_EQ(s["segments"].size(), 1u);
  struct stat st {};
  ASSERT_EQ(::stat((shm + "/" + s["segments"][0]["name"].get<std::string>()).c_str(), &st), 0);
  // The file is the daemon's alone: members never open it by path, the daemon passes them a read-only descriptor.
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A member by supplementary group only, as the daemon's check allows.
  const json a = AttachOnce(d, ckpt, shm, "", "setpriv --reuid=65533 --regid=65533 --groups=65534 ");
  EXPECT_EQ(a["decision"], "shared") << a.dump();
  EXPECT_EQ(a["attach"], "descriptor") << a.dump();
  EXPECT_EQ(a["mismatches"], 0) << a.dump();
  // Without the descriptor the same member cannot read the file.
  const json p = AttachOnce(d, ckpt, shm, "--no-descriptor", "setpriv --reuid=65533 --regid=65533 --groups=65534 ");
  EXPECT_EQ(p["attach"], "path") << p.dump();
  EXPECT_NE(p.value("error", "").find("Permission denied"), std::string::npos) << p.dump();
  EXPECT_NE(p["mismatches"], 0) << p.dump();
}

// --- refused uids get nothing from any service -----------------------------------------------------------------------

TEST(DaemonHardeningTest, RefusedUidsGetNothingFromAnyService) {
  if (const std::string no = NoOtherUids("setpriv switches to another uid", false); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ::chmod(d.socket().c_str(), 0666);  // the socket is reachable: the daemon's own check is what is tested
  EXPECT_EQ(testing::HealthCheck(d.socket()), 1) << "the daemon's own uid gets the health status";
  const std::string probe = g_self + " --health-probe " + d.socket();
  auto member = RunCmd("setpriv --reuid=65533 --regid=65533 --groups=65534 " + probe);
  EXPECT_EQ(member.exit_code, 1) << member.err;
  auto stranger = RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups " + probe);
  EXPECT_EQ(stranger.exit_code, 100 + grpc::StatusCode::PERMISSION_DENIED) << stranger.err;
  EXPECT_NE(stranger.err.find("uid 65533 may not use engramd"), std::string::npos) << stranger.err;
  auto status = RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups " + BinPath("engramctl") +
                       " status --json --socket " + d.socket());
  EXPECT_NE(status.exit_code, 0);
  EXPECT_NE(status.err.find("uid 65533 may not use engramd"), std::string::npos) << status.err;
  EXPECT_TRUE(d.proc().Running());
  EXPECT_FALSE(d.Status().is_null());
}

// --- streams other than sessions are bounded ----------------------------------------------------------------------

// Idle reflection streams (each would hold one of the server's threads) cannot starve status or another uid's
// attach: reflection is off unless asked for; with --reflection on an engine's streams are refused (operators only)
// and an operator's are bounded per uid (max_streams_per_uid).
TEST(DaemonHardeningTest, IdleReflectionStreamsDoNotStarveTheDaemon) {
  if (const std::string no = NoOtherUids("the streams and the attach come from other uids", true); !no.empty())
    GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string kMethod = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
  const std::string engine = "setpriv --reuid=65533 --regid=65533 --groups=65534 ";
  // --max-sessions 8: the server has 72 threads; 200 idle streams would take them all.
  for (const std::string reflection : {"off", "on"}) {
    SCOPED_TRACE("reflection " + reflection);
    Daemon d(dir,
             {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup", "--max-sessions", "8", "--reflection",
              reflection},
             "refl-" + reflection);
    ASSERT_TRUE(d.WaitReady()) << d.Log();
    ::chmod(d.socket().c_str(), 0666);
    std::vector<std::unique_ptr<Process>> holders;
    for (const std::string& who : {std::string("engine"), std::string("root")}) {
      const std::vector<std::string> prefix =
          who == "root"
              ? std::vector<std::string>{}
              : std::vector<std::string>{"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--groups=65534"};
      std::vector<std::string> argv = prefix;
      for (const std::string& a : {g_self, std::string("--idle-streams"), d.socket(), kMethod, std::string("200")}) {
        argv.push_back(a);
      }
      holders.push_back(std::make_unique<Process>(argv, dir / ("streams-" + reflection + "-" + who + ".log")));
      Process& h = *holders.back();
      ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(h.Output(), false).is_null(); }, 90s)) << h.Output();
      const json got = testing::JsonLine(h.Output(), false);
      EXPECT_EQ(got["answered"].get<int>() + got["failed"].get<int>(), 200) << got.dump();
      const int expected = reflection == "on" && who == "root" ? 16 : 0;
      EXPECT_EQ(got["answered"], expected) << who << ": " << got.dump();
    }
    EXPECT_FALSE(d.Status().is_null()) << "status fails while the streams are held";
    const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
    EXPECT_EQ(text.exit_code, 0) << text.out << text.err;
    const json a = AttachOnce(d, ckpt, shm, "", engine);
    EXPECT_EQ(a["decision"], "shared") << a.dump();
    if (reflection == "on") {
      EXPECT_NE(d.Log().find("call=reflection reason=NOT_OPERATOR"), std::string::npos) << d.Log();
      EXPECT_NE(d.Log().find("reason=TOO_MANY_STREAMS"), std::string::npos) << d.Log();
    }
    for (auto& h : holders) h->Signal(SIGKILL);
    EXPECT_TRUE(d.proc().Running());
  }
}

// --- connections are bounded per uid ------------------------------------------------------------------------------

// One uid holding many idle connections (each a descriptor of the daemon, none a session) is cut at
// max_connections_per_uid: the rest are closed at accept and logged; root's status and another uid's attach keep
// working, and once the holder is gone the same uid connects again.
TEST(DaemonHardeningTest, ConnectionsAreBoundedPerUid) {
  if (const std::string no = NoOtherUids("the connections and the attach come from other uids", true); !no.empty())
    GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup", "--max-connections-per-uid", "64"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  Process holder({"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--groups=65534", g_self, "--hold-connections",
                  d.socket(), "300"},
                 dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(holder.Output(), false).is_null(); }, 60s)) << holder.Output();
  const json held = testing::JsonLine(holder.Output(), false);
  EXPECT_EQ(held["connected"], 64) << held.dump();
  EXPECT_EQ(held["refused"], 300 - 64) << held.dump();
  EXPECT_TRUE(d.WaitLog("reason=TOO_MANY_CONNECTIONS")) << d.Log();
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  EXPECT_EQ(text.exit_code, 0) << text.out << text.err;
  const json other = AttachOnce(d, ckpt, shm, "", "setpriv --reuid=65532 --regid=65532 --groups=65534 ");
  EXPECT_EQ(other["decision"], "shared") << other.dump();
  const json refused = AttachOnce(d, ckpt, shm, "", "setpriv --reuid=65533 --regid=65533 --groups=65534 ");
  EXPECT_TRUE(refused.is_null() || refused.value("decision", "") != "shared")
      << "the holder's uid is at its bound: " << refused.dump();
  holder.Signal(SIGKILL);
  (void)holder.Wait(10s);
  json again;
  ASSERT_TRUE(WaitFor(
      [&] {
        again = AttachOnce(d, ckpt, shm, "", "setpriv --reuid=65533 --regid=65533 --groups=65534 ");
        return again["decision"] == "shared";
      },
      30s))
      << again.dump() << d.Log();
  EXPECT_TRUE(d.proc().Running());
}

// SIGHUP applies a new connection bound (and says so): the next connections of a uid are held to it.
TEST(DaemonHardeningTest, AReloadAppliesTheConnectionBound) {
  if (const std::string no = NoOtherUids("the connections come from another uid", true); !no.empty()) {
    GTEST_SKIP() << no;
  }
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string conf = dir / "engramd.conf";
  const std::string base = "checkpoint = " + ckpt + "\nshm_dir = " + shm + "\ngroup = nogroup\n";
  testing::WriteFile(conf, base + "max_connections_per_uid = 64\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  testing::WriteFile(conf, base + "max_connections_per_uid = 3\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("event=reload key=max_connections_per_uid applied")) << d.Log();
  Process holder({"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--groups=65534", g_self, "--hold-connections",
                  d.socket(), "10"},
                 dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(holder.Output(), false).is_null(); }, 60s)) << holder.Output();
  EXPECT_EQ(testing::JsonLine(holder.Output(), false)["connected"], 3) << holder.Output();
  holder.Signal(SIGKILL);
  EXPECT_TRUE(d.proc().Running());
}

}  // namespace
}  // namespace engram

int main(int argc, char** argv) {
  engram::g_self = std::filesystem::canonical("/proc/self/exe").string();
  if (argc == 3 && std::string(argv[1]) == "--health-probe") return engram::testing::HealthCheck(argv[2]);
  if (argc == 4 && std::string(argv[1]) == "--hold-connections")
    return engram::HoldConnections(argv[2], std::atoi(argv[3]));
  if (argc == 5 && std::string(argv[1]) == "--idle-streams")
    return engram::IdleStreams(argv[2], argv[3], std::atoi(argv[4]));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
