// engramd hardening, as real processes: files planted or changed in the shm directory and beside the daemon. Forged
// files under a segment's name are never adopted nor written through (a copy of a READY segment writable by others, a
// file of another uid the daemon cannot remove, a symlink); a READY segment whose file is truncated or replaced under
// the daemon is no longer READY nor granted; a directory planted at the lock file's path does not stop the daemon, and
// a regular file at the socket's path is left in place and refused.
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
using testing::BinPath;
using testing::Daemon;
using testing::MakeCheckpoint;
using testing::MakeShm;
using testing::NoOtherUids;
using testing::Process;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

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

// --- segments whose file changed size --------------------------------------------------------------------------------

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

// --- planted paths beside the shm directory's segments ---------------------------------------------------------------

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
