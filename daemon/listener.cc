#include "daemon/listener.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "net/posix_acl.h"
#include "net/unix_socket.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

namespace {

// The directory part of a socket path; "" for a bare name (`--socket engramd.sock`: the working directory).
std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

// The gid of `name` (-1 for an empty name), or InvalidArgument naming the option.
absl::StatusOr<int> ResolveGroup(Env& env, const std::string& name, const char* what) {
  if (name.empty()) return -1;
  gid_t gid = 0;
  if (env.LookupGroup(name.c_str(), &gid) != 0) {
    if (errno == ENOENT) return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' does not exist"));
    return absl::UnavailableError(absl::StrCat("cannot look up the ", what, " '", name, "': ", std::strerror(errno)));
  }
  return static_cast<int>(gid);
}

}  // namespace

absl::StatusOr<UdsListener::Groups> UdsListener::ResolveGroups(const std::string& group,
                                                               const std::string& admin_group) const {
  Groups g;
  ASSIGN_OR_RETURN(g.gid, ResolveGroup(*env_, group, "group"));
  ASSIGN_OR_RETURN(g.admin_gid, ResolveGroup(*env_, admin_group, "admin group"));
  return g;
}

void UdsListener::ApplyGroups(const Groups& g) {
  admin_gid_ = g.admin_gid;
  if (g.gid != group_gid_.exchange(g.gid)) {
    // Root or the daemon's gid without a --group: the files keep the daemon's own group.
    const gid_t file_gid = g.gid >= 0 ? static_cast<gid_t>(g.gid) : ::getegid();
    for (const std::string& p : {path_, path_ + ".fds"}) {
      if (env_->Chown(p.c_str(), static_cast<uid_t>(-1), file_gid) != 0) {
        spdlog::warn("event=chown_failed path={} errno={}", engram::LogValue(p), errno);
      }
    }
  }
  ShareWithAdmins();
}

void UdsListener::ShareWithAdmins() {
  const int admin = admin_gid_, group = group_gid_;
  const bool grant = admin >= 0 && admin != group;
  std::vector<std::string> paths = {path_};
  // The socket's directory too, where it is the daemon's own (made here or by the service manager for it) and open
  // to its group.
  const std::string dir = DirectoryOf(path_);
  struct stat st {};
  // A directory its group cannot enter stays as it is: an entry copying the group's (absent) access would deny the
  // admin group what "other" may later be given.
  if (!dir.empty() && env_->Stat(dir.c_str(), &st) == 0 && st.st_uid == ::geteuid() && (st.st_mode & 0070) != 0) {
    paths.insert(paths.begin(), dir);
  }
  for (const std::string& p : paths) {
    const absl::Status s = grant ? net::GrantGroup(p, static_cast<gid_t>(admin)) : net::ClearAcl(p);
    if (s.ok()) continue;
    if (grant) {
      spdlog::warn(
          "event=admin_access_failed path={} detail={}: members of admin_group connect only if they are also "
          "in group",
          engram::LogValue(p), engram::LogQuoted(std::string(s.message())));
    } else {
      spdlog::warn("event=admin_access_failed path={} detail={}", engram::LogValue(p),
                   engram::LogQuoted(std::string(s.message())));
    }
  }
  if (grant) spdlog::info("event=admin_access gid={} paths={}", admin, paths.size());
}

absl::Status UdsListener::Bind(const std::string& path, const std::string& group, const std::string& admin_group) {
  path_ = path;
  ASSIGN_OR_RETURN(admin_gid_, ResolveGroup(*env_, admin_group, "admin group"));
  RETURN_IF_ERROR(net::CheckSocketPath(path));
  ASSIGN_OR_RETURN(group_gid_, ResolveGroup(*env_, group, "group"));
  const std::string dir = DirectoryOf(path);
  if (!dir.empty() && env_->Mkdir(dir.c_str(), 0750) == 0 && group_gid_ >= 0) {
    if (env_->Chown(dir.c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(group_gid_)) != 0) {
      spdlog::warn("event=chown_failed path={} errno={}", engram::LogValue(dir), errno);
    }
  }
  if (net::SomeoneListens(path)) {
    return absl::AlreadyExistsError(absl::StrCat("another engramd is already serving ", path));
  }
  ASSIGN_OR_RETURN(net::Listening l, net::ListenUnix(path, {.backlog = 256, .mode = 0660, .gid = group_gid_}));
  if (!l.warning.empty()) spdlog::warn("event=chown_failed detail={}", engram::LogQuoted(l.warning));
  fd_ = l.fd;
  ShareWithAdmins();
  return absl::OkStatus();
}

