// The DP-sharded plan: which rank owns which columns and rows, and what one step exchanges (V4.1-Flash layout).
#include "client/dp/plan.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram {
namespace {

TEST(DpShardedTest, TpTimesDpShardsTileTheColumns) {
  auto cfg = LoadEngramConfig(testing::DataPath("configs/v41-flash.json"));
  auto layout = Layout::Build(*cfg);
  ASSERT_TRUE(layout.ok());
  // TP 2 x DP 4: 8 shards of 3 columns each, one copy of the table in total.
  int64_t next_col = 0, bytes = 0;
  for (int tp = 0; tp < 2; ++tp) {
    for (int dp = 0; dp < 4; ++dp) {
      auto p = client::PlanDpSharded(*layout, 2, tp, 4, dp);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->shards, 8);
      EXPECT_EQ(p->shard_index, tp * 4 + dp);
      EXPECT_EQ(p->owned.col_end - p->owned.col_begin, 3);
      bytes += p->table_bytes;
    }
  }
  for (int s = 0; s < 8; ++s) {
    auto p = client::PlanDpSharded(*layout, 2, s / 4, 4, s % 4);
    EXPECT_EQ(p->owned.col_begin, next_col);
    next_col = p->owned.col_end;
  }
  EXPECT_EQ(next_col, 24);
  EXPECT_EQ(bytes, layout->table_bytes());
  // One step with 100 / 200 / 300 / 400 tokens on the four DP ranks, seen from dp rank 1 of tp rank 0.
  auto p = client::PlanDpSharded(*layout, 2, 0, 4, 1);
  auto b = client::DpShardedStepBytes(*layout, *p, {100, 200, 300, 400}, 1);
  EXPECT_EQ(b.ids_sent, 200 * 2 * 24 * 4);
  EXPECT_EQ(b.ids_received, 800 * 2 * 24 * 4);
  EXPECT_EQ(b.records_sent, 800 * 2 * 3 * 264);
  // Only this TP position's columns (0..11) come back: the other 9 of the group, not all 21 others.
  EXPECT_EQ(b.records_received, 200 * 2 * 9 * 264);
  EXPECT_EQ(p->group_col_begin, 0);
  EXPECT_EQ(p->group_col_end, 12);
  // Two groups of two per TP position when only 2 of the 4 DP replicas share a node.
  auto q = client::PlanDpSharded(*layout, 2, 1, 4, 3, 2);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->edp, 2);
  EXPECT_EQ(q->edp_rank, 1);
  EXPECT_EQ(q->group_index, 1);
  EXPECT_EQ(q->shard_index, 3);
  EXPECT_EQ(q->owned.col_begin, 18);
  EXPECT_EQ(q->owned.col_end, 24);
  EXPECT_FALSE(client::PlanDpSharded(*layout, 2, 2, 4, 0).ok());
  EXPECT_FALSE(client::PlanDpSharded(*layout, 8, 0, 4, 0).ok()) << "32 shards for 24 columns";
}

}  // namespace
}  // namespace engram
