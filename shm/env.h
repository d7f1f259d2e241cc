// Env: the seam between engram and the operating system for segments and tables (LevelDB's Env is the model).
// The OS calls of shm/ and daemon/ on files, directories, shared memory and the group database go through an Env:
// the daemon's publisher, its shm-directory scan and lock, its segment registry and DP regions, the capacity probe
// with its /proc and /sys reads (shm/capacity.h), the descriptor channel, the listener's socket files and group,
// the metrics file's checked directory walk, the prewarm tool's lookup, checkpoint paths' realpath, and the
// client's tables (client/table/tables.h). Direct on purpose: process control (the prewarm child's spawn, its pipe
// and signals), and the files model/ reads for the daemon (the checkpoint, the config file: model/ sits below shm/
// and has no Env). The default, Env::Default(), makes the system calls; a test derives from PosixEnv and overrides one
// call to inject a fault (ENOSPC from fallocate after the capacity probe passed, EINTR, a failed mlock, a small
// statvfs) without root and without filling a real filesystem.
//
// Calls keep the POSIX convention (a result of -1 or MAP_FAILED with the cause in errno; PosixFallocate returns the
// error number like posix_fallocate), so callers handle a real failure and an injected one the same way. Callers
// retry EINTR where POSIX allows it (RetryEintr below). Env::Default() lives for the whole process; every method is
// thread-safe in PosixEnv, and overrides must be too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>

#include <cerrno>
#include <cstddef>

namespace engram {

class Env {
 public:
  virtual ~Env() = default;
  static Env* Default();

  virtual int Open(const char* path, int flags, mode_t mode) = 0;
  virtual int Close(int fd) = 0;
  virtual int Unlink(const char* path) = 0;
  virtual int ShmUnlink(const char* name) = 0;  // a POSIX shared-memory object's name ("/engram-...")
  virtual int Fstat(int fd, struct stat* st) = 0;
  virtual int Stat(const char* path, struct stat* st) = 0;
  virtual int Lstat(const char* path, struct stat* st) = 0;
  // The entries of directory `dir` (without "." and ".."), appended to `names`: 0, or -1 with errno (opendir's).
  virtual int ListDirectory(const char* dir, std::vector<std::string>* names) = 0;
  virtual int Flock(int fd, int operation) = 0;
  virtual int Ftruncate(int fd, off_t length) = 0;
  virtual int Dup(int fd) = 0;
  virtual int Fchmod(int fd, mode_t mode) = 0;
  virtual int PosixFallocate(int fd, off_t offset, off_t len) = 0;  // 0 or an error number (not errno)
  virtual ssize_t Pread(int fd, void* buf, size_t n, off_t offset) = 0;
  virtual ssize_t Pwrite(int fd, const void* buf, size_t n, off_t offset) = 0;
  virtual int Statvfs(const char* path, struct statvfs* out) = 0;
  virtual void* Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) = 0;
  virtual int Munmap(void* addr, size_t len) = 0;
  virtual int Madvise(void* addr, size_t len, int advice) = 0;
  virtual int Mprotect(void* addr, size_t len, int prot) = 0;
  virtual int Mlock(const void* addr, size_t len) = 0;
  virtual int Munlock(const void* addr, size_t len) = 0;
  // The system's base page (sysconf(_SC_PAGESIZE): 4 KiB, or 16/64 KiB on some aarch64 kernels): madvise ranges
  // start on one, and a tmpfs reports it as its block size.
  virtual size_t PageBytes() = 0;
  // The memory this process may still take: the lesser of /proc/meminfo's MemAvailable and, under a cgroup v2
  // memory.max, that limit less memory.current (a side that cannot be read does not count; neither: UINT64_MAX).
  // The client checks it before it builds a private table.
  virtual uint64_t AvailableMemoryBytes() = 0;
  // The whole of a small file read to its end (a /proc or /sys entry, whose size stat reports as 0; a config file)
  // into *out: 0, or -1 with errno (EFBIG past `max_bytes`).
  virtual int ReadSmallFile(const char* path, size_t max_bytes, std::string* out) = 0;
  // realpath(3) into *out: 0, or -1 with errno.
  virtual int Realpath(const char* path, std::string* out) = 0;
  virtual int Mkdir(const char* path, mode_t mode) = 0;
  virtual int Chown(const char* path, uid_t uid, gid_t gid) = 0;
  virtual int Access(const char* path, int mode) = 0;
  // readlink(2) into *out (the whole target): 0, or -1 with errno.
  virtual int Readlink(const char* path, std::string* out) = 0;
  // Calls relative to an open directory (the metrics file's checked walk).
  virtual int Openat(int dirfd, const char* name, int flags, mode_t mode) = 0;
  virtual int Fstatat(int dirfd, const char* name, struct stat* st, int flags) = 0;
  virtual int Readlinkat(int dirfd, const char* name, std::string* out) = 0;  // 0, or -1 with errno
  virtual int Renameat(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name) = 0;
  virtual int Unlinkat(int dirfd, const char* name, int flags) = 0;
  virtual ssize_t Write(int fd, const void* buf, size_t n) = 0;
  // The group named `name` (getgrnam_r): 0 with *gid, or -1 with errno (ENOENT when there is no such group).
  virtual int LookupGroup(const char* name, gid_t* gid) = 0;
};

