#include "daemon/replica_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/utf8.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string ReasonsText(const std::vector<engram::v1::Reason>& reasons) {
  std::vector<std::string> names;
  for (const auto& r : reasons) names.push_back(ReasonName(r.code()));
  return absl::StrJoin(names, ",");
}

}  // namespace

std::string_view Name(TicketState s) {
  switch (s) {
    case TicketState::kNone: return "none";
    case TicketState::kQueued: return "queued";
    case TicketState::kHeld: return "held";
  }
  return "unknown";
}

std::string_view AttachName(engram::v1::AttachMethod m) {
  return m == engram::v1::ATTACH_DESCRIPTOR ? "descriptor" : m == engram::v1::ATTACH_PATH ? "path" : "";
}

absl::Status ValidateOutcome(const engram::v1::Outcome& o, engram::v1::Outcome* clean) {
  if (!engram::v1::Mode_IsValid(o.mode()) || o.mode() == engram::v1::MODE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("outcome: mode ", static_cast<int>(o.mode()),
                                                   " is not a mode (SHARED, PRIVATE_PINNED, DEVICE, DP_SHARDED)"));
  }
  if (o.reasons_size() > kMaxOutcomeReasons) {
    return absl::InvalidArgumentError(
        absl::StrCat("outcome: ", o.reasons_size(), " reasons, at most ", kMaxOutcomeReasons, " are accepted"));
  }
  for (const auto& r : o.reasons()) {
    if (!engram::v1::FallbackReason_IsValid(r.code()) || r.code() == engram::v1::REASON_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("outcome: reason code ", static_cast<int>(r.code()), " is not a known fallback reason"));
    }
  }
  // A SHARED outcome without one comes from a client older than descriptor passing: accepted, shown as unknown.
  if (!engram::v1::AttachMethod_IsValid(o.attach()) ||
      (o.mode() != engram::v1::SHARED && o.attach() != engram::v1::ATTACH_NONE)) {
    return absl::InvalidArgumentError(absl::StrCat("outcome: attach method ", static_cast<int>(o.attach()),
                                                   engram::v1::AttachMethod_IsValid(o.attach())
                                                       ? ": only a SHARED outcome has an attach method"
                                                       : " is not known"));
  }
  if (o.backend() != "cuda" && o.backend() != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("outcome: backend '", Printable(Utf8Prefix(o.backend(), 64)),
                                                   "' is neither \"cuda\" nor \"cpu\""));
  }
  *clean = o;
  for (auto& r : *clean->mutable_reasons()) {
    r.set_hint(Printable(r.hint().size() > kMaxHintBytes ? Utf8Prefix(r.hint(), kMaxHintBytes) : r.hint()));
  }
  return absl::OkStatus();
}

ReplicaRegistry::ReplicaRegistry(uint64_t instance_id, int tickets)
    : instance_id_(instance_id), ticket_capacity_(std::max(1, tickets)) {}

ReplicaRegistry::~ReplicaRegistry() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void ReplicaRegistry::AddRecentFallbackLocked(std::string line) {
  recent_fallbacks_.push_back(std::move(line));
  while (recent_fallbacks_.size() > kMaxRecentFallbacks) recent_fallbacks_.pop_front();
}

std::string ReplicaRegistry::Attach(const engram::v1::Hello& h, const PeerCred& peer, const Decision& d,
                                    const std::string& segment_key,
                                    std::function<void(const engram::v1::ServerMessage&)> notify) {
  std::lock_guard<std::mutex> lock(mu_);
  Replica r;
  r.lease_id = absl::StrFormat("%016x-%d", instance_id_, next_lease_++);
  r.peer = peer;
  r.hello = h;
  r.mode = d.mode;
  r.reasons = d.reasons;
  r.attached = std::chrono::steady_clock::now();
  r.notify = std::move(notify);
  if (d.share) {
    r.segment_key = segment_key;
  } else {
    AddRecentFallbackLocked(absl::StrFormat("pid %d dp %d tp %d: %s -> %s", peer.pid, h.dp_rank(), h.tp_rank(),
                                            ReasonsText(d.reasons), ModeName(d.mode)));
    for (const auto& reason : d.reasons) ++counters_.fallbacks_by_reason[ReasonName(reason.code())];
  }
  ++counters_.sessions_total;
  std::string id = r.lease_id;
  replicas_[id] = std::move(r);
  return id;
}

