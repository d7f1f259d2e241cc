// DpGroup: this replica's membership of its node-local DP group (embedding_across_dp), as engramd brokers it
// (daemon/group_registry.h). Join sends the GroupJoin over the replica's session (the lease) and waits until every
// member joined (FORMED: the group slot, the members, the rank-0 member's rendezvous bytes). From then on Broken()
// says whether the group can still exchange: it turns non-empty when the daemon reports a member gone (BROKEN,
// naming it) or when this replica's own session ends (lease lost); the exchange checks it while it waits, so no
// member is left hanging in a step. Join and formed() are for the thread that drives the engine; Broken() is
// thread-safe (the session's events thread sets it).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/session.h"

namespace engram::client {

class DpGroup {
 public:
  // Sends `join` over `session` (after Keep()) and waits at most `timeout` for the group to form. Errors: the join
  // could not be sent, the daemon refused it (the session ended), the group broke while forming, or the timeout
  // (DEADLINE_EXCEEDED naming how many members are missing).
  static absl::StatusOr<std::unique_ptr<DpGroup>> Join(Session& session, const GroupJoinRequest& join,
                                                       std::chrono::milliseconds timeout);
  const GroupEvent& formed() const { return formed_; }
  // Empty while the group is intact; otherwise why it cannot go on.
  std::optional<std::string> Broken() const;

 private:
  struct State;
  explicit DpGroup(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;  // shared with the session's callback, which may outlive this object
  GroupEvent formed_;
};

// Timeouts of the group, from the environment (milliseconds): ENGRAM_DP_FORM_TIMEOUT_MS (forming, default 300000)
// and ENGRAM_DP_STEP_TIMEOUT_MS (one step's wait for the slowest member, default 60000).
std::chrono::milliseconds DpFormTimeout();
std::chrono::milliseconds DpStepTimeout();

}  // namespace engram::client
