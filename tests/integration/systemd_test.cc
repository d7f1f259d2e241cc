// The systemd unit, for real where this machine allows: `systemd-analyze verify` accepts it (with ExecStart pointed
// at the built binary), its hardening keeps /dev/shm shared (no RemoveIPC, DynamicUser, PrivateDevices, PrivateIPC),
// and its ExecStart line, run exactly as written (paths swapped for the build tree's) with a NOTIFY_SOCKET, reaches
// READY=1; ExecReload's SIGHUP reloads; SIGTERM stops cleanly. The install target puts every file in place.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstring>
#include <map>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/integration/process.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using testing::BinPath;
using testing::Process;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;

std::string SourcePath(const std::string& rel) { return std::string(ENGRAM_SOURCE_DIR) + "/" + rel; }

std::multimap<std::string, std::string> UnitKeys(const std::string& text) {
  std::multimap<std::string, std::string> keys;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line[0] == '[') continue;
    auto eq = line.find('=');
    if (eq != std::string::npos) keys.emplace(line.substr(0, eq), line.substr(eq + 1));
  }
  return keys;
}

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) s.replace(p, from.size(), to);
  return s;
}

TEST(SystemdTest, UnitKeepsSharedMemoryShared) {
  auto keys = UnitKeys(testing::ReadFile(SourcePath("systemd/engramd.service")));
  auto one = [&](const std::string& k) { return keys.count(k) ? keys.find(k)->second : ""; };
  EXPECT_EQ(one("Type"), "notify");
  EXPECT_EQ(one("RemoveIPC"), "no");
  EXPECT_NE(one("DynamicUser"), "yes");
  EXPECT_NE(one("PrivateDevices"), "yes");
  EXPECT_NE(one("PrivateIPC"), "yes");
  EXPECT_NE(one("ReadWritePaths").find("/dev/shm"), std::string::npos);
  EXPECT_EQ(one("RuntimeDirectory"), "engramd");
  EXPECT_EQ(one("RuntimeDirectoryMode"), "0750");
  EXPECT_EQ(one("Restart"), "on-failure");
  EXPECT_EQ(one("LimitMEMLOCK"), "infinity");
  EXPECT_NE(one("ExecStart").find("--config /etc/engramd/engramd.conf"), std::string::npos);
  // Segments on the huge-page tmpfs by default: the service requires the mount, the shipped config points there, and
  // the mount gives huge pages.
  EXPECT_EQ(one("Requires"), "var-lib-engram-shm.mount");
  bool after_mount = false;
  for (auto [it, end] = keys.equal_range("After"); it != end; ++it)
    after_mount |= it->second == "var-lib-engram-shm.mount";
  EXPECT_TRUE(after_mount) << "engramd starts after its tmpfs is mounted";
  auto mount = UnitKeys(testing::ReadFile(SourcePath("systemd/var-lib-engram-shm.mount")));
  ASSERT_EQ(mount.count("Where"), 1u);
  EXPECT_EQ(mount.find("Where")->second, "/var/lib/engram/shm");
  EXPECT_EQ(mount.find("Type")->second, "tmpfs");
  EXPECT_NE(mount.find("Options")->second.find("huge=always"), std::string::npos);
  EXPECT_NE(testing::ReadFile(SourcePath("etc/engramd.conf")).find("\nshm_dir = /var/lib/engram/shm\n"),
            std::string::npos);
  // The tmpfs comes up root's; engramd (User=engram) gets its root before every start, whatever ran before.
  EXPECT_EQ(one("ExecStartPre"), "+/usr/bin/install -d -o engram -g engram -m 0750 /var/lib/engram/shm");
  // Prometheus metrics on by default (docs/operations.md "Metrics"): the shipped config serves them on 9464 and the
  // unit lets the daemon open a TCP socket.
  EXPECT_NE(testing::ReadFile(SourcePath("etc/engramd.conf")).find("\nmetrics_address = 0.0.0.0:9464\n"),
            std::string::npos);
  EXPECT_NE(one("RestrictAddressFamilies").find("AF_INET"), std::string::npos);
}

