// Status: the StatusReply engramctl shows (Status RPC; its Prometheus rendering is daemon/metrics_text.h), built
// from copies taken from the SegmentRegistry and the ReplicaRegistry (one registry lock at a time; the report itself
// holds none). The strings shown are the registries' Name()s: segment states
// PENDING/LOADING/READY/FAILED/RETIRED, checksum states pending/verifying/ok/mismatch, origins published/adopted,
// modes as the replicas reported them; a replica holding a registration ticket shows backend "registering".
// recent_fallbacks also carries the last failed loads/reloads (`load_failed dir=... detail=...`) and, when the
// replica list was cut (kMaxStatusReplicas / kMaxStatusReplicaBytes), a `replicas_not_listed count=N` line.
// daemon_version is this build's (engram/version.h); each replica's client_version is its hello's, "" when its
// client sent none.
// Pure functions over their arguments (BuildStatus also probes the shm directory); thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "daemon/prewarm.h"
#include "daemon/replica_registry.h"
#include "daemon/segment_registry.h"
#include "engram/v1/engram.pb.h"

namespace engram::daemon {

// Status stays far below gRPC's 4 MiB default message limit whatever the clients send.
inline constexpr size_t kMaxStatusReplicas = 1024;
inline constexpr size_t kMaxStatusReplicaBytes = size_t{1} << 20;

// `prewarm`: the daemon's registration prewarm (null: off, "engramd is not serving yet").
engram::v1::StatusReply BuildStatus(const SegmentRegistry& segments, const ReplicaRegistry& replicas, bool draining,
                                    const RegistrationPrewarm* prewarm = nullptr);

}  // namespace engram::daemon
