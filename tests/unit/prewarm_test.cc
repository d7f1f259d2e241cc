// RegistrationPrewarm (daemon/prewarm.h) with stand-in tools (shell scripts that answer as engram-prewarm does, or
// misbehave): a report is parsed, a missing GPU is a skip with the tool's reason, a failure or a lying report is
// failed, a hung child is killed when a replica queues for a ticket and at the timeout, Stop kills and reaps a
// running child; tickets: the prewarm never takes one a replica waits for, and gives back every one it took.
// ResolvePrewarmTool: off, auto with and without the tool, a path that is not an executable. Also ReplicaRegistry's
// daemon ticket. Waits are on conditions with deadlines, never fixed sleeps.
#include "daemon/prewarm.h"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "daemon/replica_registry.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram::daemon {
namespace {

using namespace std::chrono_literals;
using engram::testing::ReadFile;
using engram::testing::TempDir;
using engram::testing::WriteFile;

std::string Script(const TempDir& dir, const std::string& name, const std::string& body) {
  const std::string path = dir / name;
  WriteFile(path, "#!/bin/sh\n" + body);
  ::chmod(path.c_str(), 0755);
  return path;
}

struct FakeTickets {
  std::atomic<int> held{0}, taken{0};
  std::atomic<bool> free{true}, waiting{false};
  RegistrationPrewarm::Hooks Hooks() {
    return {[this] {
              if (!free.load() || waiting.load()) return false;
              ++held;
              ++taken;
              return true;
            },
            [this] { --held; }, [this] { return waiting.load(); }};
  }
};

PrewarmOptions Tool(const std::string& path, std::chrono::milliseconds timeout = 60s) {
  PrewarmOptions o;
  o.tool = path;
  o.timeout = timeout;
  return o;
}

// Polls `f` until true or 30 s.
template <typename F>
bool Eventually(F f) {
  const auto end = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return f();
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0; }

pid_t ReadPid(const std::string& path) {
  std::ifstream in(path);
  pid_t pid = 0;
  in >> pid;
  return pid;
}

TEST(Prewarm, ReportOfTheToolIsRecordedAndTheTicketGivenBack) {
  TempDir dir;
  const std::string args = dir / "args";
  const std::string tool = Script(dir, "engram-prewarm",
                                  "echo \"$@\" > " + args +
                                      "\necho 'populate_seconds=0.100 register_seconds=1.625 "
                                      "unregister_seconds=0.200 bytes=4096'\n");
  FakeTickets t;
  RegistrationPrewarm p(Tool(tool), t.Hooks());
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kOff);
  EXPECT_EQ(p.RecordOf("/shm/a").detail, "the segment is not READY yet");
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(p.WaitIdle(30s));
  const PrewarmRecord r = p.RecordOf("/shm/a");
  EXPECT_EQ(r.state, PrewarmState::kDone) << r.detail;
  EXPECT_DOUBLE_EQ(r.register_seconds, 1.625);
  EXPECT_GT(r.seconds, 0);
  EXPECT_GT(r.at_unix_ms, 1700000000000);
  EXPECT_NE(r.detail.find("register_seconds=1.625"), std::string::npos);
  EXPECT_EQ(ReadFile(args), "--segment /shm/a\n");
  EXPECT_EQ(t.taken.load(), 1);
  EXPECT_EQ(t.held.load(), 0);
}

// engramd blocks SIGTERM/SIGINT/SIGHUP for its signal thread: the child must not inherit that (it could not be
// stopped like any process).
TEST(Prewarm, TheChildStartsWithNoSignalBlocked) {
  TempDir dir;
  const std::string out = dir / "sigblk";
  // The tool's shell execs grep in its own place (no fork): grep's mask is the one the child started with. (Reading
  // the shell's own status from a forked grep races with dash, which blocks every signal while it forks.)
  const std::string tool = Script(dir, "t", "exec grep SigBlk /proc/self/status > " + out + "\n");
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGHUP);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, &old), 0);  // the worker thread inherits this, as in engramd
  FakeTickets t;
  {
    RegistrationPrewarm p(Tool(tool), t.Hooks());
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    p.SegmentReady("/shm/a");
    ASSERT_TRUE(p.WaitIdle(30s));
    // No register_seconds line: the record says the tool failed; what matters here is the mask it started with.
    EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kFailed) << p.RecordOf("/shm/a").detail;
  }
  const std::string line = ReadFile(out);  // "SigBlk:\t<hex mask>": bit n-1 is signal n
  const size_t tab = line.find_first_of("\t ");
  ASSERT_NE(tab, std::string::npos) << line;
  const unsigned long long mask = std::strtoull(line.c_str() + tab + 1, nullptr, 16);
  EXPECT_EQ(mask & ((1ull << (SIGTERM - 1)) | (1ull << (SIGHUP - 1))), 0u) << line;
}

