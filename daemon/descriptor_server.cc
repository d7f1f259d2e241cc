#include "daemon/descriptor_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "net/unix_socket.h"
#include "shm/descriptor_protocol.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kDeadline = std::chrono::seconds(2);
constexpr const char* kProtocol = kDescriptorProtocol;

std::string RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

// Compares in time independent of where the strings differ.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

DescriptorChannel::DescriptorChannel(std::function<bool(const PeerCred&)> allowed, Env* env)
    : allowed_(std::move(allowed)), env_(env) {}

DescriptorChannel::~DescriptorChannel() { Stop(); }

std::string DescriptorChannel::PathFor(const std::string& grpc_socket) { return grpc_socket + ".fds"; }

absl::Status DescriptorChannel::Bind(const std::string& grpc_socket, int gid) {
  const std::string path = PathFor(grpc_socket);
  RETURN_IF_ERROR(net::CheckSocketPath(path));
  // The gRPC listener already made sure no other engramd serves this directory; what is left here is stale.
  ASSIGN_OR_RETURN(net::Listening l,
                   net::ListenUnix(path, {.backlog = 128, .nonblocking = true, .mode = 0660, .gid = gid}));
  if (!l.warning.empty()) spdlog::warn("event=chown_failed detail={}", engram::LogQuoted(l.warning));
  const int fd = l.fd;
  std::lock_guard<std::mutex> lock(mu_);
  path_ = path;
  fd_ = fd;
  return absl::OkStatus();
}

void DescriptorChannel::Start() {
  if (fd_ < 0 || thread_.joinable()) return;
  thread_ = std::thread([this] { Serve(); });
}

void DescriptorChannel::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    env_->Unlink(path_.c_str());
  }
}

std::string DescriptorChannel::Issue(const std::string& lease, const PeerCred& peer, const std::string& segment_path,
                                     uint64_t segment_bytes, uint64_t dev, uint64_t ino) {
  Pending p{lease, RandomToken(), segment_path, segment_bytes, dev, ino, peer};
  std::string token = p.token;
  std::lock_guard<std::mutex> lock(mu_);
  by_lease_[lease] = std::move(p);
  return token;
}

void DescriptorChannel::Revoke(const std::string& lease) {
  std::lock_guard<std::mutex> lock(mu_);
  by_lease_.erase(lease);
}

std::string DescriptorChannel::socket_name() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (path_.empty()) return "";
  const auto slash = path_.rfind('/');
  return slash == std::string::npos ? path_ : path_.substr(slash + 1);
}

DescriptorStats DescriptorChannel::Stats() const {
  DescriptorStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.socket = path_;
  }
  s.sent = sent_;
  s.refused = refused_;
  return s;
}

absl::StatusOr<int> DescriptorChannel::Redeem(const std::string& request_line, const PeerCred& peer) {
  auto refuse = [this](absl::Status st) {
    ++refused_;
    return st;
  };
  if (!allowed_(peer)) {
    return refuse(absl::PermissionDeniedError(
        absl::StrCat("uid ", peer.uid, " may not use engramd: add it to the daemon's group (--group)")));
  }
  std::vector<std::string> parts = absl::StrSplit(request_line, ' ');
  if (parts.size() != 3 || parts[0] != kProtocol || parts[1].empty() || parts[2].empty()) {
    return refuse(
        absl::InvalidArgumentError(absl::StrCat("malformed request: expected \"", kProtocol, " <lease> <token>\"")));
  }
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_lease_.find(parts[1]);
    if (it == by_lease_.end()) {
      return refuse(absl::NotFoundError("no live lease with a descriptor to fetch under that id"));
    }
    // A wrong token or another process does not use the token up: the lease's own process can still fetch it.
    if (!SameSecret(it->second.token, parts[2])) return refuse(absl::PermissionDeniedError("wrong token"));
    // The session's uid, and its process where the daemon can tell processes apart (a peer in another PID
    // namespace, a pod or container, shows pid 0 on every connection: then the token alone says who it is).
    if (it->second.peer.uid != peer.uid) {
      return refuse(absl::PermissionDeniedError(
          absl::StrCat("the lease belongs to uid ", it->second.peer.uid, ", not to uid ", peer.uid)));
    }
    if (it->second.peer.pid != 0 && it->second.peer.pid != peer.pid) {
      return refuse(absl::PermissionDeniedError(
          absl::StrCat("the lease belongs to pid ", it->second.peer.pid, ", not to pid ", peer.pid)));
    }
    p = std::move(it->second);
    by_lease_.erase(it);
  }
  int fd = RetryEintr([&] { return env_->Open(p.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0); });
  if (fd < 0 && errno == ENOENT) {  // retired or unloaded between the grant and this fetch
    return refuse(
        absl::NotFoundError(absl::StrCat(kSegmentGone, ": ", p.path, " was retired or unloaded since the grant")));
  }
  if (fd < 0) return refuse(absl::NotFoundError(absl::StrCat("open ", p.path, ": ", std::strerror(errno))));
  struct stat st {};
  if (env_->Fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      static_cast<uint64_t>(st.st_size) != p.bytes ||
      (p.ino != 0 && (static_cast<uint64_t>(st.st_dev) != p.dev || static_cast<uint64_t>(st.st_ino) != p.ino))) {
    env_->Close(fd);
    return refuse(
        absl::FailedPreconditionError(absl::StrCat(kSegmentGone, ": ", p.path, " is no longer the granted segment")));
  }
  return fd;
}

