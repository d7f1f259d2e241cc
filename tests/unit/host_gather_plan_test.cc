// The CPU side of the host-gather path (client/engine/host_gather_plan.h): the plan of a batch's rows (every owned
// item maps to its row, non-owned items to none and -1), chunk planning, range splitting, the pool, and the record
// gather. Oracles: direct indexing, never the code under test.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "client/engine/host_gather_plan.h"
#include "gtest/gtest.h"

namespace engram::client {
namespace {

// Checks the plan against the ids by direct indexing: item i of a non-owned id has index -1 and no row; an owned
// item's index is i and its row is id - begin.
void CheckPlan(const std::vector<int32_t>& ids, int32_t T, int32_t C, int64_t stride, int64_t begin, int64_t end,
               const std::vector<int32_t>& index, const GatherPlan& plan) {
  ASSERT_EQ(plan.n_rows, static_cast<int64_t>(T) * C);
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t c = 0; c < C; ++c) {
      const int64_t i = static_cast<int64_t>(t) * C + c;
      const int64_t id = ids[static_cast<size_t>(t * stride + c)];
      if (id < begin || id >= end) {
        ASSERT_EQ(index[static_cast<size_t>(i)], -1) << "item " << i;
        ASSERT_EQ(plan.rows[static_cast<size_t>(i)], GatherPlan::kNoRow) << "item " << i;
        continue;
      }
      ASSERT_EQ(index[static_cast<size_t>(i)], i) << "item " << i;
      ASSERT_EQ(plan.rows[static_cast<size_t>(i)], static_cast<uint32_t>(id - begin)) << "item " << i;
    }
  }
}

TEST(HostGatherPlanTest, EveryItemMapsToItsRowAndForeignIdsToNone) {
  std::mt19937_64 rng(11);
  for (int threads : {1, 3, 8}) {
    GatherPool pool(threads);
    const int32_t T = 1000, C = 6;
    const int64_t stride = 2 * C;  // layer 1 of a two-layer hash output
    std::vector<int32_t> ids(static_cast<size_t>(T * stride));
    // Half the items repeat an earlier one; some ids fall outside the layer's rows [100, 5100).
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i > 0 && rng() % 2 == 0)
        ids[i] = ids[rng() % i];
      else
        ids[i] = static_cast<int32_t>(rng() % 5300);
    }
    std::vector<int32_t> index(static_cast<size_t>(T) * C, 12345);
    GatherPlan plan;
    ASSERT_TRUE(PlanIdentity(ids.data(), T, C, stride, 100, 5100, pool, index.data(), &plan).ok());
    CheckPlan(ids, T, C, stride, 100, 5100, index, plan);
    // A range planned alone gives the same answer as the whole batch.
    std::vector<uint32_t> rows(static_cast<size_t>(T) * C, 7);
    std::vector<int32_t> part(static_cast<size_t>(T) * C, 7);
    PlanIdentityRange(ids.data(), C, stride, 100, 5100, 37, 4001, rows.data(), part.data());
    for (int64_t i = 37; i < 4001; ++i) {
      ASSERT_EQ(rows[static_cast<size_t>(i)], plan.rows[static_cast<size_t>(i)]) << "item " << i;
      ASSERT_EQ(part[static_cast<size_t>(i)], index[static_cast<size_t>(i)]) << "item " << i;
    }
    EXPECT_EQ(rows[36], 7u);  // outside the range: untouched
    EXPECT_EQ(rows[4001], 7u);
  }
}

TEST(HostGatherPlanTest, NoneOwnedAndEmpty) {
  GatherPool pool(4);
  std::vector<int32_t> ids(4096, 77), index(4096);
  GatherPlan plan;
  ASSERT_TRUE(PlanIdentity(ids.data(), 4096, 1, 1, 0, 50, pool, index.data(), &plan).ok());
  EXPECT_EQ(plan.n_rows, 4096);
  for (int32_t k : index) ASSERT_EQ(k, -1);
  ASSERT_TRUE(PlanIdentity(nullptr, 0, 24, 24, 0, 50, pool, nullptr, &plan).ok());
  EXPECT_EQ(plan.n_rows, 0);
}

