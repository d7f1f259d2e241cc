// engramd hardening, as real processes: the metrics file is never written through a planted link (a directory symlink
// on its path, a link whose target runs through another uid's directory, a link at its temporary name), and the
// segments such links point at keep their bytes.
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
using testing::AttachOnce;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::NoOtherUids;
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

// --- the metrics file ------------------------------------------------------------------------------------------------

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

}  // namespace
}  // namespace engram
