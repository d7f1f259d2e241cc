// DescriptorChannel: how engramd hands a granted segment to a replica without the replica opening a path
// (docs/architecture.md, "Data flow" step 3). gRPC cannot carry file descriptors, so this is a second, tiny Unix
// socket in the same directory as the gRPC socket (`<socket>.fds`, same mode and group). For each grant the daemon
// issues a one-time token bound to the session's lease and to the process that opened it (SO_PEERCRED pid and uid);
// the grant carries the token and the channel's file name. The replica connects, sends one line
//     ENGRAM-FD/1 <lease_id> <token>\n
// and receives one line back, "OK\n" with the segment's descriptor attached (SCM_RIGHTS), or
// "ERR <reason>\n" with none. The descriptor is opened O_RDONLY by the daemon for that request (the file is 0600,
// the daemon's): the replica can map it PROT_READ only, and reopening it through /proc/self/fd needs the file's
// permissions, which a replica of another uid does not have.
//
// Who gets a descriptor: a peer the gRPC listener would let in (`allowed`, the same function, checked when the
// connection is accepted: a refused uid is answered at once and holds nothing), holding the token of a live lease,
// of the session's uid, and from the session's process where the daemon can tell processes apart (a peer in another
// PID namespace shows pid 0 on every connection; there the 128-bit token, sent only on that session's stream, is the
// proof). Each token works once and dies with its lease (Revoke). Everything else is refused and counted. Bounds:
// requests are 256 bytes at most, a connection has 2 s to send one, at most kMaxPendingDescriptorRequests are open at
// once (one uid holds a quarter of them at most; beyond, new connections wait in the listen backlog until a slot
// frees, they are not dropped), running out of descriptors pauses accepting instead of spinning, and the daemon
// keeps no descriptor after a reply (the count returns to where it was). Root, and the daemon's own uid, can reopen a
// passed descriptor writable through /proc/<pid>/fd (they may open the file anyway): run engines as another uid.
//
// Thread-safety: Issue/Revoke/Stats may be called from any thread; one internal thread serves the socket (poll).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "net/peer_cred.h"
#include "shm/env.h"

namespace engram::daemon {

inline constexpr size_t kMaxDescriptorRequestBytes = 256;
inline constexpr int kMaxPendingDescriptorRequests = 64;

struct DescriptorStats {
  std::string socket;              // the channel's path ("" when not bound)
  uint64_t sent = 0, refused = 0;  // sent: the reply with the descriptor reached the peer's socket
};

class DescriptorChannel {
 public:
  // `allowed`: the listener's authorisation (daemon/listener.h UdsListener::Allowed).
  // `env`: the OS seam for the segment files it opens and its socket file (tests inject faults through it).
  explicit DescriptorChannel(std::function<bool(const PeerCred&)> allowed, Env* env = Env::Default());
  ~DescriptorChannel();  // Stop()
  DescriptorChannel(const DescriptorChannel&) = delete;
  DescriptorChannel& operator=(const DescriptorChannel&) = delete;

  // The channel's path for the gRPC socket `grpc_socket`: "<grpc_socket>.fds".
  static std::string PathFor(const std::string& grpc_socket);
  // Binds PathFor(grpc_socket), mode 0660, group `gid` (>= 0) like the gRPC socket; a stale file is replaced.
  absl::Status Bind(const std::string& grpc_socket, int gid);
  void Start();
  void Stop();

  // A one-time token for lease `lease`: `peer` may fetch the descriptor of `segment_path` (a regular file of
  // `segment_bytes` bytes owned by this process's uid, and when `dev`/`ino` are not 0 the very file the grant
  // named: another file put under the name since is refused) once. Replaces any earlier token of the lease.
  std::string Issue(const std::string& lease, const PeerCred& peer, const std::string& segment_path,
                    uint64_t segment_bytes, uint64_t dev = 0, uint64_t ino = 0);
  void Revoke(const std::string& lease);
  // The file name clients look for next to the gRPC socket ("" before Bind).
  std::string socket_name() const;
  DescriptorStats Stats() const;

  // One request, as the serving thread handles it (public for the unit tests): the descriptor to send (the caller
  // closes it), or the reason for refusing. Counts the refusal.
  absl::StatusOr<int> Redeem(const std::string& request_line, const PeerCred& peer);

 private:
  struct Pending {
    std::string lease, token, path;
    uint64_t bytes = 0, dev = 0, ino = 0;
    PeerCred peer;
  };
  void Serve();

  std::function<bool(const PeerCred&)> allowed_;
  Env* const env_;
  std::string path_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable std::mutex mu_;
  std::map<std::string, Pending> by_lease_;
  std::atomic<uint64_t> sent_{0}, refused_{0};
};

}  // namespace engram::daemon