TEST(HostGatherPlanTest, BadInputsAreErrors) {
  GatherPool pool(2);
  std::vector<int32_t> ids(200), index(200);
  GatherPlan plan;
  EXPECT_EQ(PlanIdentity(ids.data(), 10, 4, 3, 0, 10, pool, index.data(), &plan).code(),
            absl::StatusCode::kInvalidArgument);  // stride < cols
  EXPECT_EQ(PlanIdentity(ids.data(), 10, 1, 1, 10, 0, pool, index.data(), &plan).code(),
            absl::StatusCode::kInvalidArgument);  // empty reversed range
  EXPECT_EQ(PlanIdentity(nullptr, 10, 1, 1, 0, 10, pool, index.data(), &plan).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanIdentity(ids.data(), -1, 1, 1, 0, 10, pool, index.data(), &plan).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanIdentity(ids.data(), 1, 1, 1, 0, int64_t{1} << 33, pool, index.data(), &plan).code(),
            absl::StatusCode::kInvalidArgument);  // more than 2^32 - 1 rows
}

TEST(HostGatherPlanTest, ChunksAndRanges) {
  EXPECT_EQ(PlanChunkRows(0, 8), 0);
  EXPECT_EQ(PlanChunkRows(10, 8), 1024);       // never below the minimum
  EXPECT_EQ(PlanChunkRows(1 << 20, 8), 8192);  // never above the maximum
  EXPECT_EQ(PlanChunkRows(196608, 16), 3072);  // four chunks per thread
  EXPECT_EQ(PlanChunkRows(100, 4, 1, 1000), 7);
  for (int64_t n : {0, 1, 7, 100, 12345}) {
    for (int parts : {1, 3, 16}) {
      int64_t next = 0;
      for (int p = 0; p < parts; ++p) {
        const Range r = SplitRange(n, parts, p);
        EXPECT_EQ(r.begin, next);
        EXPECT_LE(r.end - r.begin, n / parts + 1);
        EXPECT_GE(r.end - r.begin, n / parts);
        next = r.end;
      }
      EXPECT_EQ(next, n);
    }
  }
  EXPECT_EQ(DefaultGatherThreads(1), 1);
  EXPECT_EQ(DefaultGatherThreads(16), 8);
  EXPECT_EQ(DefaultGatherThreads(128), 16);
}

