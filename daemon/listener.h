// UdsListener: the daemon's Unix socket. It owns the listening socket (directory 0750, socket 0660, group
// configurable; an `--admin-group` other than `--group` is added to the socket and to a directory the daemon owns as
// a POSIX ACL entry with the group's access, so an operator only in the admin group can connect), refuses to start when
// another engramd answers on the same path, accepts connections itself so that it can read each peer's real uid/gid/pid
// (SO_PEERCRED), and hands the connected fd to the gRPC server. The service maps a call back to its peer through
// ServerContext::peer() ("fd:N").
//
// Authorisation happens here, for every service on the socket (engram, health, reflection): each connection is
// handed on with `allowed` (Allowed(peer)); main() gives the refused ones to a server whose only service answers
// every method PERMISSION_DENIED (daemon/refuser.h), so a uid that may not connect learns nothing.
//
// Running out of descriptors (EMFILE/ENFILE) or kernel memory (ENOBUFS/ENOMEM) in accept does not spin: the loop
// backs off (50 ms doubling to 400 ms), logs `event=accept_backoff` once per episode and `event=accept_resumed` when
// accept works again; established connections keep being served meanwhile.
// Groups change at run time (ResolveGroups + ApplyGroups, on SIGHUP): the next connection and the next call are checked
// against the new ones, and the socket files change group with them. Connections are bounded per uid
// (SetMaxConnectionsPerUid; root and the daemon's uid are exempt), refused or not, so that no uid can take the daemon's
// descriptors or server threads from the others: one more is closed at accept and logged (`event=connection_refused
// reason=TOO_MANY_CONNECTIONS`, at most once a second per uid, with how many were closed since). gRPC owns a
// connection's fd once handed on and closes it when the peer goes; the listener remembers each fd with the socket's
// inode and, when a uid reaches its bound (at most every 50 ms), drops the fds that are closed or now name another
// file. Thread-safe: the accept loop runs on its own thread; PeerOf, Allowed, Operator and ApplyGroups may be called
// from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "net/peer_cred.h"
#include "shm/env.h"

namespace engram::daemon {

class UdsListener {
 public:
  // `env`: the OS seam for the socket's files and directory (mkdir, chown, stat, fstat, unlink).
  explicit UdsListener(Env* env = Env::Default()) : env_(env) {}
  ~UdsListener();
  // Binds `path`; fails (AlreadyExists) when a live daemon listens there, removes a stale socket file otherwise.
  absl::Status Bind(const std::string& path, const std::string& group, const std::string& admin_group = "");
  // Starts accepting; each connection's fd goes to `on_connection`, with whether its peer is Allowed.
  void Start(std::function<void(int fd, bool allowed)> on_connection);
  void Stop();  // stops accepting (existing connections stay)
  std::optional<PeerCred> PeerOf(const std::string& grpc_peer);
  // Whether a peer may use the daemon: root, the daemon's own uid, or a member of the configured group.
  bool Allowed(const PeerCred& p) const;
  // Whether a peer may run the operator calls: root, the daemon's own uid, or a member of the admin group (an
  // allowed peer that is not one attaches and reads status only).
  bool Operator(const PeerCred& p) const;
  // New groups (a reload), in two steps so that the reload checks everything before it changes anything:
  // ResolveGroups looks them up (InvalidArgument naming a group that does not exist, Unavailable when the group
  // database cannot be read) and changes nothing; ApplyGroups serves with what it resolved, looking nothing up again,
  // and gives the sockets (this one and `<path>.fds`) the new --group.
  struct Groups {
    int gid = -1;        // --group's gid (-1: none)
    int admin_gid = -1;  // --admin-group's gid (-1: none)
  };
  absl::StatusOr<Groups> ResolveGroups(const std::string& group, const std::string& admin_group) const;
  void ApplyGroups(const Groups& groups);
  // The gid of --group (-1 when none is given or it cannot be resolved), for the descriptor socket beside this one.
  int group_gid() const { return group_gid_; }
  // At most `n` (>= 1) connections open at once per uid from now on (a reload lowers it for new connections only).
  void SetMaxConnectionsPerUid(int n) { max_per_uid_ = n; }

 private:
  Env* const env_;
  // Grants the admin group the socket (and the daemon's own socket directory) by ACL, or clears the ACL when there
  // is no separate admin group; a failure is a warning naming the path (the operators then need --group too).
  void ShareWithAdmins();
  // Whether connection `fd` of `peer` (socket inode `ino`) may be handed on; records it when so. Called on the accept
  // thread.
  bool Admit(int fd, const PeerCred& peer, uint64_t dev, uint64_t ino);
  // Forgets the fds that are closed or name another file than the socket accepted there. Holds mu_.
  void SweepLocked();
  struct Connection;
  // Forgets one remembered connection; returns the next. Holds mu_.
  std::map<int, Connection>::iterator ForgetLocked(std::map<int, Connection>::iterator it);

  struct Connection {
    PeerCred peer;
    uint64_t dev = 0;
    uint64_t ino = 0;
  };
  struct Refusals {
    std::chrono::steady_clock::time_point logged{};
    int since = 0;  // refused since the last log line
  };

  std::string path_;
  int fd_ = -1;
  std::atomic<int> group_gid_{-1};
  std::atomic<int> admin_gid_{-1};
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::atomic<int> max_per_uid_{256};
  std::mutex mu_;
  std::map<int, Connection> peers_;
  std::map<uint32_t, int> per_uid_;  // connections in peers_ per uid
  std::map<uint32_t, Refusals> refusals_;
  std::chrono::steady_clock::time_point swept_{};
};

}  // namespace engram::daemon
