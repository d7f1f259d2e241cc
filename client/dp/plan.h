// The DP-sharded topology (`embedding_across_dp`, docs/math.md section 8): which rows a rank holds and what a step
// moves. The hash columns are split over tp_size * edp shards, TP-major, where edp = gcd(dp_size, local_dp_size) is the
// node-local Engram DP group at each TP position (all DP replicas on one node: edp = dp_size). A rank's shard index is
// tp_rank * edp + edp_rank (edp_rank = dp_rank % edp); the usual column split over the shards decides which columns
// (and so which contiguous rows of each layer) it owns. The edp shards of one TP position together cover that
// position's columns [group_col_begin, group_col_end); the exchange never leaves the group. Per step:
//   1. all-gather of hash ids across the group: every rank contributes its [T_r, layers, cols] int32 ids;
//   2. each rank looks up its own columns for every gathered token;
//   3. all-to-all of packed 264-byte records back: rank r receives from every member its T_r tokens' rows of that
//      member's columns, and unpacks them to bf16 in column order (columns outside the group's range are zero).
// The exchange runs in client/dp/dp_engine.h over a transport (client/dp/host_transport.h between processes on the
// host); the group is brokered by engramd (daemon/group_registry.h). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "model/layout.h"

namespace engram::client {

struct DpShardedPlan {
  int64_t shards = 0;                              // tp_size * edp
  int64_t shard_index = 0;                         // tp_rank * edp + edp_rank
  int64_t edp = 0;                                 // members of the group: gcd(dp_size, local_dp_size)
  int64_t edp_rank = 0;                            // dp_rank % edp
  int64_t group_index = 0;                         // dp_rank / edp: which of the node's groups at this TP position
  ShardRange owned;                                // columns and per-layer rows this rank holds
  int64_t table_bytes = 0;                         // bytes of the owned rows
  std::vector<ShardRange> members;                 // every member's shard, by edp rank
  int64_t group_col_begin = 0, group_col_end = 0;  // the columns the group covers (this TP position's)
};

// local_dp_size 0 = every DP replica on this node (edp = dp_size).
absl::StatusOr<DpShardedPlan> PlanDpSharded(const Layout& layout, int64_t tp_size, int64_t tp_rank, int64_t dp_size,
                                            int64_t dp_rank, int64_t local_dp_size = 0);

// Bytes one step moves for a rank: the ids it contributes to the all-gather, the ids it receives, and the record
// bytes it sends and receives in the all-to-all, given every member's token count (by edp rank).
struct DpStepBytes {
  int64_t ids_sent = 0;
  int64_t ids_received = 0;
  int64_t records_sent = 0;
  int64_t records_received = 0;
  int64_t total() const { return ids_sent + ids_received + records_sent + records_received; }
};
DpStepBytes DpShardedStepBytes(const Layout& layout, const DpShardedPlan& plan,
                               const std::vector<int64_t>& tokens_per_member, int64_t edp_rank);

}  // namespace engram::client
