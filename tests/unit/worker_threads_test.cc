// base/worker_threads.h: RunWorkers runs the work on the threads asked for, and where the system refuses every
// thread (pthread_create failing: here a default stack larger than any address space) the caller runs it alone
// instead of an exception escaping (std::thread's std::system_error, std::terminate in engramd's publish loop).
#include "base/worker_threads.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace engram {
namespace {

TEST(RunWorkersTest, RunsTheWorkOnEveryThreadItStarts) {
  std::atomic<int> on_threads{0}, inline_runs{0};
  std::mutex mu;
  std::set<std::thread::id> ids;
  const int started = RunWorkers(4, [&](bool own_thread) {
    (own_thread ? on_threads : inline_runs)++;
    std::lock_guard<std::mutex> l(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(started, 4);
  EXPECT_EQ(on_threads.load(), 4);
  EXPECT_EQ(inline_runs.load(), 0);
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u) << "the caller ran the work although threads started";
}

TEST(RunWorkersTest, ZeroOrNegativeThreadsStillRunOneWorker) {
  std::atomic<int> runs{0};
  EXPECT_EQ(RunWorkers(0, [&](bool own_thread) { runs += own_thread ? 1 : 100; }), 1);
  EXPECT_EQ(RunWorkers(-3, [&](bool own_thread) { runs += own_thread ? 1 : 100; }), 1);
  EXPECT_EQ(runs.load(), 2);
}

TEST(RunWorkersTest, WhenNoThreadCanStartTheCallerRunsTheWorkOnce) {
  int started = -1, on_threads = 0, inline_runs = 0;
  std::thread::id ran_on;
  bool refused = false, threw = false;
  {
    testing::RefusedThreads no_threads;
    refused = no_threads.refused();
    try {
      started = RunWorkers(4, [&](bool own_thread) {
        ++(own_thread ? on_threads : inline_runs);
        ran_on = std::this_thread::get_id();
      });
    } catch (const std::exception&) {
      threw = true;
    }
  }
  ASSERT_TRUE(refused) << "the huge default stack did not make pthread_create fail";
  ASSERT_FALSE(threw) << "an exception escaped RunWorkers";
  EXPECT_EQ(started, 0);
  EXPECT_EQ(on_threads, 0);
  EXPECT_EQ(inline_runs, 1);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

}  // namespace
}  // namespace engram
