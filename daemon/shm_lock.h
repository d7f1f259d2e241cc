// ShmDirLock: one engramd per shm directory. Two daemons on one directory would each retire and unlink the
// other's segments as "not served by this configuration", so the daemon takes an exclusive flock(2) on
// `<shm_dir>/.engramd.lock` before it touches anything there and holds it (an open descriptor) for its whole life;
// the kernel drops it when the process dies, however it dies, so a stale lock file never blocks a restart.
//
// The file is mode 0600 and holds the owner's pid as text (for the refusal message only; the lock is the flock).
// The directory is usually world-writable (/dev/shm, 1777): a lock file that is not the daemon's own (another uid,
// writable by others, not a regular file, a symlink) is removed and created again (O_NOFOLLOW), never written
// through, unless some process holds it locked: that is a live engramd of another uid, and this one refuses to start;
// when it cannot be removed (a non-root daemon, a file of another uid in a sticky directory) the daemon runs without
// the lock and says so (`event=shm_lock_unavailable`) rather than let any local user stop it. A missing shm directory
// is not an error: there is nothing in it to protect (the registry reports SHM_MISSING), and the lock is then not held.
//
// Move-only; not thread-safe (taken once at start-up).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "shm/env.h"

namespace engram::daemon {

class ShmDirLock {
 public:
  ShmDirLock() = default;
  ShmDirLock(ShmDirLock&& o) noexcept;
  ShmDirLock& operator=(ShmDirLock&& o) noexcept;
  ShmDirLock(const ShmDirLock&) = delete;
  ShmDirLock& operator=(const ShmDirLock&) = delete;
  ~ShmDirLock();  // closes the descriptor (the lock goes); the file stays (the next daemon reuses it)

  // Takes the lock of `shm_dir`. FailedPrecondition "another engramd (pid N) owns DIR" when a live process holds
  // it; other errors when the lock file cannot be created.
  static absl::StatusOr<ShmDirLock> Acquire(const std::string& shm_dir, Env* env = Env::Default());

  bool held() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  Env* env_ = Env::Default();  // not owned
  int fd_ = -1;
  std::string path_;
};

inline constexpr char kShmLockName[] = ".engramd.lock";

}  // namespace engram::daemon
