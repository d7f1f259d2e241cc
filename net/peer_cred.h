// PeerCred: who is on the other end of a connection, as the kernel reports it for the Unix socket (SO_PEERCRED for
// pid/uid/gid, SO_PEERGROUPS for the supplementary groups), never as the client claims. The listeners record it per
// connection at accept; the service and the replica registry copy it. Read at accept, the groups are right whatever
// PID namespace the peer lives in (a pod or container: the daemon sees pid 0 for it, and could not read its
// /proc entry). Plain value type; ReadPeerCred is thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace engram::daemon {

struct PeerCred {
  PeerCred() = default;
  PeerCred(int32_t pid_in, uint32_t uid_in, uint32_t gid_in, std::vector<uint32_t> groups_in = {})
      : pid(pid_in), uid(uid_in), gid(gid_in), groups(std::move(groups_in)) {}
  int32_t pid = 0;  // 0 when the peer is outside the daemon's PID namespace
  uint32_t uid = 0;
  uint32_t gid = 0;
  std::vector<uint32_t> groups;  // supplementary groups
};

// The credentials of the peer of connected Unix socket `fd` (SO_PEERCRED + SO_PEERGROUPS); nullopt when the kernel
// does not give both: the connection is then refused.
std::optional<PeerCred> ReadPeerCred(int fd);

}  // namespace engram::daemon
