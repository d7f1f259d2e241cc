// engramd's configuration reload and roles, as real processes: on SIGHUP every changed key is applied or refused
// with a log line (`event=reload key=K applied|refused`); admin_group and the session bounds apply at once; a new
// revision written into a served checkpoint directory is published (replicas of the new files share) while the old
// revision's segments are retired.
//
// Every test has its own shm directory and socket under a temporary directory. They synchronise on conditions
// (status answers, log lines), never on sleeps. Cases that need other uids run them through setpriv and skip
// without root.
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
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
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

json AttachOnce(const Daemon& d, const std::string& ckpt, const std::string& shm, const std::string& prefix = "") {
  auto r = RunCmd(prefix + BinPath("engramctl") + " attach --socket " + d.socket() + " --checkpoint " + ckpt +
                  " --shm-dir " + shm + " --dp-size 2 --verify 50");
  json j = testing::JsonLine(r.out, false);
  if (j.is_null()) std::cerr << "attach: " << r.exit_code << " " << r.out << r.err << "\n";
  return j;
}

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// SIGHUP, then wait until the daemon logged one more summary line of a reload (or a refusal).
bool Reload(Daemon& d) {
  const std::string before = d.Log();
  const size_t done = Count(before, "event=reload added=") + Count(before, "event=reload_failed");
  d.proc().Signal(SIGHUP);
  return WaitFor(
      [&] {
        const std::string now = d.Log();
        return Count(now, "event=reload added=") + Count(now, "event=reload_failed") > done;
      },
      30s);
}

// A group other than root's and nogroup, to stand for the operators' group; empty when the system has none.
std::string SomeOtherGroup() {
  std::string name;
  setgrent();
  while (const struct group* g = getgrent()) {
    if (g->gr_gid != 0 && g->gr_gid != 65534 && g->gr_gid != 65533) {
      name = g->gr_name;
      break;
    }
  }
  endgrent();
  return name;
}

// The session bounds apply on SIGHUP (a second session of one uid is refused once max_sessions_per_uid is 1), and
// keys that need a restart are refused by name; every changed key has its line.
TEST(DaemonRolesTest, ReloadAppliesSessionBoundsAndRefusesRestartKeysByName) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string conf = dir / "engramd.conf";
  const std::string base = "checkpoint = " + a + "\nshm_dir = " + shm + "\n";
  testing::WriteFile(conf, base + "max_sessions_per_uid = 4\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  Process holder({BinPath("engramctl"), "attach", "--socket", d.socket(), "--checkpoint", a, "--shm-dir", shm,
                  "--dp-size", "2", "--hold", "600"},
                 dir / "holder.log");
  ASSERT_TRUE(WaitFor([&] { return !testing::JsonLine(holder.Output(), false).is_null(); }, 30s));
  EXPECT_EQ(AttachOnce(d, a, shm)["decision"], "shared") << "two sessions of one uid fit under 4";
  testing::WriteFile(conf, base + "max_sessions_per_uid = 1\nthreads = 3\n");
  ASSERT_TRUE(Reload(d)) << d.Log();
  const std::string log = d.Log();
  EXPECT_NE(log.find("event=reload key=max_sessions_per_uid applied value=\"1\""), std::string::npos) << log;
  EXPECT_NE(log.find("event=reload key=threads refused reason="), std::string::npos) << log;
  // The holder keeps its session; one more of the same uid is over the new bound.
  auto r = RunCmd(BinPath("engramctl") + " attach --socket " + d.socket() + " --checkpoint " + a + " --shm-dir " + shm +
                  " --dp-size 2");
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE((r.out + r.err).find("max_sessions_per_uid"), std::string::npos) << r.out << r.err;
  EXPECT_TRUE(d.WaitLog("reason=TOO_MANY_SESSIONS")) << d.Log();
  EXPECT_TRUE(holder.Running());
}

