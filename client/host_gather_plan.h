// The CPU side of the host-gather lookup path (client/host_gather.h), free of CUDA so that it is unit-tested on any
// machine: a small thread pool (optional CPU affinity), the de-duplication of a batch's row ids (each distinct row
// fetched once; every item maps to its row's slot in the gathered array), the chunk plan (how many rows per H2D
// copy) and the row gather itself (264 B records copied from the shared mapping, with software prefetch).
//
// Ownership: GatherPool owns its threads and joins them in its destructor. RowDeduper owns its hash table, sized
// for max_items. Thread-safety: one thread drives a GatherPool (Run is not reentrant); a RowDeduper is used by one
// Dedup call at a time (which itself spreads over the pool). The free functions are pure.
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

namespace engram::client {

// The default number of gather threads on a machine with `cores` cores: a share of them (half, at most 16, at
// least 1), the rest left to the serving engine.
int DefaultGatherThreads(int cores);

// A CPU list such as "0-7,16,18-19" (the gather threads' affinity, e.g. from ENGRAM_HOST_GATHER_CPUS).
absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text);

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
  // ignored (the worker runs unpinned).
  GatherPool(int threads, std::vector<int> cpus = {});
  ~GatherPool();
  GatherPool(const GatherPool&) = delete;
  GatherPool& operator=(const GatherPool&) = delete;
  int threads() const { return static_cast<int>(workers_.size()); }
  // Runs fn(worker) on every worker at once and returns when all have returned.
  void Run(const std::function<void(int worker)>& fn);

 private:
  void Loop(int worker);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> running_{0};
  bool stop_ = false;
};

// A batch of one layer's ids, de-duplicated: `rows` holds each distinct owned row (relative to row_begin) once, in
// ascending row order as far as the placement allows (address order for the gather), and
// index[i] is item i's position in `rows` (or -1 when the id lies outside [row_begin, row_end)). Without
// de-duplication rows[k] is item k's row and index[i] = i for owned items (a non-owned item's rows[i] is kNoRow).
struct GatherPlan {
  static constexpr uint32_t kNoRow = 0xFFFFFFFFu;
  std::vector<uint32_t> rows;
  int64_t n_rows = 0;  // rows used (rows.size() is a capacity)
};

class RowDeduper {
 public:
  explicit RowDeduper(int64_t max_items);
  // Items i in [0, num_tokens * num_cols): id = ids[t * ids_stride + c]. Writes index[0 .. items) and plan->rows.
  // With dedup=false the plan is the identity (every item fetched, in item order).
  absl::Status Plan(const int32_t* ids, int32_t num_tokens, int32_t num_cols, int64_t ids_stride, int64_t row_begin,
                    int64_t row_end, bool dedup, GatherPool& pool, int32_t* index, GatherPlan* plan);

 private:
  // How: the row range is cut into one part per worker; items are bucketed by part (count, prefix, scatter), then
  // each worker de-duplicates its own part in a private open-addressing table (no shared atomics, a table sized to
  // the part, slots ordered by row), numbers its rows after the parts before it and rewrites its items' indices.
  int64_t max_items_;
  std::vector<uint64_t> bucketed_;               // (row << 32 | item) grouped by part
  std::vector<std::vector<int64_t>> counts_;     // [worker][part] items, then scatter offsets
  std::vector<int64_t> part_begin_;              // [part + 1] start of each part in bucketed_
  std::vector<int64_t> part_rows_;               // [part + 1] distinct rows before each part
  std::vector<std::vector<uint32_t>> tables_;    // [part] row + 1 per slot; 0 = empty
};

// Copies record rows[k] (of `record_bytes` bytes, from `records`) to dst + k * record_bytes for k in [begin, end);
// kNoRow rows are left untouched. Prefetches a few rows ahead (the gather is bound by memory latency).
void GatherRecords(const uint8_t* records, int64_t record_bytes, const uint32_t* rows, int64_t begin, int64_t end,
                   uint8_t* dst);

}  // namespace engram::client
