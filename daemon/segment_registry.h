// SegmentRegistry: the checkpoints engramd serves and their segments, one per (TP size, TP rank). It plans each
// checkpoint's segments, adopts READY segments left by a previous daemon (and verifies their checksums in the
// background), publishes the missing ones from a queue on its own thread, scans the shm directory for debris and
// segments no longer served, and loads/unloads checkpoints at run time. It knows nothing about replicas: the lease
// bookkeeping lives in ReplicaRegistry, the sharing decision in Decide (daemon/fallback.h).
//
// Ownership: the registry owns the checkpoint entries, its worker threads (one publish loop, one verifier per
// adopted segment) and the segment files it creates; callers get copies (SegmentInfo, ShardOffer), never pointers
// into the registry. Segment files outlive it (READY segments stay in place for the next daemon).
//
// Paths: every checkpoint directory the registry takes (Start, Load, Unload, Reconfigure) is canonicalised first
// (CanonicalCheckpointPath, daemon/options.h): `DIR/`, `DIR/.` and a symlink to DIR are DIR. Two checkpoints with
// the same fingerprint are never served at once (their segments would have the same names).
//
// Foreign files: the shm directory is usually world-writable. A file under a segment's name that is not this
// daemon's (another owner, writable by group/others, a symlink, not a regular file) is never adopted, served or
// written to: it is logged (`event=segment_foreign`) and removed; when it cannot be removed (the daemon is not root
// and does not own it) the segment is FAILED ("a file owned by uid N occupies PATH"), replicas get SEGMENT_NOT_READY.
//
// Reconfigure (SIGHUP) is all-or-nothing: every new checkpoint is opened and every TP size checked before anything
// changes; then checkpoints are added and removed and kept ones re-planned for the new TP sizes (new shards queued,
// dropped shards retired) in one step under the lock. A kept directory is fingerprinted again (headers only): when
// a new revision was written into it, the new revision is published and the old one's segments are retired
// (unlinked: replicas that map them keep their mappings).
//
// Thread-safety: every public method may be called from any thread. One internal mutex guards all state; it is
// never held while a segment is published or verified, and never while calling out of the registry (no callback
// runs under it), so it can't take part in a lock-order cycle with ReplicaRegistry.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/fallback.h"
#include "daemon/publish_tuning.h"
#include "daemon/shm_lock.h"
#include "engram/v1/engram.pb.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "shm/capacity.h"
#include "shm/env.h"

