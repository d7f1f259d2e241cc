// The LookupEngine of a DP_SHARDED table (embedding_across_dp, client/dp/plan.h): the same calls as any engine,
// with the group's exchange inside them. Created by LookupEngine::Create for a table of mode DP_SHARDED; creating it
// joins the node-local DP group through engramd (client/dp/group.h) and sets up the transport, so every member must
// create its engine (the group forms when the last one did).
//   Hash, Gate     local, as on any engine (no exchange).
//   Prefetch       one step for every layer, unpacked to bf16 into staging(l) in column order (columns outside the
//                  group's range are zero). A collective: every member calls it, with its own token count (0
//                  included); the step is padded to the group slot. Host transport: all-gather of the members' hash
//                  ids, lookup of this rank's columns for every gathered token, all-to-all of packed records, done
//                  when Prefetch returns. CUDA: enqueued on the engine's side stream (the host never waits): small
//                  slots read the other members' shards over NVLink; larger ones run the all-to-all path of
//                  client/dp/nccl_exchange.h (ids only to the member owning the columns, own columns read in
//                  place, records packed / sent / unpacked chunk by chunk; for small slots replayed as one CUDA graph).
//   Wait(l)        the step's status; on CUDA it also joins the step into the engine's stream (an event), so work
//                  queued after it sees the rows.
//   Lookup(l, ...) one layer's step, the same collective for that layer alone (bf16 or packed records).
// Buffers are fixed at creation (sized from the group slot). Any failure of a step (a member left, the lease
// ended, the step timeout, a bad argument on one member) aborts the step on every member and poisons the engine:
// every later call returns the same error, and the member leaves the group (GroupLeave: the others stop at once,
// told who left and why); destroying the engine leaves it too, after which its session may join a new group.
// Transport: the host region (client/dp/host_transport.h) on the CPU backend; NCCL (and NVLink peer reads) on the
// CUDA backend (client/dp/dp_device_engine.h). One thread drives an engine; the Table must outlive it.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engram/client.h"
#include "engram/lookup_engine.h"

namespace engram::client {

struct DpEngineOptions {
  // CUDA backend: the engine's own NCCL communicator of this group (ncclComm_t, ranks = edp ranks; not owned). Null:
  // one is formed from the ncclUniqueId that rank 0 sends through engramd.
  void* nccl_comm = nullptr;
};

absl::StatusOr<std::unique_ptr<LookupEngine>> CreateDpEngine(const Table& table, int32_t max_tokens, void* stream,
                                                             const DpEngineOptions& options = {});

}  // namespace engram::client