void UdsListener::Start(std::function<void(int, bool)> on_connection) {
  thread_ = std::thread([this, on_connection] {
    int backoff_ms = 0;  // > 0 while accept fails for lack of descriptors or memory
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      int err = 0;
      const int c = net::AcceptUnix(fd_, /*nonblocking=*/true, &err);  // gRPC wants non-blocking fds
      if (c < 0) {
        if (net::IsAcceptShortage(err)) {
          // The pending connection stays in the backlog, so poll would wake at once: wait instead of spinning.
          if (backoff_ms == 0) {
            spdlog::warn(
                "event=accept_backoff errno={} detail={}: new connections wait, established ones are "
                "served",
                err, engram::LogQuoted(std::strerror(err)));
          }
          backoff_ms = backoff_ms == 0 ? 50 : std::min(backoff_ms * 2, 400);
          for (int waited = 0; waited < backoff_ms && !stop_; waited += 10) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        continue;
      }
      if (backoff_ms > 0) {
        spdlog::info("event=accept_resumed");
        backoff_ms = 0;
      }
      const std::optional<PeerCred> read = ReadPeerCred(c);
      if (!read) {
        ::close(c);
        continue;
      }
      const PeerCred peer = *read;
      struct stat st {};
      if (env_->Fstat(c, &st) != 0 || !Admit(c, peer, st.st_dev, st.st_ino)) {
        ::close(c);
        continue;
      }
      const bool allowed = Allowed(peer);
      if (!allowed) spdlog::warn("event=refused pid={} uid={} reason=PERMISSION_DENIED", peer.pid, peer.uid);
      on_connection(c, allowed);
    }
  });
}

void UdsListener::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    env_->Unlink(path_.c_str());
  }
}

UdsListener::~UdsListener() { Stop(); }

std::optional<PeerCred> UdsListener::PeerOf(const std::string& grpc_peer) {
  // gRPC names a connection added from an fd "fd:<n>".
  const auto pos = grpc_peer.rfind("fd:");
  if (pos == std::string::npos) return std::nullopt;
  int fd = std::atoi(grpc_peer.c_str() + pos + 3);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second.peer;
}

std::map<int, UdsListener::Connection>::iterator UdsListener::ForgetLocked(std::map<int, Connection>::iterator it) {
  if (--per_uid_[it->second.peer.uid] <= 0) per_uid_.erase(it->second.peer.uid);
  return peers_.erase(it);
}

void UdsListener::SweepLocked() {
  swept_ = std::chrono::steady_clock::now();
  for (auto it = peers_.begin(); it != peers_.end();) {
    struct stat st {};
    if (env_->Fstat(it->first, &st) == 0 && static_cast<uint64_t>(st.st_dev) == it->second.dev &&
        static_cast<uint64_t>(st.st_ino) == it->second.ino) {
      ++it;
    } else {
      it = ForgetLocked(it);
    }
  }
}

bool UdsListener::Admit(int fd, const PeerCred& peer, uint64_t dev, uint64_t ino) {
  std::lock_guard<std::mutex> lock(mu_);
  // An fd number gRPC closed and the kernel gave out again: the old entry is gone.
  if (auto old = peers_.find(fd); old != peers_.end()) ForgetLocked(old);
  const bool exempt = peer.uid == 0 || peer.uid == ::geteuid();
  const int cap = max_per_uid_;
  auto count = [&] {
    auto it = per_uid_.find(peer.uid);
    return it == per_uid_.end() ? 0 : it->second;
  };
  const auto now = std::chrono::steady_clock::now();
  if (!exempt && count() >= cap && now - swept_ >= std::chrono::milliseconds(50)) SweepLocked();
  if (!exempt && count() >= cap) {
    Refusals& r = refusals_[peer.uid];
    ++r.since;
    if (now - r.logged >= std::chrono::seconds(1)) {
      spdlog::warn(
          "event=connection_refused pid={} uid={} reason=TOO_MANY_CONNECTIONS open={} max={} refused={}: the "
          "uid's connections are bounded (max_connections_per_uid)",
          peer.pid, peer.uid, count(), cap, r.since);
      r.logged = now;
      r.since = 0;
    }
    if (refusals_.size() > 4096) refusals_.clear();  // bounded memory whatever the number of uids
    return false;
  }
  peers_[fd] = Connection{peer, dev, ino};
  ++per_uid_[peer.uid];
  return true;
}

namespace {

bool InGroup(const PeerCred& p, int gid) {
  if (gid < 0) return false;
  if (p.gid == static_cast<uint32_t>(gid)) return true;
  for (uint32_t g : p.groups) {
    if (g == static_cast<uint32_t>(gid)) return true;
  }
  return false;
}

}  // namespace

bool UdsListener::Operator(const PeerCred& p) const {
  return p.uid == 0 || p.uid == ::geteuid() || InGroup(p, admin_gid_);
}

bool UdsListener::Allowed(const PeerCred& p) const {
  if (p.uid == 0 || p.uid == ::geteuid()) return true;
  if (InGroup(p, admin_gid_)) return true;
  return InGroup(p, group_gid_);
}

}  // namespace engram::daemon
