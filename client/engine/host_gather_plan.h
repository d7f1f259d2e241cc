// The CPU side of the host-gather lookup path (client/engine/host_gather.h), free of CUDA so that it is unit-tested on
// any machine: a small thread pool (optional CPU affinity), the plan of a batch's rows (every owned item's row, in
// item order; items outside the layer's rows read as zeros), the chunk plan (how many rows per H2D copy) and the row
// gather itself (264 B records copied from the shared mapping, with software prefetch a tunable number of rows ahead,
// optionally with non-temporal stores: the destination is pinned staging that only the GPU's DMA reads, so the CPU need
// not read its lines before writing them).
//
// Ownership: GatherPool owns its threads and joins them in its destructor. Thread-safety: one thread drives a
// GatherPool (Run is not reentrant); PlanIdentity spreads over the pool it is given. The other free functions are
// pure. (Fetching each distinct row of a batch once was measured and lost: it cost more than it saved even at 45%
// repeated rows, bench/RESULTS.md.)
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cpu_list.h"  // ParseCpuList: the gather threads' affinity

namespace engram::client {

// The default number of gather threads on a machine with `cores` cores: a share of them (half, at most 16, at
// least 1), the rest left to the serving engine.
int DefaultGatherThreads(int cores);

// Rows per chunk (per H2D copy) for `rows` rows gathered by `threads` threads: enough chunks that every thread has
// several (the copy of one chunk overlaps the gather of the next), never fewer than `min_rows` nor more than
// `max_rows` rows per chunk. 0 rows -> 0.
int64_t PlanChunkRows(int64_t rows, int threads, int64_t min_rows = 1024, int64_t max_rows = 8192);

// [begin, end) of part `part` of `n` items split into `parts` nearly equal contiguous ranges.
struct Range {
  int64_t begin = 0, end = 0;
};
Range SplitRange(int64_t n, int parts, int part);

class GatherPool {
 public:
  // `threads` >= 1 workers; `cpus` (may be empty) pins worker i to cpus[i % cpus.size()]. Pinning failures are
  // ignored (the worker runs unpinned). Idle workers spin `spin_us` microseconds before they sleep (a batch runs
  // several short passes back to back; a sleeping worker costs a futex wake-up).
  // The calling thread of Run spins `caller_spin_us` (default: spin_us) for the pass to finish before it sleeps.
  GatherPool(int threads, std::vector<int> cpus = {}, int spin_us = 200, int caller_spin_us = -1);
  ~GatherPool();
  GatherPool(const GatherPool&) = delete;
  GatherPool& operator=(const GatherPool&) = delete;
  int threads() const { return static_cast<int>(workers_.size()); }
  // Runs fn(worker) on every worker at once and returns when all have returned. `caller`, if given, runs on the
  // calling thread meanwhile (e.g. handing finished chunks to a copy engine).
  void Run(const std::function<void(int worker)>& fn, const std::function<void()>& caller = nullptr);
  // Wakes sleeping workers so that they spin (for spin_us) waiting for the next Run: a hint given as soon as a
  // batch is known, so that their wake-up overlaps whatever precedes the first Run.
  void Wake();

 private:
  void Loop(int worker);
  std::vector<std::thread> workers_;
  const int64_t spin_ns_, caller_spin_ns_;
  // Workers sleep on signal_ (a futex word: Run and Wake bump it); generation_ numbers the jobs.
  std::atomic<uint32_t> signal_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int32_t> running_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;  // written before generation_'s release increment
};

// A batch of one layer's ids, planned: rows[i] is item i's row (relative to row_begin) and index[i] = i for an owned
// item; an item whose id lies outside [row_begin, row_end) has rows[i] = kNoRow and index[i] = -1 (zeros).
struct GatherPlan {
  static constexpr uint32_t kNoRow = 0xFFFFFFFFu;
  std::vector<uint32_t> rows;
  int64_t n_rows = 0;  // rows used (rows.size() is a capacity)
};

// Items i in [0, num_tokens * num_cols): id = ids[t * ids_stride + c]. Writes index[0 .. items) and plan->rows
// (grown to the batch), spread over the pool's workers. InvalidArgument for a bad shape or null ids.
absl::Status PlanIdentity(const int32_t* ids, int32_t num_tokens, int32_t num_cols, int64_t ids_stride,
                          int64_t row_begin, int64_t row_end, GatherPool& pool, int32_t* index, GatherPlan* plan);

// The plan of items [begin, end) alone (what PlanIdentity does for the whole batch): rows[i] = id - row_begin and
// index[i] = i for owned items, rows[i] = kNoRow and index[i] = -1 otherwise; id of item i = t * cols + c is ids[t *
// stride + c].
void PlanIdentityRange(const int32_t* ids, int32_t cols, int64_t stride, int64_t row_begin, int64_t row_end,
                       int64_t begin, int64_t end, uint32_t* rows, int32_t* index);

// How GatherRecords copies. prefetch_rows: every line of the row that many rows ahead in the list is prefetched
// (the gather is bound by memory latency and address translation; 0 = no software prefetch). stream_stores:
// non-temporal stores (x86-64; elsewhere plain stores), fenced before GatherRecords returns, so a DMA (or another
// thread told after the return) sees them.
struct GatherCopy {
  int prefetch_rows = 16;
  bool stream_stores = false;
};

// Copies record rows[k] (of `record_bytes` bytes, from `records`) to dst + k * record_bytes for k in [begin, end);
// kNoRow rows are left untouched.
void GatherRecords(const uint8_t* records, int64_t record_bytes, const uint32_t* rows, int64_t begin, int64_t end,
                   uint8_t* dst, const GatherCopy& how = {});

}  // namespace engram::client
