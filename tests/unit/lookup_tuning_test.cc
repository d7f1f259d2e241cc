// The kernels' process-wide lookup tuning (kernels/engram_kernels.h): SetLookupSortShape changes only the fields it
// is given, clamped as SetLookupTuning clamps them, so that engines created at once, each naming one field, do not
// undo each other; a concurrent writer of another field keeps its value. CPU only: no launch.
#include <atomic>
#include <cstdint>
#include <optional>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/engram_kernels.h"

namespace engram::kernels {
namespace {

TEST(LookupSortShape, OnlyTheGivenFieldsChangeAndAreClamped) {
  const LookupTuning before = GetLookupTuning();
  LookupTuning t = before;
  t.sort_min_items = 4321;
  t.sort_variant = 0;
  t.sort_blocks = 16;
  SetLookupTuning(t);
  SetLookupSortShape(2, std::nullopt);
  EXPECT_EQ(GetLookupTuning().sort_variant, 2);
  EXPECT_EQ(GetLookupTuning().sort_blocks, 16) << "the grid was not named";
  EXPECT_EQ(GetLookupTuning().sort_min_items, 4321) << "the threshold was not named";
  SetLookupSortShape(std::nullopt, 64);
  EXPECT_EQ(GetLookupTuning().sort_variant, 2) << "the variant was not named";
  EXPECT_EQ(GetLookupTuning().sort_blocks, 64);
  SetLookupSortShape(9, -5);
  EXPECT_EQ(GetLookupTuning().sort_variant, 3);
  EXPECT_EQ(GetLookupTuning().sort_blocks, 0);
  SetLookupSortShape(-1, std::nullopt);
  EXPECT_EQ(GetLookupTuning().sort_variant, 0);
  SetLookupSortShape(std::nullopt, std::nullopt);  // nothing named: nothing changes
  EXPECT_EQ(GetLookupTuning().sort_variant, 0);
  EXPECT_EQ(GetLookupTuning().sort_blocks, 0);
  SetLookupTuning(before);
}

// One thread sets the grid over and over while another sets the variant: every value either writes is the one it
// reads back, and at the end both fields hold their writer's last value.
TEST(LookupSortShape, TwoWritersOfDifferentFieldsDoNotUndoEachOther) {
  const LookupTuning before = GetLookupTuning();
  constexpr int kRounds = 20000;
  std::atomic<int> grid_lost{0}, variant_lost{0};
  std::thread grid([&] {
    for (int i = 0; i < kRounds; ++i) {
      SetLookupSortShape(std::nullopt, i);
      if (GetLookupTuning().sort_blocks != i) ++grid_lost;
    }
  });
  std::thread variant([&] {
    for (int i = 0; i < kRounds; ++i) {
      SetLookupSortShape(i % 4, std::nullopt);
      if (GetLookupTuning().sort_variant != i % 4) ++variant_lost;
    }
  });
  grid.join();
  variant.join();
  EXPECT_EQ(grid_lost.load(), 0);
  EXPECT_EQ(variant_lost.load(), 0);
  EXPECT_EQ(GetLookupTuning().sort_blocks, kRounds - 1);
  EXPECT_EQ(GetLookupTuning().sort_variant, (kRounds - 1) % 4);
  SetLookupTuning(before);
}

}  // namespace
}  // namespace engram::kernels
