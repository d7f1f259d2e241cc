#include "daemon/shm_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/utf8.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// The file on `fd` is ours: a regular file of this uid that nobody else may write.
bool Ours(Env* env, int fd) {
  struct stat st {};
  return env->Fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
         (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

std::string PidIn(Env* env, int fd) {
  char buf[32] = {};
  const ssize_t n = env->Pread(fd, buf, sizeof(buf) - 1, 0);
  int64_t pid = 0;
  if (n > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, static_cast<size_t>(n))), &pid)) {
    return std::to_string(pid);
  }
  return "unknown";
}

}  // namespace

ShmDirLock::ShmDirLock(ShmDirLock&& o) noexcept
    : env_(o.env_), fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}

ShmDirLock& ShmDirLock::operator=(ShmDirLock&& o) noexcept {
  std::swap(env_, o.env_);
  std::swap(fd_, o.fd_);
  std::swap(path_, o.path_);
  return *this;
}

ShmDirLock::~ShmDirLock() {
  if (fd_ >= 0) env_->Close(fd_);
}

absl::StatusOr<ShmDirLock> ShmDirLock::Acquire(const std::string& shm_dir, Env* env) {
  ShmDirLock lock;
  lock.env_ = env;
  lock.path_ = shm_dir + "/" + kShmLockName;
  struct stat dst {};
  if (env->Stat(shm_dir.c_str(), &dst) != 0 && errno == ENOENT) {
    spdlog::warn("event=shm_lock_skipped dir={}: the directory does not exist", engram::LogValue(shm_dir));
    return lock;
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    int fd = env->Open(lock.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    // Something that cannot be opened as our file (a symlink, another uid's file, a directory, a socket, a device)
    // is foreign, not a reason to stop: it is removed below, or the daemon runs unlocked.
    const bool foreign_kind = fd < 0 && (errno == ELOOP || errno == EACCES || errno == EPERM || errno == EISDIR ||
                                         errno == ENXIO || errno == EOPNOTSUPP || errno == ETXTBSY || errno == ENODEV);
    if (fd < 0 && !foreign_kind) return Errno(absl::StrCat("open ", lock.path_));
    if (fd >= 0 && Ours(env, fd)) {
      if (env->Flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        const std::string pid = PidIn(env, fd);
        env->Close(fd);
        if (err == EWOULDBLOCK) {
          return absl::FailedPreconditionError(
              absl::StrCat("another engramd (pid ", pid, ") owns ", shm_dir, " (", lock.path_, " is locked)"));
        }
        errno = err;
        return Errno(absl::StrCat("flock ", lock.path_));
      }
      const std::string text = absl::StrCat(::getpid(), "\n");
      if (env->Ftruncate(fd, 0) != 0 ||
          env->Pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
        spdlog::warn("event=shm_lock_pid_not_written path={} errno={}", engram::LogValue(lock.path_), errno);
      }
      env->Fchmod(fd, 0600);
      lock.fd_ = fd;
      spdlog::info("event=shm_lock path={} pid={}", engram::LogValue(lock.path_), ::getpid());
      return lock;
    }
    // Not ours: planted by another user, a symlink, or the lock of another engramd running as another uid. A file
    // that some process holds locked is a live daemon's: refuse to start (removing it would let both run).
    if (fd >= 0 || errno == EACCES || errno == EPERM) {
      const int probe =
          fd >= 0 ? env->Dup(fd) : env->Open(lock.path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
      if (probe >= 0) {
        const bool held = env->Flock(probe, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        const std::string pid = held ? PidIn(env, probe) : "";
        env->Close(probe);
        if (held) {
          if (fd >= 0) env->Close(fd);
          return absl::FailedPreconditionError(absl::StrCat("another engramd (pid ", pid, ", another user) owns ",
                                                            shm_dir, " (", lock.path_, " is locked)"));
        }
      }
    }
    struct stat st {};
    env->Lstat(lock.path_.c_str(), &st);
    spdlog::warn("event=segment_foreign path={} owner={} mode={:04o}: not this daemon's lock file, removed",
                 engram::LogValue(lock.path_), st.st_uid, st.st_mode & 07777);
    if (fd >= 0) env->Close(fd);
    if (env->Unlink(lock.path_.c_str()) != 0 && errno != ENOENT) {
      // Refusing to start would let any local user stop a non-root engramd by planting the file: run unlocked.
      spdlog::error(
          "event=shm_lock_unavailable path={} owner={} detail={}: a file owned by uid {} occupies it; "
          "running without the one-daemon-per-directory lock",
          engram::LogValue(lock.path_), st.st_uid, engram::LogQuoted(std::strerror(errno)), st.st_uid);
      return ShmDirLock();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("cannot create ", lock.path_, ": it keeps being replaced"));
}

}  // namespace engram::daemon
