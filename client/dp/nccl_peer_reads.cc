// DpNcclExchange, the peer path: every member exports its shard allocation as a CUDA IPC handle through the
// communicator once, and maps the others' shards, so a step reads them directly over NVLink. The contract is in
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
#include "client/fault_points.h"
#include "kernels/dp_kernels.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

namespace {

constexpr int kMaxPeerLayers = 16;

// What a member exports for peer reads: its shard allocation and where each layer lies in it.
struct PeerExport {
  cudaIpcMemHandle_t handle;
  int32_t ok;  // 1: `handle` is valid
  int64_t offset[kMaxPeerLayers];
  int64_t row_begin[kMaxPeerLayers];
  int64_t row_end[kMaxPeerLayers];
};

}  // namespace

absl::Status DpNcclExchange::ExchangePeerShards(const void* alloc_base) {
  if (shape_.layers > kMaxPeerLayers) return absl::UnimplementedError("peer reads: too many layers");
  const BrokenFn stop = [this]() -> std::optional<std::string> {
    if (aborted_) return "the DP exchange was aborted";
    return broken_ ? broken_() : std::nullopt;
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const bool fail_open = Fault(FaultPoint::kDpPeerOpen);  // fault injection (client/fault_points.h)
  // 1. Every member's export, with whether it could make one (a local failure still takes part in the all-gather).
  PeerExport mine{};
  std::string why;
  if (cudaError_t e = cudaIpcGetMemHandle(&mine.handle, const_cast<void*>(alloc_base)); e != cudaSuccess) {
    why = absl::StrCat("cudaIpcGetMemHandle: ", cudaGetErrorString(e));
  } else {
    mine.ok = 1;
  }
  for (int32_t l = 0; l < shape_.layers; ++l) {
    mine.offset[l] = shard_[static_cast<size_t>(l)].records - static_cast<const uint8_t*>(alloc_base);
    mine.row_begin[l] = shard_[static_cast<size_t>(l)].row_begin;
    mine.row_end[l] = shard_[static_cast<size_t>(l)].row_end;
  }
  const size_t n = static_cast<size_t>(shape_.members);
  std::vector<PeerExport> all(n);
  RETURN_IF_ERROR(AllGather(comm_, stream_, shape_.members, &mine, sizeof(mine), all.data(), stop, deadline,
                            "DP exchange: all-gather of the peer handles", &mu_));
  // 2. Map the others' shards (only if every member exported one).
  bool exported = true;
  for (const PeerExport& x : all) exported = exported && x.ok == 1;
  std::vector<std::vector<ShardLayer>> peers(n);
  std::vector<void*> opened;
  int32_t mapped = exported ? 1 : 0;
  if (!exported && why.empty()) why = "a member could not export its shard";
  for (size_t s = 0; s < n && mapped == 1; ++s) {
    const uint8_t* base = static_cast<const uint8_t*>(alloc_base);
    if (static_cast<int32_t>(s) != shape_.me) {
      void* p = nullptr;
      const cudaError_t e = fail_open ? cudaErrorPeerAccessUnsupported
                                      : cudaIpcOpenMemHandle(&p, all[s].handle, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        why = absl::StrCat("cudaIpcOpenMemHandle of dp member ", s, "'s shard: ", cudaGetErrorString(e));
        mapped = 0;
        break;
      }
      opened.push_back(p);
      base = static_cast<const uint8_t*>(p);
    }
    for (int32_t l = 0; l < shape_.layers; ++l) {
      peers[s].push_back({base + all[s].offset[l], all[s].row_begin[l], all[s].row_end[l]});
    }
  }
  // 3. The group takes the peer path only if every member mapped every other one.
  std::vector<int32_t> every(n);
  RETURN_IF_ERROR(AllGather(comm_, stream_, shape_.members, &mapped, sizeof(mapped), every.data(), stop, deadline,
                            "DP exchange: all-gather of the peer mappings", &mu_));
  bool all_mapped = true;
  for (size_t s = 0; s < n; ++s) {
    if (every[s] != 1 && all_mapped) {
      all_mapped = false;
      if (mapped == 1) why = absl::StrCat("dp member ", s, " could not map the others' shards");
    }
  }
  if (!all_mapped) {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
    return absl::FailedPreconditionError(absl::StrCat("peer reads are not possible in this group: ", why));
  }
  ipc_opened_.insert(ipc_opened_.end(), opened.begin(), opened.end());
  peers_ = std::move(peers);
  return absl::OkStatus();
}

}  // namespace engram::client
