// Descriptor passing end to end, with a real engramd and real replica processes: replicas in their own
// mount and IPC namespaces, replicas of another uid, a uid that may not connect, and a thousand attaches with kills.
// Needs root for namespaces and uids (the tests say so and skip otherwise); everything else runs anywhere.
#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shm/descriptor_protocol.h"
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

bool Root() { return ::geteuid() == 0; }

// Whether this machine lets us make private mount + IPC namespaces (root in a container may not).
bool CanUnshare() {
  static const bool ok = RunCmd("unshare -m -i true").exit_code == 0;
  return ok;
}

json LastJson(const std::string& out) { return testing::JsonLine(out, true); }

std::string Replica(const Daemon& d, const std::string& ckpt, const std::string& extra = "") {
  return BinPath("engram-replica") + " --socket " + d.socket() + " --checkpoint " + ckpt +
         " --dp-size 2 --batches 1 --tokens 64 --verify 32 " + extra;
}

// The command line run inside fresh mount and IPC namespaces where /dev/shm and the daemon's shm directory are
// private, empty tmpfs mounts: nothing the daemon put there is visible by path.
std::string Isolated(const std::string& shm, const std::string& cmd) {
  return "exec unshare -m -i sh -c 'mount --make-rprivate / && mount -t tmpfs -o size=4m tmpfs /dev/shm && "
         "mount -t tmpfs -o size=4m tmpfs " +
         shm + " && ls -A " + shm + " | wc -l >&2 && exec " + cmd + "'";
}

