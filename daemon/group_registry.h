// GroupRegistry: the DP-sharded groups engramd brokers (embedding_across_dp; proto GroupJoin / GroupLeave /
// GroupUpdate / GroupStatus). Replicas of one checkpoint at one TP position that run DP_SHARDED form a node-local
// group of edp = gcd(dp_size, local_dp_size) members: member edp rank = dp_rank % edp, group index = dp_rank / edp.
// Each member joins over its session; when the last one joined, every member is sent FORMED with the group's slot
// (the largest max_tokens), the member list and the rank-0 member's rendezvous bytes (an ncclUniqueId, or the name
// of a host-transport region; opaque here: the daemon links neither CUDA nor NCCL and never carries step data).
// A member departs in one of two ways:
//   - its session ends (its lease: process death included): a FORMING group forgets it (another process may take
//     its place), a FORMED group becomes BROKEN;
//   - it leaves (GroupLeave, LeaveGroup below: its engine closed, or it gave up forming or setting up the exchange):
//     the group becomes BROKEN whether FORMING or FORMED (the others' wait for the group fails at once), and the
//     session, which goes on, may join a group again.
// A group that breaks sends every other member BROKEN naming the member that left and why ("member dp rank 1
// (edp rank 1, pid N) left: <reason>"), so nobody waits in a collective or for a group that cannot form; status
// keeps the broken group (and, bounded, the last few whose members all left) with each member's departure.
//
// Every join and leave is validated (daemon/group_registry.cc); a bad one is refused with a Status and changes
// nothing. Thread-safe: one mutex, never held while a member is notified: the updates are decided under it and
// sent after it is released, so a member whose stream is slow or blocked stalls only the calls that notify its
// group, never the registry; each member still gets its group's updates in the order they were decided. The `notify`
// callbacks must therefore stay callable after the member's session ended (the service hands in one that drops what
// comes after its session closed).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engram/v1/engram.pb.h"
#include "net/peer_cred.h"
#include "shm/env.h"

namespace engram::daemon {

inline constexpr size_t kMaxGroupNameBytes = 128;
inline constexpr size_t kMaxRendezvousBytes = 1024;
inline constexpr int32_t kMaxGroupSlot = 1 << 20;
inline constexpr size_t kMaxGroupHistory = 16;
inline constexpr size_t kMaxLeaveReasonBytes = 512;

class GroupRegistry {
 public:
  using Notify = std::function<void(const engram::v1::ServerMessage&)>;

  // `env` (not owned, outlives the registry) removes a retired group's host region.
  explicit GroupRegistry(Env* env = Env::Default()) : env_(env) {}

  // The group size for a hello: gcd(dp_size, local_dp_size or dp_size).
  static int32_t EdpSize(const engram::v1::Hello& hello);

  // A session's join. InvalidArgument for malformed fields, FailedPrecondition for a join this session may not
  // make (no embedding_across_dp, group of one, joined already, another transport), AlreadyExists when the edp rank
  // is taken in the group or the group under its key formed already (another deployment of the checkpoint: the
  // message names ENGRAM_DP_GROUP). On success the member is recorded; the last member's join forms the group.
  absl::Status Join(const std::string& lease_id, const engram::v1::Hello& hello, const PeerCred& peer,
                    const engram::v1::GroupJoin& join, Notify notify);
  // The session ended: a forming group forgets the member, a formed one breaks and tells the others.
  void Leave(const std::string& lease_id);
  // The session's member leaves its group (proto GroupLeave): the group breaks, naming the member and `reason`, the
  // others are told, and the session may join again. Refused (nothing changes) with FailedPrecondition when the
  // session is in no group or names an older generation, PermissionDenied when it names an existing group it is not
  // a member of, NotFound when it names no group, InvalidArgument for an oversized reason. On success: the group
  // key and generation left (GroupLeft, code 0).
  absl::StatusOr<engram::v1::GroupLeft> LeaveGroup(const std::string& lease_id, const engram::v1::GroupLeave& leave);

  // Current groups, then recently broken ones whose members all left (newest first).
  std::vector<engram::v1::GroupStatus> Groups() const;

 private:
  struct Member {
    std::string lease_id;
    PeerCred peer;
    engram::v1::GroupMember info;  // info.left(): it departed (the group keeps it for status)
    Notify notify;
    uint64_t join_id = 0;  // echoed in its updates
  };
  // A group's updates reach each member in the order they were decided (FORMED before BROKEN): every decision that
  // sends takes a ticket under the registry's lock, and its updates are sent when the group's earlier tickets were.
  // A member whose stream blocks holds up its own group's later updates, never the registry.
  struct Delivery {
    uint64_t next_ticket = 0;  // guarded by the registry's mu_
    std::mutex mu;
    std::condition_variable cv;
    uint64_t serving = 0;  // guarded by mu
  };
  struct Group {
    engram::v1::GroupStatus status;  // state, members etc. kept current
    std::vector<Member> members;
    std::string rendezvous;
    uint64_t generation = 0;
    std::shared_ptr<Delivery> delivery = std::make_shared<Delivery>();
  };
  // Updates decided under the lock, sent after it is released (Send), in ticket order within the group.
  struct Outgoing {
    Notify notify;
    engram::v1::ServerMessage msg;
  };
  struct Outbox {
    std::shared_ptr<Delivery> delivery;  // set with the first update
    uint64_t ticket = 0;
    std::vector<Outgoing> updates;
  };
  // Queues update `msg` for member `m` (its join id set) of group `g`.
  static void Enqueue(Group& g, const Member& m, const engram::v1::ServerMessage& msg, Outbox* out);
  static void Send(Outbox& out);

  void FormLocked(Group& g, Outbox* out);
  // Member `self` of the group under `key` departs (`reason` as status shows it); `breaks_forming`: an explicit
  // leave, which breaks a FORMING group too.
  // `stalled`: the edp ranks the departing member named stalled (GroupLeave.stalled_edp_ranks): status then names
  // the first of them, not the member that left, as what broke the group.
  void DepartLocked(const std::string& key, const std::string& lease_id, const std::string& reason, bool breaks_forming,
                    Outbox* out, const std::vector<int32_t>& stalled = {});
  void RetireLocked(std::map<std::string, Group>::iterator it);
  static void RefreshStatus(Group& g);

  Env* const env_;
  mutable std::mutex mu_;
  std::map<std::string, Group> groups_;             // by key
  std::map<std::string, std::string> lease_group_;  // lease id -> key
  std::deque<engram::v1::GroupStatus> history_;     // broken groups whose members all left
  uint64_t next_generation_ = 1;
};

}  // namespace engram::daemon
