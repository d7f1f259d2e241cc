// engramd's registration prewarm (daemon/prewarm.h) as real processes: engramd with the real engram-prewarm beside
// it (a GPU machine: done, with the registration's seconds; elsewhere: skipped, naming why there is no GPU), off by
// option, refused at start when the named tool is not an executable, and a hung stand-in tool stopped (killed) the
// moment a replica asks for the registration ticket, which the replica then gets. Status JSON, the text of
// `engramctl status` and the log say the same.
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

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

json PrewarmOf(const Daemon& d) {
  const json s = d.Status();
  if (s.is_null() || s["segments"].empty()) return json();
  return s["segments"][0]["prewarm"];
}

bool Settled(const json& p) {
  if (!p.is_object()) return false;
  const std::string st = p["state"];
  return st != "queued" && st != "running";
}

TEST(PrewarmDaemon, TheRealToolRunsOnEachReadySegment) {
  if (!std::filesystem::exists(BinPath("../daemon/engram-prewarm"))) {
    GTEST_SKIP() << "engram-prewarm is built with CUDA only (ENGRAM_CUDA=OFF here)";
  }
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", MakeShm(dir)});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  ASSERT_TRUE(WaitFor([&] { return Settled(PrewarmOf(d)); }, std::chrono::seconds(60))) << d.Status().dump();
  const json p = PrewarmOf(d);
  const std::string state = p["state"];
  if (state == "done") {  // a GPU machine
    EXPECT_GT(p["register_seconds"].get<double>(), 0) << p.dump();
    EXPECT_GE(p["seconds"].get<double>(), p["register_seconds"].get<double>()) << p.dump();
    EXPECT_NE(p["detail"].get<std::string>().find("register_seconds="), std::string::npos) << p.dump();
  } else {
    ASSERT_EQ(state, "skipped") << p.dump();
    const std::string why = p["detail"];
    EXPECT_TRUE(why.find("no GPU driver") != std::string::npos || why.find("no CUDA device") != std::string::npos ||
                why.find("driver is older") != std::string::npos)
        << why;
  }
  EXPECT_GT(p["at_unix_ms"].get<int64_t>(), 0);
  EXPECT_TRUE(d.WaitLog("event=registration_prewarm segment=")) << d.Log();
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  EXPECT_NE(text.out.find("prewarm engram-"), std::string::npos) << text.out;
}

TEST(PrewarmDaemon, OffByOption) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", MakeShm(dir), "--prewarm-registration", "off"});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  const json p = PrewarmOf(d);
  EXPECT_EQ(p["state"], "off") << p.dump();
  EXPECT_EQ(p["detail"], "prewarm_registration is off");
  EXPECT_EQ(p["at_unix_ms"], 0);
  EXPECT_TRUE(d.WaitLog("event=registration_prewarm state=off")) << d.Log();
  const auto text = RunCmd(BinPath("engramctl") + " status --socket " + d.socket());
  EXPECT_NE(text.out.find("registration prewarm off: prewarm_registration is off"), std::string::npos) << text.out;
}

TEST(PrewarmDaemon, ANamedToolThatIsNotAProgramIsAStartupError) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  testing::WriteFile(dir / "plain", "not a program");
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", MakeShm(dir), "--prewarm-registration", dir / "plain"});
  EXPECT_NE(d.proc().Wait(), 0);
  EXPECT_NE(d.Log().find("is not an executable file"), std::string::npos) << d.Log();
}

TEST(PrewarmDaemon, AReplicaAskingForTheTicketStopsAHungPrewarmAndGetsIt) {
  TempDir dir;
  const std::string ckpt = MakeCheckpoint(dir, 8);
  const std::string shm = MakeShm(dir);
  const std::string pidfile = dir / "tool.pid";
  const std::string tool = dir / "stand-in-prewarm";
  testing::WriteFile(tool, "#!/bin/sh\necho $$ > " + pidfile + "\nexec sleep 600\n");
  ::chmod(tool.c_str(), 0755);
  Daemon d(dir, {"--checkpoint", ckpt, "--shm-dir", shm, "--tickets", "1", "--prewarm-registration", tool});
  ASSERT_TRUE(d.WaitReady()) << d.proc().Output();
  ASSERT_TRUE(WaitFor([&] { return PrewarmOf(d)["state"] == "running"; }, std::chrono::seconds(30)))
      << d.Status().dump();
  pid_t child = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        std::ifstream in(pidfile);
        return static_cast<bool>(in >> child) && child > 0;
      },
      std::chrono::seconds(30)));
  Process replica({BinPath("../tests/session_helper"), d.socket(), ckpt, shm, "ticket"}, dir / "replica.log");
  ASSERT_TRUE(
      WaitFor([&] { return replica.Output().find("\"ticket\": true") != std::string::npos; }, std::chrono::seconds(30)))
      << replica.Output() << d.Status().dump();
  const json p = PrewarmOf(d);
  EXPECT_EQ(p["state"], "stopped") << p.dump();
  EXPECT_NE(p["detail"].get<std::string>().find("a replica asked for a registration ticket"), std::string::npos);
  EXPECT_NE(::kill(child, 0), 0) << "the stand-in tool still runs";
  replica.Signal(SIGKILL);
  replica.Wait();
}

}  // namespace
}  // namespace engram
