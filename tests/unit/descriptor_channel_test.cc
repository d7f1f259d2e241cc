// The descriptor side channel in-process, over a real Unix socket: daemon/descriptor_server.h (serving) and
// client/session/descriptor_client.h (fetching). Who gets a descriptor (token, lease, process, authorisation), what the
// descriptor allows (read-only), what a hostile or silent peer can do (nothing lasting), and that no descriptor leaks.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "client/session/descriptor_client.h"
#include "daemon/descriptor_server.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram {
namespace {

using daemon::DescriptorChannel;
using daemon::PeerCred;
using testing::TempDir;
using namespace std::chrono_literals;

PeerCred Me() { return PeerCred{static_cast<int32_t>(::getpid()), ::geteuid(), ::getegid()}; }

int OpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

class DescriptorChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc_socket_ = dir_ / "engramd.sock";
    file_ = dir_ / "engram-segment";
    content_.assign(8192, 'x');
    for (size_t i = 0; i < content_.size(); ++i) content_[i] = static_cast<char>('a' + i % 26);
    testing::WriteFile(file_, content_);
    ::chmod(file_.c_str(), 0600);
    channel_ = std::make_unique<DescriptorChannel>([this](const PeerCred&) { return allowed_.load(); });
    ASSERT_TRUE(channel_->Bind(grpc_socket_, -1).ok());
    channel_->Start();
    path_ = *client::ChannelPath(grpc_socket_, channel_->socket_name());
  }

  absl::StatusOr<int> Fetch(const std::string& lease, const std::string& token) {
    return client::FetchSegmentDescriptor(path_, lease, token, 5s);
  }

  // Sends raw bytes and returns the reply line (and whether a descriptor came with it).
  std::string Raw(const std::string& bytes, bool* got_fd = nullptr) {
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    if (!bytes.empty()) (void)::send(s, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    char buf[512];
    iovec iov{buf, sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
    bool fd = false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_type == SCM_RIGHTS) {
        int f;
        std::memcpy(&f, CMSG_DATA(c), sizeof(int));
        ::close(f);
        fd = true;
      }
    }
    if (got_fd != nullptr) *got_fd = fd;
    ::close(s);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

  TempDir dir_;
  std::string grpc_socket_, file_, path_, content_;
  std::atomic<bool> allowed_{true};
  std::unique_ptr<DescriptorChannel> channel_;
};

// A listener whose backlog is full (another uid's flood): the fetch connects again with backoff and reaches the
// channel once there is room, instead of failing at once (its socket was never connected: send gave ENOTCONN).
TEST(DescriptorFetchTest, AFullBacklogIsWaitedOutWithinTheDeadline) {
  testing::TempDir dir;
  const std::string path = dir / "full.fds";
  int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(l, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(l, 0), 0);
  std::vector<int> flood;
  for (int i = 0; i < 64; ++i) {  // fill the backlog: non-blocking connects until one is refused with EAGAIN
    int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno == EAGAIN) {
      ::close(c);
      break;
    }
    flood.push_back(c);
  }
  ASSERT_FALSE(flood.empty());
  std::atomic<bool> stop{false};
  std::thread server([&] {  // after 300 ms: drain the backlog and answer every new connection with a refusal
    std::this_thread::sleep_for(300ms);
    while (!stop) {
      pollfd p{l, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      int c = ::accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      const char reply[] = "ERR seen by the channel\n";
      (void)::send(c, reply, sizeof(reply) - 1, MSG_NOSIGNAL);
      ::close(c);
    }
  });
  auto fd = client::FetchSegmentDescriptor(path, "lease", "token", 5000ms);
  stop = true;
  server.join();
  for (int c : flood) ::close(c);
  ::close(l);
  ASSERT_FALSE(fd.ok());
  EXPECT_NE(fd.status().message().find("seen by the channel"), std::string::npos) << fd.status();
}

