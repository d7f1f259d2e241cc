// engramctl's errors say what is wrong: an integer option that does not parse or would be truncated is a usage
// error (exit 2) naming the option, never the default or a wrapped value; "not running" (exit 3) only when nothing
// listens; a socket this user may not open is a permission error (exit 4), not "not running".
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using testing::BinPath;
using testing::RunCmd;
using testing::TempDir;

TEST(CtlErrorsTest, IntegersAreParsedStrictly) {
  TempDir dir;
  const std::string ctl = BinPath("engramctl");
  auto r = RunCmd(ctl + " attach --checkpoint " + dir.path() + " --tp-size 4294967297 --socket " + (dir / "s"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--tp-size"), std::string::npos) << r.err;
  r = RunCmd(ctl + " attach --checkpoint " + dir.path() + " --dp-rank two --socket " + (dir / "s"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--dp-rank wants an integer"), std::string::npos) << r.err;
  r = RunCmd(ctl + " watch --count x --socket " + (dir / "s"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  r = RunCmd(ctl + " watch --interval -1 --socket " + (dir / "s"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  r = RunCmd(ctl + " load --checkpoint " + dir.path() + " --tp 0 --socket " + (dir / "s"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

// A checkpoint path that is not UTF-8 cannot travel in the daemon's protocol: engramctl says so itself (exit 2),
// before any request, instead of an empty error and a raw protobuf log line.
TEST(CtlErrorsTest, ANonUtf8PathIsABadArgument) {
  TempDir dir;
  const std::string ctl = BinPath("engramctl");
  for (const std::string cmd : {"load", "unload"}) {
    auto r = RunCmd(ctl + " " + cmd + " --checkpoint '" + dir.path() + "/\xff\xfe' --socket " + (dir / "s"));
    EXPECT_EQ(r.exit_code, 2) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("not valid UTF-8"), std::string::npos) << cmd << ": " << r.err;
    EXPECT_EQ(r.err.find("libprotobuf"), std::string::npos) << cmd << ": " << r.err;
  }
}

TEST(CtlErrorsTest, NotRunningIsOnlySaidWhenNothingListens) {
  TempDir dir;
  auto r = RunCmd(BinPath("engramctl") + " status --socket " + (dir / "none.sock"));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.err.find("not running"), std::string::npos) << r.err;
}

// A --socket that names a FIFO, a regular file or a directory is said to be that, not a daemon that is not running;
// a socket nobody listens on (a dead engramd's leftover) is "not running".
TEST(CtlErrorsTest, APathThatIsNotASocketIsNamedForWhatItIs) {
  TempDir dir;
  const std::string ctl = BinPath("engramctl");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  testing::WriteFile(dir / "file", "x");
  ASSERT_EQ(::mkdir((dir / "dir").c_str(), 0700), 0);
  for (const auto& [name, kind] : std::vector<std::pair<std::string, std::string>>{
           {"fifo", "is a FIFO"}, {"file", "is a regular file"}, {"dir", "is a directory"}}) {
    auto r = RunCmd(ctl + " status --socket " + (dir / name));
    EXPECT_EQ(r.exit_code, 3) << name << ": " << r.err;
    EXPECT_NE(r.err.find(kind + ", not engramd's socket"), std::string::npos) << name << ": " << r.err;
    EXPECT_EQ(r.err.find("not running"), std::string::npos) << name << ": " << r.err;
  }
  // A bound socket with no listener left (what a killed engramd leaves behind).
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir / "dead.sock";
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  auto r = RunCmd(ctl + " status --socket " + path);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("not running (nothing listens on"), std::string::npos) << r.err;
  r = RunCmd(ctl + " status --socket /dev/null");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("/dev/null is a character device, not engramd's socket"), std::string::npos) << r.err;
}

// The same for a user who may not write the path (connect(2) then fails with EACCES, not ECONNREFUSED): a root-owned
// configuration file or the socket's directory given as --socket is named for what it is, not a permission refusal.
TEST(CtlErrorsTest, APathThatIsNotASocketIsNamedForWhatItIsToAnotherUser) {
  if (::geteuid() != 0 || RunCmd("setpriv --reuid 65534 --regid 65534 --clear-groups true").exit_code != 0) {
    GTEST_SKIP() << "needs root and setpriv to run engramctl as another user";
  }
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  testing::WriteFile(dir / "engramd.conf", "tickets = 1\n");
  ASSERT_EQ(::chmod((dir / "engramd.conf").c_str(), 0644), 0);
  ASSERT_EQ(::mkdir((dir / "run").c_str(), 0755), 0);
  for (const auto& [name, kind] : std::vector<std::pair<std::string, std::string>>{
           {"engramd.conf", "is a regular file"}, {"run", "is a directory"}}) {
    auto r = RunCmd("setpriv --reuid 65534 --regid 65534 --clear-groups " + BinPath("engramctl") + " status --socket " +
                    (dir / name));
    EXPECT_EQ(r.exit_code, 3) << name << ": " << r.err;
    EXPECT_NE(r.err.find(kind + ", not engramd's socket"), std::string::npos) << name << ": " << r.err;
    EXPECT_EQ(r.err.find("permission denied"), std::string::npos) << name << ": " << r.err;
  }
}

TEST(CtlErrorsTest, APermissionRefusalIsNotNotRunning) {
  if (::geteuid() != 0 || RunCmd("setpriv --reuid 65534 --regid 65534 --clear-groups true").exit_code != 0) {
    GTEST_SKIP() << "needs root and setpriv to run engramctl as another user";
  }
  TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  const std::string path = dir / "engramd.sock";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);  // root's socket: nobody else may connect
  auto r =
      RunCmd("setpriv --reuid 65534 --regid 65534 --clear-groups " + BinPath("engramctl") + " status --socket " + path);
  ::close(fd);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("permission denied"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("not running"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace engram