// The system calls themselves. Derive from it to override one call in a test.
class PosixEnv : public Env {
 public:
  int Open(const char* path, int flags, mode_t mode) override;
  int Close(int fd) override;
  int Unlink(const char* path) override;
  int ShmUnlink(const char* name) override;
  int Fstat(int fd, struct stat* st) override;
  int Stat(const char* path, struct stat* st) override;
  int Lstat(const char* path, struct stat* st) override;
  int ListDirectory(const char* dir, std::vector<std::string>* names) override;
  int Flock(int fd, int operation) override;
  int Ftruncate(int fd, off_t length) override;
  int Dup(int fd) override;
  int Fchmod(int fd, mode_t mode) override;
  int PosixFallocate(int fd, off_t offset, off_t len) override;
  ssize_t Pread(int fd, void* buf, size_t n, off_t offset) override;
  ssize_t Pwrite(int fd, const void* buf, size_t n, off_t offset) override;
  int Statvfs(const char* path, struct statvfs* out) override;
  void* Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) override;
  int Munmap(void* addr, size_t len) override;
  int Madvise(void* addr, size_t len, int advice) override;
  int Mprotect(void* addr, size_t len, int prot) override;
  int Mlock(const void* addr, size_t len) override;
  int Munlock(const void* addr, size_t len) override;
  size_t PageBytes() override;
  uint64_t AvailableMemoryBytes() override;
  int ReadSmallFile(const char* path, size_t max_bytes, std::string* out) override;
  int Realpath(const char* path, std::string* out) override;
  int Mkdir(const char* path, mode_t mode) override;
  int Chown(const char* path, uid_t uid, gid_t gid) override;
  int Access(const char* path, int mode) override;
  int Readlink(const char* path, std::string* out) override;
  int Openat(int dirfd, const char* name, int flags, mode_t mode) override;
  int Fstatat(int dirfd, const char* name, struct stat* st, int flags) override;
  int Readlinkat(int dirfd, const char* name, std::string* out) override;
  int Renameat(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name) override;
  int Unlinkat(int dirfd, const char* name, int flags) override;
  ssize_t Write(int fd, const void* buf, size_t n) override;
  int LookupGroup(const char* name, gid_t* gid) override;
};

// Repeats `call` while it fails with EINTR (for calls whose result is -1 + errno).
template <typename F>
auto RetryEintr(F call) -> decltype(call()) {
  decltype(call()) r;
  do {
    r = call();
  } while (r == -1 && errno == EINTR);
  return r;
}

// madvise(advice) over [p, p + bytes) through `env` from up to `max_threads` threads (one per GiB, at least one), in
// slices whose starts are whole 2 MiB past p: populating or dropping a table-sized mapping in parallel (the client
// before its ticket, the publisher before READY). Returns the first failing call's errno, 0 when all succeeded.
int MadviseInSlices(Env* env, uint8_t* p, uint64_t bytes, int advice, int max_threads);

}  // namespace engram
