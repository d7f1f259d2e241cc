// engramd hardening, as real processes: forged files in the shm directory are never adopted nor written through,
// aliases of a checkpoint path are one checkpoint, one engramd per shm directory (flock), SIGHUP is all or nothing
// (a broken new configuration changes nothing; a TP change publishes and retires shards), running out of
// descriptors does not spin the accept loop, long client strings cannot blow up status, a hello's client version is
// bounded printable text and status shows it per replica (with the daemon's own), --group members can map the
// segments, failed loads are logged and shown, and refused uids get nothing from any service (health included).
//
// Every test has its own shm directory and socket under a temporary directory (never /dev/shm), so the tests run in
// parallel. They synchronise on conditions (status answers, files, log lines), never on sleeps; the one measurement
// is the CPU-usage behaviour check of the descriptor-exhaustion test (a busy spin uses a whole core; a backed-off
// loop almost none). Root-only cases skip with the reason.
//
// The binary has its own main(): `daemon_hardening_test --health-probe SOCKET` prints the health status code (or
// the gRPC error code) and exits, so a test can run the probe as another uid through setpriv;
// `daemon_hardening_test --idle-streams SOCKET METHOD N` opens N bidirectional streams of METHOD, sends one request
// on each (a reflection list_services), prints {"answered": A, "failed": F} once each stream was answered or ended,
// and holds the answered ones open, idle, until killed; `daemon_hardening_test --hold-connections SOCKET N` connects
// N times to SOCKET (a gRPC channel each, no call), prints {"connected": C, "refused": R} (R: not connected after 3 s)
// and holds the open ones until killed.
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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

// Why a test that runs processes as other uids (setpriv) cannot run here, or "" when it can: root, setpriv, and with
// `nogroup` the group 'nogroup' (gid 65534) that such tests give the daemon.
std::string NoOtherUids(const std::string& why_root, bool nogroup) {
  if (::geteuid() != 0) return "needs root: " + why_root;
  if (RunCmd("command -v setpriv").exit_code != 0) return "setpriv (util-linux) is not installed";
  if (nogroup && RunCmd("getent group nogroup").exit_code != 0) return "no group 'nogroup' (gid 65534)";
  return "";
}

// `engramctl attach` once: its first JSON line (decision, verified rows, mismatches).
json AttachOnce(const Daemon& d, const std::string& ckpt, const std::string& shm, const std::string& extra = "",
                const std::string& prefix = "") {
  auto r = RunCmd(prefix + BinPath("engramctl") + " attach --socket " + d.socket() + " --checkpoint " + ckpt +
                  " --shm-dir " + shm + " --dp-size 2 --verify 100 " + extra);
  json j = testing::JsonLine(r.out, false);
  if (j.is_null()) std::cerr << "attach: " << r.exit_code << " " << r.out << r.err << "\n";
  return j;
}

ino_t InodeOf(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

bool SegmentsReady(const json& s, size_t n) {
  if (s.is_null() || s.is_discarded() || s["segments"].size() != n) return false;
  for (const auto& seg : s["segments"]) {
    if (seg["state"] != "READY") return false;
  }
  return true;
}

// --- forged segments ---------------------------------------------------------------------------------------------

// A file with a segment's name and a valid READY header, planted before engramd starts, is not adopted: a copy of a
// real segment made writable by others (mode 0666), and (as root) one owned by another uid. The daemon logs it,
// removes it, publishes its own; replicas read the checkpoint's rows.
TEST(DaemonHardeningTest, PlantedSegmentIsNotAdopted) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  ::chmod(shm.c_str(), 01777);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  std::string name;
  {
    Daemon first(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "first");
    ASSERT_TRUE(first.WaitReady()) << first.Log();
    name = first.Status()["segments"][0]["name"];
    first.proc().Signal(SIGTERM);
    ASSERT_EQ(first.proc().Wait(), 0);
  }
  const std::string path = shm + "/" + name;
  ASSERT_TRUE(ReadSegmentHeader(path).ok());
  struct Plant {
    const char* what;
    mode_t mode;
    uid_t uid;
  };
  std::vector<Plant> plants = {{"mode0666", 0666, ::geteuid()}};
  if (::geteuid() == 0) plants.push_back({"uid65534", 0640, 65534});
  for (const Plant& p : plants) {
    SCOPED_TRACE(p.what);
    // The planted file: the real segment's bytes (valid header, fingerprint, size), another mode or owner.
    if (!std::filesystem::exists(path)) {
      ASSERT_TRUE(std::filesystem::copy_file(dir / "saved", path));
    } else {
      std::filesystem::copy_file(path, dir / "saved", std::filesystem::copy_options::overwrite_existing);
    }
    ASSERT_EQ(::chmod(path.c_str(), p.mode), 0);
    ASSERT_EQ(::chown(path.c_str(), p.uid, static_cast<gid_t>(-1)), 0);
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, std::string("second-") + p.what);
    ASSERT_TRUE(d.WaitReady()) << d.Log();
    const json s = d.Status();
    ASSERT_EQ(s["segments"].size(), 1u);
    EXPECT_EQ(s["segments"][0]["state"], "READY") << s.dump();
    EXPECT_EQ(s["segments"][0]["origin"], "published") << "a planted file was adopted: " << s.dump();
    EXPECT_NE(d.Log().find("event=segment_foreign path=" + path), std::string::npos) << d.Log();
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, ::geteuid());
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    const json a = AttachOnce(d, ckpt, shm);
    EXPECT_EQ(a["decision"], "shared") << a.dump();
    EXPECT_EQ(a["mismatches"], 0) << a.dump();
    d.proc().Signal(SIGTERM);
    EXPECT_EQ(d.proc().Wait(), 0);
  }
}