bool ReplicaRegistry::AcquireTicket(const std::string& lease_id, const std::function<bool()>& cancelled) {
  return AwaitTicket(lease_id, cancelled, std::chrono::steady_clock::time_point::max()) == TicketWait::kGranted;
}

TicketWait ReplicaRegistry::AwaitTicket(const std::string& lease_id, const std::function<bool()>& cancelled,
                                        std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end() || it->second.ticket != TicketState::kNone) return TicketWait::kCancelled;
  it->second.ticket = TicketState::kQueued;
  ticket_queue_.push_back(lease_id);
  while (true) {
    it = replicas_.find(lease_id);  // Detach may have removed it while we waited
    ExpireTicketsLocked();
    const bool timed_out = std::chrono::steady_clock::now() >= deadline;
    const std::string* next_up = NextInQueueLocked();
    const bool granted =
        it != replicas_.end() && tickets_held_ < ticket_capacity_ && next_up != nullptr && *next_up == lease_id;
    if (!granted && (it == replicas_.end() || cancelled() || stopping_ || timed_out)) {
      ticket_queue_.erase(std::remove(ticket_queue_.begin(), ticket_queue_.end(), lease_id), ticket_queue_.end());
      if (it != replicas_.end()) it->second.ticket = TicketState::kNone;
      cv_.notify_all();
      return timed_out && it != replicas_.end() && !stopping_ ? TicketWait::kTimedOut : TicketWait::kCancelled;
    }
    if (granted) {
      ticket_queue_.erase(std::find(ticket_queue_.begin(), ticket_queue_.end(), lease_id));
      if (last_grant_.size() > 4096) last_grant_.clear();  // bounded whatever the number of uids
      last_grant_[it->second.peer.uid] = ++grant_seq_;
      ++tickets_held_;
      it->second.ticket = TicketState::kHeld;
      it->second.ticket_since = std::chrono::steady_clock::now();
      cv_.notify_all();
      return TicketWait::kGranted;
    }
    // Also polls `cancelled` and the holders' limit.
    const auto next = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    cv_.wait_until(lock, std::min(next, deadline));
  }
}

const std::string* ReplicaRegistry::NextInQueueLocked() const {
  const std::string* best = nullptr;
  uint64_t best_seq = 0;
  for (const std::string& id : ticket_queue_) {
    auto r = replicas_.find(id);
    if (r == replicas_.end()) continue;
    auto g = last_grant_.find(r->second.peer.uid);
    const uint64_t seq = g == last_grant_.end() ? 0 : g->second;
    if (best == nullptr || seq < best_seq) {
      best = &id;
      best_seq = seq;
    }
  }
  return best;
}

void ReplicaRegistry::ExpireTicketsLocked() {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [id, r] : replicas_) {
    if (r.ticket != TicketState::kHeld || now - r.ticket_since < ticket_hold_limit_) continue;
    const double held = std::chrono::duration<double>(now - r.ticket_since).count();
    spdlog::warn("event=ticket_expired pid={} uid={} lease={} held_seconds={:.1f} limit_ms={}", r.peer.pid, r.peer.uid,
                 id, held, ticket_hold_limit_.count());
    AddRecentFallbackLocked(
        absl::StrFormat("ticket_expired pid %d uid %d: held its registration ticket %.1f s "
                        "without reporting (limit %d ms)",
                        r.peer.pid, r.peer.uid, held, ticket_hold_limit_.count()));
    ReleaseTicketLocked(r);
  }
}

void ReplicaRegistry::ReclaimExpiredTickets() {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireTicketsLocked();  // a ticket given back wakes the waiters (ReleaseTicketLocked)
}

void ReplicaRegistry::RecordEngineChoice(const std::string& lease_id, const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it != replicas_.end()) it->second.engine = engram::Printable(text);
}

