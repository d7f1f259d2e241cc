// ReplicaRegistry: the replicas holding a session with engramd. A session is a lease: while it is registered the
// replica may hold the segment it was granted (its segment key), and it leaves with Detach. The registry also
// owns the registration tickets (a FIFO queue and a capacity: at most `capacity` replicas register their mapping
// with CUDA at once), the recent fallback decisions (bounded) and the counters the metrics show.
//
// What status shows for a replica is what it reported last: the daemon's decision at attach, then the result of
// its registration, then its Outcome (ClientMessage.outcome), which replaces mode, reasons and backend exactly as
// the replica sent them, so status never lists a mode no process is in. Its hello is kept whole for the session:
// topology, pid and client_version (the replica's library version, checked by the service before it gets here).
//
// Ownership: the registry owns its replica records (including each session's notify callback); callers get copies
// (ReplicaInfo). It knows segments only by key (checkpoint dir + "/" + segment name).
//
// Thread-safety: every public method may be called from any thread. One internal mutex guards all state.
// AcquireTicket blocks (polling `cancelled`, up to the waiter's deadline); nothing else blocks.
//
// A ticket is held at most the hold limit (SetTicketHoldLimit, --ticket-hold-ms): a replica that takes one and never
// reports its registration loses it; the registry reclaims it (`event=ticket_expired` naming the holder's pid, uid
// and lease, and a line in the recent fallbacks) when a waiter, the daemon's own registration or a reader of status
// (ReclaimExpiredTickets) next looks, and the next in the queue gets it. The notify
// callbacks run under the mutex (they only queue a write on their session's stream) and must not call back into the
// registry. The registry never calls SegmentRegistry, so the two locks are never held together.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "daemon/fallback.h"
#include "daemon/histogram.h"
#include "engram/v1/engram.pb.h"
#include "net/peer_cred.h"

namespace engram::daemon {

// Where a replica stands with the registration tickets.
enum class TicketState { kNone, kQueued, kHeld };
// How a wait for a ticket ended.
enum class TicketWait { kGranted, kCancelled, kTimedOut };
std::string_view Name(TicketState s);  // "none", "queued", "held"
// "descriptor", "path", "" (ATTACH_NONE), as status shows it.
std::string_view AttachName(engram::v1::AttachMethod m);

inline constexpr size_t kMaxRecentFallbacks = 32;
inline constexpr int kMaxOutcomeReasons = 32;
inline constexpr size_t kMaxHintBytes = 512;

// Checks an Outcome a replica sent: mode a known value other than MODE_UNSPECIFIED, at most kMaxOutcomeReasons
// reasons with known codes other than REASON_UNSPECIFIED, backend "cuda" or "cpu". InvalidArgument naming the
// problem otherwise. On success `*clean` is the outcome with every hint cut to kMaxHintBytes (at a UTF-8
// character boundary).
absl::Status ValidateOutcome(const engram::v1::Outcome& outcome, engram::v1::Outcome* clean);

// A copy of one replica's record, for status and tests.
struct ReplicaInfo {
  std::string lease_id;
  PeerCred peer;
  engram::v1::Hello hello;  // as the replica sent it (its topology, pid and client_version), kept for the session
  engram::v1::Mode mode = engram::v1::MODE_UNSPECIFIED;
  // "unknown" until the replica reports one; status shows "registering" while it holds a ticket instead.
  std::string backend = "unknown";
  engram::v1::AttachMethod attach = engram::v1::ATTACH_NONE;  // from its outcome: how a SHARED replica attached
  std::vector<engram::v1::Reason> reasons;
  TicketState ticket = TicketState::kNone;
  bool outcome_reported = false;
  double attached_seconds = 0;
  double register_seconds = -1;
  std::string segment_key;  // the segment it holds a lease on; "" when none
  std::string engine;       // its latest lookup engine's choice (printable); "" until it made one
};

struct ReplicaCounters {
  std::map<std::string, uint64_t> fallbacks_by_reason;  // since start
  uint64_t sessions_total = 0;
  // The seconds each replica reported for its registration (RegisterResult.seconds, failed ones too).
  Histogram register_seconds;
  // From a replica's grant to its registration report, as the daemon saw them: mapping the segment, waiting for a
  // ticket and registering it (one observation per registration report).
  Histogram attach_seconds;
};

class ReplicaRegistry {
 public:
  // `instance_id` prefixes lease ids; `tickets` is the initial ticket capacity (at least 1 is used).
  ReplicaRegistry(uint64_t instance_id, int tickets);
  ~ReplicaRegistry();  // wakes ticket waiters (they return false)