// A non-root engramd (uid 65533, through setpriv) finds a file of another uid (root) under its segment's name in a
// sticky directory: it cannot remove it, so it never adopts nor writes it, and the segment fails with a clear error
// that replicas get as SEGMENT_NOT_READY.
TEST(DaemonHardeningTest, ForeignFileThatCannotBeRemovedFailsTheSegment) {
  if (const std::string no = NoOtherUids("the daemon runs as another uid than the planted file's", false); !no.empty())
    GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0777);
  const std::string shm = MakeShm(dir);
  ::chmod(shm.c_str(), 01777);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  std::string name;
  {
    Daemon first(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "first");  // root: its file is root's, 0640
    ASSERT_TRUE(first.WaitReady()) << first.Log();
    name = first.Status()["segments"][0]["name"];
    first.proc().Signal(SIGTERM);
    ASSERT_EQ(first.proc().Wait(), 0);
  }
  const std::string path = shm + "/" + name;
  const std::string before = testing::ReadFile(path);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "nonroot",
           {"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const json s = d.Status();
  ASSERT_EQ(s["segments"].size(), 1u);
  EXPECT_EQ(s["segments"][0]["state"], "FAILED") << s.dump();
  EXPECT_NE(s["segments"][0]["error"].get<std::string>().find("a file owned by uid 0 occupies " + path),
            std::string::npos)
      << s.dump();
  EXPECT_NE(d.Log().find("event=segment_foreign path=" + path + " owner=0"), std::string::npos) << d.Log();
  EXPECT_EQ(testing::ReadFile(path), before) << "the foreign file was written";
  const json a = AttachOnce(d, ckpt, shm);
  EXPECT_EQ(a["decision"], "fallback") << a.dump();
  EXPECT_TRUE(testing::ReasonSet(a).count("SEGMENT_NOT_READY")) << a.dump();
}

// A symlink under a segment's name (one this configuration does not serve, so the start-up scan would retire it,
// and one it serves) pointing at a file holding a READY segment: the target is never written (no RETIRED through
// the link), the link is removed, the daemon publishes its own file.
TEST(DaemonHardeningTest, PlantedSymlinkIsNotWrittenThrough) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string b = MakeCheckpoint(dir, 8, "b", 2);
  std::string name_a, name_b;
  {
    Daemon first(dir, {"--checkpoint", a, "--checkpoint", b, "--shm-dir", shm}, "first");
    ASSERT_TRUE(first.WaitReady()) << first.Log();
    const json st = first.Status();
    for (const auto& seg : st["segments"]) {
      (seg["checkpoint"] == a ? name_a : name_b) = seg["name"];
    }
    first.proc().Signal(SIGTERM);
    ASSERT_EQ(first.proc().Wait(), 0);
  }
  // Victims outside the shm directory: real READY segments; the links take the segments' names.
  const std::string victim_a = dir / "victim-a", victim_b = dir / "victim-b";
  std::filesystem::rename(shm + "/" + name_a, victim_a);
  std::filesystem::rename(shm + "/" + name_b, victim_b);
  const std::string before_a = testing::ReadFile(victim_a), before_b = testing::ReadFile(victim_b);
  ASSERT_EQ(::symlink(victim_a.c_str(), (shm + "/" + name_a).c_str()), 0);
  ASSERT_EQ(::symlink(victim_b.c_str(), (shm + "/" + name_b).c_str()), 0);
  Daemon d(dir, {"--checkpoint", a, "--shm-dir", shm}, "second");  // serves a, not b: b's name is retired
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const json s = d.Status();
  ASSERT_EQ(s["segments"].size(), 1u);
  EXPECT_EQ(s["segments"][0]["state"], "READY");
  EXPECT_EQ(s["segments"][0]["origin"], "published");
  EXPECT_EQ(testing::ReadFile(victim_a), before_a) << "written through a symlink";
  EXPECT_EQ(testing::ReadFile(victim_b), before_b) << "RETIRED written through a symlink";
  auto hb = ReadSegmentHeader(victim_b);
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->state, static_cast<uint32_t>(SegmentState::kReady));
  struct stat st {};
  EXPECT_NE(::lstat((shm + "/" + name_b).c_str(), &st), 0) << "the link to b stays";
  ASSERT_EQ(::lstat((shm + "/" + name_a).c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "a's name is still a link";
}

// --- aliases and neighbours --------------------------------------------------------------------------------------

TEST(DaemonHardeningTest, AliasesOfACheckpointAreTheSameCheckpoint) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt + "/", "--shm-dir", shm});  // the config's alias is canonical too
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  json s = d.Status();
  ASSERT_EQ(s["segments"].size(), 1u);
  EXPECT_EQ(s["segments"][0]["checkpoint"], ckpt);
  const std::string seg = shm + "/" + s["segments"][0]["name"].get<std::string>();
  const ino_t ino = InodeOf(seg);
  ASSERT_EQ(::symlink(ckpt.c_str(), (dir / "link").c_str()), 0);
  const std::string ctl = BinPath("engramctl");
  for (const std::string& alias : {ckpt + "/", ckpt + "/.", dir / "link", dir / "x/../ck"}) {
    SCOPED_TRACE(alias);
    auto r = RunCmd(ctl + " load --checkpoint " + alias + " --socket " + d.socket());
    EXPECT_NE(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.err.find(ckpt + " is already served"), std::string::npos) << r.err;
    s = d.Status();
    ASSERT_EQ(s["segments"].size(), 1u) << s.dump();
    EXPECT_EQ(s["segments"][0]["state"], "READY");
    EXPECT_EQ(InodeOf(seg), ino) << "the READY segment was replaced";
  }
  // Unload through an alias unloads the checkpoint itself: status and the directory agree.
  auto r = RunCmd(ctl + " unload --checkpoint " + ckpt + "/ --socket " + d.socket());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  s = d.Status();
  EXPECT_TRUE(s["segments"].empty()) << s.dump();
  EXPECT_TRUE(ListSegments(shm).empty());
  EXPECT_TRUE(d.proc().Running());
}

