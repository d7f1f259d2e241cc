// UdsListener's file-system calls go through its Env (daemon/listener.h): the socket's directory is made (and given
// the group) through Env::Mkdir / Env::Chown, a connection's identity read through Env::Fstat, and the socket file
// removed at Stop through Env::Unlink; a socket named without a directory makes no directory.
#include "daemon/listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shm/env.h"
#include "tests/test_util.h"

namespace engram::daemon {
namespace {

class RecordingEnv : public PosixEnv {
 public:
  std::mutex mu;
  std::vector<std::string> mkdirs, unlinks;
  std::atomic<int> fstats{0};
  int Mkdir(const char* path, mode_t mode) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      mkdirs.push_back(path);
    }
    return PosixEnv::Mkdir(path, mode);
  }
  int Unlink(const char* path) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      unlinks.push_back(path);
    }
    return PosixEnv::Unlink(path);
  }
  int Fstat(int fd, struct stat* st) override {
    ++fstats;
    return PosixEnv::Fstat(fd, st);
  }
};

int ConnectTo(const std::string& path) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

TEST(ListenerEnv, TheSocketsFilesGoThroughTheEnv) {
  testing::TempDir dir;
  RecordingEnv env;
  const std::string sock_dir = dir / "run";
  const std::string sock = sock_dir + "/engramd.sock";
  std::atomic<int> accepted{0};
  {
    UdsListener l(&env);
    ASSERT_TRUE(l.Bind(sock, "").ok());
    {
      std::lock_guard<std::mutex> lock(env.mu);
      ASSERT_EQ(env.mkdirs, std::vector<std::string>{sock_dir});
    }
    struct stat st {};
    ASSERT_EQ(::stat(sock_dir.c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    l.Start([&](int fd, bool) {
      ++accepted;
      ::close(fd);
    });
    const int c = ConnectTo(sock);
    ASSERT_GE(c, 0);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (accepted.load() == 0 && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::close(c);
    EXPECT_EQ(accepted.load(), 1);
    EXPECT_GE(env.fstats.load(), 1);
    l.Stop();
  }
  std::lock_guard<std::mutex> lock(env.mu);
  EXPECT_NE(std::find(env.unlinks.begin(), env.unlinks.end(), sock), env.unlinks.end());
  EXPECT_NE(::access(sock.c_str(), F_OK), 0) << "the socket file stayed";
}

TEST(ListenerEnv, ABareSocketNameMakesNoDirectory) {
  testing::TempDir dir;
  RecordingEnv env;
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  {
    UdsListener l(&env);
    EXPECT_TRUE(l.Bind("bare.sock", "").ok());
    struct stat st {};
    EXPECT_EQ(::stat("bare.sock", &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    l.Stop();
  }
  ASSERT_EQ(::chdir(cwd), 0);
  std::lock_guard<std::mutex> lock(env.mu);
  EXPECT_TRUE(env.mkdirs.empty());
}

}  // namespace
}  // namespace engram::daemon
