// Joining a DP_SHARDED group through engramd and forming its NCCL communicator: rank 0 draws an ncclUniqueId and
// sends it with its join; engramd hands it to every member when the group forms, and each member initializes its
// rank of the communicator (or the engine brings a communicator of its own, and the group only names it).
// CUDA builds only. Not synchronized: one thread forms one group.
#pragma once

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "client/dp/group.h"
#include "client/dp/nccl_api.h"
#include "client/dp/plan.h"
#include "client/session/session.h"
#include "model/layout.h"

namespace engram::client {

struct NcclGroup {
  std::unique_ptr<DpGroup> group;  // the caller's; it owns the membership
  ncclComm_t comm = nullptr;       // `engine_comm` when given (not owned), else formed here (the caller's)
};

// Joins the group for `plan` (a step of up to `max_tokens` tokens per member) and returns it with its
// communicator. The join and the communicator's forming each take at most `timeout`. InternalError when engramd
// formed a group of another size than the plan's; FailedPrecondition when the rendezvous is not an ncclUniqueId.
absl::StatusOr<NcclGroup> FormNcclGroup(Session& session, const Layout& layout, const DpShardedPlan& plan,
                                        int32_t max_tokens, const NcclApi& nccl, void* engine_comm,
                                        std::chrono::milliseconds timeout);

}  // namespace engram::client
