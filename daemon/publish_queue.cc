// SegmentRegistry, its publish queue: the worker loop that publishes queued segments one at a time, the wait for
// every segment to settle, and the progress line of a load. The class's contract is in daemon/segment_registry.h.
#include "daemon/segment_registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "daemon/options.h"
#include "daemon/publisher.h"
#include "daemon/segment_files.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

void SegmentRegistry::DropQueuedLocked(const std::string& dir, const Key* key) {
  publish_queue_.erase(
      std::remove_if(publish_queue_.begin(), publish_queue_.end(),
                     [&](const auto& q) { return q.first == dir && (key == nullptr || q.second == *key); }),
      publish_queue_.end());
}

void SegmentRegistry::PublishLoop() {
  while (true) {
    std::string dir;
    Key key;
    std::shared_ptr<const Checkpoint> ckpt;
    std::shared_ptr<const Layout> layout;
    std::shared_ptr<const TokenMap> map;
    uint64_t serial = 0, generation = 0;
    std::shared_ptr<std::atomic<uint64_t>> progress;
    uint64_t bytes = 0;
    std::string path;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !publish_queue_.empty(); });
      if (stopping_) return;
      std::tie(dir, key) = publish_queue_.front();
      publish_queue_.pop_front();
      auto it = checkpoints_.find(dir);
      if (it == checkpoints_.end()) continue;
      Segment* e = FindLocked(dir, key);
      if (e == nullptr) continue;
      // Shared: an Unload during the publish erases the entry, not what the publisher reads.
      ckpt = it->second->ckpt;
      layout = it->second->layout;
      map = it->second->map;
      serial = it->second->serial;
      generation = e->generation;
      progress = e->rows_done;
      progress->store(0);
      bytes = e->bytes;
      path = e->path;
      // Capacity: the segment must fit in what the mount has free now.
      auto cap = ProbeShm(shm_dir_, env_);
      if (!cap.ok() || cap->free_bytes < bytes) {
        e->state = ServingState::kFailed;
        e->too_small = cap.ok();
        e->error = cap.ok()
                       ? absl::StrFormat("%s has %d bytes free, the segment needs %d", shm_dir_, cap->free_bytes, bytes)
                       : std::string(cap.status().message());
        spdlog::error("event=segment_not_created path={} reason={} detail={}", engram::LogValue(path),
                      cap.ok() ? "SHM_TOO_SMALL" : "SHM_MISSING", engram::LogQuoted(e->error));
        cv_.notify_all();
        continue;
      }
      // The name must be free: a stale file of ours goes, a foreign one is removed or fails the segment.
      auto ours = OursOrClear(path, env_);
      if (ours.ok() && *ours) env_->Unlink(path.c_str());
      if (!ours.ok()) {
        e->state = ServingState::kFailed;
        e->error = std::string(ours.status().message());
        spdlog::error("event=segment_not_created path={} reason=SEGMENT_NOT_READY detail={}", engram::LogValue(path),
                      engram::LogQuoted(e->error));
        cv_.notify_all();
        continue;
      }
      e->state = ServingState::kLoading;
      e->origin = SegmentOrigin::kPublished;
      e->error.clear();  // a failure of an earlier try is not this one's
      e->too_small = false;
    }
    spdlog::info("event=publish_start path={} bytes={} threads={}", engram::LogValue(path), bytes, threads_);
    bool ready = false;
    auto r = Publish(*ckpt, *layout, *map, key.first, key.second, shm_dir_, instance_id_, epoch_.load(), threads_,
                     progress.get(), env_, publish_tuning_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Unloaded (and maybe loaded again) while publishing: Unload/Load unlinked the file already, nothing to record.
      Segment* e = FindLocked(dir, key, serial, generation);
      if (e == nullptr) {
        // Its shard was unloaded (or dropped by a reload) meanwhile: the file just made is nobody's. When the shard
        // is served again under the same name, its own publish replaces the file (it may be writing it now).
        const bool planned_again = FindLocked(dir, key) != nullptr;
        if (r.ok() && !planned_again) RetireFileLocked(path);
        spdlog::info("event=publish_discarded path={}: the shard was {} meanwhile", engram::LogValue(path),
                     planned_again ? "dropped and served again" : "unloaded");
      } else if (r.ok()) {
        e->descriptor = ReadDescriptor(path, env_);
        e->file = FileIdentityOf(path, env_);
        e->state = ServingState::kReady;
        e->error.clear();
        e->too_small = false;
        e->load_seconds = r->seconds;
        e->checksum = ChecksumState::kOk;
        spdlog::info(
            "event=publish_done path={} bytes={} seconds={:.2f} gib_per_s={:.2f} page_bytes={} "
            "populated_by_writers={} streamed_bytes={} prefetched_bytes={} release_seconds={:.2f} "
            "warm_seconds={:.2f}",
            engram::LogValue(path), r->bytes, r->seconds, r->bytes / 1073741824.0 / std::max(r->seconds, 1e-9),
            r->page_bytes, r->populated, r->streamed_bytes, r->prefetched_bytes, r->release_seconds, r->warm_seconds);
      } else {
        e->state = ServingState::kFailed;
        e->too_small = r.status().code() == absl::StatusCode::kResourceExhausted;
        e->error = std::string(r.status().message());
        spdlog::error("event=publish_failed path={} detail={}", engram::LogValue(path), engram::LogQuoted(e->error));
      }
      ready = r.ok() && e != nullptr;
    }
    cv_.notify_all();
    if (ready && ready_hook_) ready_hook_(path);
  }
}

bool SegmentRegistry::WaitSettled(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    for (const auto& [dir, c] : checkpoints_) {
      for (const auto& [k, e] : c->segments) {
        if (Unsettled(e.state)) return false;
      }
    }
    return true;
  });
}

std::string SegmentRegistry::LoadProgressLine() const {
  std::lock_guard<std::mutex> lock(mu_);
  int ready = 0, total = 0;
  uint64_t done = 0, all = 0;
  for (const auto& [dir, c] : checkpoints_) {
    for (const auto& [k, e] : c->segments) {
      ++total;
      ready += e.state == ServingState::kReady;
      all += e.rows_total;
      done += e.state == ServingState::kReady ? e.rows_total : e.rows_done->load();
    }
  }
  return absl::StrFormat("%d/%d segments ready, %.0f%% of rows", ready, total, all ? 100.0 * done / all : 100.0);
}

void SegmentRegistry::Wake() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

}  // namespace engram::daemon