void DescriptorChannel::Serve() {
  struct Conn {
    int fd;
    PeerCred peer;
    std::string buf;
    Clock::time_point deadline;
  };
  std::vector<Conn> conns;
  std::map<uint32_t, int> per_uid;  // open connections of each uid
  Clock::time_point accept_paused_until{};
  bool backoff_logged = false;
  auto finish = [&](Conn& c, const std::string& reply, int fd) -> bool {
    const bool sent = net::SendWithDescriptor(c.fd, reply, fd);
    // Unread input at close would reset the connection before the peer reads the reply: drain what is queued.
    char sink[1024];
    for (int i = 0; i < 64 && ::recv(c.fd, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
    }
    ::close(c.fd);
    c.fd = -1;
    if (--per_uid[c.peer.uid] <= 0) per_uid.erase(c.peer.uid);
    return sent;
  };
  while (!stop_) {
    // Full (kMaxPendingDescriptorRequests open) or out of descriptors: leave new connections in the backlog.
    const auto now0 = Clock::now();
    const bool accepting =
        conns.size() < static_cast<size_t>(kMaxPendingDescriptorRequests) && now0 >= accept_paused_until;
    std::vector<pollfd> fds;
    fds.push_back({fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    for (const Conn& c : conns) fds.push_back({c.fd, POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), accepting ? 200 : 50);
    if (n < 0 && errno != EINTR) break;
    const auto now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      const short ev = fds[i + 1].revents;
      if (ev != 0) {
        char chunk[kMaxDescriptorRequestBytes];
        const ssize_t got = ::recv(c.fd, chunk, sizeof(chunk), MSG_DONTWAIT);
        if (got > 0) c.buf.append(chunk, static_cast<size_t>(got));
        const auto nl = c.buf.find('\n');
        if (nl != std::string::npos) {
          auto fd = Redeem(c.buf.substr(0, nl), c.peer);
          if (fd.ok()) {
            const PeerCred peer = c.peer;
            if (finish(c, "OK\n", *fd)) {
              ++sent_;
            } else {
              ++refused_;
              spdlog::warn("event=descriptor_lost pid={} uid={}: the peer went away before the reply", peer.pid,
                           peer.uid);
            }
            ::close(*fd);
          } else {
            spdlog::warn("event=descriptor_refused pid={} uid={} detail={}", c.peer.pid, c.peer.uid,
                         engram::LogQuoted(std::string(fd.status().message())));
            finish(c, absl::StrCat("ERR ", fd.status().message(), "\n"), -1);
          }
          continue;
        }
        if (c.buf.size() > kMaxDescriptorRequestBytes || got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
          ++refused_;
          finish(c, "ERR malformed request\n", -1);
          continue;
        }
      }
      if (now > c.deadline) {
        ++refused_;
        finish(c, "ERR timed out\n", -1);
      }
    }
    std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
    if (!(fds[0].revents & POLLIN)) continue;
    while (conns.size() < static_cast<size_t>(kMaxPendingDescriptorRequests)) {
      int err = 0;
      const int s = net::AcceptUnix(fd_, /*nonblocking=*/true, &err);
      if (s < 0) {
        if (net::IsAcceptShortage(err)) {
          // The connection stays in the backlog, so poll would wake at once: pause accepting instead of spinning.
          accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
          if (!backoff_logged) spdlog::warn("event=descriptor_accept_backoff errno={}", err);
          backoff_logged = true;
        }
        break;
      }
      backoff_logged = false;
      std::optional<PeerCred> peer = ReadPeerCred(s);
      // A peer the daemon refuses is answered at once and holds no slot; one uid holds at most a quarter of them.
      const auto held = peer ? per_uid.find(peer->uid) : per_uid.end();
      const int open_of_uid = held == per_uid.end() ? 0 : held->second;
      const char* refusal = !peer                                              ? "ERR no peer credentials\n"
                            : !allowed_(*peer)                                 ? "ERR this uid may not use engramd\n"
                            : open_of_uid >= kMaxPendingDescriptorRequests / 4 ? "ERR too many requests from this uid\n"
                                                                               : nullptr;
      if (refusal != nullptr) {
        ++refused_;
        net::SendWithDescriptor(s, refusal, -1);
        ::close(s);
        if (peer) {
          spdlog::warn("event=descriptor_refused pid={} uid={} detail={}", peer->pid, peer->uid,
                       engram::LogQuoted(std::string(refusal + 4, std::strlen(refusal) - 5)));
        }
        continue;
      }
      ++per_uid[peer->uid];
      conns.push_back({s, *peer, "", Clock::now() + kDeadline});
    }
  }
  for (Conn& c : conns) ::close(c.fd);
}

}  // namespace engram::daemon
