#include "shm/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "base/worker_threads.h"
#include "model/file_util.h"

namespace engram {

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: usable from static destructors and detached threads
  return env;
}

int PosixEnv::Open(const char* path, int flags, mode_t mode) {
  return RetryEintr([&] { return ::open(path, flags, mode); });
}
int PosixEnv::Close(int fd) { return ::close(fd); }
int PosixEnv::Unlink(const char* path) { return ::unlink(path); }
int PosixEnv::ShmUnlink(const char* name) { return ::shm_unlink(name); }
int PosixEnv::Fstat(int fd, struct stat* st) { return ::fstat(fd, st); }
int PosixEnv::Stat(const char* path, struct stat* st) { return ::stat(path, st); }
int PosixEnv::Lstat(const char* path, struct stat* st) { return ::lstat(path, st); }
int PosixEnv::ListDirectory(const char* dir, std::vector<std::string>* names) {
  DIR* d = ::opendir(dir);
  if (d == nullptr) return -1;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n(e->d_name);
    if (n != "." && n != "..") names->emplace_back(n);
  }
  ::closedir(d);
  return 0;
}
int PosixEnv::Flock(int fd, int operation) { return ::flock(fd, operation); }
int PosixEnv::Ftruncate(int fd, off_t length) { return ::ftruncate(fd, length); }
int PosixEnv::Dup(int fd) { return ::dup(fd); }
int PosixEnv::Fchmod(int fd, mode_t mode) { return ::fchmod(fd, mode); }
int PosixEnv::PosixFallocate(int fd, off_t offset, off_t len) { return ::posix_fallocate(fd, offset, len); }
ssize_t PosixEnv::Pread(int fd, void* buf, size_t n, off_t offset) { return ::pread(fd, buf, n, offset); }
ssize_t PosixEnv::Pwrite(int fd, const void* buf, size_t n, off_t offset) { return ::pwrite(fd, buf, n, offset); }
int PosixEnv::Statvfs(const char* path, struct statvfs* out) { return ::statvfs(path, out); }
void* PosixEnv::Mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) {
  return ::mmap(addr, len, prot, flags, fd, offset);
}
int PosixEnv::Munmap(void* addr, size_t len) { return ::munmap(addr, len); }
int PosixEnv::Madvise(void* addr, size_t len, int advice) { return ::madvise(addr, len, advice); }
size_t PosixEnv::PageBytes() {
  static const size_t page = [] {
    const long v = ::sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<size_t>(v) : size_t{4096};
  }();
  return page;
}
int PosixEnv::Mprotect(void* addr, size_t len, int prot) { return ::mprotect(addr, len, prot); }

uint64_t PosixEnv::AvailableMemoryBytes() {
  std::string meminfo, cgroup;
  if (ReadSmallFile("/proc/meminfo", 1 << 20, &meminfo) != 0) meminfo.clear();
  if (ReadSmallFile("/proc/self/cgroup", 1 << 20, &cgroup) != 0) cgroup.clear();
  return engram::AvailableMemoryBytes(meminfo, cgroup, "/sys/fs/cgroup");
}

int PosixEnv::ReadSmallFile(const char* path, size_t max_bytes, std::string* out) {
  const int fd = RetryEintr([&] { return ::open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); });
  if (fd < 0) return -1;
  out->clear();
  char buf[8192];
  while (true) {
    const ssize_t n = RetryEintr([&] { return ::read(fd, buf, sizeof(buf)); });
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      errno = e;
      return -1;
    }
    if (n == 0) break;
    if (out->size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      errno = EFBIG;
      return -1;
    }
    out->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return 0;
}

int PosixEnv::Mkdir(const char* path, mode_t mode) { return ::mkdir(path, mode); }
int PosixEnv::Access(const char* path, int mode) { return ::access(path, mode); }