namespace engram::daemon {

// Where the daemon is with serving a segment (its own bookkeeping; the state written into the file's header is
// shm/segment.h's SegmentState).
enum class ServingState { kPending, kLoading, kReady, kFailed, kRetired };
// "PENDING", "LOADING", "READY", "FAILED", "RETIRED" (as shown in status and metrics).
std::string_view Name(ServingState s);

enum class ChecksumState { kPending, kVerifying, kOk, kMismatch };
// "pending", "verifying", "ok", "mismatch".
std::string_view Name(ChecksumState s);

enum class SegmentOrigin { kNone, kPublished, kAdopted };
// "", "published", "adopted".
std::string_view Name(SegmentOrigin o);

// A copy of one segment's state, for status and tests.
struct SegmentInfo {
  std::string checkpoint;  // the checkpoint directory
  std::string name, path;
  int64_t tp_size = 0, tp_rank = 0;
  uint64_t bytes = 0;
  ServingState state = ServingState::kPending;
  SegmentOrigin origin = SegmentOrigin::kNone;
  double load_seconds = 0;
  ChecksumState checksum = ChecksumState::kPending;
  uint64_t rows_done = 0, rows_total = 0;
  std::string error;
};

// A file's device and inode (zeros: unknown).
struct FileIdentity {
  uint64_t dev = 0, ino = 0;
};

// What a replica's hello can get: the node view Decide needs and, when the shard is READY, what a grant carries.
struct ShardOffer {
  NodeView node;
  bool ready = false;      // a READY segment exists for the shard (the fields below are set)
  std::string checkpoint;  // directory of the checkpoint with the hello's fingerprint
  std::string segment_name, segment_path;
  uint64_t segment_bytes = 0;
  std::shared_ptr<const engram::v1::SegmentDescriptor> descriptor;
  FileIdentity file;  // the file READY was decided for (the grant names it; the descriptor channel checks it)
  // Key a lease on this segment is recorded under (checkpoint dir + "/" + segment name).
  std::string segment_key() const { return checkpoint + "/" + segment_name; }
};

// What a Reconfigure changed (canonical directories; segment keys as ShardOffer::segment_key()).
struct ReconfigureResult {
  std::vector<std::string> added, removed, tp_changed;
  std::vector<std::string> revised;               // kept directories whose files now have another fingerprint
  std::vector<std::string> retired_segment_keys;  // shards dropped from kept checkpoints
};

inline constexpr size_t kMaxRecentLoadFailures = 8;

class SegmentRegistry {
 public:
  // `threads`: publish/verify workers (>= 1). `instance_id`: written into the headers of published segments.
  // `env`: the OS seam for the shm directory (capacity probe, segment files); tests inject faults through it.
  // `publish_tuning`: how every publish of this registry runs (the daemon's Options::publish_tuning).
  SegmentRegistry(std::string shm_dir, int threads, uint64_t instance_id, Env* env = Env::Default(),
                  PublishTuning publish_tuning = PublishTuning{});
  ~SegmentRegistry();  // stops the workers (a publish in progress finishes first)
  SegmentRegistry(const SegmentRegistry&) = delete;
  SegmentRegistry& operator=(const SegmentRegistry&) = delete;

  // Probes the shm directory, opens every checkpoint (an error when one can't be opened or is inconsistent),
  // removes debris, retires READY segments not served, adopts matching READY segments and queues the rest for
  // publishing. A missing shm directory is not an error: every segment is FAILED (replicas fall back).
  // `lock_shm_dir` (engramd): after the checkpoints opened and before anything in the shm directory is touched, take
  // its one-daemon lock (daemon/shm_lock.h), held until the registry goes; FailedPrecondition "another engramd
  // (pid N) owns DIR" when another process holds it.
  absl::Status Start(const std::vector<std::string>& checkpoints, const std::vector<int64_t>& tp_sizes,
                     bool lock_shm_dir = false);
  // Blocks until no segment is PENDING or LOADING (true), or the timeout passes (false).
  bool WaitSettled(std::chrono::milliseconds timeout);
  std::string LoadProgressLine() const;

  // Waits while the shard the hello names is PENDING or LOADING (until `give_up` returns true; it is polled), then
  // describes it. Cancelled when `cancelled()` became true while waiting.
  absl::StatusOr<ShardOffer> Offer(const engram::v1::Hello& hello, const std::function<bool()>& cancelled,
                                   const std::function<bool()>& give_up);

  // Opens and plans a checkpoint and queues its segments (an existing file with the same name is replaced).
  absl::Status Load(const std::string& dir, const std::vector<int64_t>& tp_sizes);
  // Retires and unlinks the checkpoint's segments (replicas that map them keep their mappings).
  absl::Status Unload(const std::string& dir);
  // Serve exactly `checkpoints` with `tp_sizes` (SIGHUP), all or nothing: an error changes nothing.
  absl::StatusOr<ReconfigureResult> Reconfigure(const std::vector<std::string>& checkpoints,
                                                const std::vector<int64_t>& tp_sizes);
  // Failed loads/reloads, for status (oldest first, at most kMaxRecentLoadFailures, each line bounded).
  void RecordLoadFailure(const std::string& what, const std::string& dir, const std::string& detail);
  std::vector<std::string> RecentLoadFailures() const;
  std::vector<std::string> CheckpointDirs() const;

