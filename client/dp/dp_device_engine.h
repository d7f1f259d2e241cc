// The DP-sharded LookupEngine on the CUDA backend (client/dp/dp_engine.h describes the calls): the exchange runs over
// NCCL (client/dp/nccl_exchange.h) into fixed device staging buffers; Prefetch runs it on the engine's side stream
// after the work queued on the engine's stream (the hash ids), and Wait(l) joins it back into the engine's stream with
// an event (the host never waits); Lookup runs it on the engine's stream. Hash and Gate are the DeviceEngine's. The
// communicator is the engine's own (DpEngineOptions::nccl_comm, not owned) or one formed from the ncclUniqueId that
// the group's rank 0 sent through engramd (client/dp/nccl_group.h).
// Which collectives a step runs is agreed once when the group forms (client/dp/agreement.h), from group-wide facts
// and rank 0's tuning knobs (the table's Tuning: dp_peer_max_slot, dp_chunk_kib, dp_a2a, dp_graph_max_slot,
// dp_nccl_blocking; defaults in client/tuning.h): group slots up to dp_peer_max_slot read the other members' shards
// over NVLink when every member's shard is in GPU memory (cpu_offload false) and every member can map the others'
// (else all take the all-to-all); the all-to-all is a replayed CUDA graph of the pipelined step for slots up to
// dp_graph_max_slot, pipelined call by call above (or as dp_a2a names). Under the caller's own stream capture the
// graph form enqueues the pipelined step into the caller's graph instead (no nested instantiate). A watchdog thread
// aborts the communicator when the group breaks (engramd: a member left; or this lease ended) or a step does not
// finish within dp_step_timeout_ms, so no member hangs in a collective; every later call then returns the reason.
// CUDA builds only. One thread drives the engine; the Table must outlive it.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "client/dp/group.h"
#include "client/dp/plan.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"

namespace engram::client {

absl::StatusOr<std::unique_ptr<LookupEngine>> CreateDpDeviceEngine(const Table& table, int32_t max_tokens,
                                                                   cudaStream_t stream, Session& session,
                                                                   const DpShardedPlan& plan, void* nccl_comm);

}  // namespace engram::client
