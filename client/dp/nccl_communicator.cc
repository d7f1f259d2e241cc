// DpNcclExchange, its communicator: forming one from an ncclUniqueId (non-blocking), polling NCCL calls and
// stream waits with a deadline and an abort check, and the blocking twin. The contract is in
// client/dp/nccl_exchange.h.
#include "client/dp/nccl_exchange.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "client/environment.h"
#include "kernels/dp_kernels.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

absl::StatusOr<ncclComm_t> DpNcclExchange::InitComm(const ncclUniqueId& id, int32_t members, int32_t me,
                                                    const BrokenFn& broken, std::chrono::milliseconds timeout) {
  auto api = NcclApi::Get();
  if (!api.ok()) return api.status();
  const NcclApi* n = *api;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // every call returns; we poll with a deadline and can abort
  ncclComm_t comm = nullptr;
  const ncclResult_t r = n->CommInitRankConfig(&comm, members, id, me, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) n->CommAbort(comm);
    return absl::InternalError(absl::StrCat("NCCL communicator: ", n->GetErrorString(r)));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    ncclResult_t st = ncclSuccess;
    n->CommGetAsyncError(comm, &st);
    if (st == ncclSuccess) return comm;
    if (st != ncclInProgress) {
      n->CommAbort(comm);
      return absl::InternalError(absl::StrCat("NCCL communicator: ", n->GetErrorString(st)));
    }
    std::optional<std::string> why = broken ? broken() : std::nullopt;
    if (!why && std::chrono::steady_clock::now() > deadline) why = "the NCCL communicator did not form in time";
    if (why) {
      n->CommAbort(comm);
      return absl::AbortedError(*why);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

absl::Status DpNcclExchange::Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status DpNcclExchange::Poll(ncclComm_t comm, ncclResult_t r, const BrokenFn& stop,
                                  std::chrono::steady_clock::time_point deadline, const char* what) {
  ASSIGN_OR_RETURN(const NcclApi* n, NcclApi::Get());
  if (r != ncclSuccess && r != ncclInProgress) {
    return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", n->GetErrorString(r)));
  }
  while (true) {
    ncclResult_t st = ncclSuccess;
    n->CommGetAsyncError(comm, &st);
    if (st == ncclSuccess) return absl::OkStatus();
    if (st != ncclInProgress) {
      return absl::InternalError(absl::StrCat("DP exchange: ", what, ": ", n->GetErrorString(st)));
    }
    if (std::optional<std::string> why = stop ? stop() : std::nullopt) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("DP exchange: ", what, " did not complete in time"));
    }
    std::this_thread::yield();
  }
}

absl::Status DpNcclExchange::WaitStream(cudaStream_t stream, const BrokenFn& stop,
                                        std::chrono::steady_clock::time_point deadline, const char* what) {
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(q)));
    if (std::optional<std::string> why = stop ? stop() : std::nullopt) return absl::AbortedError(*why);
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not complete in time"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status DpNcclExchange::Wait(ncclResult_t r, const char* what) {
  return Poll(
      comm_, r,
      [this]() -> std::optional<std::string> {
        if (aborted_) return "the DP exchange was aborted";
        return std::nullopt;
      },
      std::chrono::steady_clock::now() + timeout_, what);
}

bool DpNcclExchange::SplitSupported() {
  auto api = NcclApi::Get();
  if (!api.ok() || (*api)->CommSplit == nullptr) return false;
  // NCCL_COMM_SPLIT_SHARE_RESOURCES=1 overrides the config: the twin would share (and die with) its parent.
  return !Environment().nccl_split_shares_resources;
}

absl::StatusOr<ncclComm_t> DpNcclExchange::BlockingTwin(ncclComm_t comm, int32_t me, const BrokenFn& broken,
                                                        std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(const NcclApi* n, NcclApi::Get());
  if (n->CommSplit == nullptr) return absl::UnimplementedError("this NCCL has no ncclCommSplit");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.splitShare = 0;  // the twin must outlive its parent's abort
  ncclComm_t twin = nullptr;
  const ncclResult_t r = n->CommSplit(comm, 0, me, &twin, &cfg);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  absl::Status st = Poll(comm, r, broken, deadline, "the blocking communicator");
  if (st.ok() && twin != nullptr) st = Poll(twin, ncclSuccess, broken, deadline, "the blocking communicator");
  if (st.ok() && twin == nullptr) st = absl::InternalError("DP exchange: ncclCommSplit gave no communicator");
  if (!st.ok()) {
    n->CommAbort(comm);  // first: an interrupted split hands its child over only when the parent's abort joins it
    if (twin != nullptr) n->CommAbort(twin);
    return st;
  }
  n->CommAbort(comm);  // local: the twin owns its own resources (splitShare 0; SplitSupported refuses the env override)
  return twin;
}

}  // namespace engram::client
