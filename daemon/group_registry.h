// GroupRegistry: the DP-sharded groups engramd brokers (embedding_across_dp; proto GroupJoin / GroupUpdate /
// GroupStatus). Replicas of one checkpoint at one TP position that run DP_SHARDED form a node-local group of
// edp = gcd(dp_size, local_dp_size) members: member edp rank = dp_rank % edp, group index = dp_rank / edp. Each
// member joins over its session; when the last one joined, every member is sent FORMED with the group's slot (the
// largest max_tokens), the member list and the rank-0 member's rendezvous bytes (an ncclUniqueId, or the name of a
// host-transport region; opaque here: the daemon links neither CUDA nor NCCL and never carries step data). When a
// member's session ends (its lease: process death included) a FORMED group becomes BROKEN and every other member is
// sent BROKEN naming the member that left, so nobody waits in a collective for it; status keeps the broken group
// (and, bounded, the last few whose members all left) so an operator sees which member went away.
//
// Every join is validated (hello asked for embedding_across_dp, a group of at least two, names/rendezvous/slot in
// bounds, one member per edp rank, one transport per group, one join per session); a bad one is refused with a
// Status and changes nothing. Thread-safe: one mutex; `notify` callbacks are called under it (as the replica
// registry does), so a member's stream is alive whenever it is notified (Leave runs before the session ends).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/peer.h"
#include "engram/v1/engram.pb.h"

namespace engram::daemon {

inline constexpr size_t kMaxGroupNameBytes = 128;
inline constexpr size_t kMaxRendezvousBytes = 1024;
inline constexpr int32_t kMaxGroupSlot = 1 << 20;
inline constexpr size_t kMaxGroupHistory = 16;

class GroupRegistry {
 public:
  using Notify = std::function<void(const engram::v1::ServerMessage&)>;

  // The group size for a hello: gcd(dp_size, local_dp_size or dp_size).
  static int32_t EdpSize(const engram::v1::Hello& hello);

  // A session's join. InvalidArgument for malformed fields, FailedPrecondition for a join this session may not
  // make (no embedding_across_dp, group of one, joined already, another transport), AlreadyExists when the edp rank
  // is taken in the group. On success the member is recorded; the last member's join forms the group.
  absl::Status Join(const std::string& lease_id, const engram::v1::Hello& hello, const PeerInfo& peer,
                    const engram::v1::GroupJoin& join, Notify notify);
  // The session ended: a forming group forgets the member, a formed one breaks and tells the others.
  void Leave(const std::string& lease_id);

  // Current groups, then recently broken ones whose members all left (newest first).
  std::vector<engram::v1::GroupStatus> Groups() const;

 private:
  struct Member {
    std::string lease_id;
    PeerInfo peer;
    engram::v1::GroupMember info;
    Notify notify;
    bool left = false;
  };
  struct Group {
    engram::v1::GroupStatus status;  // state, members etc. kept current
    std::vector<Member> members;
    std::string rendezvous;
    uint64_t generation = 0;
  };
  void FormLocked(Group& g);
  static void RefreshStatus(Group& g);

  mutable std::mutex mu_;
  std::map<std::string, Group> groups_;            // by key
  std::map<std::string, std::string> lease_group_;  // lease id -> key
  std::deque<engram::v1::GroupStatus> history_;    // broken groups whose members all left
  uint64_t next_generation_ = 1;
};

}  // namespace engram::daemon
