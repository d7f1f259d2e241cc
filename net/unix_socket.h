// Unix-domain stream sockets, the one place engram makes them: the daemon's two listeners (the gRPC socket,
// daemon/listener.h, and the descriptor socket, daemon/descriptor_server.h) and the replica's descriptor fetch
// (client/session/descriptor_client.h) all open, accept, connect and pass descriptors through these calls.
//
// Conventions: every descriptor made here is O_CLOEXEC; a call that fails closes what it opened and returns the
// cause (a Status, or -1 with the errno in *err for the calls a caller retries on particular errnos). No call raises
// SIGPIPE. Stateless; every function is thread-safe.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace engram::net {

// InvalidArgument when `path` does not fit a sockaddr_un (the kernel would truncate it silently).
absl::Status CheckSocketPath(const std::string& path);

// Whether a process accepts connections on `path` now (a blocking connect that succeeds).
bool SomeoneListens(const std::string& path);

struct ListenOptions {
  int backlog = 128;
  bool nonblocking = false;  // the listening socket itself (accepted sockets are chosen per AcceptUnix call)
  mode_t mode = 0660;        // the socket file's mode, set after bind
  int gid = -1;              // the socket file's group when >= 0
};

struct Listening {
  int fd = -1;
  std::string warning;  // non-empty when the socket works but its group could not be set (chown failed)
};

// Removes a stale socket at `path` (anything else there is FailedPrecondition, left alone), binds, sets mode and
// group, listens. PermissionDenied when bind fails.
absl::StatusOr<Listening> ListenUnix(const std::string& path, const ListenOptions& options);

// accept4 with SOCK_CLOEXEC (and SOCK_NONBLOCK when asked): the connected descriptor, or -1 with *err set.
int AcceptUnix(int listen_fd, bool nonblocking, int* err);

// Whether an accept failure is a shortage of descriptors or kernel memory: the connection stays in the backlog, so
// a listener must wait before it tries again instead of spinning on poll.
bool IsAcceptShortage(int err);

// A non-blocking connect to `path`: the socket (connected, or connecting: EINPROGRESS), or -1 with *err set (EAGAIN
// means the listener's backlog is full and nothing is in progress: connect again later).
int ConnectUnixNonBlocking(const std::string& path, int* err);

// Sends `bytes` in one sendmsg with `fd` attached when fd >= 0 (SCM_RIGHTS), without blocking: true when all of it
// went.
bool SendWithDescriptor(int sock, std::string_view bytes, int fd);

// One recvmsg (MSG_CMSG_CLOEXEC) into `buf`: the byte count (0 at end of stream, -1 with errno set), with every
// descriptor that came with them appended to `fds` (the caller owns and closes them).
ssize_t ReceiveWithDescriptors(int sock, char* buf, size_t size, std::vector<int>* fds);

}  // namespace engram::net
