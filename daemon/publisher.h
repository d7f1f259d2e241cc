// Publisher: builds one TP shard's segment from a checkpoint (docs/architecture.md, "Data flow", publish): reserves and
// maps the segment, fills it with ReadShardRecords (io/shard_records.h: parallel ranged reads, repacked records,
// checksums), writes the final descriptor, then READY.
//
// A failure (read error, truncated file, ENOSPC at fallocate) removes the partial segment; a killed daemon leaves a
// CREATING/LOADING file that the next start removes. Progress is published through an atomic counter for status.
// One Publish call per segment; the call blocks its thread and uses `threads` workers; on hugetlbfs they also
// populate the segment's pages as they fill them (SegmentReserve::kAuto: no single-threaded zeroing up front; a short
// hugetlb pool is an error from the fill, never SIGBUS). The segment file is 0600, the daemon's (shm/segment.h).
// The checkpoint's table pages are dropped from the page cache once the segment is READY, by a detached thread (so
// that a publish does not keep two copies, and READY does not wait for ~2 s of eviction per 16 GiB).
// Diagnosis knobs: PublishTuning below (from the environment unless the caller passes one).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/publish_tuning.h"
#include "engram/v1/engram.pb.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "shm/env.h"
#include "shm/segment.h"

namespace engram::daemon {

struct PublishResult {
  std::string path;
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t page_bytes = 0;        // the segment's page size (SegmentWriter::page_bytes)
  bool populated = false;         // pages populated by the filling threads (kWriters), not reserved whole
  uint64_t streamed_bytes = 0;    // of the records, those written with non-temporal stores (PublishStreamsStores): all
                                  // or none
  uint64_t prefetched_bytes = 0;  // streamed by the cold-cache readers ahead of the filling threads (read from disk or
                                  // found cached on the way: ColdPrefetch::bytes_streamed); 0 when none ran
  double release_seconds = 0;     // dropping the writer's page tables before READY (SegmentWriter::ReleaseDataMapping)
  double warm_seconds = 0;        // the first readers' page accesses, taken before READY on 4 KiB pages
};

// The descriptor of shard (tp_size, tp_rank): layout, owned rows, token map, with data offsets inside the segment
// (checksums are filled in by Publish).
engram::v1::SegmentDescriptor MakeDescriptor(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                             const ShardRange& shard, uint64_t fingerprint);

// The publish/verify workers engramd uses when --threads is 0 (and bench_daemon's default): the hardware's threads,
// at most 32 (bench_daemon: 32 threads publish 24 GiB/s on huge pages).
int DefaultPublishThreads();

// Whether a publish streams its stores, for PublishTuning::stream_stores `setting` (-1: only into a segment on huge
// pages, SegmentWriter::huge_pages).
bool PublishStreamsStores(int setting, bool huge_pages);

// The page-cache handling a publish of `shard_bytes` uses for PublishTuning::drop_cache `setting`: kAuto becomes
// kInline when `free_bytes` (ColdPrefetch::FreeMemoryBytes: MemAvailable, or less where the daemon's cgroup has
// less room) is under twice the shard (the segment and the checkpoint's cached pages of it would not fit
// together), else kAfterReady; any other setting stays.
PublishTuning::DropCache ChooseDropCache(PublishTuning::DropCache setting, uint64_t shard_bytes, uint64_t free_bytes);

// `tuning`: the daemon's (Options::publish_tuning, read from the environment once at start); bench_daemon passes
// its variants.
absl::StatusOr<PublishResult> Publish(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                      int64_t tp_size, int64_t tp_rank, const std::string& shm_dir,
                                      uint64_t instance_id, uint64_t epoch, int threads,
                                      std::atomic<uint64_t>* rows_done = nullptr, Env* env = Env::Default(),
                                      const PublishTuning& tuning = PublishTuning{});

// Recomputes a READY segment's per-layer checksums from its records and compares them with the descriptor's.
// `rows_done` reports progress. OK when all match; DataLoss naming the layer otherwise.
absl::Status VerifyChecksums(const std::string& segment_path, int threads, std::atomic<uint64_t>* rows_done = nullptr);

}  // namespace engram::daemon
