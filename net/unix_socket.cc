#include "net/unix_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace engram::net {
namespace {

sockaddr_un Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  return addr;
}

}  // namespace

absl::Status CheckSocketPath(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long or empty: '", path, "'"));
  }
  return absl::OkStatus();
}

bool SomeoneListens(const std::string& path) {
  if (!CheckSocketPath(path).ok()) return false;
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  const sockaddr_un addr = Address(path);
  const bool ok = ::connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(s);
  return ok;
}

absl::StatusOr<Listening> ListenUnix(const std::string& path, const ListenOptions& options) {
  if (absl::Status s = CheckSocketPath(path); !s.ok()) return s;
  // A stale socket left by a process that died goes; anything else at the path is not ours to remove.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket: remove it or choose another path (it is left as it is)"));
    }
    ::unlink(path.c_str());
  }
  const int type = SOCK_STREAM | SOCK_CLOEXEC | (options.nonblocking ? SOCK_NONBLOCK : 0);
  Listening out;
  out.fd = ::socket(AF_UNIX, type, 0);
  if (out.fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const sockaddr_un addr = Address(path);
  if (::bind(out.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(out.fd);
    return absl::PermissionDeniedError(absl::StrCat("bind ", path, ": ", std::strerror(err)));
  }
  ::chmod(path.c_str(), options.mode);
  if (options.gid >= 0 && ::chown(path.c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(options.gid)) != 0) {
    out.warning = absl::StrCat("chown ", path, ": ", std::strerror(errno));
  }
  if (::listen(out.fd, options.backlog) != 0) {
    const int err = errno;
    ::close(out.fd);
    ::unlink(path.c_str());
    return absl::InternalError(absl::StrCat("listen ", path, ": ", std::strerror(err)));
  }
  return out;
}

int AcceptUnix(int listen_fd, bool nonblocking, int* err) {
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0));
  if (fd < 0 && err != nullptr) *err = errno;
  return fd;
}

bool IsAcceptShortage(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

int ConnectUnixNonBlocking(const std::string& path, int* err) {
  if (!CheckSocketPath(path).ok()) {
    if (err != nullptr) *err = ENAMETOOLONG;
    return -1;
  }
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) {
    if (err != nullptr) *err = errno;
    return -1;
  }
  const sockaddr_un addr = Address(path);
  if (::connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EINPROGRESS) return s;
  const int e = errno;
  ::close(s);
  if (err != nullptr) *err = e;
  return -1;
}

bool SendWithDescriptor(int sock, std::string_view bytes, int fd) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(bytes.size());
}

ssize_t ReceiveWithDescriptors(int sock, char* buf, size_t size, std::vector<int>* fds) {
  iovec iov{buf, size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  if (n < 0) return n;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(fd);
    }
  }
  return n;
}

}  // namespace engram::net
