#include "client/dp/group.h"

#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "client/environment.h"
#include "client/log.h"
#include "client/tuning.h"

namespace engram::client {

struct DpGroup::State {
  std::mutex mu;
  std::condition_variable cv;
  bool formed = false;
  GroupEvent formed_event;
  std::atomic<bool> broken{false};
  std::string detail;  // guarded by mu; set once before `broken`
};

absl::StatusOr<std::unique_ptr<DpGroup>> DpGroup::Join(Session& session, const GroupJoinRequest& join,
                                                       std::chrono::milliseconds timeout) {
  auto state = std::make_shared<State>();
  auto on_update = [state](const GroupEvent& e) {
    std::lock_guard<std::mutex> lock(state->mu);
    if (e.formed && !state->formed && !state->broken) {
      state->formed = true;
      state->formed_event = e;
    } else if (e.broken && !state->broken) {
      state->detail = e.group.empty() ? e.detail : absl::StrCat("DP group ", e.group, " broken: ", e.detail);
      state->broken.store(true, std::memory_order_release);
      Log().error("engram: event=dp_group_broken detail={}", engram::LogQuoted(state->detail));
    }
    state->cv.notify_all();
  };
  GroupJoinRequest named = join;
  if (named.name.empty()) named.name = Environment().dp_group;  // the deployment's name, when the operator gave one
  ASSIGN_OR_RETURN(const uint64_t join_id, session.JoinGroup(named, on_update));
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_for(lock, timeout, [&] { return state->formed || state->broken.load(); })) {
    lock.unlock();
    // Giving up: the members that did join are told at once (their wait fails naming this one), and this session
    // is free to join again.
    (void)session.LeaveGroup(join_id, "", 0,
                             absl::StrCat("gave up waiting for the group to form after ", timeout.count(), " ms"));
    return absl::DeadlineExceededError(
        absl::StrCat("the DP group did not form within ", timeout.count(),
                     " ms: every DP replica of this TP position on the node "
                     "must run with embedding_across_dp and join (ENGRAM_DP_FORM_TIMEOUT_MS sets the wait)"));
  }
  // Formed, even if broken since: the caller learns the group (a host region's name it must remove) and stops at
  // its first Broken() check.
  if (!state->formed) {
    const std::string detail = state->detail;
    lock.unlock();
    (void)session.LeaveGroup(join_id, "", 0, "the group broke while it was forming");
    return absl::AbortedError(detail);
  }
  std::unique_ptr<DpGroup> g(new DpGroup(&session, join_id, state));
  g->formed_ = state->formed_event;
  return g;
}

DpGroup::~DpGroup() { Leave("its DP engine was closed"); }

void DpGroup::Leave(const std::string& reason, const std::vector<int32_t>& stalled) {
  if (left_) return;
  left_ = true;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->broken) {
      state_->detail = absl::StrCat("this replica left DP group ", formed_.group, ": ", reason);
      state_->broken.store(true, std::memory_order_release);
    }
  }
  if (auto st = session_->LeaveGroup(join_id_, formed_.group, formed_.generation, reason, stalled); !st.ok()) {
    Log().warn("engram: event=dp_group_leave_failed detail={}", engram::LogQuoted(std::string(st.message())));
  }
}

std::optional<std::string> DpGroup::Broken() const {
  if (!state_->broken.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->detail;
}

std::chrono::milliseconds DpFormTimeout(const Tuning& tuning) {
  return TuningMillis(tuning.dp_form_timeout_ms, tuning_default::kDpFormTimeoutMs);
}
std::chrono::milliseconds DpStepTimeout(const Tuning& tuning) {
  return TuningMillis(tuning.dp_step_timeout_ms, tuning_default::kDpStepTimeoutMs);
}

}  // namespace engram::client
