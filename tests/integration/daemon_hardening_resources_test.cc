// engramd hardening, as real processes: the node's limits. Running out of descriptors does not spin the accept loop
// (the one measurement of these tests: a busy spin uses a whole core, a backed-off loop almost none), a held
// registration ticket expires and waiters keep their deadlines, tickets go round the uids, and a private fallback
// checks the memory first.
//
// See tests/integration/daemon_hardening.h for what the hardening tests share.
#include <fcntl.h>
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
using testing::NoOtherUids;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

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

}  // namespace
}  // namespace engram