  // Records a new session after the daemon decided (`decision`). On share, `segment_key` names the segment the
  // replica is granted (a lease on it); on fallback the decision goes to the recent fallbacks and counters.
  // `notify` pushes an event to the session. Returns the lease id.
  std::string Attach(const engram::v1::Hello& hello, const PeerCred& peer, const Decision& decision,
                     const std::string& segment_key, std::function<void(const engram::v1::ServerMessage&)> notify);
  // Queues the replica for a ticket and blocks until it is next (NextInQueueLocked) and a ticket is free (true),
  // or `cancelled()` turns true, the replica is detached or the registry shuts down (false; it leaves the queue).
  bool AcquireTicket(const std::string& lease_id, const std::function<bool()>& cancelled);
  // The same, waiting at most until `deadline` (kTimedOut: it leaves the queue).
  TicketWait AwaitTicket(const std::string& lease_id, const std::function<bool()>& cancelled,
                         std::chrono::steady_clock::time_point deadline);
  // The daemon's own registration (daemon/prewarm.h): takes a ticket only when one is free and no replica is queued
  // for one (true); ReleaseDaemonTicket gives it back. ReplicaWaiting: a replica is queued for a ticket now.
  bool TryHoldDaemonTicket();
  void ReleaseDaemonTicket();
  bool ReplicaWaiting() const;
  // How long a ticket may be held before it is reclaimed (at least 1 ms).
  void SetTicketHoldLimit(std::chrono::milliseconds limit);
  // Reclaims the tickets held past the hold limit now (a waiter or the daemon's own registration also does, before
  // it takes one): the status and metrics paths call it, so that a ticket that nobody waits for is not shown held
  // past its limit.
  void ReclaimExpiredTickets();
  // Registration result: frees the replica's ticket; on failure the replica falls back (REGISTER_FAILED), its
  // lease is released and the fallback recorded.
  void ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& result);
  // The replica's settled outcome (see the file comment). InvalidArgument for a malformed outcome (see
  // ValidateOutcome), FailedPrecondition for a second one, NotFound for an unknown lease. A mode other than SHARED
  // releases the replica's lease.
  absl::Status RecordOutcome(const std::string& lease_id, const engram::v1::Outcome& outcome);
  // The replica's latest lookup engine's choice, shown in status (control characters replaced; the caller bounds
  // its size). An unknown lease changes nothing.
  void RecordEngineChoice(const std::string& lease_id, const std::string& text);
  // Ends the session: frees its ticket, removes it from the ticket queue, releases its lease.
  void Detach(const std::string& lease_id);

  // Sends `msg` to every session; returns how many there are.
  size_t NotifyAll(const engram::v1::ServerMessage& msg);
  // Forgets the leases on the segments of checkpoint `dir` (it was unloaded; the replicas keep their mappings).
  void ForgetSegmentsOf(const std::string& dir);
  // Forgets the leases on one segment (its shard was dropped by a reload).
  void ForgetSegment(const std::string& segment_key);
  // SIGHUP: a new ticket capacity (at least 1). Takes effect at once: the free count becomes capacity minus the
  // tickets in use (never negative; tickets held beyond a smaller capacity are kept until they are given back).
  void SetTicketCapacity(int tickets);

  std::vector<ReplicaInfo> Replicas() const;         // in lease-id order
  std::vector<std::string> RecentFallbacks() const;  // oldest first, at most kMaxRecentFallbacks
  ReplicaCounters Counters() const;
  int ticket_capacity() const;
  int tickets_free() const;  // capacity minus tickets held, never negative
  size_t ticket_queue_length() const;
  int leases_on(const std::string& segment_key) const;

 private:
  struct Replica {
    std::string lease_id;
    PeerCred peer;
    engram::v1::Hello hello;
    engram::v1::Mode mode = engram::v1::MODE_UNSPECIFIED;
    std::string backend = "unknown";
    engram::v1::AttachMethod attach = engram::v1::ATTACH_NONE;
    std::vector<engram::v1::Reason> reasons;
    TicketState ticket = TicketState::kNone;
    std::chrono::steady_clock::time_point ticket_since;  // when it took its ticket (kHeld)
    bool outcome_reported = false;
    std::chrono::steady_clock::time_point attached;
    double register_seconds = -1;
    std::string segment_key;
    std::string engine;
    std::function<void(const engram::v1::ServerMessage&)> notify;
  };
  void AddRecentFallbackLocked(std::string line);
  void ReleaseTicketLocked(Replica& r);
  void ExpireTicketsLocked();  // reclaims tickets held past the hold limit
  // The queued lease the next free ticket goes to: of the uids waiting, the one granted least recently (never first),
  // and that uid's longest-waiting lease; so that one uid queueing many replicas cannot keep another's waiting behind
  // all of them.
  const std::string* NextInQueueLocked() const;

  const uint64_t instance_id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Replica> replicas_;
  std::deque<std::string> recent_fallbacks_;
  ReplicaCounters counters_;
  int ticket_capacity_ = 1;
  int tickets_held_ = 0;  // the daemon's own (daemon_tickets_) included
  int daemon_tickets_ = 0;
  std::chrono::milliseconds ticket_hold_limit_{120000};
  std::deque<std::string> ticket_queue_;
  std::map<uint32_t, uint64_t> last_grant_;  // uid -> grant_seq_ at its last grant
  uint64_t grant_seq_ = 0;
  bool stopping_ = false;
  uint64_t next_lease_ = 1;
};

}  // namespace engram::daemon