bool ReplicaRegistry::TryHoldDaemonTicket() {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireTicketsLocked();
  if (stopping_ || !ticket_queue_.empty() || tickets_held_ >= ticket_capacity_) return false;
  ++tickets_held_;
  ++daemon_tickets_;
  return true;
}

void ReplicaRegistry::ReleaseDaemonTicket() {
  std::lock_guard<std::mutex> lock(mu_);
  if (daemon_tickets_ == 0) return;
  --daemon_tickets_;
  if (tickets_held_ > 0) --tickets_held_;
  cv_.notify_all();
}

bool ReplicaRegistry::ReplicaWaiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !ticket_queue_.empty();
}

void ReplicaRegistry::SetTicketHoldLimit(std::chrono::milliseconds limit) {
  std::lock_guard<std::mutex> lock(mu_);
  ticket_hold_limit_ = std::max(limit, std::chrono::milliseconds(1));
  cv_.notify_all();
}

void ReplicaRegistry::ReleaseTicketLocked(Replica& r) {
  if (r.ticket == TicketState::kHeld && tickets_held_ > 0) --tickets_held_;
  if (r.ticket == TicketState::kQueued) {
    ticket_queue_.erase(std::remove(ticket_queue_.begin(), ticket_queue_.end(), r.lease_id), ticket_queue_.end());
  }
  r.ticket = TicketState::kNone;
  cv_.notify_all();
}

void ReplicaRegistry::ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& res) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end()) return;
  Replica& r = it->second;
  if (r.ticket == TicketState::kHeld) ReleaseTicketLocked(r);
  r.backend = res.backend().empty() ? (res.ok() ? "cuda" : "cpu") : EchoOf(res.backend(), 16);
  r.register_seconds = res.seconds();
  counters_.register_seconds.Observe(res.seconds());
  counters_.attach_seconds.Observe(SecondsSince(r.attached));
  if (!res.ok()) {
    ++counters_.fallbacks_by_reason["REGISTER_FAILED"];
    r.reasons.push_back(MakeReason(engram::v1::REGISTER_FAILED,
                                   absl::StrFormat("cudaHostRegister failed at chunk %d: %s (check ulimit -l / "
                                                   "LimitMEMLOCK)",
                                                   res.failed_chunk(), EchoOf(res.error()))));
    r.mode = r.hello.config().cpu_offload() == engram::v1::DISABLED ? engram::v1::DEVICE : engram::v1::PRIVATE_PINNED;
    r.segment_key.clear();  // the lease goes: it did not keep the mapping registered
    AddRecentFallbackLocked(absl::StrFormat("pid %d dp %d tp %d: REGISTER_FAILED (chunk %d) -> %s", r.peer.pid,
                                            r.hello.dp_rank(), r.hello.tp_rank(), res.failed_chunk(),
                                            ModeName(r.mode)));
    spdlog::warn("event=register_failed pid={} lease={} chunk={} detail={}", r.peer.pid, lease_id, res.failed_chunk(),
                 engram::LogQuoted(EchoOf(res.error())));
  }
  cv_.notify_all();
}