// A second engramd with its own socket on the same shm directory refuses to start and deletes nothing; the first
// one's segment is untouched and still served.
// The same across users: a non-root engramd owns the directory's lock; root starting another engramd there must
// refuse (the lock file is not root's, but a live daemon holds it), not replace the lock and delete the segments.
TEST(DaemonHardeningTest, ADaemonOfAnotherUserKeepsTheDirectory) {
  if (const std::string no = NoOtherUids("the two daemons run as different uids", false); !no.empty())
    GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0777);
  const std::string shm = MakeShm(dir);
  ::chmod(shm.c_str(), 01777);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  Daemon first(dir, {"--checkpoint", a, "--shm-dir", shm}, "first",
               {"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"});
  ASSERT_TRUE(first.WaitReady()) << first.Log();
  const std::string seg = shm + "/" + first.Status()["segments"][0]["name"].get<std::string>();
  const ino_t ino = InodeOf(seg);
  Daemon second(dir, {"--checkpoint", a, "--shm-dir", shm}, "second");  // root
  EXPECT_EQ(second.proc().Wait(), 1) << second.Log();
  EXPECT_NE(second.Log().find("another engramd"), std::string::npos) << second.Log();
  EXPECT_EQ(InodeOf(seg), ino) << "the first daemon's segment was removed";
  EXPECT_EQ(first.Status()["segments"][0]["state"], "READY");
  EXPECT_EQ(AttachOnce(first, a, shm)["decision"], "shared");
}

TEST(DaemonHardeningTest, SecondDaemonOnTheSameShmDirRefuses) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string b = MakeCheckpoint(dir, 8, "b", 2);
  Daemon first(dir, {"--checkpoint", a, "--shm-dir", shm}, "first");
  ASSERT_TRUE(first.WaitReady()) << first.Log();
  const std::string seg = shm + "/" + first.Status()["segments"][0]["name"].get<std::string>();
  const ino_t ino = InodeOf(seg);
  Daemon second(dir, {"--checkpoint", b, "--shm-dir", shm}, "second");
  EXPECT_EQ(second.proc().Wait(), 1) << second.Log();
  EXPECT_NE(second.Log().find("another engramd (pid " + std::to_string(first.proc().pid()) + ") owns " + shm),
            std::string::npos)
      << second.Log();
  EXPECT_EQ(InodeOf(seg), ino) << "the first daemon's segment was removed";
  auto h = ReadSegmentHeader(seg);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->state, static_cast<uint32_t>(SegmentState::kReady));
  EXPECT_EQ(ListSegments(shm).size(), 1u);
  const json s = first.Status();
  ASSERT_EQ(s["segments"].size(), 1u);
  EXPECT_EQ(s["segments"][0]["state"], "READY");
  EXPECT_EQ(AttachOnce(first, a, shm)["decision"], "shared");
  // The lock goes with the process: once the first stops, a daemon on the directory starts (and adopts).
  first.proc().Signal(SIGTERM);
  ASSERT_EQ(first.proc().Wait(), 0);
  Daemon third(dir, {"--checkpoint", a, "--shm-dir", shm}, "third");
  ASSERT_TRUE(third.WaitReady()) << third.Log();
  EXPECT_EQ(third.Status()["segments"][0]["origin"], "adopted");
}

// --- SIGHUP is all or nothing -----------------------------------------------------------------------------------

TEST(DaemonHardeningTest, ReloadWithABrokenCheckpointChangesNothing) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string bad = MakeCheckpoint(dir, 8, "bad", 2);
  ASSERT_EQ(RunCmd("truncate -s -1000 " + bad + "/model-00002-of-00002.safetensors").exit_code, 0);
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf, "checkpoint = " + a + "\ntp = 1\ntickets = 1\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const json before = d.Status();
  ASSERT_EQ(before["segments"].size(), 1u);
  // A replica holds a session across the reload.
  Process holder({BinPath("engramctl"), "attach", "--socket", d.socket(), "--checkpoint", a, "--shm-dir", shm,
                  "--dp-size", "2", "--hold", "600"},
                 dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(holder.Output(), false).is_null(); }, 30s));
  // The new configuration replaces a by a broken checkpoint (and changes the tickets): nothing may change.
  testing::WriteFile(conf, "checkpoint = " + bad + "\ntp = 1\ntickets = 3\nshm_dir = " + shm + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("event=reload_failed")) << d.Log();
  EXPECT_NE(d.Log().find("nothing changed"), std::string::npos) << d.Log();
  EXPECT_NE(d.Log().find("truncated"), std::string::npos) << "the log says why: " << d.Log();
  const json after = d.Status();
  ASSERT_EQ(after["segments"].size(), 1u) << after.dump();
  EXPECT_EQ(after["segments"][0]["checkpoint"], a);
  EXPECT_EQ(after["segments"][0]["state"], "READY");
  EXPECT_EQ(after["segments"][0]["name"], before["segments"][0]["name"]);
  EXPECT_EQ(ListSegments(shm).size(), 1u);
  EXPECT_EQ(after["replicas"].size(), 1u);
  EXPECT_EQ(AttachOnce(d, a, shm)["decision"], "shared") << "a replica still shares";
  bool shown = false;
  for (const auto& f : after["recent_fallbacks"]) shown = shown || f.get<std::string>().find("reload_failed") == 0;
  EXPECT_TRUE(shown) << after.dump();
  // A configuration that does not even parse: logged and shown in status too; still nothing changes.
  const size_t failures = after["recent_fallbacks"].size();
  testing::WriteFile(conf, "checkpoint = " + a + "\ntp = one\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] { return d.Status()["recent_fallbacks"].size() > failures; }, 30s)) << d.Log();
  const std::string last = d.Status()["recent_fallbacks"].back();
  EXPECT_EQ(last.find("reload_failed"), 0u) << last;
  EXPECT_EQ(AttachOnce(d, a, shm)["decision"], "shared");
  EXPECT_TRUE(holder.Running());
}

