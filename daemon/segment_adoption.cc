// SegmentRegistry, its shm directory: the scan at start (debris removed, unwanted READY segments retired, foreign
// files named), retiring a file, and the verification of an adopted segment's checksums against the checkpoint.
// The class's contract is in daemon/segment_registry.h.
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

void SegmentRegistry::ScanShmDirLocked() {
  // Debris (anything not READY) goes; READY segments that no configured checkpoint wants are retired (unlinked:
  // a replica that maps one keeps its mapping, the memory returns when the last mapping goes).
  for (const std::string& name : ListSegments(shm_dir_, env_)) {
    const std::string path = shm_dir_ + "/" + name;
    auto ours = OursOrClear(path, env_);
    if (!ours.ok() || !*ours) continue;  // foreign: removed, or left (its segment fails when planned)
    auto h = ReadOwnedSegmentHeader(path, ::geteuid(), env_);
    if (!h.ok() || h->state != static_cast<uint32_t>(SegmentState::kReady)) {
      spdlog::warn("event=segment_debris path={} state={} detail={}: removed", engram::LogValue(path),
                   h.ok() ? SegmentStateName(static_cast<SegmentState>(h->state)) : "unreadable",
                   engram::LogQuoted(h.ok() ? "left by a crash during loading" : std::string(h.status().message())));
      env_->Unlink(path.c_str());
      continue;
    }
    bool wanted = false;
    for (const auto& [dir, c] : checkpoints_) {
      for (const auto& [key, seg] : c->segments) wanted = wanted || seg.name == name;
    }
    if (!wanted) {
      spdlog::info("event=segment_retired path={}: not served by this configuration", engram::LogValue(path));
      RetireFileLocked(path);
      continue;
    }
    // A segment an older engramd left 0640 becomes 0600 like a new one: only the daemon hands it out.
    int fd = RetryEintr([&] { return env_->Open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0); });
    if (fd >= 0) {
      env_->Fchmod(fd, 0600);
      env_->Close(fd);
    }
  }
}

void SegmentRegistry::RetireFileLocked(const std::string& path) const {
  // Only a file of ours is written to (never through a link, never someone else's file).
  if (ReadOwnedSegmentHeader(path, ::geteuid(), env_).ok()) (void)SetSegmentState(path, SegmentState::kRetired, env_);
  env_->Unlink(path.c_str());
}

void SegmentRegistry::VerifyAdopted(const std::string& dir, Key key) {
  std::string path;
  std::shared_ptr<std::atomic<uint64_t>> progress;
  uint64_t serial = 0, generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Segment* e = FindLocked(dir, key);
    if (e == nullptr) return;
    serial = checkpoints_.at(dir)->serial;
    generation = e->generation;
    path = e->path;
    progress = e->rows_done;
  }
  absl::Status st = VerifyChecksums(path, std::max(1, threads_ / 2), progress.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    Segment* e = FindLocked(dir, key, serial, generation);
    if (e == nullptr) return;
    e->checksum = st.ok() ? ChecksumState::kOk : ChecksumState::kMismatch;
    if (!st.ok()) {
      spdlog::error("event=segment_checksum_mismatch path={} detail={}: republishing", engram::LogValue(path),
                    engram::LogQuoted(std::string(st.message())));
      e->state = ServingState::kPending;
      e->descriptor.reset();
      env_->Unlink(path.c_str());
      publish_queue_.push_back({dir, key});
    }
  }
  cv_.notify_all();
}

}  // namespace engram::daemon
