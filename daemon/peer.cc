#include "daemon/peer.h"

#include <sys/socket.h>

#include <cerrno>

#include <fstream>
#include <sstream>
#include <string>

namespace engram::daemon {
namespace {

// Supplementary groups of a live process in this PID namespace, from /proc/<pid>/status: the fallback for a
// kernel without SO_PEERGROUPS (before 4.13).
std::vector<uint32_t> GroupsFromProc(int32_t pid) {
  std::vector<uint32_t> out;
  if (pid <= 0) return out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream ss(line.substr(7));
    uint32_t g;
    while (ss >> g) out.push_back(g);
  }
  return out;
}

}  // namespace

std::optional<PeerInfo> ReadPeer(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return std::nullopt;
  PeerInfo p{cred.pid, cred.uid, cred.gid, {}};
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (rc != 0 && errno == ERANGE) {  // glen now says how many bytes are needed
    groups.resize(glen / sizeof(gid_t));
    rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  if (rc == 0) {
    groups.resize(glen / sizeof(gid_t));
    p.groups.assign(groups.begin(), groups.end());
  } else {
    p.groups = GroupsFromProc(p.pid);
  }
  return p;
}

}  // namespace engram::daemon