TEST(DaemonHardeningTest, ReloadChangingTpPublishesAndRetiresShards) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf, "checkpoint = " + a + "\ntp = 1\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ASSERT_EQ(d.Status()["segments"].size(), 1u);
  const std::string tp1 = d.Status()["segments"][0]["name"];
  testing::WriteFile(conf, "checkpoint = " + a + "\ntp = 1,2\nshm_dir = " + shm + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] { return SegmentsReady(d.Status(), 3); }, 30s)) << d.Status().dump() << d.Log();
  EXPECT_EQ(ListSegments(shm).size(), 3u);
  EXPECT_NE(d.Log().find("event=reload added= removed= tp=1,2"), std::string::npos) << d.Log();
  EXPECT_EQ(AttachOnce(d, a, shm, "--tp-size 2 --tp-rank 1")["decision"], "shared");
  // tp 2 only: the tp1 shard is retired (unlinked), the tp2 ones stay as they are.
  testing::WriteFile(conf, "checkpoint = " + a + "\ntp = 2\nshm_dir = " + shm + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(WaitFor([&] { return SegmentsReady(d.Status(), 2); }, 30s)) << d.Status().dump() << d.Log();
  EXPECT_EQ(ListSegments(shm).size(), 2u);
  EXPECT_FALSE(std::filesystem::exists(shm + "/" + tp1));
}

// --- descriptor exhaustion ---------------------------------------------------------------------------------------

int CountFds(pid_t pid) {
  int n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// utime + stime of a process, in clock ticks.
long CpuTicks(pid_t pid) {
  std::string stat = testing::ReadFile("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream ss(stat.substr(close + 2));
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && ss >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return utime + stime;
}

int ConnectRaw(const std::string& path) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

TEST(DaemonHardeningTest, RunningOutOfDescriptorsDoesNotSpinAndKeepsServing) {
  if (RunCmd("command -v prlimit").exit_code != 0) GTEST_SKIP() << "prlimit (util-linux) is not installed";
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--threads", "1"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const pid_t pid = d.proc().pid();
  // A connection kept across the exhaustion.
  auto stub =
      engram::v1::Engram::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
  auto status_ok = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    engram::v1::StatusReply r;
    return stub->Status(&ctx, engram::v1::StatusRequest(), &r).ok() && r.segments_size() == 1;
  };
  ASSERT_TRUE(status_ok());
  const int limit = CountFds(pid) + 6;
  ASSERT_EQ(RunCmd("prlimit --pid " + std::to_string(pid) + " --nofile=" + std::to_string(limit) + ":" +
                   std::to_string(limit))
                .exit_code,
            0);
  std::vector<int> extra;
  for (int i = 0; i < 40; ++i) {
    int s = ConnectRaw(d.socket());
    if (s >= 0) extra.push_back(s);
  }
  ASSERT_GT(extra.size(), 10u);
  ASSERT_TRUE(WaitFor([&] { return CountFds(pid) >= limit; }, 20s)) << CountFds(pid) << " of " << limit;
  EXPECT_TRUE(d.WaitLog("event=accept_backoff", 10s)) << d.Log();
  // Behaviour check, not a speed threshold: a loop that spins on a failing accept burns a whole core over the
  // window; one that backs off uses next to nothing.
  const long hz = ::sysconf(_SC_CLK_TCK);
  const long t0 = CpuTicks(pid);
  const auto w0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(3s);  // the measurement window itself (nothing waits on it)
  const double window = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  const double used = static_cast<double>(CpuTicks(pid) - t0) / static_cast<double>(hz);
  std::cout << "[ fds ] daemon cpu " << used << " s over " << window << " s with descriptors exhausted\n";
  EXPECT_LT(used, 0.5 * window) << "the accept loop spins while descriptors are exhausted";
  EXPECT_TRUE(status_ok()) << "the kept connection is still served";
  EXPECT_TRUE(d.proc().Running());
  for (int s : extra) ::close(s);
  EXPECT_TRUE(WaitFor([&] { return !d.Status().is_null(); }, 30s)) << "new connections are accepted again";
}

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

// --- failed loads are visible; refused uids get nothing from any service -----------------------------------------

TEST(DaemonHardeningTest, FailedLoadIsLoggedAndShownInStatus) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto r = RunCmd(BinPath("engramctl") + " load --checkpoint " + (dir / "missing") + " --socket " + d.socket());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(d.WaitLog("event=load_failed dir=" + (dir / "missing"))) << d.Log();
  const json s = d.Status();
  bool shown = false;
  for (const auto& f : s["recent_fallbacks"]) {
    shown = shown || f.get<std::string>().find("load_failed dir=" + (dir / "missing")) == 0;
  }
  EXPECT_TRUE(shown) << s.dump();
  EXPECT_EQ(s["segments"].size(), 1u) << "status fields are unchanged: " << s.dump();
}

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

// --- registration tickets: a hold limit, and each waiter's own deadline -------------------------------------------

