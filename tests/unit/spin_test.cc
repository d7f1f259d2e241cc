// base/spin.h: SpinUntil returns as soon as its condition holds (checked first, without spinning), gives up with
// false when it never does, and sees a condition another thread makes true while it spins. No durations are
// asserted: the budgets are either zero or far longer than the event.
#include "base/spin.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace engram {
namespace {

TEST(SpinUntilTest, AConditionAlreadyTrueIsCheckedOnce) {
  int checks = 0;
  EXPECT_TRUE(SpinUntil([&] { return ++checks > 0; }, 0));
  EXPECT_TRUE(SpinUntil([&] { return ++checks > 0; }, int64_t{60} * 1000 * 1000 * 1000));
  EXPECT_EQ(checks, 2);
}

TEST(SpinUntilTest, NoBudgetMeansOneCheckAndNoSpin) {
  int checks = 0;
  EXPECT_FALSE(SpinUntil([&] { return ++checks < 0; }, 0));
  EXPECT_FALSE(SpinUntil([&] { return ++checks < 0; }, -5));
  EXPECT_EQ(checks, 2);
}

TEST(SpinUntilTest, AConditionThatNeverHoldsGivesUp) {
  int checks = 0;
  EXPECT_FALSE(SpinUntil([&] { return ++checks < 0; }, 1000));  // 1 us
  EXPECT_GE(checks, 1);
}

TEST(SpinUntilTest, SeesAnotherThreadsStore) {
  std::atomic<bool> flag{false};
  std::thread setter([&] { flag.store(true, std::memory_order_release); });
  const bool seen = SpinUntil([&] { return flag.load(std::memory_order_acquire); }, int64_t{60} * 1000 * 1000 * 1000);
  setter.join();
  EXPECT_TRUE(seen);
}

}  // namespace
}  // namespace engram
