#include "client/session/descriptor_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "net/unix_socket.h"
#include "shm/descriptor_protocol.h"

namespace engram::client {
namespace {

using Clock = std::chrono::steady_clock;

// Waits for `events` on `fd` until `deadline`; false on timeout or error.
bool WaitFor(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

}  // namespace

absl::StatusOr<std::string> ChannelPath(const std::string& grpc_socket, const std::string& fd_socket) {
  if (fd_socket.empty() || fd_socket.find('/') != std::string::npos || fd_socket == "." || fd_socket == "..") {
    return absl::InvalidArgumentError(absl::StrCat("the daemon named no usable descriptor socket ('", fd_socket, "')"));
  }
  const auto slash = grpc_socket.rfind('/');
  return slash == std::string::npos ? fd_socket : grpc_socket.substr(0, slash + 1) + fd_socket;
}

absl::StatusOr<int> FetchSegmentDescriptor(const std::string& channel_path, const std::string& lease_id,
                                           const std::string& token, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  RETURN_IF_ERROR(net::CheckSocketPath(channel_path));
  // A Unix socket whose listen backlog is full refuses a non-blocking connect with EAGAIN, and the socket is then
  // not connected at all (there is no connection in progress to wait for): another uid filling the daemon's backlog
  // must not make this replica fall back, so it connects again, with backoff, until the deadline.
  int s = -1;
  auto backoff = std::chrono::milliseconds(2);
  while (true) {
    int err = 0;
    s = net::ConnectUnixNonBlocking(channel_path, &err);
    if (s >= 0) break;
    if (err != EAGAIN) {
      return absl::UnavailableError(absl::StrCat("connect ", channel_path, ": ", std::strerror(err)));
    }
    if (Clock::now() + backoff >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the descriptor channel ", channel_path, " kept its backlog full until the deadline"));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{s};
  const std::string request = absl::StrCat(kDescriptorProtocol, " ", lease_id, " ", token, "\n");
  size_t sent = 0;
  while (sent < request.size()) {
    if (!WaitFor(s, POLLOUT, deadline)) return absl::DeadlineExceededError("the descriptor channel did not accept");
    const ssize_t n = ::send(s, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EPIPE || errno == ECONNRESET) {
      break;  // the daemon answered and closed before reading (a refusal at accept): its reply is waiting
    } else if (errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("send to ", channel_path, ": ", std::strerror(errno)));
    }
  }
  // One reply: a line, and with "OK" exactly one descriptor (in the first bytes' control message).
  std::string line;
  std::vector<int> fds;
  while (line.find('\n') == std::string::npos && line.size() < 1024) {
    if (!WaitFor(s, POLLIN, deadline)) break;
    char buf[512];
    const ssize_t n = net::ReceiveWithDescriptors(s, buf, sizeof(buf), &fds);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  const auto nl = line.find('\n');
  if (nl == std::string::npos) {
    close_all();
    return Clock::now() >= deadline ? absl::DeadlineExceededError("the descriptor channel did not answer in time")
                                    : absl::DataLossError("the descriptor channel closed without a reply");
  }
  line.resize(nl);
  if (line.rfind("ERR ", 0) == 0) {
    close_all();
    const std::string why = line.substr(4);
    if (why.rfind("too many requests", 0) == 0) {  // busy: worth another try
      return absl::ResourceExhaustedError(absl::StrCat("engramd's descriptor channel is busy: ", why));
    }
    return absl::PermissionDeniedError(absl::StrCat("engramd refused the descriptor: ", why));
  }
  if (line != "OK" || fds.size() != 1) {
    close_all();
    return absl::DataLossError(
        absl::StrCat("malformed descriptor reply ('", line.substr(0, 64), "', ", fds.size(), " descriptors)"));
  }
  const int fd = fds[0];
  struct stat st {};
  const int flags = ::fcntl(fd, F_GETFL);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || flags < 0 || (flags & O_ACCMODE) != O_RDONLY ||
      (flags & O_PATH) != 0) {  // an O_PATH descriptor reads as O_RDONLY and maps nothing
    ::close(fd);
    return absl::DataLossError("the daemon passed a descriptor that is not a read-only regular file");
  }
  return fd;
}

}  // namespace engram::client