// A replica that takes the node's only ticket and never reports cannot keep another uid's replica waiting past that
// replica's --timeout-ms (it gets its answer, a fallback naming the ticket, by its deadline), and the daemon takes
// the ticket back after --ticket-hold-ms (event=ticket_expired names the holder), so the next replica shares.
TEST(DaemonHardeningTest, AHeldTicketExpiresAndWaitersKeepTheirDeadlines) {
  if (const std::string no = NoOtherUids("the waiting replica runs as another uid than the holder", true); !no.empty())
    GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string helper = BinPath("../tests/session_helper");
  auto replica = [&](const Daemon& d, const std::string& timeout_ms, const std::string& name) {
    return std::make_unique<Process>(
        std::vector<std::string>{"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--groups=65534",
                                 BinPath("engram-replica"), "--socket", d.socket(), "--checkpoint", ckpt, "--dp-size",
                                 "2", "--batches", "1", "--timeout-ms", timeout_ms},
        dir / name);
  };
  for (const std::string hold_ms : {"600000", "1500"}) {
    SCOPED_TRACE("ticket_hold_ms " + hold_ms);
    Daemon d(
        dir,
        {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup", "--tickets", "1", "--ticket-hold-ms", hold_ms},
        "tickets-" + hold_ms);
    ASSERT_TRUE(d.WaitReady()) << d.Log();
    ::chmod(d.socket().c_str(), 0666);
    Process holder({helper, d.socket(), ckpt, shm, "ticket"}, dir / ("holder-" + hold_ms + ".log"));
    ASSERT_TRUE(WaitFor([&] { return holder.Output().find("\"ticket\": true") != std::string::npos; }, 30s))
        << holder.Output();
    if (hold_ms == "600000") {
      // The holder keeps the ticket for the whole test: the waiter's 2 s deadline alone ends its wait.
      auto waiter = replica(d, "2000", "waiter.log");
      const int rc = waiter->Wait(30s);
      ASSERT_NE(rc, -1) << "the replica waited past its own deadline for the held ticket: " << d.Status().dump();
      const json out = testing::JsonLine(waiter->Output(), false);
      EXPECT_NE(out["mode"], "SHARED") << waiter->Output();
      EXPECT_NE(waiter->Output().find("no registration ticket"), std::string::npos) << waiter->Output();
      EXPECT_NE(d.Log().find("event=ticket_timeout"), std::string::npos) << d.Log();
      EXPECT_TRUE(holder.Running());
    } else {
      // The holder never reports: its ticket is reclaimed and the waiter (with time to spare) shares.
      auto waiter = replica(d, "60000", "next.log");
      EXPECT_EQ(waiter->Wait(90s), 0) << waiter->Output() << d.Log();
      const json out = testing::JsonLine(waiter->Output(), false);
      EXPECT_EQ(out["mode"], "SHARED") << waiter->Output();
      EXPECT_NE(d.Log().find("event=ticket_expired pid=" + std::to_string(holder.pid()) + " uid=0 "), std::string::npos)
          << d.Log();
    }
    holder.Signal(SIGKILL);
    holder.Wait();
    EXPECT_TRUE(d.proc().Running());
  }
}

// One uid queueing many replicas for the node's only ticket does not keep another uid's replica behind all of them:
// the next ticket goes to the uid granted least recently. Each of uid 65533's six never reports and holds its ticket
// until the 1.5 s hold limit; first come, first served, uid 65532's replica would wait about 10 s, past its 6 s
// deadline.
TEST(DaemonHardeningTest, TicketsGoRoundTheUids) {
  if (const std::string no = NoOtherUids("the replicas run as two other uids", true); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string helper = BinPath("../tests/session_helper");
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup", "--tickets", "1", "--ticket-hold-ms",
                 "1500"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ::chmod(d.socket().c_str(), 0666);
  std::vector<std::unique_ptr<Process>> squatters;
  for (int i = 0; i < 6; ++i) {
    squatters.push_back(
        std::make_unique<Process>(std::vector<std::string>{"/usr/bin/setpriv", "--reuid=65533", "--regid=65533",
                                                           "--groups=65534", helper, d.socket(), ckpt, shm, "ticket"},
                                  dir / ("squatter-" + std::to_string(i) + ".log")));
  }
  ASSERT_TRUE(WaitFor([&] { return d.Status()["replicas"].size() == 6; }, 30s)) << d.Status().dump();
  std::this_thread::sleep_for(500ms);  // all six have asked for the ticket
  Process other(
      {"/usr/bin/setpriv", "--reuid=65532", "--regid=65532", "--groups=65534", BinPath("engram-replica"), "--socket",
       d.socket(), "--checkpoint", ckpt, "--dp-size", "2", "--batches", "1", "--timeout-ms", "6000"},
      dir / "other.log");
  ASSERT_NE(other.Wait(60s), -1) << other.Output();
  const json out = testing::JsonLine(other.Output(), false);
  EXPECT_EQ(out["mode"], "SHARED") << other.Output() << d.Log();
  for (auto& p : squatters) p->Signal(SIGKILL);
  EXPECT_TRUE(d.proc().Running());
}

// --- the metrics file, and segments whose file changed size ------------------------------------------------------

// A directory symlink planted on the metrics file's path (in a sticky directory anyone may write, by another uid)
// pointing at the shm directory, with the file's name a segment's: the metrics file is never written through it
// (event=metrics_write_failed names the link's owner) and the segment keeps its bytes.
TEST(DaemonHardeningTest, ALinkOnTheMetricsPathIsNotFollowed) {
  if (const std::string no = NoOtherUids("the link is planted by another uid", false); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string pub = dir / "pub";
  ASSERT_EQ(::mkdir(pub.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(pub.c_str(), 01777), 0);
  // The daemon first starts without metrics to learn the segment's name.
  std::string name;
  {
    Daemon first(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "first");
    ASSERT_TRUE(first.WaitReady()) << first.Log();
    name = first.Status()["segments"][0]["name"].get<std::string>();
  }
  const std::string seg = shm + "/" + name;
  const std::string before = testing::ReadFile(seg);
  ASSERT_FALSE(before.empty());
  const auto ln = RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups ln -s " + shm + " " + pub + "/textfile");
  ASSERT_EQ(ln.exit_code, 0) << ln.out << ln.err;
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--metrics-file", pub + "/textfile/" + name}, "linked");
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ASSERT_TRUE(d.WaitLog("event=metrics_write_failed")) << d.Log();
  EXPECT_NE(d.Log().find("symlink of uid 65533"), std::string::npos) << d.Log();
  EXPECT_EQ(testing::ReadFile(seg), before) << "the segment was written through the link";
  EXPECT_TRUE(d.proc().Running());
}

// A root-owned link on the metrics path whose target runs through another uid's directory: the target is walked
// component by component like the path itself, so the other uid's directory (and the link it put there, to the shm
// directory) is refused; nothing is written there.
TEST(DaemonHardeningTest, ALinksTargetOnTheMetricsPathIsCheckedToo) {
  if (const std::string no = NoOtherUids("a directory of another uid", false); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string evil = dir / "evil", tgt = dir / "tgt";
  ASSERT_EQ(::mkdir(evil.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(tgt.c_str(), 0755), 0);
  ASSERT_EQ(::chown(evil.c_str(), 65533, 65533), 0);
  ASSERT_EQ(::symlink((evil + "/d").c_str(), (dir / "L").c_str()), 0);  // root's link
  const auto ln = RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups ln -s " + tgt + " " + evil + "/d");
  ASSERT_EQ(ln.exit_code, 0) << ln.out << ln.err;
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--metrics-file", dir / "L/m.prom"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ASSERT_TRUE(d.WaitLog("event=metrics_write_failed")) << d.Log();
  EXPECT_FALSE(std::filesystem::exists(tgt + "/m.prom")) << d.Log();
  EXPECT_TRUE(d.proc().Running());
}

// A symlink planted at the metrics file's old temporary name (`<file>.tmp`) pointing at a live segment: the segment
// is never opened through it (size, header and rows unchanged), and the metrics file is still written, as a regular
// file.
TEST(DaemonHardeningTest, APlantedLinkBesideTheMetricsFileIsNotWrittenThrough) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  const std::string metrics = dir / "metrics.prom";
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--metrics-file", metrics});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const std::string seg = shm + "/" + d.Status()["segments"][0]["name"].get<std::string>();
  const std::string before = testing::ReadFile(seg);
  ASSERT_FALSE(before.empty());
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(metrics); }, 30s)) << d.Log();
  ASSERT_EQ(::symlink(seg.c_str(), (metrics + ".tmp").c_str()), 0);
  ASSERT_EQ(::unlink(metrics.c_str()), 0);
  // The next write (every 2 s) brings the metrics file back.
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(std::filesystem::symlink_status(metrics)); }, 30s))
      << d.Log();
  struct stat st {};
  ASSERT_EQ(::lstat(metrics.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the metrics file is the planted link";
  EXPECT_NE(testing::ReadFile(metrics).find("engram"), std::string::npos) << testing::ReadFile(metrics);
  EXPECT_TRUE(testing::ReadFile(seg) == before) << "the segment was written through the planted link";
  const json s = d.Status();
  EXPECT_EQ(s["segments"][0]["state"], "READY") << s.dump();
  EXPECT_EQ(AttachOnce(d, ckpt, shm)["decision"], "shared");
}

// A READY segment whose file is truncated under the daemon is no longer READY in status (nor granted), and a
// restarted daemon does not adopt it (its header still claims the full size): it publishes a new one.
TEST(DaemonHardeningTest, ATruncatedSegmentIsNeverReady) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  std::string seg;
  {
    Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "first");
    ASSERT_TRUE(d.WaitReady()) << d.Log();
    ASSERT_TRUE(WaitFor([&] { return d.Status()["segments"][0]["checksum_state"] == "ok"; }, 30s)) << d.Log();
    seg = shm + "/" + d.Status()["segments"][0]["name"].get<std::string>();
    ASSERT_EQ(::truncate(seg.c_str(), static_cast<off_t>(std::filesystem::file_size(seg) / 2)), 0);
    const json s = d.Status();
    EXPECT_NE(s["segments"][0]["state"], "READY") << s.dump();
    EXPECT_NE(s["segments"][0].value("error", "").find("truncated"), std::string::npos) << s.dump();
    const json a = AttachOnce(d, ckpt, shm);
    EXPECT_EQ(a["decision"], "fallback") << a.dump();
    d.proc().Signal(SIGTERM);
    ASSERT_EQ(d.proc().Wait(), 0);
  }
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm}, "second");
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const json s = d.Status();
  EXPECT_EQ(s["segments"][0]["state"], "READY") << s.dump();
  EXPECT_EQ(s["segments"][0]["origin"], "published") << "the truncated file was adopted: " << s.dump();
  EXPECT_EQ(AttachOnce(d, ckpt, shm)["mismatches"], 0);
  EXPECT_TRUE(d.proc().Running());
}

