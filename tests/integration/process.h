// Real child processes for the multi-process tests: spawn with output to a file, signal, wait, read output.
// Test-only; not thread-safe.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

extern char** environ;

namespace engram::testing {

class Process {
 public:
  Process() = default;
  Process(const std::vector<std::string>& argv, const std::string& log) : log_(log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  Process(Process&& o) noexcept : pid_(o.pid_), log_(o.log_), status_(o.status_), exited_(o.exited_) { o.pid_ = -1; }
  Process& operator=(Process&& o) noexcept {
    std::swap(pid_, o.pid_);
    std::swap(log_, o.log_);
    std::swap(status_, o.status_);
    std::swap(exited_, o.exited_);
    return *this;
  }
  ~Process() {
    if (pid_ > 0 && Running()) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
  }
  pid_t pid() const { return pid_; }
  void Signal(int sig) const { ::kill(pid_, sig); }
  bool Running() {
    if (pid_ <= 0 || exited_) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      exited_ = true;
      status_ = st;
      return false;
    }
    return true;
  }
  // Exit code (128 + signal for a signal), waiting at most `timeout`; -1 when still running.
  int Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (Running() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!exited_) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
  }
  std::string Output() const { return ReadFile(log_); }

 private:
  pid_t pid_ = -1;
  std::string log_;
  int status_ = 0;
  bool exited_ = false;
};

// A datagram socket standing in for systemd's notify socket: children spawned while it is Export()ed get its path
// in NOTIFY_SOCKET; Drain() appends what arrived (one line per datagram).
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    bound_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~NotifySocket() { ::close(fd_); }
  bool bound() const { return bound_; }
  void Export() const { ::setenv("NOTIFY_SOCKET", path_.c_str(), 1); }
  static void Unexport() { ::unsetenv("NOTIFY_SOCKET"); }
  const std::string& Drain() {
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT)) > 0) got_.append(buf, static_cast<size_t>(n)).append("\n");
    return got_;
  }
  void Clear() { got_.clear(); }

 private:
  std::string path_, got_;
  int fd_ = -1;
  bool bound_ = false;
};

// Polls `pred` every 20 ms until it holds or `timeout` passes.
template <typename F>
bool WaitFor(F pred, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

}  // namespace engram::testing
