// A Session's DP group (client/session/session.h, JoinGroup / LeaveGroup): the join and leave requests, and the
// group updates the events thread delivers to the membership's callback.
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/utf8.h"
#include "client/log.h"
#include "client/session/session_impl.h"

namespace engram::client {

void Session::Impl::DeliverGroupUpdate(const v1::GroupUpdate& u) {
  GroupEvent e;
  e.formed = u.state() == v1::GroupUpdate::FORMED;
  e.broken = u.state() == v1::GroupUpdate::BROKEN;
  e.group = u.group();
  e.detail = u.detail();
  e.rendezvous = u.rendezvous();
  e.slot = u.slot();
  e.left_pid = u.left_pid();
  e.left_dp_rank = u.left_dp_rank();
  e.generation = u.generation();
  for (const auto& m : u.members()) e.members.push_back({m.pid(), m.dp_rank(), m.edp_rank(), m.max_tokens()});
  std::function<void(const GroupEvent&)> cb;
  {
    std::lock_guard<std::mutex> lock(mu);
    // A late update of a membership this session left is not the current one's (0: an engramd that does not
    // echo join ids, which has no GroupLeave either: its updates are the one membership's).
    if (u.join_id() == join_id || u.join_id() == 0) cb = on_group;
  }
  if (cb) cb(e);
}

void Session::Impl::DeliverGroupLeft(const v1::GroupLeft& l) {
  if (l.code() == 0) {
    Log().info("engram: event=dp_group_left group={} generation={}", l.group(), l.generation());
  } else {
    Log().warn("engram: event=dp_group_leave_refused code={} detail={}", l.code(), engram::LogQuoted(l.error()));
  }
}

void Session::Impl::LoseGroup() {
  std::function<void(const GroupEvent&)> cb;
  {
    std::lock_guard<std::mutex> lock(mu);
    cb = std::move(on_group);
    on_group = nullptr;
    join_id = 0;
  }
  if (!cb) return;
  GroupEvent e;
  e.broken = true;
  e.detail = absl::StrCat("this replica's session with engramd on ", socket,
                          " ended (lease lost, or the daemon refused the group join): the DP group cannot go on");
  cb(e);
}

absl::StatusOr<uint64_t> Session::JoinGroup(const GroupJoinRequest& join,
                                            std::function<void(const GroupEvent&)> on_update) {
  v1::ClientMessage m;
  auto* j = m.mutable_group_join();
  j->set_name(join.name);
  j->set_transport(join.transport);
  j->set_rendezvous(join.rendezvous);
  j->set_max_tokens(join.max_tokens);
  j->set_bytes_per_step(join.bytes_per_step);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->on_group) {
    return absl::FailedPreconditionError(
        "this session is in a DP group already: close its engine (which leaves the "
        "group) before making another");
  }
  const uint64_t id = impl_->next_join_id++;
  j->set_join_id(id);
  impl_->on_group = std::move(on_update);
  impl_->join_id = id;
  if (auto st = impl_->Write(m); !st.ok()) {
    impl_->on_group = nullptr;
    impl_->join_id = 0;
    return st;
  }
  return id;
}

absl::Status Session::LeaveGroup(uint64_t join_id, const std::string& group, uint64_t generation,
                                 const std::string& reason, const std::vector<int32_t>& stalled_edp_ranks) {
  v1::ClientMessage m;
  auto* l = m.mutable_group_leave();
  for (int32_t r : stalled_edp_ranks) l->add_stalled_edp_ranks(r);
  l->set_group(group);
  l->set_generation(generation);
  l->set_reason(Utf8Prefix(reason, 512));  // the daemon's bound
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (join_id == 0 || impl_->join_id != join_id) return absl::OkStatus();  // lost with the lease, or left already
  impl_->on_group = nullptr;
  impl_->join_id = 0;
  return impl_->Write(m);
}

}  // namespace engram::client
