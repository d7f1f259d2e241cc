// The daemon's remaining file and group-database calls go through its Env (shm/env.h): the metrics file's checked
// walk and atomic replace (daemon/metrics_file.h), the group lookups of the listener (daemon/listener.h), and the
// prewarm tool's checks (daemon/prewarm.h). A fault injected at each call gives a clear error and leaves nothing
// behind; the real calls still do the work. Oracles: the directory's listing and the file's bytes, read here.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/listener.h"
#include "daemon/metrics_file.h"
#include "daemon/prewarm.h"
#include "gtest/gtest.h"
#include "shm/env.h"
#include "tests/test_util.h"

namespace engram::daemon {
namespace {

std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  return names;
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class MetricsFaultEnv : public PosixEnv {
 public:
  int fail_write = 0, fail_rename = 0, fail_openat = 0;  // errno to fail with, 0: the real call
  std::atomic<int> openats{0}, fstatats{0}, renames{0}, unlinkats{0}, writes{0};
  int Openat(int dirfd, const char* name, int flags, mode_t mode) override {
    ++openats;
    if (fail_openat != 0 && (flags & O_CREAT) != 0) {
      errno = fail_openat;
      return -1;
    }
    return PosixEnv::Openat(dirfd, name, flags, mode);
  }
  int Fstatat(int dirfd, const char* name, struct stat* st, int flags) override {
    ++fstatats;
    return PosixEnv::Fstatat(dirfd, name, st, flags);
  }
  ssize_t Write(int fd, const void* buf, size_t n) override {
    ++writes;
    if (fail_write != 0) {
      errno = fail_write;
      return -1;
    }
    return PosixEnv::Write(fd, buf, n);
  }
  int Renameat(int od, const char* o, int nd, const char* n) override {
    ++renames;
    if (fail_rename != 0) {
      errno = fail_rename;
      return -1;
    }
    return PosixEnv::Renameat(od, o, nd, n);
  }
  int Unlinkat(int dirfd, const char* name, int flags) override {
    ++unlinkats;
    return PosixEnv::Unlinkat(dirfd, name, flags);
  }
};

TEST(DaemonEnv, TheMetricsFileIsWrittenThroughTheEnv) {
  testing::TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  MetricsFaultEnv env;
  const std::string path = dir / "engram.prom";
  ASSERT_TRUE(WriteMetricsFile(path, "engram_up 1\n", &env).ok());
  EXPECT_EQ(Slurp(path), "engram_up 1\n");
  EXPECT_GE(env.openats.load(), 2) << "the walk and the temporary file";
  EXPECT_GE(env.fstatats.load(), 1);
  EXPECT_EQ(env.renames.load(), 1);
  EXPECT_GE(env.writes.load(), 1);
  EXPECT_EQ(Listing(dir.path()), std::vector<std::string>{"engram.prom"});
}

TEST(DaemonEnv, AFailedWriteOrRenameOfTheMetricsFileSaysSoAndLeavesTheOldFile) {
  testing::TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string path = dir / "engram.prom";
  ASSERT_TRUE(WriteMetricsFile(path, "old\n").ok());
  {
    MetricsFaultEnv env;
    env.fail_write = ENOSPC;
    const absl::Status st = WriteMetricsFile(path, "new\n", &env);
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
    EXPECT_NE(st.message().find("write"), std::string::npos) << st;
    EXPECT_NE(st.message().find(std::strerror(ENOSPC)), std::string::npos) << st;
    EXPECT_EQ(env.unlinkats.load(), 1) << "the temporary file is removed";
  }
  {
    MetricsFaultEnv env;
    env.fail_rename = EXDEV;
    const absl::Status st = WriteMetricsFile(path, "new\n", &env);
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
    EXPECT_NE(st.message().find("rename"), std::string::npos) << st;
    EXPECT_EQ(env.unlinkats.load(), 1);
  }
  {
    MetricsFaultEnv env;
    env.fail_openat = EACCES;
    const absl::Status st = WriteMetricsFile(path, "new\n", &env);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("create"), std::string::npos) << st;
  }
  EXPECT_EQ(Slurp(path), "old\n") << "a failed replace keeps the last good file";
  EXPECT_EQ(Listing(dir.path()), std::vector<std::string>{"engram.prom"}) << "no temporary file is left";
}

// Fails one call of the metrics file's directory walk (shm/env.h's Open, Fstat, Fstatat, Readlinkat, or a
// directory's Openat) with EIO; every other call is the real one.
class WalkFaultEnv : public PosixEnv {
 public:
  enum What { kOpen, kFstat, kFstatat, kReadlinkat, kDirOpenat } what;
  explicit WalkFaultEnv(What w) : what(w) {}
  int Open(const char* path, int flags, mode_t mode) override {
    return what == kOpen ? Fail() : PosixEnv::Open(path, flags, mode);
  }
  int Fstat(int fd, struct stat* st) override { return what == kFstat ? Fail() : PosixEnv::Fstat(fd, st); }
  int Fstatat(int dirfd, const char* name, struct stat* st, int flags) override {
    return what == kFstatat ? Fail() : PosixEnv::Fstatat(dirfd, name, st, flags);
  }
  int Readlinkat(int dirfd, const char* name, std::string* out) override {
    return what == kReadlinkat ? Fail() : PosixEnv::Readlinkat(dirfd, name, out);
  }
  int Openat(int dirfd, const char* name, int flags, mode_t mode) override {
    return what == kDirOpenat && (flags & O_DIRECTORY) != 0 ? Fail() : PosixEnv::Openat(dirfd, name, flags, mode);
  }

