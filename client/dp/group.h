// DpGroup: this replica's membership of its node-local DP group (embedding_across_dp), as engramd brokers it
// (daemon/group_registry.h). Join sends the GroupJoin over the replica's session (the lease) and waits until every
// member joined (FORMED: the group slot, the members, the rank-0 member's rendezvous bytes). From then on Broken()
// says whether the group can still exchange: it turns non-empty when the daemon reports a member gone (BROKEN,
// naming it and why) or when this replica's own session ends (lease lost); the exchange checks it while it waits,
// so no member is left hanging in a step.
//
// Leaving: Leave(reason) tells engramd this member is done with the group (proto GroupLeave): the group breaks for
// the others at once (their step, or their wait for the group to form, fails naming this member and `reason`) and
// the session may join a group again (a new engine). The destructor leaves ("its DP engine was closed") unless
// Leave was called; Join leaves by itself when it gives up (timeout) or the group broke while forming, so a failed
// Join leaves the session free to join again. Join, formed() and Leave are for the thread that drives the engine;
// Broken() is thread-safe (the session's events thread sets it). The Session must outlive the DpGroup.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/session/session.h"
#include "engram/tuning.h"

namespace engram::client {

class DpGroup {
 public:
  // Sends `join` over `session` (after Keep()) and waits at most `timeout` for the group to form. Errors: the join
  // could not be sent (or this session is in a group already), the daemon refused it (the session ended), the group
  // broke while forming (ABORTED, naming who left and why), or the timeout (DEADLINE_EXCEEDED).
  static absl::StatusOr<std::unique_ptr<DpGroup>> Join(Session& session, const GroupJoinRequest& join,
                                                       std::chrono::milliseconds timeout);
  ~DpGroup();
  DpGroup(const DpGroup&) = delete;
  DpGroup& operator=(const DpGroup&) = delete;

  const GroupEvent& formed() const { return formed_; }
  // Empty while the group is intact; otherwise why it cannot go on.
  std::optional<std::string> Broken() const;
  // Leaves the group with `reason` (the others' error and engramd's status show it); the first call counts, and
  // Broken() says so afterwards.
  // `stalled`: the edp ranks this member gives up on because a step timed out waiting for them (engramd's status
  // names them as the cause).
  void Leave(const std::string& reason, const std::vector<int32_t>& stalled = {});

 private:
  struct State;
  DpGroup(Session* session, uint64_t join_id, std::shared_ptr<State> s)
      : session_(session), join_id_(join_id), state_(std::move(s)) {}
  Session* session_;
  uint64_t join_id_;
  std::shared_ptr<State> state_;  // shared with the session's callback, which may outlive this object
  GroupEvent formed_;
  bool left_ = false;
};

// Timeouts of the group from the table's tuning: dp_form_timeout_ms (forming) and dp_step_timeout_ms (one step's
// wait for the slowest member); their defaults are client/tuning.h's.
std::chrono::milliseconds DpFormTimeout(const Tuning& tuning);
std::chrono::milliseconds DpStepTimeout(const Tuning& tuning);

}  // namespace engram::client
