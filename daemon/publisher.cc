#include "daemon/publisher.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "absl/strings/str_cat.h"
#include "base/utf8.h"
#include "base/worker_threads.h"
#include "io/cold_prefetch.h"
#include "io/shard_records.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"
#include "xxhash.h"

namespace engram::daemon {
namespace {

std::vector<LayerRows> RowsOf(const engram::v1::SegmentDescriptor& d) {
  std::vector<LayerRows> rows;
  for (int l = 0; l < d.layers_size(); ++l) {
    rows.push_back({l, d.layers(l).row_begin(), d.layers(l).row_end(), d.layers(l).data_offset()});
  }
  return rows;
}

// The first reader of freshly written 4 KiB pages pays about twice what later readers pay to map and register them
// (94 GiB: populate 6.7 s against 2.9 s, registration 9.0 s against 5.0 s, bench/RESULTS.md "Full scale"): the
// kernel's first accesses of each page. The daemon takes them before READY, from all its threads: a read-only
// mapping populated twice, then dropped. Seconds taken.
double WarmForReaders(const std::string& path, int threads, Env* env) {
  const auto t0 = std::chrono::steady_clock::now();
  auto reader = SegmentReader::Open(path, env);
  if (!reader.ok()) {
    spdlog::warn("event=publish_warm_skipped path={} detail={}: the first replica maps the pages cold",
                 engram::LogValue(path), engram::LogQuoted(std::string(reader.status().message())));
    return 0;
  }
  auto* data = const_cast<uint8_t*>((*reader)->data());
  const uint64_t bytes = (*reader)->file_bytes() - (*reader)->header().data_offset;
  for (int pass = 0; pass < 2; ++pass) (void)MadviseInSlices(env, data, bytes, MADV_POPULATE_READ, threads);
  (void)MadviseInSlices(env, data, bytes, MADV_DONTNEED, threads);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int DefaultPublishThreads() {
  return static_cast<int>(std::min(32u, std::max(1u, std::thread::hardware_concurrency())));
}

PublishTuning PublishTuning::FromEnvironment() {
  PublishTuning t;
  const char* reserve = std::getenv("ENGRAM_PUBLISH_RESERVE");
  const std::string r = reserve == nullptr ? "" : reserve;
  if (r == "whole") t.reserve = SegmentReserve::kWhole;
  if (r == "writers") t.reserve = SegmentReserve::kWriters;
  const char* drop = std::getenv("ENGRAM_PUBLISH_DROP_CACHE");
  const std::string d = drop == nullptr ? "" : drop;
  if (d == "inline") {
    t.drop_cache = DropCache::kInline;
  } else if (d == "after" || d == "1") {
    t.drop_cache = DropCache::kAfterReady;
  } else if (!d.empty()) {
    t.drop_cache = DropCache::kKeep;
  }
  if (const char* v = std::getenv("ENGRAM_PUBLISH_SUB_ROWS"); v != nullptr) t.sub_rows = std::atoll(v);
  if (const char* v = std::getenv("ENGRAM_PUBLISH_COLD_READERS"); v != nullptr && *v != '\0') {
    t.cold_readers = std::clamp(std::atoi(v), 0, 64);
  }
  if (const char* v = std::getenv("ENGRAM_PUBLISH_NT"); v != nullptr && *v != '\0') {
    t.stream_stores = std::clamp(std::atoi(v), -1, 1);
  }
  for (const char* gone : {"ENGRAM_PUBLISH_DIRECT_READ"}) {
    if (const char* v = std::getenv(gone); v != nullptr && *v != '\0') t.removed.push_back(gone);
  }
  return t;
}

PublishTuning::DropCache ChooseDropCache(PublishTuning::DropCache setting, uint64_t shard_bytes, uint64_t free_bytes) {
  if (setting != PublishTuning::DropCache::kAuto) return setting;
  // Twice the shard: the segment and the checkpoint's pages of it, which reading it puts in the page cache.
  return shard_bytes > free_bytes / 2 ? PublishTuning::DropCache::kInline : PublishTuning::DropCache::kAfterReady;
}

bool PublishStreamsStores(int setting, bool huge_pages) { return setting > 0 || (setting < 0 && huge_pages); }

engram::v1::SegmentDescriptor MakeDescriptor(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                             const ShardRange& shard, uint64_t fingerprint) {
  const EngramConfig& c = layout.config();
  engram::v1::SegmentDescriptor d;
  d.set_fingerprint(fingerprint);
  d.set_checkpoint(ckpt.dir());
  d.set_architecture(c.architecture);
  d.set_tp_size(static_cast<int32_t>(shard.tp_size));
  d.set_tp_rank(static_cast<int32_t>(shard.tp_rank));
  d.set_col_begin(static_cast<int32_t>(shard.col_begin));
  d.set_col_end(static_cast<int32_t>(shard.col_end));
  d.set_head_dim(static_cast<int32_t>(c.head_dim));
  d.set_record_bytes(static_cast<int32_t>(c.record_bytes()));
  d.set_max_ngram(static_cast<int32_t>(c.max_ngram_size));
  d.set_n_heads(static_cast<int32_t>(c.n_heads));
  d.set_pad_token_id(c.pad_token_id);
  d.set_compressed_vocab(c.compressed_vocab_size);
  uint64_t offset = 0;  // relative to the data region; the reader adds header().data_offset
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    auto* ld = d.add_layers();
    ld->set_layer_id(c.layer_ids[l]);
    ld->set_row_begin(shard.row_begin[l]);
    ld->set_row_end(shard.row_end[l]);
    ld->set_data_offset(offset);
    const uint64_t bytes = static_cast<uint64_t>(shard.row_end[l] - shard.row_begin[l]) * c.record_bytes();
    ld->set_bytes(bytes);
    offset += bytes;
    for (int64_t v : layout.multipliers(l)) ld->add_multipliers(v);
    for (int64_t v : layout.primes(l)) ld->add_primes(v);
    for (int64_t v : layout.offsets(l)) ld->add_offsets(v);
  }
  for (int32_t v : map.ids()) d.add_token_map(v);
  return d;
}

absl::StatusOr<PublishResult> Publish(const Checkpoint& ckpt, const Layout& layout, const TokenMap& map,
                                      int64_t tp_size, int64_t tp_rank, const std::string& shm_dir,
                                      uint64_t instance_id, uint64_t epoch, int threads,
                                      std::atomic<uint64_t>* rows_done, Env* env, const PublishTuning& tuning) {
  const auto t0 = std::chrono::steady_clock::now();
  auto shard = layout.Shard(tp_size, tp_rank);
  if (!shard.ok()) return shard.status();
  const uint64_t fingerprint = ckpt.Fingerprint();
  engram::v1::SegmentDescriptor desc = MakeDescriptor(ckpt, layout, map, *shard, fingerprint);
  uint64_t data_bytes = 0;
  for (const auto& l : desc.layers()) data_bytes += l.bytes();
  // Checksums are not known yet: reserve the descriptor's final size by filling them with a non-zero placeholder
  // (fixed64 fields serialise to the same size whatever their value).
  for (auto& l : *desc.mutable_layers()) l.set_checksum(~uint64_t{0});
  // A checkpoint not in the page cache starts streaming from disk now, while the segment is reserved (fallocate of a
  // 4 KiB tmpfs zeroes the whole file first: ~2 s per 16 GiB on the H200 host).
  const int cold_readers = tuning.cold_readers.value_or(ShardFillOptions{}.cold_readers);
  std::string cold_why_not;
  std::unique_ptr<ColdPrefetch> prefetch = StartColdPrefetch(ckpt, RowsOf(desc), threads, cold_readers, &cold_why_not);
  if (!cold_why_not.empty()) {
    spdlog::info(
        "event=publish_cold_probe_unsupported checkpoint={} detail={}: if the checkpoint is not in the "
        "page cache, the filling threads read it themselves",
        engram::LogValue(ckpt.dir()), engram::LogQuoted(cold_why_not));
  }
  // On hugetlbfs the data's pages are populated by the filling threads (in parallel, next to their writes), not
  // zeroed up front by one thread in fallocate; a tmpfs is reserved whole (SegmentReserve::kAuto; tuning may force
  // one).
  const uint64_t free_before = ColdPrefetch::FreeMemoryBytes();  // before the segment's reservation takes its share
  auto writer = SegmentWriter::Create(shm_dir, fingerprint, tp_size, tp_rank, desc.SerializeAsString(), data_bytes,
                                      instance_id, epoch, env, tuning.reserve);
  if (!writer.ok()) return writer.status();
  (*writer)->SetLoading();
  uint8_t* data = (*writer)->data();

  ShardFillOptions fill;
  if ((*writer)->populate_data()) {
    fill.before_write = [env](uint8_t* p, uint64_t n) { return PopulateForWrite(p, n, env); };
  }
  // The checkpoint's pages leave the page cache after READY, on a thread of their own (not job by job inside the
  // fill, where the eviction cost ~2 s per 16 GiB), unless the node cannot hold them next to the segment: then job
  // by job, so that the page cache never holds a second copy of the shard (at full size on a node with little room
  // the kernel would reclaim under the fill, and the after-READY eviction would compete with the first attaches).
  const PublishTuning::DropCache drop = ChooseDropCache(tuning.drop_cache, data_bytes, free_before);
  if (drop != tuning.drop_cache && drop == PublishTuning::DropCache::kInline) {
    spdlog::info(
        "event=publish_drop_cache mode=inline path={} bytes={} detail=\"the node cannot keep the checkpoint's pages "
        "next to the segment: they leave the page cache as they are read\"",
        engram::LogValue((*writer)->path()), data_bytes);
  }
  fill.drop_cache = drop == PublishTuning::DropCache::kInline;
  if (tuning.sub_rows) fill.sub_rows = *tuning.sub_rows;
  fill.stream_stores = PublishStreamsStores(tuning.stream_stores, (*writer)->huge_pages());
  std::atomic<uint64_t> streamed{0};
  fill.streamed_bytes = &streamed;
  fill.cold_readers = 0;  // decided above: the fill does not probe the cache a second time
  fill.cold_prefetch = prefetch.get();
  std::atomic<uint64_t> prefetched{0};
  fill.prefetched_bytes = &prefetched;
  std::vector<uint64_t> checksums;
  absl::Status st = ReadShardRecords(ckpt, RowsOf(desc), data, threads, &checksums, rows_done, fill);
  if (prefetch) {
    if (auto why = prefetch->gave_up()) {
      spdlog::warn("event=publish_cold_readers_stopped path={} detail={} (the filling threads read the rest)",
                   engram::LogValue((*writer)->path()), engram::LogQuoted(*why));
    }
  }
  if (!st.ok()) return st;  // the writer's destructor removes the partial segment
  for (int l = 0; l < desc.layers_size(); ++l) desc.mutable_layers(l)->set_checksum(checksums[static_cast<size_t>(l)]);
  const std::string final_desc = desc.SerializeAsString();
  // Rewrite the descriptor in place (same size) and its checksum, then READY.
  auto reopened = ReadSegmentHeader((*writer)->path(), env);
  if (!reopened.ok()) return reopened.status();
  if (final_desc.size() != reopened->desc_bytes) return absl::InternalError("descriptor size changed");
  uint8_t* base = data - reopened->data_offset;
  std::memcpy(base + reopened->desc_offset, final_desc.data(), final_desc.size());
  reinterpret_cast<SegmentHeader*>(base)->desc_checksum = XXH3_64bits(final_desc.data(), final_desc.size());
  const double release_seconds = (*writer)->ReleaseDataMapping(threads);
  const double warm_seconds = (*writer)->huge_pages() ? 0 : WarmForReaders((*writer)->path(), threads, env);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (auto f = (*writer)->Finish(seconds); !f.ok()) return f;
  if (drop == PublishTuning::DropCache::kAfterReady) {
    std::function<void()> dropper = ShardCacheDropper(ckpt, RowsOf(desc));
    try {
      std::thread(dropper).detach();
    } catch (const std::system_error&) {
      dropper();  // no thread to be had (EAGAIN): dropped here, slower, but never an exception out of the publish
    }
  }
  PublishResult result{(*writer)->path(),          reopened->total_bytes, seconds,          (*writer)->page_bytes(),
                       (*writer)->populate_data(), streamed.load(),       prefetched.load()};
  result.release_seconds = release_seconds;
  result.warm_seconds = warm_seconds;
  return result;
}

absl::Status VerifyChecksums(const std::string& segment_path, int threads, std::atomic<uint64_t>* rows_done) {
  auto reader = SegmentReader::Open(segment_path);
  if (!reader.ok()) return reader.status();
  engram::v1::SegmentDescriptor desc;
  if (!desc.ParseFromString((*reader)->descriptor_bytes())) {
    return absl::DataLossError(absl::StrCat(segment_path, ": descriptor does not parse"));
  }
  const std::vector<uint64_t> sums =
      ChecksumRecords(RowsOf(desc), desc.record_bytes(), (*reader)->data(), threads, rows_done);
  for (int l = 0; l < desc.layers_size(); ++l) {
    if (sums[static_cast<size_t>(l)] != desc.layers(l).checksum()) {
      return absl::DataLossError(absl::StrCat(segment_path, ": layer ", desc.layers(l).layer_id(),
                                              " checksum mismatch (the segment was modified)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace engram::daemon