int DaemonFds(pid_t pid) {
  int n = 0;
  DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

TEST(DescriptorTest, AReplicaInPrivateNamespacesSharesThroughTheDescriptor) {
  if (!Root() || !CanUnshare()) GTEST_SKIP() << "needs root and unshare(CLONE_NEWNS|CLONE_NEWIPC)";
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();

  auto r = RunCmd(Isolated(shm, Replica(d, ckpt, "--write-probe")));
  EXPECT_NE(r.err.find("0\n"), std::string::npos) << "the namespace's shm directory is not empty: " << r.err;
  json j = LastJson(r.out);
  EXPECT_EQ(j["mode"], "SHARED") << r.out << r.err;
  EXPECT_EQ(j["attach"], "descriptor") << j.dump();
  EXPECT_GT(j["verified"].get<int>(), 0) << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();
  EXPECT_EQ(j["write_faulted"], true) << j.dump();
  EXPECT_EQ(j["mprotect_refused"], true) << j.dump();

  // The same replica without the descriptor cannot see the file: that is SHM_NOT_VISIBLE, and it says both why's.
  r = RunCmd(Isolated(shm, Replica(d, ckpt, "--no-descriptor")));
  j = LastJson(r.out);
  EXPECT_EQ(j["mode"], "PRIVATE_PINNED") << r.out << r.err;
  EXPECT_EQ(j["reasons"], json::array({"NO_CUDA_DEVICE", "SHM_NOT_VISIBLE"})) << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();

  // Status shows how a live replica attached.
  Process held({"/bin/sh", "-c", Isolated(shm, Replica(d, ckpt, "--hold 60"))}, dir / "held.log");
  ASSERT_TRUE(WaitFor([&] { return held.Output().find("\"attached\"") != std::string::npos; }, 30s)) << held.Output();
  const json s = d.Status();
  ASSERT_EQ(s["replicas"].size(), 1u) << s.dump();
  EXPECT_EQ(s["replicas"][0]["mode"], "SHARED");
  EXPECT_EQ(s["replicas"][0]["attach"], "descriptor");
  EXPECT_GE(s["descriptors"]["sent"].get<int>(), 2);
  EXPECT_EQ(s["descriptors"]["socket"], d.socket() + ".fds");
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  EXPECT_NE(text.out.find("descriptor"), std::string::npos) << text.out;
  held.Signal(SIGKILL);
  held.Wait();
}

TEST(DescriptorTest, AReplicaNeedsNoShmDirectoryAndFallsBackToThePath) {
  TempDir dir;
  const std::string shm = MakeShm(dir);  // not /dev/shm: the replica is never told
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  json j = LastJson(RunCmd(Replica(d, ckpt)).out);
  EXPECT_EQ(j["mode"], "SHARED") << j.dump();
  EXPECT_EQ(j["attach"], "descriptor") << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();
  // Where no descriptor comes, the path the grant names works for a process that may open the file.
  j = LastJson(RunCmd(Replica(d, ckpt, "--no-descriptor")).out);
  EXPECT_EQ(j["mode"], "SHARED") << j.dump();
  EXPECT_EQ(j["attach"], "path") << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();
  // And a wrong --shm-dir for the path fallback is SHM_NOT_VISIBLE, not a crash or a wrong table.
  j = LastJson(RunCmd(Replica(d, ckpt, "--no-descriptor --shm-dir " + (dir / "nowhere"))).out);
  EXPECT_EQ(j["mode"], "PRIVATE_PINNED") << j.dump();
  EXPECT_EQ(j["reasons"], json::array({"NO_CUDA_DEVICE", "SHM_NOT_VISIBLE"})) << j.dump();
}

TEST(DescriptorTest, ANonRootReplicaGetsAReadOnlyDescriptorAndNothingMore) {
  if (!Root()) GTEST_SKIP() << "needs root: setpriv changes uid";
  if (RunCmd("getent group nogroup").exit_code != 0) GTEST_SKIP() << "no group 'nogroup'";
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const std::string seg = shm + "/" + d.Status()["segments"][0]["name"].get<std::string>();
  struct stat st {};
  ASSERT_EQ(::stat(seg.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "only the daemon's uid may read the file";
  EXPECT_EQ(st.st_uid, ::geteuid());

  const std::string member = "setpriv --reuid=65533 --regid=65533 --groups=65534 ";
  auto r = RunCmd(member + BinPath("fd_helper") + " fetch " + d.socket() + " " + ckpt);
  json j = LastJson(r.out);
  ASSERT_EQ(j["granted"], true) << r.out << r.err;
  EXPECT_EQ(j["fetched"], true) << j.dump();
  EXPECT_EQ(j["read_only"], true) << j.dump();
  EXPECT_EQ(j["magic_ok"], true) << j.dump();
  EXPECT_EQ(j["mmap_write_errno"], EACCES) << j.dump();
  EXPECT_EQ(j["mprotect_errno"], EACCES) << j.dump();
  EXPECT_EQ(j["reopen_rw_errno"], EACCES) << "reopened writable through /proc/self/fd: " << j.dump();
  EXPECT_EQ(j["open_path_errno"], EACCES) << "the file is readable by another uid: " << j.dump();
  EXPECT_EQ(j["second_fetch"], false) << "a token works once: " << j.dump();

  // The whole client as that uid: SHARED through the descriptor, rows checked against the checkpoint.
  r = RunCmd(member + Replica(d, ckpt, "--write-probe"));  // a 4 MiB table: within a non-root RLIMIT_MEMLOCK
  j = LastJson(r.out);
  EXPECT_EQ(j["mode"], "SHARED") << r.out << r.err;
  EXPECT_EQ(j["attach"], "descriptor") << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();
  EXPECT_EQ(j["mprotect_refused"], true) << j.dump();
}

TEST(DescriptorTest, AUidThatMayNotConnectOrAnotherProcessGetsNoDescriptor) {
  if (!Root()) GTEST_SKIP() << "needs root: setpriv changes uid";
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});  // no --group: root and the daemon's uid only
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  // A legitimate session holds a token; others try to use it.
  Process holder({BinPath("fd_helper"), "grant", d.socket(), ckpt}, dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return holder.Output().find("\"token\"") != std::string::npos; }, 30s)) << holder.Output();
  const json g = LastJson(holder.Output());
  ASSERT_EQ(g["granted"], true);
  const std::string steal = BinPath("fd_helper") + " steal " + g["channel"].get<std::string>() + " " +
                            g["lease"].get<std::string>() + " " + g["token"].get<std::string>();
  // Another uid, even with the socket made reachable: the daemon's own SO_PEERCRED check refuses it.
  ::chmod(g["channel"].get<std::string>().c_str(), 0666);
  json j = LastJson(RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups " + steal).out);
  EXPECT_EQ(j["fetched"], false) << j.dump();
  EXPECT_NE(j["error"].get<std::string>().find("may not use engramd"), std::string::npos) << j.dump();
  // The right uid with the right token, but not the process that holds the lease.
  j = LastJson(RunCmd(steal).out);
  EXPECT_EQ(j["fetched"], false) << j.dump();
  EXPECT_NE(j["error"].get<std::string>().find("belongs to pid"), std::string::npos) << j.dump();
  // The refused uid's replica falls back with PERMISSION_DENIED (the gRPC socket refuses it too).
  ::chmod(d.socket().c_str(), 0666);
  j = LastJson(RunCmd("setpriv --reuid=65533 --regid=65533 --clear-groups " + Replica(d, ckpt)).out);
  EXPECT_EQ(j["mode"], "PRIVATE_PINNED") << j.dump();
  EXPECT_NE(j["reasons"].dump().find("PERMISSION_DENIED"), std::string::npos) << j.dump();
  const json s = d.Status();
  EXPECT_GE(s["descriptors"]["refused"].get<int>(), 2) << s.dump();
  EXPECT_EQ(s["descriptors"]["sent"].get<int>(), 0) << s.dump();
  holder.Signal(SIGKILL);
  holder.Wait();
}