// A READY segment replaced under the daemon by another file of the same size (a copy with one row changed) is not
// READY in status, names the replacement, and is not granted: the size alone would not tell.
TEST(DaemonHardeningTest, ASameSizeReplacementIsNeverReady) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 2);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  ASSERT_TRUE(WaitFor([&] { return d.Status()["segments"][0]["checksum_state"] == "ok"; }, 30s)) << d.Log();
  const std::string seg = shm + "/" + d.Status()["segments"][0]["name"].get<std::string>();
  std::string bytes = testing::ReadFile(seg);
  bytes[bytes.size() - 1] = static_cast<char>(bytes[bytes.size() - 1] ^ 0x5a);
  testing::WriteFile(seg + ".new", bytes);
  ::chmod((seg + ".new").c_str(), 0440);
  ASSERT_EQ(::rename((seg + ".new").c_str(), seg.c_str()), 0);
  ASSERT_EQ(std::filesystem::file_size(seg), bytes.size());
  const json s = d.Status();
  EXPECT_NE(s["segments"][0]["state"], "READY") << s.dump();
  EXPECT_NE(s["segments"][0].value("error", "").find("replaced"), std::string::npos) << s.dump();
  const json a = AttachOnce(d, ckpt, shm);
  EXPECT_NE(a["decision"], "shared") << a.dump();
  EXPECT_TRUE(d.proc().Running());
}