 private:
  static int Fail() {
    errno = EIO;
    return -1;
  }
};

int OpenDescriptors() {
  std::vector<std::string> fds = Listing("/proc/self/fd");
  return static_cast<int>(fds.size());
}

TEST(DaemonEnv, EveryCallOfTheMetricsFilesWalkFailsCleanly) {
  testing::TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string real = dir / "real";
  ASSERT_EQ(::mkdir(real.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(real.c_str(), (dir / "link").c_str()), 0);  // ours: the walk follows it, through Readlinkat
  const std::string path = dir / "link/engram.prom";
  ASSERT_TRUE(WriteMetricsFile(path, "old\n").ok());
  for (auto what : {WalkFaultEnv::kOpen, WalkFaultEnv::kFstat, WalkFaultEnv::kFstatat, WalkFaultEnv::kReadlinkat,
                    WalkFaultEnv::kDirOpenat}) {
    WalkFaultEnv env(what);
    const int fds = OpenDescriptors();
    const absl::Status st = WriteMetricsFile(path, "new\n", &env);
    EXPECT_FALSE(st.ok()) << "fault " << what;
    EXPECT_FALSE(st.message().empty());
    if (what != WalkFaultEnv::kFstatat) {  // a failed Fstatat reads as "not a link": the O_NOFOLLOW open refuses it
      EXPECT_NE(st.message().find(std::strerror(EIO)), std::string::npos) << "fault " << what << ": " << st;
    }
    EXPECT_EQ(OpenDescriptors(), fds) << "fault " << what << " leaked a descriptor";
    EXPECT_EQ(Slurp(real + "/engram.prom"), "old\n") << "fault " << what;
    EXPECT_EQ(Listing(real), std::vector<std::string>{"engram.prom"}) << "fault " << what;
  }
}

class GroupEnv : public PosixEnv {
 public:
  int err = 0;  // errno LookupGroup fails with
  gid_t gid = 4242;
  int lookups = 0;
  int LookupGroup(const char* name, gid_t* out) override {
    (void)name;
    ++lookups;
    if (err != 0) {
      errno = err;
      return -1;
    }
    *out = gid;
    return 0;
  }
};

TEST(DaemonEnv, GroupLookupsGoThroughTheEnvAndAnUnreadableDatabaseIsNotAMissingGroup) {
  GroupEnv env;
  UdsListener listener(&env);
  auto groups = listener.ResolveGroups("engram", "engram-admin");
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_EQ(groups->gid, 4242);
  EXPECT_EQ(groups->admin_gid, 4242);
  EXPECT_EQ(env.lookups, 2);
  EXPECT_EQ(listener.group_gid(), -1) << "resolving changes nothing";
  listener.ApplyGroups(*groups);  // a reload applies what it checked, looking nothing up again
  EXPECT_EQ(env.lookups, 2);
  EXPECT_EQ(listener.group_gid(), 4242);
  EXPECT_TRUE(listener.ResolveGroups("", "").ok()) << "no group named: nothing to look up";
  EXPECT_EQ(env.lookups, 2);
  env.err = ENOENT;
  absl::Status st = listener.ResolveGroups("engram", "").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'engram' does not exist"), std::string::npos) << st;
  env.err = EIO;
  st = listener.ResolveGroups("", "engram-admin").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("engram-admin"), std::string::npos) << st;
  EXPECT_NE(st.message().find(std::strerror(EIO)), std::string::npos) << st;
  EXPECT_EQ(listener.group_gid(), 4242) << "a failed resolve leaves the groups served";
}

TEST(DaemonEnv, TheRealGroupDatabaseAnswers) {
  gid_t gid = 99;
  EXPECT_EQ(Env::Default()->LookupGroup("root", &gid), 0);
  EXPECT_EQ(gid, 0u);
  errno = 0;
  EXPECT_EQ(Env::Default()->LookupGroup("engram-no-such-group-xyz", &gid), -1);
  EXPECT_EQ(errno, ENOENT);
}

class NoExecEnv : public PosixEnv {
 public:
  int Access(const char* path, int mode) override {
    (void)path;
    (void)mode;
    errno = EACCES;
    return -1;
  }
};

TEST(DaemonEnv, ThePrewarmToolIsCheckedThroughTheEnv) {
  testing::TempDir dir;
  const std::string tool = dir / "engram-prewarm";
  testing::WriteFile(tool, "#!/bin/sh\nexit 0\n");
  ::chmod(tool.c_str(), 0755);
  auto found = ResolvePrewarmTool("auto", dir.path());
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->tool, tool);
  NoExecEnv env;
  auto off = ResolvePrewarmTool("auto", dir.path(), &env);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_TRUE(off->tool.empty()) << "not executable as the Env sees it: auto turns it off";
  EXPECT_FALSE(off->off_reason.empty());
  EXPECT_FALSE(ResolvePrewarmTool(tool, dir.path(), &env).ok()) << "a named tool that cannot run is an error";
}

TEST(DaemonEnv, ReadlinkReturnsTheWholeTarget) {
  testing::TempDir dir;
  const std::string target(600, 'x');  // longer than the first buffer
  const std::string link = dir / "l";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  std::string got;
  ASSERT_EQ(Env::Default()->Readlink(link.c_str(), &got), 0);
  EXPECT_EQ(got, target);
  const int dfd = ::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(dfd, 0);
  got.clear();
  ASSERT_EQ(Env::Default()->Readlinkat(dfd, "l", &got), 0);
  EXPECT_EQ(got, target);
  EXPECT_EQ(Env::Default()->Readlinkat(dfd, "missing", &got), -1);
  EXPECT_EQ(errno, ENOENT);
  ::close(dfd);
}

}  // namespace
}  // namespace engram::daemon