// A segment unloaded between the grant and the descriptor fetch: the channel says the segment is gone (the client
// then reports SEGMENT_NOT_READY, not SHM_NOT_VISIBLE with a hint to mount a directory).
TEST(DescriptorTest, ASegmentGoneBetweenGrantAndFetchIsSaidSo) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const std::string trigger = dir / "fetch-now";
  Process holder({BinPath("fd_helper"), "grant", d.socket(), ckpt, trigger}, dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return holder.Output().find("\"token\"") != std::string::npos; }, 30s)) << holder.Output();
  auto unload = RunCmd(BinPath("engramctl") + " unload --checkpoint " + ckpt + " --socket " + d.socket());
  ASSERT_EQ(unload.exit_code, 0) << unload.out << unload.err;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& e : std::filesystem::directory_iterator(shm)) {
          if (e.path().filename().string().rfind("engram-", 0) == 0) return false;
        }
        return true;
      },
      30s))
      << "the unloaded segment was not removed";
  { std::ofstream(trigger.c_str()) << "go"; }
  ASSERT_TRUE(WaitFor([&] { return holder.Output().find("\"fetched\"") != std::string::npos; }, 30s))
      << holder.Output();
  const json j = LastJson(holder.Output());
  EXPECT_EQ(j["fetched"], false) << j.dump();
  EXPECT_NE(j["error"].get<std::string>().find(kSegmentGone), std::string::npos) << j.dump();
  EXPECT_TRUE(SegmentGone(j["error"].get<std::string>()));
  holder.Signal(SIGKILL);
  holder.Wait();
}

// A daemon in its own PID namespace (a pod without hostPID, a container) sees pid 0 for every replica and cannot
// read their /proc entries: group membership still comes through (SO_PEERGROUPS at accept), so a non-root member
// of --group shares through the descriptor.
TEST(DescriptorTest, ADaemonInItsOwnPidNamespaceAdmitsGroupMembers) {
  if (!Root() || RunCmd("unshare -p -f --kill-child --mount-proc true").exit_code != 0) {
    GTEST_SKIP() << "needs root and unshare(CLONE_NEWPID)";
  }
  if (RunCmd("getent group nogroup").exit_code != 0) GTEST_SKIP() << "no group 'nogroup'";
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--group", "nogroup"}, "engramd",
           {"/usr/bin/unshare", "-p", "-f", "--kill-child", "--mount-proc"});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  // A member by supplementary group only: its own primary group is not the daemon's.
  const json j = LastJson(RunCmd("setpriv --reuid=65533 --regid=65533 --groups=65534 " + Replica(d, ckpt)).out);
  EXPECT_EQ(j["mode"], "SHARED") << j.dump() << d.Log();
  EXPECT_EQ(j["attach"], "descriptor") << j.dump();
  EXPECT_EQ(j["mismatches"], 0) << j.dump();
  EXPECT_EQ(d.Log().find("event=refused"), std::string::npos) << d.Log();
}

// Idle connections cannot shut the channel for others: a flood holds at most its uid's share of the slots, the
// rest wait in the backlog, and a replica that can only attach by descriptor still gets one.
TEST(DescriptorTest, AFloodOfIdleConnectionsDoesNotStarveAReplica) {
  if (!Root() || !CanUnshare()) GTEST_SKIP() << "needs root and unshare(CLONE_NEWNS|CLONE_NEWIPC)";
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  std::vector<int> flood;
  for (int i = 0; i < 200; ++i) {
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path = d.socket() + ".fds";
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    (void)::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    flood.push_back(s);
  }
  const json j = LastJson(RunCmd(Isolated(shm, Replica(d, ckpt))).out);
  EXPECT_EQ(j["mode"], "SHARED") << j.dump();
  EXPECT_EQ(j["attach"], "descriptor") << j.dump();
  for (int s : flood) ::close(s);
  EXPECT_TRUE(d.proc().Running());
}

TEST(DescriptorTest, AThousandAttachesAndKillsLeaveTheDaemonsDescriptorCountWhereItWas) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string ckpt = MakeCheckpoint(dir, 4);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const pid_t pid = d.proc().pid();
  auto cycle = [&](int n) {
    const json j =
        LastJson(RunCmd(BinPath("fd_helper") + " cycle " + d.socket() + " " + ckpt + " " + std::to_string(n)).out);
    EXPECT_EQ(j["failures"], 0) << j.dump();
  };
  auto idle = [&] {
    return WaitFor(
        [&] {
          const json s = d.Status();
          return !s.is_null() && s["replicas"].empty();
        },
        20s);
  };
  cycle(5);  // warm up whatever the daemon allocates once (gRPC's pollers, ...)
  ASSERT_TRUE(idle());
  const int before = DaemonFds(pid);
  ASSERT_GT(before, 0);

  cycle(1000);
  // Kills: after the descriptor came, and at a random moment during the attach.
  for (int i = 0; i < 20; ++i) {
    Process p({BinPath("fd_helper"), "hold", d.socket(), ckpt}, dir / ("hold" + std::to_string(i) + ".log"));
    if (i % 2 == 0) {
      EXPECT_TRUE(WaitFor([&] { return p.Output().find("\"fetched\":true") != std::string::npos; }, 20s)) << p.Output();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * i));
    }
    p.Signal(SIGKILL);
    p.Wait();
  }
  ASSERT_TRUE(idle()) << d.Status().dump();
  EXPECT_TRUE(WaitFor([&] { return DaemonFds(pid) == before; }, 20s))
      << "daemon descriptors: " << DaemonFds(pid) << ", before: " << before;
  const json s = d.Status();
  EXPECT_GE(s["descriptors"]["sent"].get<int>(), 1015) << s.dump();
  EXPECT_TRUE(d.proc().Running());
}

}  // namespace
}  // namespace engram
