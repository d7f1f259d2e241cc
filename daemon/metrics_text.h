// MetricsText: engramd's metrics in the Prometheus text exposition format (version 0.0.4), the one rendering that both
// the textfile writer (--metrics-file, daemon/metrics_file.h) and the HTTP endpoint (--metrics-address,
// daemon/metrics_http.h) serve, so both always say the same. Built from a StatusReply (daemon/status_report.h) and the
// ReplicaRegistry's counters; every family has its HELP and TYPE lines, label values are escaped as the format asks
// (backslash, double quote, newline), counts and bytes are written as exact integers.
//
// Families (docs/operations.md "Metrics" lists them with their labels):
//   engram_build_info{version}                      gauge, always 1
//   engram_shm_bytes{kind=total|free|engram}        gauge
//   engram_segments{state}                          gauge
//   engram_segment_bytes{segment,state,origin}      gauge
//   engram_publish_bytes{segment,kind=done|total}   gauge: a segment's publish (or verification) progress
//   engram_publish_gib_per_second{segment}          gauge: rate of each published READY segment
//   engram_replicas{mode}                           gauge, every mode listed (0 included)
//   engram_fallbacks_total{reason}                  counter, every reason listed (0 included) so rate() starts at once
//   engram_sessions_total                           counter
//   engram_register_seconds                         histogram: registration time as replicas reported it
//   engram_attach_seconds                           histogram: grant to registration report, as the daemon saw it
//
// Pure function over its arguments; thread-safe.
#pragma once

#include <string>

#include "daemon/replica_registry.h"
#include "engram/v1/engram.pb.h"

namespace engram::daemon {

std::string MetricsText(const engram::v1::StatusReply& status, const ReplicaCounters& counters);

// A label value escaped for the text format: `\` -> `\\`, `"` -> `\"`, newline -> `\n`.
std::string EscapeLabelValue(const std::string& value);

}  // namespace engram::daemon
