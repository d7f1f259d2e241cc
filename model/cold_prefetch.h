// ColdPrefetch: the disk side of a fill whose checkpoint is not in the page cache. A fill's workers take 64K-row jobs
// in order and read each in cache-sized steps; on a cold cache that is 16 or more small reads at scattered offsets,
// which a disk serves at about 0.7 of what it gives one sequential reader per file (bench/RESULTS.md, 2026-11-29).
// Here a few reader threads stream the jobs' byte ranges in job order, in large blocks, into the page cache, at most
// `window` jobs ahead of the last job a worker started; a worker about to start job j waits until j's ranges are in
// (then its own reads are page-cache copies). Blocks already resident (mincore) are skipped, not read.
//
// Errors: a reader whose read fails stops reading and lets every waiting worker go; the worker's own read then meets
// the same fault and reports it with the file and tensor named (the prefetch never decides a fill's outcome).
// Thread-safety: WaitForJob may be called from any number of workers; the destructor stops and joins the readers (no
// worker may be inside WaitForJob then).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
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
  static constexpr uint64_t kBlockBytes = 8ull << 20;  // one read: the size of the disk ceiling's reads

  // True when fewer than all of up to `samples` blocks spread evenly over the ranges are wholly in the page cache
  // (then a prefetch is worth starting). A failed residency check counts as not cached.
  static bool WorthStarting(const std::vector<std::vector<PrefetchRange>>& jobs, int samples = 16);

  // `jobs[j]`: the ranges job j reads, in the order jobs are handed out. Starts `readers` (>= 1) threads; a refused
  // thread is one reader fewer, and with none the workers read on their own (WaitForJob returns at once).
  ColdPrefetch(std::vector<std::vector<PrefetchRange>> jobs, int readers, int64_t window);
  ~ColdPrefetch();
  ColdPrefetch(const ColdPrefetch&) = delete;
  ColdPrefetch& operator=(const ColdPrefetch&) = delete;

  // A worker starting job `j`: lets the readers run up to j + window, then waits until job j's ranges are read (or
  // skipped as resident, or given up after a read error).
  void WaitForJob(size_t j);

  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  struct Block {
    size_t job;
    PrefetchRange range;  // at most kBlockBytes
  };
  void Reader();

  std::vector<Block> blocks_;
  std::vector<int64_t> pending_;  // per job: blocks not yet done (guarded by mu_)
  const int64_t window_;
  std::atomic<size_t> next_block_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::mutex mu_;
  std::condition_variable readers_cv_, workers_cv_;
  size_t started_ = 0;  // one past the highest job a worker started (guarded by mu_)
  bool stop_ = false;   // guarded by mu_
  bool failed_ = false;  // a read failed: nobody waits any more (guarded by mu_)
  std::vector<std::thread> threads_;
};

}  // namespace engram