absl::Status ReplicaRegistry::RecordOutcome(const std::string& lease_id, const engram::v1::Outcome& outcome) {
  engram::v1::Outcome clean;
  if (auto st = ValidateOutcome(outcome, &clean); !st.ok()) {
    spdlog::warn("event=outcome_refused lease={} detail={}", lease_id, engram::LogQuoted(std::string(st.message())));
    return st;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end()) return absl::NotFoundError(absl::StrCat("no session with lease ", lease_id));
  Replica& r = it->second;
  if (r.outcome_reported) return absl::FailedPreconditionError("outcome sent twice in one session");
  if (clean.mode() == engram::v1::SHARED && (r.mode != engram::v1::SHARED || r.segment_key.empty())) {
    // Status lists only modes processes run: SHARED needs this session's grant and its lease.
    return absl::FailedPreconditionError("outcome: SHARED, but this session holds no granted segment");
  }
  r.outcome_reported = true;
  const engram::v1::Mode decided = r.mode;
  std::vector<engram::v1::Reason> reasons(clean.reasons().begin(), clean.reasons().end());
  if (clean.mode() != decided && clean.mode() != engram::v1::SHARED) {
    // The replica ended up elsewhere than the daemon decided (e.g. its own NO_CUDA_DEVICE): a fallback of its own.
    for (const auto& reason : reasons) {
      const bool known = std::any_of(r.reasons.begin(), r.reasons.end(),
                                     [&](const engram::v1::Reason& x) { return x.code() == reason.code(); });
      if (!known) ++counters_.fallbacks_by_reason[ReasonName(reason.code())];
    }
    AddRecentFallbackLocked(absl::StrFormat("pid %d dp %d tp %d: outcome %s -> %s", r.peer.pid, r.hello.dp_rank(),
                                            r.hello.tp_rank(), ReasonsText(reasons), ModeName(clean.mode())));
  }
  r.mode = clean.mode();
  r.reasons = std::move(reasons);
  r.backend = clean.backend();
  r.attach = clean.attach();
  if (r.mode != engram::v1::SHARED) r.segment_key.clear();  // it did not keep the mapping
  spdlog::info("event=outcome pid={} lease={} mode={} backend={} attach={} reasons={}", r.peer.pid, lease_id,
               ModeName(r.mode), r.backend, AttachName(r.attach), ReasonsText(r.reasons));
  cv_.notify_all();
  return absl::OkStatus();
}

void ReplicaRegistry::Detach(const std::string& lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end()) return;
  Replica& r = it->second;
  ReleaseTicketLocked(r);
  spdlog::info("event=detach pid={} lease={} attached_seconds={:.1f}", r.peer.pid, lease_id, SecondsSince(r.attached));
  replicas_.erase(it);
  cv_.notify_all();
}

size_t ReplicaRegistry::NotifyAll(const engram::v1::ServerMessage& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : replicas_) {
    if (r.notify) r.notify(msg);
  }
  cv_.notify_all();
  return replicas_.size();
}

void ReplicaRegistry::ForgetSegmentsOf(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : replicas_) {
    if (r.segment_key.rfind(dir + "/", 0) == 0) r.segment_key.clear();
  }
}

void ReplicaRegistry::ForgetSegment(const std::string& segment_key) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : replicas_) {
    if (r.segment_key == segment_key) r.segment_key.clear();
  }
}

void ReplicaRegistry::SetTicketCapacity(int tickets) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int before = ticket_capacity_;
    ticket_capacity_ = std::max(1, tickets);
    if (before != ticket_capacity_) {
      spdlog::info("event=tickets capacity={} held={} free={}", ticket_capacity_, tickets_held_,
                   std::max(0, ticket_capacity_ - tickets_held_));
    }
  }
  cv_.notify_all();  // waiters may fit now
}

std::vector<ReplicaInfo> ReplicaRegistry::Replicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReplicaInfo> out;
  out.reserve(replicas_.size());
  for (const auto& [id, r] : replicas_) {
    ReplicaInfo i;
    i.lease_id = id;
    i.peer = r.peer;
    i.hello = r.hello;
    i.mode = r.mode;
    i.backend = r.backend;
    i.attach = r.attach;
    i.reasons = r.reasons;
    i.ticket = r.ticket;
    i.outcome_reported = r.outcome_reported;
    i.attached_seconds = SecondsSince(r.attached);
    i.register_seconds = r.register_seconds;
    i.engine = r.engine;
    i.segment_key = r.segment_key;
    out.push_back(std::move(i));
  }
  return out;
}

std::vector<std::string> ReplicaRegistry::RecentFallbacks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {recent_fallbacks_.begin(), recent_fallbacks_.end()};
}

ReplicaCounters ReplicaRegistry::Counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

int ReplicaRegistry::ticket_capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ticket_capacity_;
}

int ReplicaRegistry::tickets_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::max(0, ticket_capacity_ - tickets_held_);
}

size_t ReplicaRegistry::ticket_queue_length() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ticket_queue_.size();
}

int ReplicaRegistry::leases_on(const std::string& segment_key) const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [id, r] : replicas_) n += !segment_key.empty() && r.segment_key == segment_key;
  return n;
}

}  // namespace engram::daemon
