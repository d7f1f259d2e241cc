#include "model/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace engram {

absl::StatusOr<int> OpenRegularFile(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. Symlinks are followed on
  // purpose (Hugging Face cache layouts); fstat checks what they point at.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    auto msg = absl::StrCat(path, ": cannot open: ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot stat: ", std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISFIFO(st.st_mode)                         ? "a FIFO"
                       : S_ISDIR(st.st_mode)                        ? "a directory"
                       : S_ISSOCK(st.st_mode)                       ? "a socket"
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                    : "not a plain file";
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file (", kind, ")"));
  }
  // Back to blocking reads (regular files ignore O_NONBLOCK today, but do not rely on it).
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int e = errno;
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot clear O_NONBLOCK: ", std::strerror(e)));
  }
  return fd;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  auto opened = OpenRegularFile(path);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot stat"));
  }
  if (static_cast<size_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", st.st_size, " bytes, more than the ", max_bytes, " allowed for this file"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat(path, ": short read at byte ", done));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

absl::Status WriteFileAtomic(const std::string& path, const std::string& data) {
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat(tmp, ": cannot create: ", std::strerror(errno)));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::ResourceExhaustedError(absl::StrCat(tmp, ": write failed: ", std::strerror(e)));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": cannot finish write: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

namespace {

// The first number in `path`, if it has one ("max" and unreadable files do not).
std::optional<uint64_t> ReadNumber(const std::string& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

}  // namespace

uint64_t CgroupAvailableBytes(const std::string& self_cgroup, const std::string& sys_root) {
  uint64_t free_bytes = ~uint64_t{0};
  // What `dir` leaves, by one hierarchy's file names (v2: memory.max/current; v1: limit_in_bytes/usage_in_bytes).
  auto leave = [&](const std::string& dir, const char* limit, const char* usage) {
    const auto max = ReadNumber(dir + "/" + limit), used = ReadNumber(dir + "/" + usage);
    if (max && used) free_bytes = std::min(free_bytes, *max > *used ? *max - *used : 0);
  };
  // The group, every group above it (a parent's limit binds its children), and the mount's root (inside a container
  // the mount is the container's own group and the path, the host's name for it, does not exist there).
  auto walk = [&](const std::string& mount, std::string path, const char* limit, const char* usage) {
    while (!path.empty() && path.back() == '/') path.pop_back();
    while (true) {
      leave(mount + path, limit, usage);
      const auto slash = path.rfind('/');
      if (path.empty() || slash == std::string::npos) break;
      path.resize(slash);
    }
  };
  std::istringstream lines(self_cgroup);
  for (std::string line; std::getline(lines, line);) {
    // "ID:CONTROLLERS:PATH"; v2 is "0::PATH", v1's memory line lists "memory" among its controllers.
    const auto a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (path.empty() || path[0] != '/' || ("/" + path + "/").find("/../") != std::string::npos) continue;
    if (line.rfind("0::", 0) == 0) {
      walk(sys_root, path, "memory.max", "memory.current");
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name == "memory") walk(sys_root + "/" + controllers, path, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
  }
  return free_bytes;
}

std::optional<uint64_t> MeminfoValue(const std::string& meminfo, const std::string& key) {
  const std::string text = "\n" + meminfo;
  const size_t at = text.find("\n" + key + ":");
  if (at == std::string::npos) return std::nullopt;
  const char* p = text.c_str() + at + key.size() + 2;
  while (*p == ' ' || *p == '\t') ++p;
  if (*p < '0' || *p > '9') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(p, &end, 10);
  if (errno == ERANGE) return std::nullopt;
  return static_cast<uint64_t>(v);
}

uint64_t AvailableMemoryBytes(const std::string& meminfo, const std::string& self_cgroup, const std::string& sys_root) {
  const auto kb = MeminfoValue(meminfo, "MemAvailable");
  const uint64_t free_bytes = kb && *kb <= (~uint64_t{0} >> 10) ? *kb * 1024 : ~uint64_t{0};
  return std::min(free_bytes, CgroupAvailableBytes(self_cgroup, sys_root));
}

uint64_t AvailableMemoryBytes() {
  auto slurp = [](const char* path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  return AvailableMemoryBytes(slurp("/proc/meminfo"), slurp("/proc/self/cgroup"), "/sys/fs/cgroup");
}

}  // namespace engram