TEST(Prewarm, NoGpuIsASkipWithTheToolsReason) {
  TempDir dir;
  const std::string tool = Script(dir, "t", "echo 'reason=no CUDA device on this machine'\nexit 3\n");
  FakeTickets t;
  RegistrationPrewarm p(Tool(tool), t.Hooks());
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kSkipped);
  EXPECT_EQ(p.RecordOf("/shm/a").detail, "no CUDA device on this machine");
  EXPECT_EQ(t.held.load(), 0);
}

TEST(Prewarm, FailuresSayWhy) {
  TempDir dir;
  struct Case {
    std::string body, want;
  } cases[] = {
      {"echo 'error=cuMemHostRegister of chunk 0: CUDA_ERROR_OUT_OF_MEMORY'\nexit 1\n",
       "engram-prewarm exited with status 1: cuMemHostRegister of chunk 0: CUDA_ERROR_OUT_OF_MEMORY"},
      {"exit 7\n", "engram-prewarm exited with status 7"},
      {"kill -9 $$\n", "engram-prewarm was killed by signal 9"},
      {"echo 'register_seconds=fast'\n", "engram-prewarm said no register_seconds: register_seconds=fast"},
      {"printf 'register_seconds=\\033[2J'\n", "engram-prewarm said no register_seconds: register_seconds=?[2J"},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string tool = Script(dir, "t" + std::to_string(i++), c.body);
    FakeTickets t;
    RegistrationPrewarm p(Tool(tool), t.Hooks());
    p.SegmentReady("/shm/a");
    ASSERT_TRUE(p.WaitIdle(30s));
    EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kFailed) << c.body;
    EXPECT_EQ(p.RecordOf("/shm/a").detail, c.want) << c.body;
    EXPECT_EQ(t.held.load(), 0);
  }
}

TEST(Prewarm, AReplicaAskingForATicketStopsTheChild) {
  TempDir dir;
  const std::string pidfile = dir / "pid";
  const std::string tool = Script(dir, "t", "echo $$ > " + pidfile + "\nexec sleep 600\n");
  FakeTickets t;
  RegistrationPrewarm p(Tool(tool), t.Hooks());
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(Eventually([&] { return ReadPid(pidfile) > 0; }));
  const pid_t child = ReadPid(pidfile);
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kRunning);
  EXPECT_EQ(t.held.load(), 1);
  t.waiting = true;
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kStopped);
  EXPECT_NE(p.RecordOf("/shm/a").detail.find("a replica asked for a registration ticket"), std::string::npos);
  EXPECT_FALSE(Alive(child));  // killed and reaped
  EXPECT_EQ(t.held.load(), 0);
}

TEST(Prewarm, AChildPastTheTimeoutIsKilled) {
  TempDir dir;
  const std::string pidfile = dir / "pid";
  const std::string tool = Script(dir, "t", "echo $$ > " + pidfile + "\nexec sleep 600\n");
  FakeTickets t;
  RegistrationPrewarm p(Tool(tool, 300ms), t.Hooks());
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kFailed);
  EXPECT_EQ(p.RecordOf("/shm/a").detail, "engram-prewarm ran longer than 300 ms and was stopped");
  EXPECT_FALSE(Alive(ReadPid(pidfile)));
  EXPECT_EQ(t.held.load(), 0);
}

TEST(Prewarm, AChildThatClosesItsOutputAndHangsIsStillBounded) {
  TempDir dir;
  const std::string pidfile = dir / "pid";
  const std::string tool = Script(dir, "t", "echo $$ > " + pidfile + "\nexec sleep 600 >/dev/null 2>&1\n");
  FakeTickets t;
  RegistrationPrewarm p(Tool(tool, 300ms), t.Hooks());
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kFailed);
  EXPECT_FALSE(Alive(ReadPid(pidfile)));
}

TEST(Prewarm, StopKillsARunningChild) {
  TempDir dir;
  const std::string pidfile = dir / "pid";
  const std::string tool = Script(dir, "t", "echo $$ > " + pidfile + "\nexec sleep 600\n");
  FakeTickets t;
  pid_t child = 0;
  {
    RegistrationPrewarm p(Tool(tool), t.Hooks());
    p.SegmentReady("/shm/a");
    p.SegmentReady("/shm/b");
    ASSERT_TRUE(Eventually([&] { return ReadPid(pidfile) > 0; }));
    child = ReadPid(pidfile);
    p.Stop();
    EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kStopped);
    EXPECT_EQ(p.RecordOf("/shm/a").detail, "engramd is stopping");
    p.SegmentReady("/shm/c");  // after Stop: nothing
    EXPECT_EQ(p.RecordOf("/shm/c").state, PrewarmState::kOff);
  }
  EXPECT_FALSE(Alive(child));
  EXPECT_EQ(t.held.load(), 0);
}

