// The DP-sharded topology (`embedding_across_dp`, SPEC 5): planned here, not built. The hash heads are sharded
// over all TP x DP ranks as one copy of the table: shard index = tp_rank * dp_size + dp_rank, and the usual column
// split over tp_size * dp_size shards decides which columns (and so which contiguous rows of each layer) a rank
// owns. Per step:
//   1. all-gather of hash ids across the DP group: every rank sends its [T_r, layers, cols] int32 ids;
//   2. each rank looks up its own columns for every gathered token (rows outside its range are zero);
//   3. all-to-all of packed records back: rank r receives, from every other rank, its T_r tokens' rows of the
//      sender's columns (264-byte records), and assembles [T_r, layers, cols].
// The collective (NCCL or a host transport between replica processes) is what is missing; until it exists the
// client reports DP_SHARDED_NOT_BUILT and serves a private table. This header is the interface it will fill in.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "model/layout.h"

namespace engram::client {

struct DpShardedPlan {
  int64_t shards = 0;       // tp_size * dp_size
  int64_t shard_index = 0;  // tp_rank * dp_size + dp_rank
  ShardRange owned;         // columns and per-layer rows this rank holds
  int64_t table_bytes = 0;  // bytes of the owned rows
};

absl::StatusOr<DpShardedPlan> PlanDpSharded(const Layout& layout, int64_t tp_size, int64_t tp_rank, int64_t dp_size,
                                            int64_t dp_rank);

// Bytes one step moves for a rank: the ids it contributes to the all-gather, the ids it receives, and the record
// bytes it sends back in the all-to-all, given every DP rank's token count.
struct DpStepBytes {
  int64_t ids_sent = 0;
  int64_t ids_received = 0;
  int64_t records_sent = 0;
  int64_t records_received = 0;
};
DpStepBytes DpShardedStepBytes(const Layout& layout, const DpShardedPlan& plan, const std::vector<int64_t>& tokens_per_dp_rank,
                               int64_t dp_rank);

}  // namespace engram::client