// --- text from checkpoints and clients is printable wherever it is shown -----------------------------------------

// Control bytes of `text` other than its line ends.
int ControlBytes(const std::string& text) {
  int n = 0;
  for (const unsigned char c : text) n += (c < 0x20 && c != '\n') || c == 0x7f ? 1 : 0;
  return n;
}

// The keys of one logfmt line (key=value pairs; a value in double quotes may hold spaces and \-escaped quotes), as a
// log shipper parses it: an independent reading of the line, not the daemon's quoting code.
std::vector<std::string> LogfmtKeys(const std::string& line) {
  std::vector<std::string> keys;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '=' && line[i] != '"') ++i;
    if (i < line.size() && line[i] == '=') {
      keys.push_back(line.substr(start, i - start));
      ++i;
    }
    if (i < line.size() && line[i] == '"') {
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\') ++i;
      }
      ++i;
    } else {
      while (i < line.size() && line[i] != ' ') ++i;
    }
  }
  return keys;
}

// Quotes and spaces in a checkpoint directory's name, in a config.json value and in a reloaded setting forge no
// key: every line of the log holds one event= as a logfmt reader splits it.
TEST(DaemonHardeningTest, QuotesInHostileTextForgeNoLogKey) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 2, "a", 1);
  const std::string forge = "\" event=ready detail=\"every segment ready";
  const std::string bad = dir / ("q" + forge);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "c", 3), bad);
  {
    json cfg = json::parse(testing::ReadFile(bad + "/config.json"));
    cfg["engram_head_dim"] = "1" + forge;
    testing::WriteFile(bad + "/config.json", cfg.dump());
  }
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  Process load({BinPath("engramctl"), "load", "--checkpoint", bad, "--socket", d.socket()}, dir / "load.log");
  EXPECT_NE(load.Wait(60s), 0) << load.Output();
  ASSERT_TRUE(d.WaitLog("event=load_failed")) << d.Log();
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + forge + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("key=shm_dir")) << d.Log();
  // A refused reload names the value in its detail (an unknown group, a log level that is none).
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + "\ngroup = nosuch" + forge + "\n");
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(d.WaitLog("event=reload_failed")) << d.Log();
  const std::string log = d.Log();
  std::istringstream lines(log);
  int checked = 0;
  for (std::string line; std::getline(lines, line);) {
    const std::vector<std::string> keys = LogfmtKeys(line);
    EXPECT_LE(std::count(keys.begin(), keys.end(), "event"), 1) << "a forged key: " << line;
    EXPECT_LE(std::count(keys.begin(), keys.end(), "detail"), 1) << "a forged key: " << line;
    checked += line.find("every segment ready") != std::string::npos ? 1 : 0;
  }
  EXPECT_GE(checked, 3) << "the hostile text is logged (quoted): " << log;
  EXPECT_TRUE(d.proc().Running());
}

