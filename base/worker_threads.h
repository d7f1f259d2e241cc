// RunWorkers: the same work function on `threads` new threads at once, joined before it returns, for a caller that
// must not fail because the system refuses a thread. A thread the system refuses (pthread_create EAGAIN:
// RLIMIT_NPROC, no memory or address space for its stack) is one worker fewer, never an exception out of here (a
// half-built pool of joinable threads is std::terminate); when none starts, the caller runs the work itself. The
// work function takes `own_thread`: true on a new thread, false on the caller's. Header-only: every library uses it.
#pragma once

#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

namespace engram {

// Runs worker(true) on up to max(1, threads) new threads, or worker(false) on this thread when none could start;
// returns the number of threads that ran it (0: the caller did).
template <typename Worker>
int RunWorkers(int threads, Worker&& worker) {
  std::vector<std::thread> pool;
  for (int t = 0; t < std::max(1, threads); ++t) {
    try {
      pool.emplace_back([&worker] { worker(true); });
    } catch (const std::system_error&) {
      break;
    }
  }
  if (pool.empty()) worker(false);
  for (auto& th : pool) th.join();
  return static_cast<int>(pool.size());
}

}  // namespace engram
