// PublishTuning: how engramd publishes a segment (reservation, page-cache handling, read sizes, streamed stores,
// cold-cache readers), with the product's defaults; the publisher (daemon/publisher.h) takes it per call. Plain
// value type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shm/segment.h"

namespace engram::daemon {

// A publish's diagnosis knobs; the defaults are the product's. FromEnvironment reads them from the process's
// environment (engramd does once, at start, into Options::publish_tuning):
//   ENGRAM_PUBLISH_RESERVE=whole|writers forces a SegmentReserve (else kAuto: populated by the filling threads on
//     hugetlbfs, reserved whole on tmpfs);
//   ENGRAM_PUBLISH_DROP_CACHE: unset chooses per publish (kAuto, ChooseDropCache: inline when the free memory could
//     not hold the segment and the checkpoint's cached pages of it together, else after READY); "after" or "1"
//     drops the checkpoint's pages from the page cache after READY (a detached thread), "inline" drops them job by
//     job inside the fill, anything else ("0") keeps them;
//   ENGRAM_PUBLISH_SUB_ROWS=N rows per read-pack-hash step (unset: ShardFillOptions' default, 1024).
//   ENGRAM_PUBLISH_COLD_READERS=N readers stream a checkpoint that is not in the page cache ahead of the workers
//     (ShardFillOptions::cold_readers; 0: none).
// (Reading the weights straight into their records instead of packing them from a cache-resident buffer measured
// +1-2% on huge pages and -14% on 4 KiB /dev/shm on the H200 (2026-11-30): the fill always packs.)
struct PublishTuning {
  enum class DropCache { kAuto, kAfterReady, kInline, kKeep };
  SegmentReserve reserve = SegmentReserve::kAuto;
  DropCache drop_cache = DropCache::kAuto;
  std::optional<int64_t> sub_rows;  // unset: ShardFillOptions' default
  // ShardFillOptions::stream_stores: -1 (default) where the segment's pages are huge, 0 never, 1 always
  // (ENGRAM_PUBLISH_NT=-1|0|1). Measured (bench/RESULTS.md, 2026-11-30): faster on huge pages in every run (huge
  // tmpfs 0.74-0.79 vs 0.65-0.77 of the first-touch copy, hugetlbfs 0.86 vs 0.73); on 4 KiB /dev/shm two runs disagree
  // (3.43 vs 2.55 s, 3.24 vs 4.05 s per 16 GiB), so plain stores stay there.
  int stream_stores = -1;
  std::optional<int> cold_readers;  // unset: ShardFillOptions' default
  // Variables set in the environment that engramd no longer reads (ENGRAM_PUBLISH_DIRECT_READ: the direct read
  // lost where measured, above): engramd warns about each at start, so that an operator's setting is not silently
  // dropped.
  std::vector<std::string> removed;

  static PublishTuning FromEnvironment();
};

}  // namespace engram::daemon
