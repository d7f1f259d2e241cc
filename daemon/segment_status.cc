// SegmentRegistry, what it shows (daemon/segment_registry.h): the names of its states, the recent load failures,
// the served directories and the copies of every segment's state for status and metrics.
#include "daemon/segment_registry.h"

#include "absl/strings/str_cat.h"
#include "daemon/segment_files.h"

namespace engram::daemon {

std::string_view Name(ServingState s) {
  switch (s) {
    case ServingState::kPending: return "PENDING";
    case ServingState::kLoading: return "LOADING";
    case ServingState::kReady: return "READY";
    case ServingState::kFailed: return "FAILED";
    case ServingState::kRetired: return "RETIRED";
  }
  return "UNKNOWN";
}

std::string_view Name(ChecksumState s) {
  switch (s) {
    case ChecksumState::kPending: return "pending";
    case ChecksumState::kVerifying: return "verifying";
    case ChecksumState::kOk: return "ok";
    case ChecksumState::kMismatch: return "mismatch";
  }
  return "unknown";
}

std::string_view Name(SegmentOrigin o) {
  switch (o) {
    case SegmentOrigin::kNone: return "";
    case SegmentOrigin::kPublished: return "published";
    case SegmentOrigin::kAdopted: return "adopted";
  }
  return "";
}

void SegmentRegistry::RecordLoadFailure(const std::string& what, const std::string& dir, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mu_);
  load_failures_.push_back(
      absl::StrCat(what, "_failed dir=", Bounded(dir, 256), " detail=\"", Bounded(detail, 512), "\""));
  while (load_failures_.size() > kMaxRecentLoadFailures) load_failures_.pop_front();
}

std::vector<std::string> SegmentRegistry::RecentLoadFailures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {load_failures_.begin(), load_failures_.end()};
}

std::vector<std::string> SegmentRegistry::CheckpointDirs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [dir, c] : checkpoints_) out.push_back(dir);
  return out;
}

std::vector<SegmentInfo> SegmentRegistry::Segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentInfo> out;
  for (const auto& [dir, c] : checkpoints_) {
    for (const auto& [k, e] : c->segments) {
      SegmentInfo i;
      i.checkpoint = dir;
      i.name = e.name;
      i.path = e.path;
      i.tp_size = e.tp_size;
      i.tp_rank = e.tp_rank;
      i.bytes = e.bytes;
      i.state = e.state;
      i.origin = e.origin;
      i.load_seconds = e.load_seconds;
      i.checksum = e.checksum;
      i.rows_done = e.rows_done->load();
      i.rows_total = e.rows_total;
      i.error = e.error;
      if (e.state == ServingState::kReady) {
        // What is served is the file as it is now: one truncated or replaced under the daemon is not READY.
        if (std::string why = SizeProblem(e.path, e.bytes, env_, e.file); !why.empty()) {
          i.state = ServingState::kFailed;
          i.error = std::move(why);
        }
      }
      out.push_back(std::move(i));
    }
  }
  return out;
}

}  // namespace engram::daemon
