// ColdPrefetch: the disk side of a fill whose checkpoint is not in the page cache. A fill's workers take 64K-row jobs
// in order and read each in cache-sized steps; on a cold cache that is 16 or more small reads at scattered offsets,
// which a disk serves at about 0.7 of what it gives one sequential reader per file (bench/RESULTS.md, 2026-11-29).
// Here a few reader threads stream the jobs' byte ranges in job order (layer by layer, each job's weights then its
// scales), in 8 MiB reads, into the page cache, at most `window` jobs past the furthest job a worker started; a worker
// about to start job j waits until j's ranges are in (then its own reads are page-cache copies). What the cache holds
// already is not read from disk again (the readers only copy it): each block is first read with RWF_NOWAIT
// (SafetensorsFile::ReadIfCached), and only the rest is read with plain reads.
//
// Giving up: a reader whose read fails, whose thread cannot get memory, or who finds that the page cache does not keep
// what it read (a file system that bypasses it) stops all reading and lets every waiting worker go; the workers then
// read for themselves, and a real fault reaches them with the file and tensor named (the prefetch never decides a
// fill's outcome). gave_up() says why.
// Thread-safety: WaitForJob may be called from any number of workers; the destructor stops and joins the readers (no
// worker may be inside WaitForJob then).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "model/safetensors.h"

namespace engram {

// One byte range a job reads: `bytes` at `offset` into `tensor`'s data in `file`.
struct PrefetchRange {
  std::shared_ptr<const SafetensorsFile> file;
  const TensorInfo* tensor = nullptr;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class ColdPrefetch {
 public:
  static constexpr uint64_t kBlockBytes = 8ull << 20;   // one read: the size of the disk ceiling's reads
  static constexpr uint64_t kWindowBytes = 4ull << 30;  // how far ahead at most (also at most MemAvailable / 4)

  // Whether a prefetch is worth starting: at least two of up to `samples` probes spread evenly over the ranges find
  // pages not in the page cache (one is not enough: on kernels 5.9-6.11 a RWF_NOWAIT read stops at a cached page
  // that carries a readahead mark). Not when a probe fails: a file system without RWF_NOWAIT reads (tmpfs,
  // overlayfs, some network file systems) cannot say what is cached, and the workers' own reads are then better than
  // readers that would copy a warm checkpoint once more; `why_not` (may be null) then receives the error.
  static bool WorthStarting(const std::vector<std::vector<PrefetchRange>>& jobs, int samples = 16,
                            std::string* why_not = nullptr);

  // The window, in jobs of about `job_bytes`: kWindowBytes, or a quarter of the memory free for the page cache if
  // less (MemAvailable, and the room left under this process's cgroup v2 memory.max: engramd's DaemonSet limits
  // its pod to the tables plus 2 GiB, and prefetched pages beyond that would be reclaimed before use), but at least
  // two jobs per worker. WindowJobsFor is the arithmetic (`free_bytes` = that free memory).
  static int64_t WindowJobs(uint64_t job_bytes, int workers);
  static int64_t WindowJobsFor(uint64_t job_bytes, int workers, uint64_t free_bytes);
  // The memory free for the page cache now: the lesser of MemAvailable and the cgroup's memory.max - memory.current
  // (no limit, or nothing readable: that side does not count; neither readable: no bound, UINT64_MAX).
  static uint64_t FreeMemoryBytes();

  // Called by a reader with a block's job and the jobs started at that moment, before it reads the block (tests).
  using BlockObserver = std::function<void(size_t job, size_t started)>;

  // `jobs[j]`: the ranges job j reads, in the order jobs are handed out. Starts `readers` (>= 1) threads; a refused
  // thread is one reader fewer, and with none the workers read on their own (WaitForJob returns at once).
  ColdPrefetch(std::vector<std::vector<PrefetchRange>> jobs, int readers, int64_t window, BlockObserver observer = {});
  ~ColdPrefetch();
  ColdPrefetch(const ColdPrefetch&) = delete;
  ColdPrefetch& operator=(const ColdPrefetch&) = delete;

  // A worker starting job `j`: lets the readers run up to j + window, then waits until job j's ranges are read (or
  // found cached, or given up).
  void WaitForJob(size_t j);

  // Bytes of the blocks the readers handled: brought into the page cache or found there (all of the jobs' bytes when
  // they ran to the end).
  uint64_t bytes_streamed() const { return bytes_streamed_.load(std::memory_order_relaxed); }
  // Of those, the bytes their plain reads read after a RWF_NOWAIT read found them not cached. A lower bound of what
  // the disk moved for them: the RWF_NOWAIT read itself starts the kernel's readahead (and on 6.12+ kernels may wait
  // for its submission), so with one reader this is nearly 0 while the disk works at full rate.
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  // Why the readers stopped early, if they did.
  std::optional<std::string> gave_up() const;

 private:
  struct Block {
    size_t job;
    PrefetchRange range;  // at most kBlockBytes
  };
  void Reader();
  void ReadBlock(const Block& block, std::vector<uint8_t>* scratch);
  void GiveUp(const char* why, const char* detail = "") noexcept;

  std::vector<Block> blocks_;
  std::vector<int64_t> pending_;  // per job: blocks not yet done (guarded by mu_)
  const int64_t window_;
  const BlockObserver observer_;
  std::atomic<size_t> next_block_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_streamed_{0};
  mutable std::mutex mu_;
  std::condition_variable readers_cv_, workers_cv_;
  size_t started_ = 0;   // one past the furthest job a worker started (guarded by mu_)
  bool stop_ = false;    // guarded by mu_
  bool failed_ = false;  // the readers gave up: nobody waits any more (guarded by mu_)
  std::string why_;      // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace engram
