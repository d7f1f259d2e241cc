// Session: one replica's whole conversation with engramd (docs/architecture.md, "Data flow" step 3), over gRPC on the
// daemon's Unix socket. The only client file that speaks the wire protocol: everything it returns is plain C++.
//
//   ASSIGN_OR_RETURN(auto s, Session::Open(socket, timeout, declaration));   // hello -> grant or fallback
//   if (s->answer().granted) { RETURN_IF_ERROR(s->AcquireTicket()); ...pin...; s->ReportRegistration(result); }
//   s->ReportOutcome(mode, reasons, backend, attach);  // what this process really runs: engramctl status shows it
//   s->Keep();                                  // the open session is the lease; it ends with the Session
//
// Open connects, sends the hello and waits for the daemon's answer within `timeout` (the daemon may hold it while a
// segment loads; the call is cancelled at the deadline). Errors: UNAVAILABLE/DEADLINE_EXCEEDED/CANCELLED when no
// daemon answers, PERMISSION_DENIED when it refuses this uid, INVALID_ARGUMENT for a hello it rejects; the caller
// turns them into DAEMON_UNAVAILABLE / PERMISSION_DENIED. A Session is driven by one thread; after Keep() a
// background thread drains daemon events (DRAINING is logged) until the Session is destroyed, which cancels the
// stream and releases the lease (a session that broke is re-established in the background: see Keep).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engram/types.h"

