// The client side of descriptor passing (daemon/descriptor_server.h): fetch a granted segment's read-only
// descriptor from engramd over its side socket, with the one-time token of the grant. No path lookup and no shm
// directory on the replica's side: it works from any mount or IPC namespace that can reach the daemon's socket
// directory (a container or pod that mounts only /run/engramd).
//
//   ASSIGN_OR_RETURN(int fd, FetchSegmentDescriptor(ChannelPath(socket, grant.fd_socket), lease, token, 2s));
//
// Errors: Unavailable when the channel cannot be reached (no such socket, an older daemon), ResourceExhausted when
// it is busy (worth retrying), PermissionDenied as the daemon refused ("ERR ..."), DeadlineExceeded, and
// DataLoss when the reply is malformed or carries no descriptor, or one that is not a read-only regular file.
// Any extra descriptors a reply carries are closed. Stateless; thread-safe.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace engram::client {

// The channel's path: the file `fd_socket` (a name, never a path) in the directory of `grpc_socket`.
// InvalidArgument when the name is empty or contains a '/'.
absl::StatusOr<std::string> ChannelPath(const std::string& grpc_socket, const std::string& fd_socket);

// The descriptor (O_CLOEXEC, opened O_RDONLY by the daemon); the caller owns it.
absl::StatusOr<int> FetchSegmentDescriptor(const std::string& channel_path, const std::string& lease_id,
                                           const std::string& token, std::chrono::milliseconds timeout);

}  // namespace engram::client