TEST(HostGatherPlanTest, CpuLists) {
  EXPECT_EQ(*ParseCpuList("3"), std::vector<int>({3}));
  EXPECT_EQ(*ParseCpuList("0-3,8,10-11"), std::vector<int>({0, 1, 2, 3, 8, 10, 11}));
  for (const char* bad : {"", "a", "3-1", "1,,2", "-2", "1-", "99999999", "2048"}) {
    EXPECT_EQ(ParseCpuList(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(HostGatherPlanTest, PoolRunsEveryWorkerEveryTimeAndPins) {
  GatherPool pool(5, {0});
  std::vector<int> hits(5, 0);
  for (int round = 0; round < 100; ++round) pool.Run([&](int w) { ++hits[static_cast<size_t>(w)]; });
  for (int h : hits) EXPECT_EQ(h, 100);
}

TEST(HostGatherPlanTest, GatherCopiesRecordsAndSkipsNoRow) {
  const int64_t rb = 264, rows = 50;
  std::vector<uint8_t> table(static_cast<size_t>(rows * rb));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<uint32_t> order = {49, 0, GatherPlan::kNoRow, 17, 17, 3};
  for (int k = 0; k < 40; ++k) order.push_back(static_cast<uint32_t>((k * 13) % rows));
  std::vector<uint8_t> dst(order.size() * rb, 0xEE);
  GatherRecords(table.data(), rb, order.data(), 1, static_cast<int64_t>(order.size()), dst.data());
  for (size_t k = 0; k < order.size(); ++k) {
    const uint8_t* got = dst.data() + k * rb;
    if (k == 0 || order[k] == GatherPlan::kNoRow) {
      for (int64_t b = 0; b < rb; ++b) ASSERT_EQ(got[b], 0xEE) << "slot " << k << " was written";
      continue;
    }
    ASSERT_EQ(std::memcmp(got, table.data() + order[k] * rb, rb), 0) << "slot " << k;
  }
}

// Every copy variant (prefetch distance, non-temporal stores) writes exactly the listed records, for record sizes
// whose rows land at every alignment (33 B: none; 264 B: 8-byte; 528 B: 16-byte) and destinations offset by 0-15 B.
TEST(HostGatherPlanTest, EveryCopyVariantCopiesRecordsAndSkipsNoRow) {
  std::mt19937_64 rng(5);
  for (const int64_t rb : {int64_t{33}, int64_t{66}, int64_t{264}, int64_t{528}}) {
    const int64_t rows = 300;
    std::vector<uint8_t> table(static_cast<size_t>(rows * rb));
    for (auto& b : table) b = static_cast<uint8_t>(rng());
    std::vector<uint32_t> order;
    for (int k = 0; k < 200; ++k) {
      order.push_back(rng() % 7 == 0 ? GatherPlan::kNoRow : static_cast<uint32_t>(rng() % rows));
    }
    for (const int ahead : {0, 1, 8, 16, 64}) {
      for (const bool nt : {false, true}) {
        for (const size_t shift : {size_t{0}, size_t{8}, size_t{13}}) {
          SCOPED_TRACE(::testing::Message() << "rb " << rb << " ahead " << ahead << " nt " << nt << " shift " << shift);
          std::vector<uint8_t> buf(order.size() * static_cast<size_t>(rb) + 64, 0xEE);
          uint8_t* dst = buf.data() + shift;
          GatherRecords(table.data(), rb, order.data(), 3, static_cast<int64_t>(order.size()) - 2, dst, {ahead, nt});
          for (size_t k = 0; k < order.size(); ++k) {
            const uint8_t* got = dst + k * static_cast<size_t>(rb);
            if (k < 3 || k + 2 >= order.size() || order[k] == GatherPlan::kNoRow) {
              for (int64_t b = 0; b < rb; ++b) ASSERT_EQ(got[b], 0xEE) << "slot " << k << " was written";
              continue;
            }
            ASSERT_EQ(std::memcmp(got, table.data() + order[k] * static_cast<size_t>(rb), static_cast<size_t>(rb)), 0)
                << "slot " << k;
          }
          for (size_t b = 0; b < shift; ++b) ASSERT_EQ(buf[b], 0xEE);
          for (size_t b = shift + order.size() * static_cast<size_t>(rb); b < buf.size(); ++b) ASSERT_EQ(buf[b], 0xEE);
        }
      }
    }
  }
}

// The identity plan of a sub-range (what a fused gather thread plans for its own chunk) equals direct indexing.
TEST(HostGatherPlanTest, IdentityRangeMapsOwnedIdsAndMarksTheRest) {
  const int32_t T = 9, C = 5;
  const int64_t stride = 12, begin_row = 100, end_row = 150;
  std::vector<int32_t> ids(static_cast<size_t>(T * stride), -7);
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t c = 0; c < C; ++c) ids[static_cast<size_t>(t * stride + c)] = 90 + (t * 7 + c * 3) % 70;
  }
  std::vector<uint32_t> rows(static_cast<size_t>(T * C), 12345);
  std::vector<int32_t> index(static_cast<size_t>(T * C), 999);
  PlanIdentityRange(ids.data(), C, stride, begin_row, end_row, 7, 38, rows.data(), index.data());
  for (int64_t i = 0; i < T * C; ++i) {
    const int64_t id = ids[static_cast<size_t>((i / C) * stride + i % C)];
    if (i < 7 || i >= 38) {
      EXPECT_EQ(rows[static_cast<size_t>(i)], 12345u) << i;
      EXPECT_EQ(index[static_cast<size_t>(i)], 999) << i;
    } else if (id >= begin_row && id < end_row) {
      EXPECT_EQ(rows[static_cast<size_t>(i)], static_cast<uint32_t>(id - begin_row)) << i;
      EXPECT_EQ(index[static_cast<size_t>(i)], i);
    } else {
      EXPECT_EQ(rows[static_cast<size_t>(i)], GatherPlan::kNoRow) << i;
      EXPECT_EQ(index[static_cast<size_t>(i)], -1) << i;
    }
  }
}

// The pool with and without spinning, woken early or not, with work on the calling thread: every worker runs each
// pass exactly once, the caller's function runs during the pass, and Run returns only after every worker finished.
TEST(HostGatherPlanTest, PoolPassesWithWakeHintsAndCallerWork) {
  for (const int spin : {0, 50}) {
    GatherPool pool(4, {}, spin);
    std::vector<std::atomic<int>> hits(4);
    for (auto& h : hits) h.store(0);
    for (int round = 0; round < 200; ++round) {
      if (round % 3 == 0) pool.Wake();
      if (round % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));  // workers asleep
      std::atomic<int> done{0};
      bool caller_ran = false;
      pool.Run(
          [&](int w) {
            hits[static_cast<size_t>(w)].fetch_add(1);
            done.fetch_add(1);
          },
          round % 2 == 0 ? std::function<void()>([&] { caller_ran = true; }) : std::function<void()>());
      ASSERT_EQ(done.load(), 4) << "round " << round;
      EXPECT_EQ(caller_ran, round % 2 == 0);
    }
    for (auto& h : hits) EXPECT_EQ(h.load(), 200);
  }
}

}  // namespace
}  // namespace engram::client
