// engramd hardening, as real processes: what a daemon serves. Aliases of a checkpoint path are one checkpoint, one
// engramd per shm directory (flock, across users too), SIGHUP is all or nothing (a broken new configuration changes
// nothing; a TP change publishes and retires shards), and a failed load is logged and shown in status.
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
using testing::RunCmd;
using testing::TempDir;
using testing::WaitFor;
using namespace std::chrono_literals;

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

// --- failed loads are visible ----------------------------------------------------------------------------------------

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

}  // namespace
}  // namespace engram
