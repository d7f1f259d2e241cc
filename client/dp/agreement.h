// DpAgreement: what every member of a DP_SHARDED group must decide alike before its first step, and how the members'
// contributions become one decision. Each member contributes a few integers (DpAgreementMine: whether its shard is
// in GPU memory, whether it can split a communicator, and its tuning knobs that pick the step's collectives); one
// all-gather hands every member everyone's; DecideDpAgreement reads them the same way on every member: the shard
// and split facts must hold for all members, the knobs are rank 0's. So every member runs the same collectives.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "engram/tuning.h"

namespace engram::client {

struct DpAgreement {
  bool all_on_gpu = false;    // every member's shard is in GPU memory (peer reads need it)
  bool all_split = false;     // every member can split a communicator
  int32_t peer_max_slot = 0;  // peer reads for group slots up to this
  int64_t chunk_bytes = 0;    // the all-to-all's chunk of records (0: one chunk)
  bool sequential = false;    // the unpipelined all-to-all
  bool graph = false;         // the pipelined step as a replayed CUDA graph
  bool blocking = false;      // rank 0 asks for a blocking communicator (taken only where all_split)
};

// This member's contribution: its shard's kind, whether it can split a communicator, and its knobs (or their
// defaults, client/tuning.h).
std::vector<int32_t> DpAgreementMine(const Tuning& tuning, bool shard_on_gpu, bool can_split);

// The group's decision from every member's contribution (member m's at [m * n, (m + 1) * n), n the length of one
// contribution) and the group's slot (the most tokens a member sends per step). `all` must hold `members` whole
// contributions.
DpAgreement DecideDpAgreement(const std::vector<int32_t>& all, int64_t members, int32_t slot);

}  // namespace engram::client
