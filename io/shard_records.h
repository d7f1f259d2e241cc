// Shard records: the rows a TP shard owns, read from a checkpoint's layer tables (embed.weight + embed.scale) and
// written as packed records (head_dim e4m3 bytes, then head_dim/32 ue8m0 bytes) into caller memory, in parallel,
// through cache-sized sub-chunks (one read of the checkpoint, one write of the destination), with per-layer xxh3
// checksums over fixed 64K-row chunks (independent of the thread count). The daemon's publisher fills a segment
// with it; a replica that cannot share fills its private table with it. No table-sized buffer is ever allocated.
// Stateless; the call blocks and uses `threads` workers, and on a cold page cache a few reader threads ahead of them
// (ShardFillOptions::cold_readers).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "io/cold_prefetch.h"
#include "model/checkpoint.h"

namespace engram {

inline constexpr int64_t kChecksumChunkRows = 65536;

struct LayerRows {
  int64_t layer = 0;      // index into engram_layer_ids
  int64_t row_begin = 0;  // global rows of that layer's table
  int64_t row_end = 0;
  uint64_t dst_offset = 0;  // where row_begin's record goes
};

struct ShardFillOptions {
  // Called by the worker about to write [p, p + n) of dst, before it writes (e.g. to populate a segment's pages from
  // the filling threads, shm/segment.h PopulateForWrite); an error stops the fill and is returned.
  std::function<absl::Status(uint8_t* p, uint64_t n)> before_write;
  // Drop the checkpoint's pages from the page cache behind the reader, job by job (a private table does not keep
  // two copies). A publish does it once after READY instead (ShardCacheDropper): evicting 16 GiB of cache pages costs
  // about 2 s of kernel time, which inside the fill would be most of a huge-page publish.
  bool drop_cache = true;
  // Rows per read-pack-hash step (the buffer stays in cache); <= 0 means the default, at most kChecksumChunkRows.
  int64_t sub_rows = 1024;
  // true: the records are packed into a cache-resident buffer, hashed there and written to dst with non-temporal
  // stores (base/stream_copy.h): the segment's fresh lines are not read before they are written (no
  // read-for-ownership) nor kept in the cache.
  bool stream_stores = false;
  // If set, receives the bytes written with streamed stores (what a publish reports as PublishResult::streamed_bytes).
  std::atomic<uint64_t>* streamed_bytes = nullptr;
  // Readers that stream the checkpoint's ranges into the page cache in job order, ahead of the workers, when a sample
  // of its pages shows them not cached (io/cold_prefetch.h); 0: the workers read on their own whatever the cache.
  int cold_readers = 2;
  // Readers the caller started already (StartColdPrefetch with the same layers and threads, e.g. before it reserved
  // dst, so that the disk works meanwhile): used instead of cold_readers. Must outlive the call.
  ColdPrefetch* cold_prefetch = nullptr;
  // If set, receives the bytes those readers streamed ahead of the workers (ColdPrefetch::bytes_streamed: read from
  // disk or found cached on the way; 0 when no reader ran).
  std::atomic<uint64_t>* prefetched_bytes = nullptr;
};

// The cold-cache readers for a fill of `layers` with `threads` workers: null when `readers` <= 0, when a sample of the
// checkpoint's pages shows them cached or cannot tell (`why_not`, may be null, then says why), or when the layers are
// not valid (the fill itself reports that).
std::unique_ptr<ColdPrefetch> StartColdPrefetch(const Checkpoint& ckpt, const std::vector<LayerRows>& layers,
                                                int threads, int readers, std::string* why_not = nullptr);

// Fills the records; `checksums` (may be null) receives one per LayerRows entry.
absl::Status ReadShardRecords(const Checkpoint& ckpt, const std::vector<LayerRows>& layers, uint8_t* dst, int threads,
                              std::vector<uint64_t>* checksums, std::atomic<uint64_t>* rows_done = nullptr,
                              const ShardFillOptions& fill = {});

// A closure that drops these rows' checkpoint pages from the page cache (posix_fadvise DONTNEED, one call per tensor
// range). It holds the files it needs (it may run on another thread after the Checkpoint is gone).
std::function<void()> ShardCacheDropper(const Checkpoint& ckpt, const std::vector<LayerRows>& layers);

// One row of layer `layer` (global row id) as a record, straight from the checkpoint (for spot checks).
absl::Status ReadRecordRow(const Checkpoint& ckpt, int64_t layer, int64_t row, uint8_t* record);

// Recomputes the checksums of records already in memory.
std::vector<uint64_t> ChecksumRecords(const std::vector<LayerRows>& layers, int64_t record_bytes, const uint8_t* base,
                                      int threads, std::atomic<uint64_t>* rows_done = nullptr);

}  // namespace engram