namespace engram::client {

// What a replica declares in its hello (which also carries this library's version, engram/version.h).
struct Declaration {
  uint64_t fingerprint = 0;
  std::string checkpoint;
  int tp_size = 1, tp_rank = 0, dp_size = 1, dp_rank = 0, local_dp_size = 0;
  bool elastic_ep = false;
  Choice cpu_offload = Choice::kAuto;  // the resolved value (kTrue/kFalse) from a replica; kAuto from tools
  Choice dp_shared_memory = Choice::kAuto;
  bool embedding_across_dp = false;
};

// A granted segment, as the daemon describes it.
struct GrantedLayer {
  int64_t layer_id = 0, row_begin = 0, row_end = 0;
  uint64_t data_offset = 0;  // of row_begin's record in the segment file
};
struct Grant {
  std::string segment_path;
  uint64_t segment_bytes = 0;
  uint64_t fingerprint = 0;
  int64_t head_dim = 0, record_bytes = 0;
  std::vector<GrantedLayer> layers;
  std::vector<int32_t> token_map;
  std::string lease_id;
  uint64_t epoch = 0;
  std::string fd_socket, fd_token;  // descriptor passing (client/session/descriptor_client.h); empty: path only
  uint64_t segment_dev = 0, segment_ino = 0;  // the file's identity as the daemon saw it (0: not given)
};

// The granted segment's path as this process sees it, for attach by path: the grant's, or the same file name in
// `shm_dir` when this process mounts the daemon's directory elsewhere ("" = the grant's).
std::string GrantedSegmentPath(const Grant& grant, const std::string& shm_dir);

struct Answer {
  bool granted = false;
  Grant grant;                  // when granted
  Mode mode = Mode::kShared;    // the daemon's decision (a fallback's mode)
  std::vector<Reason> reasons;  // a fallback's reasons
};

struct RegistrationReport {
  bool ok = false;
  double seconds = 0;
  std::string error;
  int failed_chunk = -1;
  Backend backend = Backend::kCpu;
};

// A DP_SHARDED replica's group (embedding_across_dp), as the daemon brokers it (proto GroupJoin / GroupUpdate).
struct GroupJoinRequest {
  std::string name;        // optional; [A-Za-z0-9._-], at most 128 bytes
  std::string transport;   // "host" or "nccl"
  std::string rendezvous;  // the rank-0 member's opaque bytes (region name, ncclUniqueId); others: empty
  int32_t max_tokens = 0;  // this member's fixed buffers; the group slot is the members' max
  uint64_t bytes_per_step = 0;
};
struct GroupMemberInfo {
  int32_t pid = 0, dp_rank = 0, edp_rank = 0, max_tokens = 0;
};
struct GroupEvent {
  bool formed = false;  // FORMED: rendezvous, slot, members are final
  bool broken = false;  // BROKEN, or this session ended (lease lost): detail says which
  std::string group, detail, rendezvous;
  int32_t slot = 0, left_pid = 0, left_dp_rank = -1;
  uint64_t generation = 0;  // the group's, as engramd numbers them (a GroupLeave names it)
  std::vector<GroupMemberInfo> members;
};

class Session {
 public:
  static absl::StatusOr<std::unique_ptr<Session>> Open(const std::string& socket, std::chrono::milliseconds timeout,
                                                       const Declaration& declaration);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const Answer& answer() const { return answer_; }
  // The granted segment's read-only descriptor, passed by engramd over its descriptor socket next to the gRPC
  // socket (client/session/descriptor_client.h); the caller owns it. Unavailable when the grant offers none.
  absl::StatusOr<int> FetchSegmentDescriptor(std::chrono::milliseconds timeout) const;
  // The identity (st_dev, st_ino) of the file this replica mapped: after a daemon restart, the session compares the
  // new grant's file with it to know whether the replica still shares (Keep).
  void NoteMappedFile(uint64_t dev, uint64_t ino);
  // Blocks until the node's registration ticket is this replica's (one registration at a time per node), at most
  // `wait`: DeadlineExceeded when the daemon answers that none was free by then (the session goes on). Against a
  // daemon that does not answer at its deadline the call is cancelled a second after it (the session ends).
  absl::Status AcquireTicket(std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  absl::Status ReportRegistration(const RegistrationReport& report);
  absl::Status ReportOutcome(Mode mode, const std::vector<Reason>& reasons, Backend backend,
                             AttachMethod attach = AttachMethod::kNone);
  // What this replica's latest lookup engine chose (EngineChoice; status shows it): after ReportOutcome, replayed
  // after a reconnect like the outcome. Cut to 2048 bytes.
  absl::Status ReportEngineChoice(const std::string& text);
  // Holds the session (the lease) and drains daemon events in the background until destruction. When the session
  // breaks (engramd died or restarted) the background thread logs event=lease_lost, reconnects with backoff (up to
  // 5 s apart), says hello again and replays the outcome, so status lists this replica again; the table keeps its
  // mapping (pages stay mapped whatever happens to the daemon), nothing is remapped or re-registered. A SHARED
  // replica whose file the new daemon no longer grants (another file under the name, or a fallback) reports what
  // it now is: PRIVATE_PINNED with SEGMENT_NOT_READY (its mapping is a copy no one else reads).
  void Keep();
  // The declaration this session said hello with.
  const Declaration& declaration() const;
  // Joins the DP group after the outcome DP_SHARDED (call after Keep()): `on_update` is called from the events
  // thread with FORMED and BROKEN updates of this membership, and once with broken = true when the session ends (the
  // lease is lost: the group cannot go on). Returns the membership's id (for LeaveGroup). An error when the join
  // could not be sent or this session is in a group already; the daemon ends the session on a join it refuses (then
  // `on_update` is told so).
  absl::StatusOr<uint64_t> JoinGroup(const GroupJoinRequest& join, std::function<void(const GroupEvent&)> on_update);
  // Leaves membership `join_id` (proto GroupLeave): engramd breaks the group for the other members, naming this
  // replica and `reason`, and this session may join a group again at once. `group` and `generation` (from FORMED;
  // empty and 0 before it) let the daemon check the membership. Nothing is sent when the membership ended already
  // (the session was lost, or it left); `on_update` is not called again either way.
  absl::Status LeaveGroup(uint64_t join_id, const std::string& group, uint64_t generation, const std::string& reason,
                          const std::vector<int32_t>& stalled_edp_ranks = {});

 private:
  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  Answer answer_;
};

// The daemon's status document (client/session/status_json.h, docs/status.md: what `engramctl status --json` prints),
// from a Status call on `socket` within `timeout`. The gRPC error's code with "engramd at SOCKET: ..." when no daemon
// answers or it refuses.
absl::StatusOr<std::string> FetchStatusJson(const std::string& socket, std::chrono::milliseconds timeout);

}  // namespace engram::client