// A new revision written into the served directory is published on SIGHUP: replicas of the new files share it
// (before the reload they get FINGERPRINT_MISMATCH); the old revision's segment is retired.
TEST(DaemonRolesTest, ReloadPublishesANewRevisionOfAServedCheckpoint) {
  TempDir dir;
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string conf = dir / "engramd.conf";
  testing::WriteFile(conf, "checkpoint = " + a + "\nshm_dir = " + shm + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const std::string old_name = d.Status()["segments"][0]["name"];
  // The new revision: other table contents, written over the served files.
  std::filesystem::remove_all(a);
  MakeCheckpoint(dir, 8, "a", 2);
  const json stale = AttachOnce(d, a, shm);
  EXPECT_EQ(stale["decision"], "fallback") << stale.dump();
  EXPECT_TRUE(testing::ReasonSet(stale).count("FINGERPRINT_MISMATCH")) << stale.dump();
  ASSERT_TRUE(Reload(d)) << d.Log();
  EXPECT_NE(d.Log().find("event=checkpoint_revised dir=" + a), std::string::npos) << d.Log();
  EXPECT_NE(d.Log().find("event=reload key=checkpoint applied"), std::string::npos) << d.Log();
  ASSERT_TRUE(WaitFor(
      [&] {
        const json s = d.Status();
        return s["segments"].size() == 1 && s["segments"][0]["state"] == "READY" &&
               s["segments"][0]["name"] != old_name;
      },
      60s))
      << d.Status().dump() << d.Log();
  const json fresh = AttachOnce(d, a, shm);
  EXPECT_EQ(fresh["decision"], "shared") << fresh.dump();
  EXPECT_EQ(fresh["mismatches"], 0) << fresh.dump();
  EXPECT_FALSE(std::filesystem::exists(shm + "/" + old_name)) << "the old revision's segment is retired";
}

// admin_group removed on SIGHUP: its members lose the operator calls at once (and the line says it applied).
TEST(DaemonRolesTest, ReloadWithoutAdminGroupTakesTheOperatorCallsAway) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: setpriv runs the operator as another uid";
  if (RunCmd("command -v setpriv").exit_code != 0) GTEST_SKIP() << "setpriv (util-linux) is not installed";
  const std::string admins = SomeOtherGroup();
  if (admins.empty()) GTEST_SKIP() << "no group on this system to stand for the operators' group";
  const struct group* g = ::getgrnam(admins.c_str());
  ASSERT_NE(g, nullptr);
  const std::string operator_uid =
      "setpriv --reuid=65533 --regid=65533 --groups=65534," + std::to_string(g->gr_gid) + " ";
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string conf = dir / "engramd.conf";
  const std::string base = "checkpoint = " + a + "\nshm_dir = " + shm + "\ngroup = nogroup\n";
  testing::WriteFile(conf, base + "admin_group = " + admins + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  const std::string load_missing =
      BinPath("engramctl") + " load --socket " + d.socket() + " --checkpoint " + (dir / "missing");
  auto before = RunCmd(operator_uid + load_missing);
  EXPECT_EQ(before.exit_code, 1) << "an operator's load runs (and fails: no such checkpoint): " << before.err;
  EXPECT_EQ(before.err.find("may attach but not"), std::string::npos) << before.err;
  testing::WriteFile(conf, base);
  ASSERT_TRUE(Reload(d)) << d.Log();
  EXPECT_NE(d.Log().find("event=reload key=admin_group applied value=\"\""), std::string::npos) << d.Log();
  auto after = RunCmd(operator_uid + load_missing);
  EXPECT_EQ(after.exit_code, 4) << after.out << after.err;
  EXPECT_NE(after.err.find("may attach but not load"), std::string::npos) << after.err;
  // A group that does not exist refuses the whole reload.
  testing::WriteFile(conf, base + "admin_group = no-such-group-engram\n");
  ASSERT_TRUE(Reload(d)) << d.Log();
  EXPECT_NE(d.Log().find("admin group 'no-such-group-engram' does not exist: nothing changed"), std::string::npos)
      << d.Log();
}

// An operator who is only in admin_group (not in group) connects: the socket carries an ACL entry for the admin
// group. Removing admin_group on SIGHUP takes the entry away, so that user can no longer connect at all, while an
// engine of group still can.
TEST(DaemonRolesTest, AnOperatorOnlyInTheAdminGroupConnects) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: setpriv runs the operator as another uid";
  if (RunCmd("command -v setpriv").exit_code != 0) GTEST_SKIP() << "setpriv (util-linux) is not installed";
  const std::string admins = SomeOtherGroup();
  if (admins.empty()) GTEST_SKIP() << "no group on this system to stand for the operators' group";
  const struct group* g = ::getgrnam(admins.c_str());
  ASSERT_NE(g, nullptr);
  const std::string admin_gid = std::to_string(g->gr_gid);
  const std::string operator_only = "setpriv --reuid=65533 --regid=" + admin_gid + " --groups=" + admin_gid + " ";
  const std::string engine = "setpriv --reuid=65533 --regid=65534 --groups=65534 ";
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string shm = MakeShm(dir);
  const std::string a = MakeCheckpoint(dir, 8, "a", 1);
  const std::string conf = dir / "engramd.conf";
  const std::string base = "checkpoint = " + a + "\nshm_dir = " + shm + "\ngroup = nogroup\n";
  testing::WriteFile(conf, base + "admin_group = " + admins + "\n");
  Daemon d(dir, {"--config", conf});
  ASSERT_TRUE(d.WaitReady()) << d.Log();
  if (d.Log().find("keeps no ACLs") != std::string::npos) {
    GTEST_SKIP() << "the test directory's filesystem keeps no POSIX ACLs: " << d.Log();
  }
  EXPECT_NE(d.Log().find("event=admin_access gid=" + admin_gid), std::string::npos) << d.Log();
  const std::string status = BinPath("engramctl") + " status --socket " + d.socket();
  auto as_operator = RunCmd(operator_only + status);
  EXPECT_EQ(as_operator.exit_code, 0) << as_operator.out << as_operator.err;
  const std::string load_missing =
      BinPath("engramctl") + " load --socket " + d.socket() + " --checkpoint " + (dir / "missing");
  auto load = RunCmd(operator_only + load_missing);
  EXPECT_EQ(load.exit_code, 1) << "the operator's load runs (and fails: no such checkpoint): " << load.err;
  EXPECT_EQ(load.err.find("permission denied"), std::string::npos) << load.err;
  EXPECT_EQ(load.err.find("may attach but not"), std::string::npos) << load.err;
  // The socket's mode is as before: the ACL adds the admin group, nothing else.
  struct stat st {};
  ASSERT_EQ(::stat(d.socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(RunCmd("setpriv --reuid=65533 --regid=65533 --groups=65533 " + status).exit_code, 4)
      << "a user in neither group still cannot connect";

  testing::WriteFile(conf, base);
  ASSERT_TRUE(Reload(d)) << d.Log();
  auto after = RunCmd(operator_only + status);
  EXPECT_EQ(after.exit_code, 4) << after.out << after.err;
  EXPECT_NE(after.err.find("permission denied on"), std::string::npos) << after.err;
  auto engine_status = RunCmd(engine + status);
  EXPECT_EQ(engine_status.exit_code, 0) << engine_status.out << engine_status.err;
}

}  // namespace
}  // namespace engram
