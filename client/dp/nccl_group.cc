#include "client/dp/nccl_group.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/dp/nccl_exchange.h"

namespace engram::client {

absl::StatusOr<NcclGroup> FormNcclGroup(Session& session, const Layout& layout, const DpShardedPlan& plan,
                                        int32_t max_tokens, const NcclApi& nccl, void* engine_comm,
                                        std::chrono::milliseconds timeout) {
  const int32_t me = static_cast<int32_t>(plan.edp_rank);
  GroupJoinRequest join;
  join.transport = "nccl";
  join.max_tokens = max_tokens;
  join.bytes_per_step = static_cast<uint64_t>(
      DpShardedStepBytes(layout, plan, std::vector<int64_t>(static_cast<size_t>(plan.edp), max_tokens), me).total());
  ncclUniqueId id{};
  if (me == 0) {
    if (engine_comm == nullptr) {
      if (nccl.GetUniqueId(&id) != ncclSuccess) return absl::InternalError("ncclGetUniqueId failed");
      join.rendezvous.assign(id.internal, sizeof(id.internal));
    } else {
      join.rendezvous = "engine-communicator";
    }
  }
  NcclGroup out;
  ASSIGN_OR_RETURN(out.group, DpGroup::Join(session, join, timeout));
  const GroupEvent& g = out.group->formed();
  if (static_cast<int64_t>(g.members.size()) != plan.edp) {  // never an NCCL communicator of the wrong size
    return absl::InternalError(
        absl::StrCat("the daemon formed a group of ", g.members.size(), " members, expected ", plan.edp));
  }
  if (engine_comm != nullptr) {
    out.comm = static_cast<ncclComm_t>(engine_comm);
    return out;
  }
  if (g.rendezvous.size() != sizeof(id.internal)) {
    return absl::FailedPreconditionError("the DP group's rendezvous is not an ncclUniqueId");
  }
  std::memcpy(id.internal, g.rendezvous.data(), sizeof(id.internal));
  auto broken = [grp = out.group.get()] { return grp->Broken(); };
  ASSIGN_OR_RETURN(out.comm, DpNcclExchange::InitComm(id, static_cast<int32_t>(plan.edp), me, broken, timeout));
  return out;
}

}  // namespace engram::client
