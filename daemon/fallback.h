// The sharing decision (docs/math.md section 9, docs/operations.md "Troubleshooting by fallback reason"): given what a
// replica declared and what the node offers, either the replica may share the node's segment, or it falls back to a
// mode with every reason that applies, each with a hint that says what to do about it. Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engram/v1/engram.pb.h"

namespace engram::daemon {

// What the daemon knows about the node and the checkpoint the replica asked for.
struct NodeView {
  bool checkpoint_served = false;  // a configured checkpoint has the replica's fingerprint
  bool model_shareable = true;     // false for Qwen4Exp PLE
  bool shm_exists = true;
  std::string shm_path;
  uint64_t shm_free_bytes = 0;  // at the time the tables were planned
  uint64_t tables_bytes = 0;    // all TP shards of the replica's TP size
  bool shm_too_small = false;   // the daemon could not create the segments for lack of room
  bool segment_failed = false;  // loading failed for another reason
  std::string segment_error;
};

struct Decision {
  bool share = false;
  engram::v1::Mode mode = engram::v1::MODE_UNSPECIFIED;
  std::vector<engram::v1::Reason> reasons;
};

Decision Decide(const engram::v1::Hello& hello, const NodeView& node);
// The node-local DP group a DP_SHARDED replica joins: gcd(dp_size, local_dp_size) replicas (embedding_across_dp).
int DpGroupSize(const engram::v1::Hello& hello);

engram::v1::Reason MakeReason(engram::v1::FallbackReason code, const std::string& hint);
std::string ReasonName(engram::v1::FallbackReason code);
std::string ModeName(engram::v1::Mode mode);

// Client input quoted in a hint or a status line is cut to this many bytes (at a UTF-8 boundary, "..." appended),
// so that no client can make status (every replica's hints) large.
inline constexpr size_t kMaxEchoBytes = 200;
std::string EchoOf(const std::string& client_text, size_t max = kMaxEchoBytes);

}  // namespace engram::daemon
