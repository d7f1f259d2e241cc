// Status and metrics: the StatusReply engramctl shows (Status RPC) and the Prometheus text exposition written to
// --metrics-file, both built from copies taken from the SegmentRegistry and the ReplicaRegistry (one registry
// lock at a time; the report itself holds none). The strings shown are the registries' Name()s: segment states
// PENDING/LOADING/READY/FAILED/RETIRED, checksum states pending/verifying/ok/mismatch, origins published/adopted,
// modes as the replicas reported them; a replica holding a registration ticket shows backend "registering".
// Pure functions over their arguments (BuildStatus also probes the shm directory); thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "daemon/replica_registry.h"
#include "daemon/segment_registry.h"
#include "engram/v1/engram.pb.h"

namespace engram::daemon {

engram::v1::StatusReply BuildStatus(const SegmentRegistry& segments, const ReplicaRegistry& replicas, bool draining);

// Prometheus text of `status` plus the counters since start.
std::string MetricsText(const engram::v1::StatusReply& status, const ReplicaCounters& counters);

}  // namespace engram::daemon