TEST_F(DescriptorChannelTest, TheLeaseHolderGetsAReadOnlyDescriptorOfTheFileOnce) {
  EXPECT_EQ(channel_->socket_name(), "engramd.sock.fds");
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size());
  EXPECT_EQ(token.size(), 32u);
  auto fd = Fetch("lease-1", token);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(::fcntl(*fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_NE(::fcntl(*fd, F_GETFD) & FD_CLOEXEC, 0);
  // Read-only for good: no writable shared mapping, no upgrade of a read-only one.
  EXPECT_EQ(::mmap(nullptr, content_.size(), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  void* p = ::mmap(nullptr, content_.size(), PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(std::string(static_cast<const char*>(p), content_.size()), content_);  // the file's bytes, read back
  EXPECT_NE(::mprotect(p, 4096, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(errno, EACCES);
  ::munmap(p, content_.size());
  ::close(*fd);
  // Once only.
  auto again = Fetch("lease-1", token);
  EXPECT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("no live lease"), std::string::npos) << again.status();
  const auto stats = channel_->Stats();
  EXPECT_EQ(stats.sent, 1u);
  EXPECT_EQ(stats.refused, 1u);
  EXPECT_EQ(stats.socket, path_);
}

TEST_F(DescriptorChannelTest, WrongTokenOtherProcessUnknownLeaseAndRevokedLeaseGetNothing) {
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size());
  auto wrong = Fetch("lease-1", std::string(token.size(), '0'));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(wrong.status().message().find("wrong token"), std::string::npos) << wrong.status();
  EXPECT_FALSE(Fetch("lease-2", token).ok());
  // A token bound to another process (pid) is refused to this one.
  PeerCred other = Me();
  other.pid += 1;
  const std::string theirs = channel_->Issue("lease-3", other, file_, content_.size());
  auto stolen = Fetch("lease-3", theirs);
  EXPECT_FALSE(stolen.ok());
  EXPECT_NE(stolen.status().message().find("belongs to pid"), std::string::npos) << stolen.status();
  // None of that used the real token up.
  auto fd = Fetch("lease-1", token);
  ASSERT_TRUE(fd.ok()) << fd.status();
  ::close(*fd);
  // A revoked lease (session ended) has nothing to fetch.
  const std::string t4 = channel_->Issue("lease-4", Me(), file_, content_.size());
  channel_->Revoke("lease-4");
  EXPECT_FALSE(Fetch("lease-4", t4).ok());
  EXPECT_EQ(channel_->Stats().sent, 1u);
  EXPECT_EQ(channel_->Stats().refused, 4u);
}

TEST_F(DescriptorChannelTest, APeerTheDaemonRefusesGetsNoDescriptorEvenWithTheToken) {
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size());
  allowed_ = false;
  auto fd = Fetch("lease-1", token);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(fd.status().message().find("may not use engramd"), std::string::npos) << fd.status();
  allowed_ = true;
  EXPECT_TRUE(Fetch("lease-1", token).ok()) << "the refusal did not use the token up";
}

TEST_F(DescriptorChannelTest, AReplacedOrResizedFileIsNotHandedOut) {
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size() + 1);  // not this file's size
  auto fd = Fetch("lease-1", token);
  EXPECT_FALSE(fd.ok());
  EXPECT_NE(fd.status().message().find("no longer the granted segment"), std::string::npos) << fd.status();
  ::unlink(file_.c_str());
  ASSERT_EQ(::symlink("/etc/passwd", file_.c_str()), 0);  // a link in its place is never followed
  const std::string t2 = channel_->Issue("lease-2", Me(), file_, content_.size());
  EXPECT_FALSE(Fetch("lease-2", t2).ok());
}

TEST_F(DescriptorChannelTest, AnotherFileOfTheSameSizeUnderTheNameIsNotHandedOut) {
  struct stat granted {};
  ASSERT_EQ(::stat(file_.c_str(), &granted), 0);
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size(), granted.st_dev, granted.st_ino);
  // The granted file is replaced by another one with the same size, owner and mode.
  const std::string other = file_ + ".new";
  testing::WriteFile(other, content_);
  ::chmod(other.c_str(), 0600);
  ASSERT_EQ(::rename(other.c_str(), file_.c_str()), 0);
  auto fd = Fetch("lease-1", token);
  EXPECT_FALSE(fd.ok());
  EXPECT_NE(fd.status().message().find("no longer the granted segment"), std::string::npos) << fd.status();
  // The file the grant names is handed out.
  struct stat now {};
  ASSERT_EQ(::stat(file_.c_str(), &now), 0);
  const std::string t2 = channel_->Issue("lease-2", Me(), file_, content_.size(), now.st_dev, now.st_ino);
  auto good = Fetch("lease-2", t2);
  ASSERT_TRUE(good.ok()) << good.status();
  ::close(*good);
}

TEST_F(DescriptorChannelTest, MalformedOversizedAndSilentPeersAreRefusedWithoutBlockingOthers) {
  bool fd = true;
  EXPECT_EQ(Raw("hello\n", &fd).rfind("ERR malformed", 0), 0u);
  EXPECT_FALSE(fd);
  EXPECT_EQ(Raw("ENGRAM-FD/1 a b c\n").rfind("ERR malformed", 0), 0u);
  EXPECT_EQ(Raw("ENGRAM-FD/2 a b\n").rfind("ERR malformed", 0), 0u);
  EXPECT_EQ(Raw(std::string(4096, 'A'), &fd).rfind("ERR", 0), 0u) << "no newline within the limit";
  EXPECT_FALSE(fd);
  // A silent peer holds a connection; meanwhile a real request is served at once, and the silent one is cut at
  // its deadline.
  std::thread silent([&] { EXPECT_EQ(Raw(""), "ERR timed out\n"); });
  std::this_thread::sleep_for(100ms);
  const std::string token = channel_->Issue("lease-1", Me(), file_, content_.size());
  const auto t0 = std::chrono::steady_clock::now();
  auto got = Fetch("lease-1", token);
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1500ms) << "served while the silent peer waited";
  if (got.ok()) ::close(*got);
  silent.join();
}