// Checkpoint directories whose names hold an escape sequence and a newline followed by a forged log line: loading,
// unloading and failing to load them is logged one line per event, and neither the daemon's log, engramctl's error
// nor its status (text or JSON) carries a control byte.
TEST(DaemonHardeningTest, HostileCheckpointTextIsPrintableEverywhere) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 2, "a", 1);
  const std::string forged = "2026-01-01T00:00:00.000 info event=unload dir=forged";  // no '/': one name
  const std::string good = dir / ("good\x1b[31m\n" + forged);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "b", 2), good);
  const std::string bad = dir / ("bad\x1b[2J\n" + forged);
  std::filesystem::rename(MakeCheckpoint(dir, 2, "c", 3), bad);
  ASSERT_EQ(::truncate((bad + "/model-00002-of-00002.safetensors").c_str(),
                       static_cast<off_t>(std::filesystem::file_size(bad + "/model-00002-of-00002.safetensors") / 2)),
            0);
  // A config.json value with an escape and a newline too.
  {
    json cfg = json::parse(testing::ReadFile(bad + "/config.json"));
    cfg["architectures"] = json::array({"Evil\x1b[2J\n" + forged});
    testing::WriteFile(bad + "/config.json", cfg.dump());
  }
  Daemon d(dir, {"--checkpoint", a, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto ctl = [&](const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> argv = {BinPath("engramctl")};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--socket");
    argv.push_back(d.socket());
    Process p(argv, dir / name);
    const int rc = p.Wait(60s);
    return std::make_pair(rc, p.Output());
  };
  const auto loaded = ctl({"load", "--checkpoint", good}, "load-good.log");
  EXPECT_EQ(loaded.first, 0) << loaded.second;
  EXPECT_EQ(ControlBytes(loaded.second), 0) << loaded.second;
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const auto failed = ctl({"load", "--checkpoint", bad}, "load-bad.log");
  EXPECT_NE(failed.first, 0) << failed.second;
  EXPECT_EQ(ControlBytes(failed.second), 0) << failed.second;
  EXPECT_EQ(std::count(failed.second.begin(), failed.second.end(), '\n'), 1) << "one line of error: " << failed.second;
  const auto text = ctl({"status"}, "status.log");
  EXPECT_EQ(text.first, 0) << text.second;
  EXPECT_EQ(ControlBytes(text.second), 0) << text.second;
  EXPECT_EQ(text.second.find("\n" + forged), std::string::npos) << text.second;
  const auto j = ctl({"status", "--json"}, "status-json.log");
  EXPECT_EQ(j.first, 0) << j.second;
  const json s = testing::JsonLine(j.second, false);
  ASSERT_FALSE(s.is_null()) << j.second;
  EXPECT_EQ(s.dump().find("\\u001b"), std::string::npos) << s.dump();
  EXPECT_EQ(s.dump().find("\\n"), std::string::npos) << s.dump();
  const auto unloaded = ctl({"unload", "--checkpoint", good}, "unload.log");
  EXPECT_EQ(unloaded.first, 0) << unloaded.second;
  ASSERT_TRUE(d.WaitLog("event=unload dir=")) << d.Log();
  ASSERT_TRUE(d.WaitLog("event=load_failed dir=")) << d.Log();
  const std::string log = d.Log();
  EXPECT_EQ(ControlBytes(log), 0) << log;
  std::istringstream lines(log);
  std::string line;
  int loads = 0, unloads = 0;
  while (std::getline(lines, line)) {
    EXPECT_NE(line.rfind(forged, 0), 0u) << "a forged line: " << line;
    const size_t at = line.find("event=");  // the line's own event (a quoted name may hold more text)
    const std::string event = at == std::string::npos ? "" : line.substr(at, line.find(' ', at) - at);
    loads += event == "event=load" ? 1 : 0;
    unloads += event == "event=unload" ? 1 : 0;
  }
  EXPECT_EQ(loads, 1) << log;
  EXPECT_EQ(unloads, 1) << log;
  EXPECT_TRUE(d.proc().Running());
}

// --- a private fallback checks the memory first ------------------------------------------------------------------

// A replica that cannot share (its checkpoint is not served) would build a private table: where the memory free to
// it (MemAvailable, or its cgroup's room) is short of the table's size it refuses, with the bytes needed and
// available and why it did not share, instead of being OOM-killed midway. The shortage comes from the test's fault
// hook (engram-replica-faults, ENGRAM_TEST_FAULT=private_table_memory); without it the same replica builds its table.
TEST(DaemonHardeningTest, APrivateFallbackChecksTheMemoryFirst) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string served = MakeCheckpoint(dir, 2, "served", 1);
  const std::string other = MakeCheckpoint(dir, 2, "other", 2);
  Daemon d(dir, {"--checkpoint", served, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  auto run = [&](const std::string& fault, const std::string& name) {
    if (!fault.empty()) ::setenv("ENGRAM_TEST_FAULT", fault.c_str(), 1);
    Process p({BinPath("engram-replica-faults"), "--socket", d.socket(), "--checkpoint", other, "--dp-size", "2",
               "--batches", "1"},
              dir / name);
    ::unsetenv("ENGRAM_TEST_FAULT");
    const int rc = p.Wait(60s);
    return std::make_pair(rc, testing::JsonLine(p.Output(), false));
  };
  const auto refused = run("private_table_memory", "short.log");
  EXPECT_EQ(refused.first, 1) << refused.second.dump();
  const std::string error = refused.second.value("error", "");
  EXPECT_NE(error.find("a private table of this shard needs "), std::string::npos) << error;
  EXPECT_NE(error.find(" are available"), std::string::npos) << error;
  EXPECT_NE(error.find("FINGERPRINT_MISMATCH"), std::string::npos) << "why it did not share: " << error;
  const auto built = run("", "enough.log");
  EXPECT_EQ(built.first, 0) << built.second.dump();
  EXPECT_EQ(built.second["mode"], "PRIVATE_PINNED") << built.second.dump();
  EXPECT_TRUE(d.proc().Running());
}

// Another uid can plant a directory (or a socket) at the lock file's path in a world-writable shm directory: that
// must not stop engramd from starting (it runs unlocked and says so), and a regular file at the socket's path is
// not deleted to make room for the listener.
TEST(DaemonHardeningTest, APlantedDirectoryAtTheLockPathDoesNotStopTheDaemon) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  std::filesystem::create_directory(shm + "/.engramd.lock");
  Daemon d(dir, {"--checkpoint", a, "--shm-dir", shm}, "planted");
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  EXPECT_NE(d.Log().find("shm_lock_unavailable"), std::string::npos) << d.Log();
  EXPECT_EQ(AttachOnce(d, a, shm)["decision"], "shared");
}

TEST(DaemonHardeningTest, ARegularFileAtTheSocketPathIsLeftAndRefused) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string victim = dir / "victim.sock";
  { std::ofstream(victim) << "keep me"; }
  Process p({BinPath("../daemon/engramd"), "--checkpoint", a, "--shm-dir", shm, "--socket", victim},
            dir / "victim.log");
  EXPECT_NE(p.Wait(), 0);
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "keep me") << "the daemon deleted a file that is not a socket";
  EXPECT_NE(p.Output().find("is not a socket"), std::string::npos) << p.Output();
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
