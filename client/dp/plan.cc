#include "client/dp/plan.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace engram::client {

absl::StatusOr<DpShardedPlan> PlanDpSharded(const Layout& layout, int64_t tp_size, int64_t tp_rank, int64_t dp_size,
                                            int64_t dp_rank, int64_t local_dp_size) {
  if (tp_size < 1 || dp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || dp_rank < 0 || dp_rank >= dp_size ||
      local_dp_size < 0 || local_dp_size > dp_size) {
    return absl::InvalidArgumentError(absl::StrCat("invalid topology tp ", tp_rank, "/", tp_size, " dp ", dp_rank, "/",
                                                   dp_size, " local ", local_dp_size));
  }
  DpShardedPlan p;
  p.edp = std::gcd(dp_size, local_dp_size > 0 ? local_dp_size : dp_size);
  p.edp_rank = dp_rank % p.edp;
  p.group_index = dp_rank / p.edp;
  p.shards = tp_size * p.edp;
  p.shard_index = tp_rank * p.edp + p.edp_rank;
  for (int64_t r = 0; r < p.edp; ++r) {
    ASSIGN_OR_RETURN(ShardRange s, layout.Shard(p.shards, tp_rank * p.edp + r));
    p.members.push_back(std::move(s));
  }
  p.owned = p.members[static_cast<size_t>(p.edp_rank)];
  p.group_col_begin = p.members.front().col_begin;
  p.group_col_end = p.members.back().col_end;
  p.table_bytes = p.owned.bytes(layout.record_bytes());
  return p;
}

DpStepBytes DpShardedStepBytes(const Layout& layout, const DpShardedPlan& plan,
                               const std::vector<int64_t>& tokens_per_member, int64_t edp_rank) {
  DpStepBytes b;
  const int64_t L = layout.n_layers(), C = layout.n_cols(), rb = layout.record_bytes();
  const int64_t owned_cols = plan.owned.col_end - plan.owned.col_begin;
  const int64_t group_cols = plan.group_col_end - plan.group_col_begin;
  int64_t total = 0;
  for (int64_t t : tokens_per_member) total += t;
  const int64_t mine = tokens_per_member[static_cast<size_t>(edp_rank)];
  b.ids_sent = mine * L * C * 4;
  b.ids_received = (total - mine) * L * C * 4;
  // Rows of my columns for everyone else's tokens go out; rows of the group's other columns for my tokens come in.
  b.records_sent = (total - mine) * L * owned_cols * rb;
  b.records_received = mine * L * (group_cols - owned_cols) * rb;
  return b;
}

}  // namespace engram::client
