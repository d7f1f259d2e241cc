#include "client/dp/agreement.h"

#include <algorithm>
#include <climits>
#include <string>

#include "client/tuning.h"

namespace engram::client {
namespace {

// The contribution's fields, in order.
enum Field : size_t { kOnGpu, kPeerMaxSlot, kChunkKib, kA2a, kGraphMaxSlot, kBlocking, kCanSplit, kFields };

// dp_a2a: the all-to-all form. Unset (or unknown): auto, the CUDA-graph form for group slots up to
// dp_graph_max_slot, the pipelined form enqueued call by call above.
constexpr int32_t kA2aPipelined = 0, kA2aSequential = 1, kA2aGraph = 2, kA2aAuto = 3;

int32_t A2aForm(const std::string& s) {
  if (s == "sequential") return kA2aSequential;
  if (s == "pipelined") return kA2aPipelined;
  if (s == "graph") return kA2aGraph;
  return kA2aAuto;
}

int32_t Clamped(int64_t v) { return static_cast<int32_t>(std::clamp<int64_t>(v, 0, INT32_MAX)); }

}  // namespace

std::vector<int32_t> DpAgreementMine(const Tuning& tuning, bool shard_on_gpu, bool can_split) {
  std::vector<int32_t> mine(kFields, 0);
  mine[kOnGpu] = shard_on_gpu ? 1 : 0;
  mine[kPeerMaxSlot] = Clamped(tuning.dp_peer_max_slot.value_or(tuning_default::kDpPeerMaxSlot));
  mine[kChunkKib] = Clamped(tuning.dp_chunk_kib.value_or(tuning_default::kDpChunkBytes >> 10));
  mine[kA2a] = A2aForm(tuning.dp_a2a);
  mine[kGraphMaxSlot] = Clamped(tuning.dp_graph_max_slot.value_or(tuning_default::kDpGraphMaxSlot));
  mine[kBlocking] = tuning.dp_nccl_blocking.value_or(0) != 0 ? 1 : 0;
  mine[kCanSplit] = can_split ? 1 : 0;
  return mine;
}

DpAgreement DecideDpAgreement(const std::vector<int32_t>& all, int64_t members, int32_t slot) {
  DpAgreement a;
  if (members < 1 || all.size() < static_cast<size_t>(members) * kFields) return a;
  a.all_on_gpu = true;
  a.all_split = true;
  for (int64_t m = 0; m < members; ++m) {
    const size_t at = static_cast<size_t>(m) * kFields;
    a.all_on_gpu = a.all_on_gpu && all[at + kOnGpu] == 1;
    a.all_split = a.all_split && all[at + kCanSplit] == 1;
  }
  // The knobs are rank 0's: the form from group-wide facts only, so every member takes the same.
  a.peer_max_slot = all[kPeerMaxSlot];
  a.chunk_bytes = int64_t{all[kChunkKib]} << 10;
  const int32_t form = all[kA2a] == kA2aAuto ? (slot <= all[kGraphMaxSlot] ? kA2aGraph : kA2aPipelined) : all[kA2a];
  a.sequential = form == kA2aSequential;
  a.graph = form == kA2aGraph;
  a.blocking = all[kBlocking] != 0;
  return a;
}

}  // namespace engram::client
