// SegmentRegistry, its run-time changes (daemon/segment_registry.h): a checkpoint loaded, one unloaded, and the
// all-or-nothing Reconfigure of SIGHUP (validate everything first, then apply it in one step under the lock).
#include "daemon/segment_registry.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "daemon/options.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

absl::Status SegmentRegistry::Load(const std::string& given, const std::vector<int64_t>& tp_sizes) {
  const std::string dir = CanonicalCheckpointPath(given);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (checkpoints_.count(dir)) return absl::AlreadyExistsError(absl::StrCat(dir, " is already served"));
  }
  ASSIGN_OR_RETURN(auto c, OpenCheckpoint(dir, tp_sizes));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (checkpoints_.count(dir)) return absl::AlreadyExistsError(absl::StrCat(dir, " is already served"));
    for (const auto& [other, oc] : checkpoints_) {
      if (oc->fingerprint == c->fingerprint) {
        return absl::AlreadyExistsError(
            absl::StrFormat("%s is the checkpoint %s serves already (fingerprint %016x)", dir, other, c->fingerprint));
      }
    }
    PlanSegmentsLocked(*c);
    c->serial = next_serial_++;
    // Files under these names are replaced when their publish starts (PublishLoop frees the name).
    for (auto& [key, e] : c->segments) publish_queue_.push_back({dir, key});
    checkpoints_[dir] = std::move(c);
  }
  spdlog::info("event=load dir={}", engram::LogValue(dir));
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status SegmentRegistry::Unload(const std::string& given) {
  const std::string dir = CanonicalCheckpointPath(given);
  std::unique_lock<std::mutex> lock(mu_);
  auto it = checkpoints_.find(dir);
  if (it == checkpoints_.end()) return absl::NotFoundError(absl::StrCat(dir, " is not served"));
  // Segments still queued for publishing are not published any more.
  DropQueuedLocked(dir);
  for (auto& [k, e] : it->second->segments) {
    RetireFileLocked(e.path);  // replicas that map it keep their mapping
  }
  checkpoints_.erase(it);
  lock.unlock();
  spdlog::info("event=unload dir={}", engram::LogValue(dir));
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<ReconfigureResult> SegmentRegistry::Reconfigure(const std::vector<std::string>& given,
                                                               const std::vector<int64_t>& tps) {
  if (tps.empty()) return absl::InvalidArgumentError("no TP size to serve");
  std::vector<std::string> wanted;
  for (const auto& d : given) {
    const std::string c = CanonicalCheckpointPath(d);
    if (std::find(wanted.begin(), wanted.end(), c) == wanted.end()) wanted.push_back(c);
  }
  // 1. Validate everything; nothing changes yet.
  std::map<std::string, std::pair<std::shared_ptr<const Layout>, uint64_t>> served;  // dir -> (layout, fingerprint)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [dir, c] : checkpoints_) served[dir] = {c->layout, c->fingerprint};
  }
  std::vector<std::unique_ptr<ServedCheckpoint>> fresh;
  std::map<uint64_t, std::string> fingerprints;
  for (const auto& d : wanted) {
    auto it = served.find(d);
    if (it != served.end()) {
      // A new revision written into a served directory: its fingerprint changed, so it is served as new (the old
      // revision's segments are retired below; replicas that map them keep their mappings).
      ASSIGN_OR_RETURN(auto now, Checkpoint::Open(d));
      if (now->Fingerprint() != it->second.second) {
        ASSIGN_OR_RETURN(auto c, OpenCheckpoint(d, tps));
        fresh.push_back(std::move(c));
        continue;
      }
      if (it->second.first) {
        for (int64_t tp : tps) {
          if (auto s = it->second.first->Shard(tp, 0); !s.ok()) {
            return absl::InvalidArgumentError(absl::StrCat(d, ": ", s.status().message()));
          }
        }
      }
      fingerprints[it->second.second] = d;
      continue;
    }
    ASSIGN_OR_RETURN(auto c, OpenCheckpoint(d, tps));
    fresh.push_back(std::move(c));
  }
  for (const auto& c : fresh) {
    auto [it, inserted] = fingerprints.emplace(c->fingerprint, c->dir);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s and %s are the same checkpoint (fingerprint %016x)", it->second, c->dir, c->fingerprint));
    }
  }
  // 2. Apply it all under the lock.
  ReconfigureResult result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = checkpoints_.begin(); it != checkpoints_.end();) {
      if (std::find(wanted.begin(), wanted.end(), it->first) != wanted.end()) {
        ++it;
        continue;
      }
      DropQueuedLocked(it->first);
      for (auto& [k, e] : it->second->segments) RetireFileLocked(e.path);
      result.removed.push_back(it->first);
      it = checkpoints_.erase(it);
    }
    for (auto& [dir, c] : checkpoints_) {
      if (c->tp_sizes == tps) continue;
      const std::set<int64_t> keep(tps.begin(), tps.end());
      const std::set<int64_t> had(c->tp_sizes.begin(), c->tp_sizes.end());
      for (auto it = c->segments.begin(); it != c->segments.end();) {
        if (keep.count(it->first.first)) {
          ++it;
          continue;
        }
        DropQueuedLocked(dir, &it->first);
        RetireFileLocked(it->second.path);
        result.retired_segment_keys.push_back(dir + "/" + it->second.name);
        it = c->segments.erase(it);
      }
      c->tp_sizes = tps;
      for (int64_t tp : tps) {
        if (had.count(tp)) continue;
        PlanShardsLocked(*c, tp);
        for (int64_t r = 0; r < tp && c->layout; ++r) publish_queue_.push_back({dir, {tp, r}});
      }
      result.tp_changed.push_back(dir);
    }
    for (auto& c : fresh) {
      auto old = checkpoints_.find(c->dir);
      if (old != checkpoints_.end()) {
        if (old->second->fingerprint == c->fingerprint) continue;  // loaded meanwhile
        // The directory's new revision replaces the served one.
        DropQueuedLocked(c->dir);
        for (auto& [k, e] : old->second->segments) {
          RetireFileLocked(e.path);
          result.retired_segment_keys.push_back(c->dir + "/" + e.name);
        }
        spdlog::info("event=checkpoint_revised dir={} fingerprint={:016x} was={:016x}: publishing the new revision",
                     engram::LogValue(c->dir), c->fingerprint, old->second->fingerprint);
        checkpoints_.erase(old);
        result.revised.push_back(c->dir);
      } else {
        result.added.push_back(c->dir);
      }
      PlanSegmentsLocked(*c);
      c->serial = next_serial_++;
      for (auto& [key, e] : c->segments) publish_queue_.push_back({c->dir, key});
      const std::string dir = c->dir;
      checkpoints_[dir] = std::move(c);
    }
  }
  cv_.notify_all();
  return result;
}

}  // namespace engram::daemon
