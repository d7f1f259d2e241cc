#include "net/peer_cred.h"

#include <sys/socket.h>

#include <cerrno>

namespace engram::daemon {

std::optional<PeerCred> ReadPeerCred(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return std::nullopt;
  PeerCred p{cred.pid, cred.uid, cred.gid, {}};
  // SO_PEERGROUPS (Linux 4.13+): the groups the peer had when it connected, whatever its PID namespace.
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (rc != 0 && errno == ERANGE) {  // glen now says how many bytes are needed
    groups.resize(glen / sizeof(gid_t));
    rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  if (rc != 0) return std::nullopt;  // no groups known: refuse rather than judge membership on half the facts
  groups.resize(glen / sizeof(gid_t));
  p.groups.assign(groups.begin(), groups.end());
  return p;
}

}  // namespace engram::daemon