TEST(Prewarm, NeverTakesATicketAReplicaWaitsFor) {
  TempDir dir;
  const std::string ran = dir / "ran";
  const std::string tool = Script(dir, "t", "touch " + ran + "\necho register_seconds=1\n");
  FakeTickets t;
  t.waiting = true;
  RegistrationPrewarm p(Tool(tool), t.Hooks());
  p.SegmentReady("/shm/a");
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kSkipped);
  EXPECT_NE(p.RecordOf("/shm/a").detail.find("a replica was already waiting"), std::string::npos);
  t.waiting = false;
  t.free = false;  // a replica is registering
  p.SegmentReady("/shm/b");
  ASSERT_TRUE(p.WaitIdle(30s));
  EXPECT_EQ(p.RecordOf("/shm/b").state, PrewarmState::kSkipped);
  EXPECT_NE(p.RecordOf("/shm/b").detail.find("no registration ticket was free"), std::string::npos);
  EXPECT_EQ(t.taken.load(), 0);
  EXPECT_FALSE(std::filesystem::exists(ran));
}

TEST(Prewarm, ResolveTheTool) {
  TempDir dir;
  auto off = ResolvePrewarmTool("off", dir.path());
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->tool.empty());
  EXPECT_EQ(off->off_reason, "prewarm_registration is off");
  auto missing = ResolvePrewarmTool("auto", dir.path());
  ASSERT_TRUE(missing.ok());
  EXPECT_TRUE(missing->tool.empty());
  EXPECT_NE(missing->off_reason.find("engram-prewarm is not installed next to engramd"), std::string::npos);
  RegistrationPrewarm p(*missing, FakeTickets().Hooks());  // off: records say why, SegmentReady does nothing
  p.SegmentReady("/shm/a");
  EXPECT_EQ(p.RecordOf("/shm/a").state, PrewarmState::kOff);
  EXPECT_EQ(p.RecordOf("/shm/a").detail, missing->off_reason);
  const std::string tool = Script(dir, "engram-prewarm", "exit 0\n");
  auto found = ResolvePrewarmTool("auto", dir.path());
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->tool, tool);
  EXPECT_EQ(ResolvePrewarmTool(tool, "/nowhere")->tool, tool);
  WriteFile(dir / "plain", "not a program");
  EXPECT_EQ(ResolvePrewarmTool(dir / "plain", dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolvePrewarmTool(dir.path(), dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolvePrewarmTool(dir / "absent", dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PrewarmTicket, TheDaemonTicketIsTakenOnlyWhenFreeAndNobodyWaits) {
  ReplicaRegistry reg(1, 1);
  engram::v1::Hello h;
  h.set_fingerprint(1);
  h.set_tp_size(1);
  h.set_dp_size(2);
  Decision d;
  d.share = true;
  d.mode = engram::v1::SHARED;
  const std::string a = reg.Attach(h, PeerCred{}, d, "/c/s", nullptr);
  ASSERT_TRUE(reg.TryHoldDaemonTicket());
  EXPECT_FALSE(reg.TryHoldDaemonTicket());  // capacity 1
  EXPECT_EQ(reg.tickets_free(), 0);
  EXPECT_FALSE(reg.ReplicaWaiting());
  std::atomic<bool> granted{false};
  std::thread w([&] { granted = reg.AcquireTicket(a, [] { return false; }); });
  ASSERT_TRUE(Eventually([&] { return reg.ReplicaWaiting(); }));
  EXPECT_FALSE(granted.load());
  reg.ReleaseDaemonTicket();
  w.join();
  EXPECT_TRUE(granted.load());
  EXPECT_FALSE(reg.ReplicaWaiting());
  EXPECT_FALSE(reg.TryHoldDaemonTicket());  // the replica holds it
  reg.ReleaseDaemonTicket();                // none held by the daemon: changes nothing
  EXPECT_EQ(reg.tickets_free(), 0);
  reg.Detach(a);
  EXPECT_EQ(reg.tickets_free(), 1);
  EXPECT_TRUE(reg.TryHoldDaemonTicket());
  reg.ReleaseDaemonTicket();
  EXPECT_EQ(reg.tickets_free(), 1);
}

}  // namespace
}  // namespace engram::daemon
