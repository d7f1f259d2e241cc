// DaemonState: everything engramd knows, behind one mutex: the checkpoints it serves, their segments (adopted or
// published, with state, progress and checksum verification), the replicas holding sessions (leases), the
// registration tickets, and recent fallbacks. The gRPC service and the signal handling call into it; background
// threads publish and verify segments. Thread-safe.
//
// Lifecycle: Start() probes the shm directory, opens every configured checkpoint (a checkpoint that cannot be
// opened or whose token map disagrees with its config is a startup error), removes debris (segments not READY),
// adopts READY segments whose fingerprint and size match, retires READY segments it no longer serves (unlinked:
// replicas that map them keep working), and publishes the missing ones in the background.
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
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/fallback.h"
#include "daemon/options.h"
#include "engram/v1/engram.pb.h"
#include "model/checkpoint.h"
#include "model/layout.h"
#include "model/token_map.h"
#include "shm/capacity.h"

namespace engram::daemon {

struct SegmentEntry {
  std::string name, path;
  int64_t tp_size = 0, tp_rank = 0;
  uint64_t bytes = 0;
  std::string state = "PENDING";  // PENDING, LOADING, READY, FAILED, RETIRED
  std::string origin;             // published, adopted
  double load_seconds = 0;
  std::string checksum_state = "pending";
  std::shared_ptr<std::atomic<uint64_t>> rows_done = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t rows_total = 0;
  std::string error;
  bool too_small = false;
  int leases = 0;
  engram::v1::SegmentDescriptor descriptor;  // as stored in the segment (READY only)
};

struct CheckpointEntry {
  std::string dir;
  std::shared_ptr<const Checkpoint> ckpt;
  std::unique_ptr<Layout> layout;  // null for PLE
  std::unique_ptr<TokenMap> map;
  uint64_t fingerprint = 0;
  std::vector<int64_t> tp_sizes;
  std::map<std::pair<int64_t, int64_t>, SegmentEntry> segments;  // (tp_size, tp_rank)
};

struct PeerInfo {
  int32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

struct Replica {
  std::string lease_id;
  PeerInfo peer;
  engram::v1::Hello hello;
  engram::v1::Mode mode = engram::v1::MODE_UNSPECIFIED;
  std::string backend = "unknown";
  std::vector<engram::v1::Reason> reasons;
  std::chrono::steady_clock::time_point attached;
  double register_seconds = -1;
  std::string segment_key;  // checkpoint dir + "/" + segment name while it holds a lease
  std::function<void(const engram::v1::ServerMessage&)> notify;  // pushes an event to the session
};

class DaemonState {
 public:
  explicit DaemonState(Options opts);
  ~DaemonState();

  absl::Status Start();
  // Blocks until every requested segment is READY or FAILED (or the timeout passes); true once settled.
  bool WaitSettled(std::chrono::milliseconds timeout);
  std::string LoadProgressLine();

  // Session protocol.
  // Waits until the segment the hello asks for is settled, then decides. On share, a lease is taken.
  absl::StatusOr<engram::v1::ServerMessage> Attach(const engram::v1::Hello& hello, const PeerInfo& peer,
                                                   std::function<bool()> cancelled,
                                                   std::function<void(const engram::v1::ServerMessage&)> notify,
                                                   std::string* lease_id);
  // Blocks until a registration ticket is free (or cancelled); false when cancelled.
  bool AcquireTicket(const std::string& lease_id, std::function<bool()> cancelled);
  void ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& result);
  void Detach(const std::string& lease_id);

  // Admin.
  engram::v1::StatusReply Status();
  // Prometheus text exposition of the status plus counters since start.
  std::string MetricsText();
  absl::Status Load(const std::string& dir, const std::vector<int64_t>& tp_sizes);
  absl::Status Unload(const std::string& dir);
  void Drain();
  bool draining() const { return draining_; }
  absl::Status Reload(const Options& opts);  // SIGHUP: serve the new set of checkpoints
  const Options& options() const { return opts_; }

 private:
  absl::StatusOr<std::unique_ptr<CheckpointEntry>> OpenCheckpoint(const std::string& dir,
                                                                   const std::vector<int64_t>& tp_sizes);
  void PlanSegmentsLocked(CheckpointEntry& c);
  void PublishLoop();
  void VerifyAdopted(const std::string& ckpt_dir, std::pair<int64_t, int64_t> key);
  void ReleaseLeaseLocked(Replica& r);
  void ScanShmDirLocked();

  Options opts_;
  uint64_t instance_id_ = 0;
  uint64_t epoch_ = 1;
  int threads_ = 1;
  std::mutex mu_;
  std::condition_variable cv_;
  absl::StatusOr<ShmCapacity> shm_;
  std::map<std::string, std::unique_ptr<CheckpointEntry>> checkpoints_;
  std::map<std::string, Replica> replicas_;
  std::deque<std::string> recent_fallbacks_;
  std::map<std::string, uint64_t> fallbacks_by_reason_;  // since start
  uint64_t sessions_total_ = 0;
  double register_seconds_sum_ = 0;
  uint64_t register_count_ = 0;
  int tickets_free_ = 1;
  std::deque<std::string> ticket_queue_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> stopping_{false};
  std::deque<std::pair<std::string, std::pair<int64_t, int64_t>>> publish_queue_;
  std::vector<std::thread> workers_;
  uint64_t next_lease_ = 1;
};

}  // namespace engram::daemon