  std::vector<SegmentInfo> Segments() const;  // in (checkpoint dir, tp size, tp rank) order
  const std::string& shm_dir() const { return shm_dir_; }
  uint64_t epoch() const { return epoch_.load(); }
  void BumpEpoch() { ++epoch_; }
  // Wakes waiters in Offer/WaitSettled so that they re-check their conditions (e.g. after draining began).
  void Wake();
  // Called with a segment's path each time a publish of it ends READY (on the publish thread, under no lock). Set
  // before Start; segments adopted by Start are READY when it returns (Segments() lists them).
  void SetReadyHook(std::function<void(const std::string& path)> hook) { ready_hook_ = std::move(hook); }

 private:
  using Key = std::pair<int64_t, int64_t>;  // (tp_size, tp_rank)
  struct Segment {
    std::string name, path;
    int64_t tp_size = 0, tp_rank = 0;
    uint64_t bytes = 0;
    ServingState state = ServingState::kPending;
    SegmentOrigin origin = SegmentOrigin::kNone;
    double load_seconds = 0;
    ChecksumState checksum = ChecksumState::kPending;
    std::shared_ptr<std::atomic<uint64_t>> rows_done = std::make_shared<std::atomic<uint64_t>>(0);
    uint64_t rows_total = 0;
    std::string error;
    bool too_small = false;
    std::shared_ptr<const engram::v1::SegmentDescriptor> descriptor;  // as stored in the segment (READY only)
    // Distinguishes this plan of the shard from an earlier one of the same key (a TP size dropped and served
    // again): a publish or a verification started for an earlier plan records nothing in this one.
    uint64_t generation = 0;
    FileIdentity file;  // the file READY was decided for (FileIdentityOf): another one there is not served
  };
  struct ServedCheckpoint {
    std::string dir;
    std::shared_ptr<const Checkpoint> ckpt;
    std::shared_ptr<const Layout> layout;  // null for PLE
    std::shared_ptr<const TokenMap> map;
    uint64_t serial = 0;  // distinguishes a checkpoint loaded again after an unload
    uint64_t fingerprint = 0;
    std::vector<int64_t> tp_sizes;
    std::map<Key, Segment> segments;
  };

  absl::StatusOr<std::unique_ptr<ServedCheckpoint>> OpenCheckpoint(const std::string& dir,
                                                                   const std::vector<int64_t>& tp_sizes) const;
  void PlanSegmentsLocked(ServedCheckpoint& c) const;
  void PlanShardsLocked(ServedCheckpoint& c, int64_t tp) const;
  // Sets the segment's file RETIRED (only when it is this daemon's own file) and unlinks it.
  void RetireFileLocked(const std::string& path) const;
  // Drops queued publishes of `dir` (all of its shards, or only those of `key` when given).
  void DropQueuedLocked(const std::string& dir, const Key* key = nullptr);
  void ScanShmDirLocked();
  void PublishLoop();
  void VerifyAdopted(const std::string& dir, Key key);
  // The segment (dir, key) if its checkpoint is still served (and, when `serial` is not 0, is that load of it; when
  // `generation` is not 0, that plan of the shard).
  Segment* FindLocked(const std::string& dir, Key key, uint64_t serial = 0, uint64_t generation = 0);

  const std::string shm_dir_;
  const int threads_;
  const uint64_t instance_id_;
  Env* const env_;
  const PublishTuning publish_tuning_;
  std::function<void(const std::string& path)> ready_hook_;
  std::atomic<uint64_t> epoch_{1};
  std::deque<std::string> load_failures_;
  ShmDirLock shm_lock_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::StatusOr<ShmCapacity> shm_;
  std::map<std::string, std::unique_ptr<ServedCheckpoint>> checkpoints_;
  std::deque<std::pair<std::string, Key>> publish_queue_;
  uint64_t next_serial_ = 1;
  mutable uint64_t next_generation_ = 1;  // under mu_; PlanShardsLocked hands them out
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace engram::daemon
