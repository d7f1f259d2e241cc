// Coordinator: the coordinator the gRPC service and main() call. It owns the two registries, the
// SegmentRegistry (checkpoints served, their segments: plan, adopt, publish, verify, load/unload; see
// daemon/segment_registry.h) and the ReplicaRegistry (sessions/leases, registration tickets, recent fallbacks,
// counters; see daemon/replica_registry.h), and runs the steps that involve both: a hello is offered a shard by
// the segment registry, decided by Decide (daemon/fallback.h) and recorded by the replica registry; an unload
// drops the leases on the unloaded segments; SIGHUP (Reload) re-applies the checkpoints, TP sizes and the ticket
// capacity, all or nothing (SegmentRegistry::Reconfigure validates the whole new set first; a failure changes
// nothing, not even the tickets, and says why). A failed Load is logged (`event=load_failed`) and kept for status.
// Segment files are 0600, the daemon's own: a replica gets a segment as a read-only descriptor passed over the
// socket (daemon/descriptor_server.h; a grant carries the one-time token), or, where its uid may open the file,
// by the grant's path.
// Status is built by daemon/status_report.h, its Prometheus rendering by daemon/metrics_text.h.
//
// Lifecycle: Start() probes the shm directory, opens every configured checkpoint (a checkpoint that cannot be
// opened or whose token map disagrees with its config is a startup error), takes the shm directory's one-daemon
// lock (another engramd there is a startup error; daemon/shm_lock.h), removes debris (segments not READY),
// adopts READY segments whose fingerprint and size match, retires READY segments it no longer serves (unlinked:
// replicas that map them keep working), and publishes the missing ones in the background.
//
// Thread-safety: every method may be called from any thread. Locking rule: each registry has its own mutex; the
// coordinator never holds one while calling into the other (it copies what it needs out of one registry, then
// calls the other), so no lock order exists to get wrong. Its own mutex guards only the options, and is never
// held while calling a registry. A multi-registry view (Status) is therefore not one atomic snapshot: each part is
// consistent on its own.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/descriptor_server.h"
#include "daemon/group_registry.h"
#include "daemon/options.h"
#include "daemon/prewarm.h"
#include "daemon/replica_registry.h"
#include "daemon/segment_registry.h"
#include "engram/v1/engram.pb.h"
#include "net/peer_cred.h"

namespace engram::daemon {

class Coordinator {
 public:
  explicit Coordinator(Options opts);
  ~Coordinator();

  absl::Status Start();
  // Blocks until every requested segment is READY or FAILED (or the timeout passes); true once settled.
  bool WaitSettled(std::chrono::milliseconds timeout);
  std::string LoadProgressLine();

  // Session protocol.
  // Waits until the segment the hello asks for is settled, then decides. On share, a lease is taken.
  absl::StatusOr<engram::v1::ServerMessage> Attach(const engram::v1::Hello& hello, const PeerCred& peer,
                                                   std::function<bool()> cancelled,
                                                   std::function<void(const engram::v1::ServerMessage&)> notify,
                                                   std::string* lease_id);
  // Blocks until a registration ticket is free (or cancelled); false when cancelled.
  bool AcquireTicket(const std::string& lease_id, std::function<bool()> cancelled);
  // The same, waiting at most until `deadline` (ReplicaRegistry::AwaitTicket).
  TicketWait AwaitTicket(const std::string& lease_id, std::function<bool()> cancelled,
                         std::chrono::steady_clock::time_point deadline);
  void ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& result);
  // The replica's settled outcome (ReplicaRegistry::RecordOutcome): InvalidArgument when malformed,
  // FailedPrecondition when sent twice.
  absl::Status RecordOutcome(const std::string& lease_id, const engram::v1::Outcome& outcome);
  void Detach(const std::string& lease_id);
  // What the replica's latest lookup engine chose (ReplicaRegistry::RecordEngineChoice).
  void RecordEngineChoice(const std::string& lease_id, const std::string& text);
  // A DP_SHARDED replica joins its node-local group (daemon/group_registry.h); Detach leaves it.
  absl::Status JoinGroup(const std::string& lease_id, const engram::v1::Hello& hello, const PeerCred& peer,
                         const engram::v1::GroupJoin& join,
                         std::function<void(const engram::v1::ServerMessage&)> notify);

  // Admin.
  engram::v1::StatusReply Status();
  // Prometheus text exposition of the status plus counters since start.
  std::string MetricsText();
  absl::Status Load(const std::string& dir, const std::vector<int64_t>& tp_sizes);
  absl::Status Unload(const std::string& dir);
  void Drain();
  bool draining() const { return draining_; }
  // SIGHUP: serve the new set of checkpoints, with the new TP sizes and ticket capacity; all or nothing (an error
  // names the reason and that nothing changed).
  absl::Status Reload(const Options& opts);
  // A SIGHUP whose configuration did not even parse: shown in status like a failed reload (nothing changed).
  void NoteReloadFailure(const std::string& config_file, const std::string& detail);
  Options options() const;

  // Grants from now on carry a descriptor token for `channel` (main() binds it next to the gRPC socket); without
  // one, replicas attach by path. Set before serving; the channel must outlive the state's sessions.
  void SetDescriptorChannel(DescriptorChannel* channel) { descriptors_ = channel; }

  // The registries (tests and tools that look inside).
  SegmentRegistry& segments() { return segments_; }
  ReplicaRegistry& replicas() { return replicas_; }
  GroupRegistry& groups() { return groups_; }

 private:
  static uint64_t NewInstanceId();
  static int WorkerThreads(int requested);

  mutable std::mutex opts_mu_;
  Options opts_;
  std::atomic<bool> draining_{false};
  const uint64_t instance_id_;  // shared by both registries: segment headers and lease ids
  DescriptorChannel* descriptors_ = nullptr;
  // Made by Start (--prewarm-registration), before the registries so that it outlives their threads (the publish
  // thread calls its SegmentReady); ~Coordinator stops it first, while the registries it calls are alive.
  std::unique_ptr<RegistrationPrewarm> prewarm_;
  // Declared last: destroyed first (their threads stop and their waiters wake while the rest is alive).
  SegmentRegistry segments_;
  ReplicaRegistry replicas_;
  GroupRegistry groups_;
};

}  // namespace engram::daemon
