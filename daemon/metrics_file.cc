#include "daemon/metrics_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace engram::daemon {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

std::atomic<uint64_t> g_next_tmp{0};

}  // namespace

absl::Status WriteMetricsFile(const std::string& path, const std::string& text) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.empty()) return absl::InvalidArgumentError(absl::StrCat("metrics file ", path, " names no file"));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno(absl::StrCat("open the metrics file's directory ", dir));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } close_dir{dfd};
  struct stat ds {};
  if (::fstat(dfd, &ds) != 0) return Errno(absl::StrCat("fstat ", dir));
  const bool owner_ok = ds.st_uid == 0 || ds.st_uid == ::geteuid();
  const bool others_write = (ds.st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (!owner_ok || (others_write && (ds.st_mode & S_ISVTX) == 0)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the metrics file's directory %s (owner uid %d, mode %04o) is not safe to write in: it must be root's or "
        "uid %d's, and sticky if others may write it",
        dir, ds.st_uid, ds.st_mode & 07777, ::geteuid()));
  }
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = absl::StrCat(base, ".tmp.", ::getpid(), ".", g_next_tmp.fetch_add(1));
    fd = ::openat(dfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) return Errno(absl::StrCat("create ", dir, "/", tmp));
  }
  if (fd < 0) return Errno(absl::StrCat("create a temporary file beside ", path));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status st = Errno(absl::StrCat("write ", dir, "/", tmp));
      ::close(fd);
      ::unlinkat(dfd, tmp.c_str(), 0);
      return st;
    }
    done += static_cast<size_t>(n);
  }
  ::fchmod(fd, 0644);  // readable by the collector whatever the umask
  if (::close(fd) != 0) {
    const absl::Status st = Errno(absl::StrCat("close ", dir, "/", tmp));
    ::unlinkat(dfd, tmp.c_str(), 0);
    return st;
  }
  if (::renameat(dfd, tmp.c_str(), dfd, base.c_str()) != 0) {
    const absl::Status st = Errno(absl::StrCat("rename ", dir, "/", tmp, " to ", path));
    ::unlinkat(dfd, tmp.c_str(), 0);
    return st;
  }
  return absl::OkStatus();
}

}  // namespace engram::daemon
