// The DP-sharded LookupEngine on the CUDA backend (client/dp/engine.h describes the calls): the exchange runs over
// NCCL (client/dp/nccl_exchange.h) into fixed device staging buffers; Prefetch runs it on the engine's side stream
// after the work queued on the engine's stream (the hash ids), and Wait(l) joins it back into the engine's stream with
// an event (the host never waits); Lookup runs it on the engine's stream. Hash and Gate are the DeviceEngine's. The
// communicator is the engine's own (DpEngineOptions::nccl_comm, not owned) or one formed from the ncclUniqueId that
// the group's rank 0 sent through engramd. Group slots up to ENGRAM_DP_PEER_MAX_SLOT (default kDefaultPeerMaxSlot: no
// limit) read the other members' shards over NVLink instead when every member's shard is in GPU memory (cpu_offload
// false) and every member can map the others' (else all fall back to the all-to-all); the choice depends on
// group-wide facts only, so every member takes the same path.
// The knobs that decide a step's collectives (ENGRAM_DP_PEER_MAX_SLOT, ENGRAM_DP_CHUNK_KIB: the all-to-all path's
// chunk of records, 0 = one chunk; ENGRAM_DP_A2A=graph: the pipelined step captured once per shape into a CUDA graph
// and replayed, =pipelined: enqueued call by call, =sequential: the unpipelined all-to-all, unset: graph for group
// slots up to ENGRAM_DP_GRAPH_MAX_SLOT (default DpExchangeShape::kDefaultGraphMaxSlot), pipelined above) are rank
// 0's, agreed with the shard kinds in one all-gather when the group forms. Under the caller's own stream capture the
// graph form enqueues the pipelined step into the caller's graph instead (no nested instantiate). A watchdog thread
// aborts the communicator when the group breaks (engramd: a member left; or this lease ended) or a step does not finish
// within ENGRAM_DP_STEP_TIMEOUT_MS, so no member hangs in a collective; every later call then returns the reason. CUDA
// builds only. One thread drives the engine; the Table must outlive it.
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <memory>

#include "absl/status/statusor.h"
#include "client/dp/group.h"
#include "client/dp/plan.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"

namespace engram::client {

// bench_dp, 2 x H200 (bench/RESULTS.md, 2026-11-30): peer reads win at every slot measured, 1-16384 tokens per rank
// (6 us at 1 token; 384 us at 16384 against the all-to-all's 669 and the NCCL ceiling's 375): no limit by default.
// Where the GPUs cannot map each other's memory the group agrees on the all-to-all path instead.
inline constexpr int32_t kDefaultPeerMaxSlot = INT32_MAX;

absl::StatusOr<std::unique_ptr<LookupEngine>> CreateDpDeviceEngine(const Table& table, int32_t max_tokens,
                                                                   cudaStream_t stream, Session& session,
                                                                   const DpShardedPlan& plan, void* nccl_comm);

}  // namespace engram::client