TEST(SystemdTest, SystemdAnalyzeVerifiesTheUnits) {
  if (RunCmd("command -v systemd-analyze").exit_code != 0) GTEST_SKIP() << "systemd-analyze is not installed";
  TempDir dir;
  const std::string unit = Replace(testing::ReadFile(SourcePath("systemd/engramd.service")), "/usr/local/bin/engramd",
                                   BinPath("../daemon/engramd"));
  testing::WriteFile(dir / "engramd.service", unit);
  // The mount unit it requires, next to it (verify looks for units in the directories of the files it is given).
  testing::WriteFile(dir / "var-lib-engram-shm.mount",
                     testing::ReadFile(SourcePath("systemd/var-lib-engram-shm.mount")));
  auto r = RunCmd("systemd-analyze verify " + (dir / "engramd.service") + " " + (dir / "var-lib-engram-shm.mount") +
                  " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "") << "systemd-analyze complains";
  auto m = RunCmd("systemd-analyze verify " + SourcePath("systemd/var-lib-engram-shm.mount") + " 2>&1");
  EXPECT_EQ(m.exit_code, 0) << m.out;
}

TEST(SystemdTest, ExecStartReachesReadyThroughNotifySocketAndReloads) {
  TempDir dir;
  ASSERT_EQ(RunCmd(BinPath("engram-mkckpt") + " --out " + (dir / "ck") + " --table-mib 16").exit_code, 0);
  ::mkdir((dir / "shm").c_str(), 0755);
  // The shipped config, pointed at the test's checkpoint, shm and socket.
  std::string conf = testing::ReadFile(SourcePath("etc/engramd.conf"));
  conf = Replace(conf, "#checkpoint = /models/DeepSeek-V4.1-Flash", "checkpoint = " + (dir / "ck"));
  conf = Replace(conf, "shm_dir = /var/lib/engram/shm", "shm_dir = " + (dir / "shm"));
  conf = Replace(conf, "socket = /run/engramd/engramd.sock", "socket = " + (dir / "run/engramd.sock"));
  conf = Replace(conf, "group = engram", "group = root");
  // The shipped config serves metrics on 9464; the test's daemon on a port the kernel picks.
  conf = Replace(conf, "\nmetrics_address = 0.0.0.0:9464\n", "\nmetrics_address = 127.0.0.1:0\n");
  testing::WriteFile(dir / "engramd.conf", conf);
  auto keys = UnitKeys(testing::ReadFile(SourcePath("systemd/engramd.service")));
  std::string exec = keys.find("ExecStart")->second;
  exec = Replace(exec, "/usr/local/bin/engramd", BinPath("../daemon/engramd"));
  exec = Replace(exec, "/etc/engramd/engramd.conf", dir / "engramd.conf");
  std::vector<std::string> argv;
  std::istringstream ss(exec);
  for (std::string w; ss >> w;) argv.push_back(w);

  testing::NotifySocket notify(dir / "notify.sock");
  ASSERT_TRUE(notify.bound());
  notify.Export();
  Process p(argv, dir / "engramd.log");
  testing::NotifySocket::Unexport();
  ASSERT_TRUE(WaitFor([&] { return notify.Drain().find("READY=1") != std::string::npos; }, std::chrono::seconds(30)))
      << notify.Drain() << p.Output();
  struct stat st {};
  ASSERT_EQ(::stat((dir / "run/engramd.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  ASSERT_EQ(::stat((dir / "run").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750u);
  EXPECT_NE(p.Output().find("event=metrics_listening address=127.0.0.1:"), std::string::npos) << p.Output();
  // ExecReload: SIGHUP re-reads the config.
  notify.Clear();
  p.Signal(SIGHUP);
  ASSERT_TRUE(
      WaitFor([&] { return notify.Drain().find("RELOADING=1") != std::string::npos; }, std::chrono::seconds(10)))
      << p.Output();
  EXPECT_TRUE(WaitFor([&] { return p.Output().find("event=reload") != std::string::npos; }, std::chrono::seconds(10)));
  p.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(), 0) << p.Output();
}

TEST(SystemdTest, InstallPutsEverythingInPlace) {
  TempDir dir;
  auto r = RunCmd("cmake --install " + BinPath("..") + " --prefix " + dir.path() + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* f : {"bin/engramd", "bin/engramctl", "bin/engram-mkckpt", "lib/systemd/system/engramd.service",
                        "lib/systemd/system/var-lib-engram-shm.mount", "lib/tmpfiles.d/engramd.conf",
                        "lib/sysusers.d/engramd.conf", "etc/engramd/engramd.conf"}) {
    struct stat st {};
    EXPECT_EQ(::stat((dir / f).c_str(), &st), 0) << f;
  }
}

}  // namespace
}  // namespace engram
