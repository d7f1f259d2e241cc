// StepWatch (client/dp/step_watch.h): the DP watchdog's notion of an overdue step, on a hand-driven clock.
#include "client/dp/step_watch.h"

#include <gtest/gtest.h>

namespace engram::client {
namespace {

using std::chrono::milliseconds;
const StepWatch::Clock::time_point t0{};

TEST(StepWatchTest, NothingQueuedIsNeverOverdue) {
  StepWatch w(milliseconds(100));
  EXPECT_EQ(w.timeout(), milliseconds(100));
  EXPECT_FALSE(w.Overdue(t0 + milliseconds(1000000)));
  w.Finished(t0);  // a spurious finish does not go below zero
  EXPECT_EQ(w.queued(), 0);
}

// A host that keeps enqueueing behind a stalled step: the deadline counts from the first step, not the last.
TEST(StepWatchTest, EnqueueingMoreStepsDoesNotPushTheDeadlineBack) {
  StepWatch w(milliseconds(100));
  for (int i = 0; i <= 9; ++i) w.Enqueued(t0 + milliseconds(10 * i));
  EXPECT_EQ(w.queued(), 10);
  EXPECT_FALSE(w.Overdue(t0 + milliseconds(100)));
  EXPECT_TRUE(w.Overdue(t0 + milliseconds(101))) << "90 ms after the last enqueue, 101 ms after the first";
}

// Finishing steps is progress: the deadline counts from the last finish while steps remain queued.
TEST(StepWatchTest, EachFinishRestartsTheDeadlineAndAnEmptyQueueClearsIt) {
  StepWatch w(milliseconds(100));
  w.Enqueued(t0);
  w.Enqueued(t0 + milliseconds(1));
  w.Finished(t0 + milliseconds(90));
  EXPECT_FALSE(w.Overdue(t0 + milliseconds(150)));
  EXPECT_TRUE(w.Overdue(t0 + milliseconds(191)));
  w.Finished(t0 + milliseconds(195));
  EXPECT_EQ(w.queued(), 0);
  EXPECT_FALSE(w.Overdue(t0 + milliseconds(10000)));
  w.Enqueued(t0 + milliseconds(10000));  // a fresh queue counts from its own first step
  EXPECT_FALSE(w.Overdue(t0 + milliseconds(10100)));
  EXPECT_TRUE(w.Overdue(t0 + milliseconds(10101)));
}

}  // namespace
}  // namespace engram::client
