#include "client/dp_sharded.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace engram::client {

absl::StatusOr<DpShardedPlan> PlanDpSharded(const Layout& layout, int64_t tp_size, int64_t tp_rank, int64_t dp_size,
                                            int64_t dp_rank) {
  if (tp_size < 1 || dp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || dp_rank < 0 || dp_rank >= dp_size) {
    return absl::InvalidArgumentError(absl::StrCat("invalid topology tp ", tp_rank, "/", tp_size, " dp ", dp_rank, "/",
                                                   dp_size));
  }
  DpShardedPlan p;
  p.shards = tp_size * dp_size;
  p.shard_index = tp_rank * dp_size + dp_rank;
  ASSIGN_OR_RETURN(p.owned, layout.Shard(p.shards, p.shard_index));
  p.table_bytes = p.owned.bytes(layout.record_bytes());
  return p;
}

DpStepBytes DpShardedStepBytes(const Layout& layout, const DpShardedPlan& plan,
                               const std::vector<int64_t>& tokens_per_dp_rank, int64_t dp_rank) {
  DpStepBytes b;
  const int64_t L = layout.n_layers(), C = layout.n_cols(), rb = layout.record_bytes();
  const int64_t owned_cols = plan.owned.col_end - plan.owned.col_begin;
  int64_t total = 0;
  for (int64_t t : tokens_per_dp_rank) total += t;
  const int64_t mine = tokens_per_dp_rank[static_cast<size_t>(dp_rank)];
  b.ids_sent = mine * L * C * 4;
  b.ids_received = (total - mine) * L * C * 4;
  // Rows of my columns for everyone else's tokens go out; rows of every other shard's columns for my tokens come in.
  b.records_sent = (total - mine) * L * owned_cols * rb;
  b.records_received = mine * L * (C - owned_cols) * rb;
  return b;
}

}  // namespace engram::client