namespace {
// readlink(2) / readlinkat(2) into a string, growing the buffer until the target fits.
template <typename Read>
int ReadLinkInto(Read&& read, std::string* out) {
  for (size_t cap = 256; cap <= (size_t{1} << 20); cap *= 4) {
    std::string buf(cap, '\0');
    const ssize_t n = read(buf.data(), cap);
    if (n < 0) return -1;
    if (static_cast<size_t>(n) < cap) {
      buf.resize(static_cast<size_t>(n));
      *out = std::move(buf);
      return 0;
    }
  }
  errno = ENAMETOOLONG;
  return -1;
}
}  // namespace

int PosixEnv::Readlink(const char* path, std::string* out) {
  return ReadLinkInto([&](char* b, size_t n) { return ::readlink(path, b, n); }, out);
}
int PosixEnv::Openat(int dirfd, const char* name, int flags, mode_t mode) {
  return RetryEintr([&] { return ::openat(dirfd, name, flags, mode); });
}
int PosixEnv::Fstatat(int dirfd, const char* name, struct stat* st, int flags) {
  return ::fstatat(dirfd, name, st, flags);
}
int PosixEnv::Readlinkat(int dirfd, const char* name, std::string* out) {
  return ReadLinkInto([&](char* b, size_t n) { return ::readlinkat(dirfd, name, b, n); }, out);
}
int PosixEnv::Renameat(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name) {
  return ::renameat(old_dirfd, old_name, new_dirfd, new_name);
}
int PosixEnv::Unlinkat(int dirfd, const char* name, int flags) { return ::unlinkat(dirfd, name, flags); }
ssize_t PosixEnv::Write(int fd, const void* buf, size_t n) { return ::write(fd, buf, n); }
int PosixEnv::LookupGroup(const char* name, gid_t* gid) {
  struct group g {};
  struct group* found = nullptr;
  std::vector<char> buf(16384);
  int rc = 0;
  while ((rc = ::getgrnam_r(name, &g, buf.data(), buf.size(), &found)) == ERANGE && buf.size() < (size_t{1} << 24)) {
    buf.resize(buf.size() * 4);
  }
  // getgrnam_r(3) lists ENOENT, ESRCH, EBADF and EPERM (and 0 with no entry) as "the name was not found", as the
  // NSS modules report it; any other error means the database could not be read.
  if (rc == ESRCH || rc == EBADF || rc == EPERM) rc = ENOENT;
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  if (found == nullptr) {
    errno = ENOENT;
    return -1;
  }
  *gid = g.gr_gid;
  return 0;
}
int PosixEnv::Chown(const char* path, uid_t uid, gid_t gid) { return ::chown(path, uid, gid); }

int PosixEnv::Realpath(const char* path, std::string* out) {
  char buf[PATH_MAX];
  if (::realpath(path, buf) == nullptr) return -1;
  *out = buf;
  return 0;
}
int PosixEnv::Mlock(const void* addr, size_t len) { return ::mlock(addr, len); }
int PosixEnv::Munlock(const void* addr, size_t len) { return ::munlock(addr, len); }

int MadviseInSlices(Env* env, uint8_t* p, uint64_t bytes, int advice, int max_threads) {
  constexpr uint64_t kSlice = uint64_t{2} << 20;
  const int n = static_cast<int>(std::clamp<uint64_t>(bytes >> 30, 1, static_cast<uint64_t>(std::max(1, max_threads))));
  const uint64_t part = (bytes / static_cast<uint64_t>(n) + kSlice - 1) / kSlice * kSlice;
  std::atomic<int> next{0}, first_error{0};
  RunWorkers(n, [&](bool) {
    for (int i = next++; i < n; i = next++) {
      const uint64_t b = std::min(bytes, part * static_cast<uint64_t>(i)), e = std::min(bytes, b + part);
      if (e > b && env->Madvise(p + b, e - b, advice) != 0) {
        int expected = 0;
        first_error.compare_exchange_strong(expected, errno != 0 ? errno : EINVAL);
      }
    }
  });
  return first_error.load();
}

}  // namespace engram