TEST_F(DescriptorChannelTest, NoDescriptorLeaksOnEitherSide) {
  // Warm up (first-use allocations), then count this process's descriptors: the server's and the client's both.
  for (int i = 0; i < 3; ++i) {
    auto fd = Fetch("w" + std::to_string(i), channel_->Issue("w" + std::to_string(i), Me(), file_, content_.size()));
    ASSERT_TRUE(fd.ok());
    ::close(*fd);
  }
  std::this_thread::sleep_for(300ms);  // the server closes its end of the last connection after the reply
  const int before = OpenFds();
  for (int i = 0; i < 300; ++i) {
    const std::string lease = "l" + std::to_string(i);
    const std::string token = channel_->Issue(lease, Me(), file_, content_.size());
    if (i % 3 == 0) {
      (void)Raw("garbage\n");
      continue;
    }
    auto fd = Fetch(lease, i % 3 == 1 ? token : "bad");
    if (fd.ok()) ::close(*fd);
  }
  const auto end = std::chrono::steady_clock::now() + 3s;
  while (OpenFds() != before && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(OpenFds(), before);
}

TEST(FdChannelPathTest, TheChannelIsANameNextToTheSocketNeverAPath) {
  EXPECT_EQ(*client::ChannelPath("/run/engramd/engramd.sock", "engramd.sock.fds"), "/run/engramd/engramd.sock.fds");
  EXPECT_EQ(*client::ChannelPath("engramd.sock", "x.fds"), "x.fds");
  for (const char* bad : {"", "../etc/x", "/abs", ".", ".."}) {
    EXPECT_FALSE(client::ChannelPath("/run/engramd/engramd.sock", bad).ok()) << bad;
  }
}

TEST(FdChannelPathTest, NoChannelIsUnavailable) {
  TempDir dir;
  auto fd = client::FetchSegmentDescriptor(dir / "none.fds", "l", "t", 1s);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable) << fd.status();
}

}  // namespace
}  // namespace engram
