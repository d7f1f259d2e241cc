#include "daemon/coordinator.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "daemon/fallback.h"
#include "daemon/metrics_text.h"
#include "daemon/publisher.h"
#include "daemon/segment_files.h"
#include "daemon/status_report.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

namespace {

// The directory of this executable (where --prewarm-registration auto looks for engram-prewarm); "" when unknown.
std::string SelfDirectory(Env& env) {
  std::string exe;
  if (env.Readlink("/proc/self/exe", &exe) != 0 || exe.empty()) return "";
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "" : exe.substr(0, slash);
}

}  // namespace

uint64_t Coordinator::NewInstanceId() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
}

int Coordinator::WorkerThreads(int requested) { return requested > 0 ? requested : DefaultPublishThreads(); }

Coordinator::Coordinator(Options opts)
    : opts_(std::move(opts)),
      instance_id_(NewInstanceId()),
      segments_(opts_.shm_dir, WorkerThreads(opts_.threads), instance_id_, Env::Default(), opts_.publish_tuning),
      replicas_(instance_id_, opts_.tickets) {
  replicas_.SetTicketHoldLimit(std::chrono::milliseconds(opts_.ticket_hold_ms));
}

Coordinator::~Coordinator() {
  if (prewarm_ != nullptr) prewarm_->Stop();
}

Options Coordinator::options() const {
  std::lock_guard<std::mutex> lock(opts_mu_);
  return opts_;
}

absl::Status Coordinator::Start() {
  const Options o = options();
  ASSIGN_OR_RETURN(PrewarmOptions po,
                   ResolvePrewarmTool(o.prewarm_registration, SelfDirectory(*Env::Default()), Env::Default()));
  if (!po.tool.empty()) {
    spdlog::info("event=registration_prewarm state=on tool={}", engram::LogValue(po.tool));
  } else {
    spdlog::info("event=registration_prewarm state=off detail={}", engram::LogQuoted(po.off_reason));
  }
  prewarm_ = std::make_unique<RegistrationPrewarm>(
      std::move(po), RegistrationPrewarm::Hooks{[this] { return replicas_.TryHoldDaemonTicket(); },
                                                [this] { replicas_.ReleaseDaemonTicket(); },
                                                [this] { return replicas_.ReplicaWaiting(); }});
  segments_.SetReadyHook([this](const std::string& path) { prewarm_->SegmentReady(path); });
  RETURN_IF_ERROR(segments_.Start(o.checkpoints, o.tp_sizes, /*lock_shm_dir=*/true));
  for (const SegmentInfo& s : segments_.Segments()) {  // adopted: READY already
    if (s.state == ServingState::kReady) prewarm_->SegmentReady(s.path);
  }
  return absl::OkStatus();
}

bool Coordinator::WaitSettled(std::chrono::milliseconds timeout) { return segments_.WaitSettled(timeout); }

std::string Coordinator::LoadProgressLine() { return segments_.LoadProgressLine(); }

absl::StatusOr<engram::v1::ServerMessage> Coordinator::Attach(
    const engram::v1::Hello& h, const PeerCred& peer, std::function<bool()> cancelled,
    std::function<void(const engram::v1::ServerMessage&)> notify, std::string* lease_id) {
  if (h.tp_size() < 1 || h.tp_rank() < 0 || h.tp_rank() >= h.tp_size() || h.dp_size() < 1 || h.dp_rank() < 0 ||
      h.dp_rank() >= h.dp_size() || h.local_dp_size() < 0 || h.local_dp_size() > h.dp_size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hello: invalid topology tp %d/%d dp %d/%d local %d (need 0 <= rank < size, local <= dp size)",
                        h.tp_rank(), h.tp_size(), h.dp_rank(), h.dp_size(), h.local_dp_size()));
  }
  if (draining_) return absl::UnavailableError("engramd is draining: no new sessions");
  ASSIGN_OR_RETURN(ShardOffer offer, segments_.Offer(h, cancelled, [this] { return draining_.load(); }));
  Decision d = Decide(h, offer.node);
  if (d.share && !offer.ready) {
    // Decide shares only when the node view names no failure, which Offer sets whenever the shard isn't READY.
    return absl::InternalError("sharing decided without a READY segment");
  }
  *lease_id = replicas_.Attach(h, peer, d, d.share ? offer.segment_key() : std::string(), std::move(notify));
  engram::v1::ServerMessage msg;
  if (d.share) {
    auto* g = msg.mutable_grant();
    g->set_segment_path(offer.segment_path);
    g->set_segment_bytes(offer.segment_bytes);
    *g->mutable_segment() = *offer.descriptor;
    g->set_epoch(segments_.epoch());
    g->set_lease_id(*lease_id);
    g->set_takes_engine_choice(true);
    g->set_segment_dev(offer.file.dev);  // the file READY was decided for, not whatever the name holds now
    g->set_segment_ino(offer.file.ino);
    if (descriptors_ != nullptr) {
      g->set_fd_socket(descriptors_->socket_name());
      g->set_fd_token(descriptors_->Issue(*lease_id, peer, offer.segment_path, offer.segment_bytes, g->segment_dev(),
                                          g->segment_ino()));
    }
    spdlog::info("event=attach decision=shared pid={} uid={} dp_rank={} tp_rank={} segment={} lease={}", peer.pid,
                 peer.uid, h.dp_rank(), h.tp_rank(), offer.segment_name, *lease_id);
  } else {
    auto* f = msg.mutable_fallback();
    f->set_takes_engine_choice(true);
    f->set_mode(d.mode);
    std::vector<std::string> names;
    for (const auto& reason : d.reasons) {
      *f->add_reasons() = reason;
      names.push_back(ReasonName(reason.code()));
    }
    spdlog::warn("event=attach decision=fallback pid={} uid={} dp_rank={} tp_rank={} mode={} reasons={}", peer.pid,
                 peer.uid, h.dp_rank(), h.tp_rank(), ModeName(d.mode), absl::StrJoin(names, ","));
  }
  return msg;
}

bool Coordinator::AcquireTicket(const std::string& lease_id, std::function<bool()> cancelled) {
  return replicas_.AcquireTicket(lease_id, cancelled);
}

TicketWait Coordinator::AwaitTicket(const std::string& lease_id, std::function<bool()> cancelled,
                                    std::chrono::steady_clock::time_point deadline) {
  return replicas_.AwaitTicket(lease_id, cancelled, deadline);
}

void Coordinator::ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& result) {
  replicas_.ReportRegistration(lease_id, result);
}

void Coordinator::RecordEngineChoice(const std::string& lease_id, const std::string& text) {
  replicas_.RecordEngineChoice(lease_id, text);
}

absl::Status Coordinator::RecordOutcome(const std::string& lease_id, const engram::v1::Outcome& outcome) {
  return replicas_.RecordOutcome(lease_id, outcome);
}

absl::Status Coordinator::JoinGroup(const std::string& lease_id, const engram::v1::Hello& hello, const PeerCred& peer,
                                    const engram::v1::GroupJoin& join,
                                    std::function<void(const engram::v1::ServerMessage&)> notify) {
  return groups_.Join(lease_id, hello, peer, join, std::move(notify));
}

void Coordinator::Detach(const std::string& lease_id) {
  groups_.Leave(lease_id);
  if (descriptors_ != nullptr) descriptors_->Revoke(lease_id);
  replicas_.Detach(lease_id);
}

engram::v1::StatusReply Coordinator::Status() {
  replicas_.ReclaimExpiredTickets();  // what status and the metrics show of the tickets is not past its limit
  engram::v1::StatusReply reply = BuildStatus(segments_, replicas_, draining_, prewarm_.get());
  for (auto& g : groups_.Groups()) *reply.add_groups() = std::move(g);
  if (descriptors_ != nullptr) {
    const DescriptorStats d = descriptors_->Stats();
    reply.mutable_descriptors()->set_socket(d.socket);
    reply.mutable_descriptors()->set_sent(d.sent);
    reply.mutable_descriptors()->set_refused(d.refused);
  }
  return reply;
}

std::string Coordinator::MetricsText() { return daemon::MetricsText(Status(), replicas_.Counters()); }

absl::Status Coordinator::Load(const std::string& dir, const std::vector<int64_t>& tp_sizes) {
  absl::Status st = segments_.Load(dir, tp_sizes.empty() ? options().tp_sizes : tp_sizes);
  if (!st.ok()) {
    const std::string detail(st.message());
    spdlog::error("event=load_failed dir={} detail={}", engram::LogValue(EchoOf(dir, 512)),
                  engram::LogQuoted(EchoOf(detail, 1024)));
    segments_.RecordLoadFailure("load", dir, detail);
  }
  return st;
}

absl::Status Coordinator::Unload(const std::string& dir) {
  RETURN_IF_ERROR(segments_.Unload(dir));
  replicas_.ForgetSegmentsOf(dir);
  return absl::OkStatus();
}

void Coordinator::Drain() {
  draining_ = true;
  engram::v1::ServerMessage msg;
  msg.mutable_event()->set_kind(engram::v1::Event::DRAINING);
  msg.mutable_event()->set_detail("engramd is stopping; mapped segments stay valid");
  const size_t n = replicas_.NotifyAll(msg);
  segments_.Wake();  // hellos waiting for a segment stop waiting
  spdlog::info("event=drain replicas={}", n);
}

void Coordinator::NoteReloadFailure(const std::string& config_file, const std::string& detail) {
  segments_.RecordLoadFailure("reload", config_file, detail + ": nothing changed");
}

absl::Status Coordinator::Reload(const Options& opts) {
  // All or nothing: the registry validates the whole new set (opens every new checkpoint, checks every TP size)
  // before it changes anything; the ticket capacity and the options change only once that succeeded.
  auto r = segments_.Reconfigure(opts.checkpoints, opts.tp_sizes);
  if (!r.ok()) {
    const std::string detail(r.status().message());
    segments_.RecordLoadFailure("reload", opts.config_file, detail);
    return absl::Status(r.status().code(), absl::StrCat(detail, ": nothing changed, still serving ",
                                                        absl::StrJoin(segments_.CheckpointDirs(), ",")));
  }
  for (const auto& d : r->removed) replicas_.ForgetSegmentsOf(d);
  for (const auto& k : r->retired_segment_keys) replicas_.ForgetSegment(k);
  const Options before = options();
  {
    std::lock_guard<std::mutex> lock(opts_mu_);
    opts_.checkpoints = segments_.CheckpointDirs();
    opts_.tp_sizes = opts.tp_sizes;
    opts_.tickets = opts.tickets;
    opts_.ticket_hold_ms = opts.ticket_hold_ms;
  }
  replicas_.SetTicketCapacity(opts.tickets);
  replicas_.SetTicketHoldLimit(std::chrono::milliseconds(opts.ticket_hold_ms));
  segments_.BumpEpoch();
  // One line per changed key: applied here (checkpoint, tp, tickets), applied by main() on the socket side right
  // after this returns (group, admin_group, the session bounds, log_level), or refused until the next start.
  auto line = [](const char* key, bool changed, const std::string& value, const char* refused) {
    if (!changed) return;
    if (refused == nullptr) {
      spdlog::info("event=reload key={} applied value={}", engram::LogValue(key),
                   engram::LogQuoted(Bounded(value, 256)));
    } else {
      spdlog::warn("event=reload key={} refused reason={} value={}", engram::LogValue(key), engram::LogQuoted(refused),
                   engram::LogQuoted(Bounded(value, 256)));
    }
  };
  constexpr const char* kRestart = "takes effect at the next start of engramd";
  line("checkpoint", !r->added.empty() || !r->removed.empty() || !r->revised.empty(),
       absl::StrJoin(opts.checkpoints, ","), nullptr);
  line("tp", before.tp_sizes != opts.tp_sizes, absl::StrJoin(opts.tp_sizes, ","), nullptr);
  line("tickets", before.tickets != opts.tickets, std::to_string(opts.tickets), nullptr);
  line("group", before.group != opts.group, opts.group, nullptr);
  line("admin_group", before.admin_group != opts.admin_group, opts.admin_group, nullptr);
  line("max_sessions", before.max_sessions != opts.max_sessions, std::to_string(opts.max_sessions), nullptr);
  line("max_sessions_per_uid", before.max_sessions_per_uid != opts.max_sessions_per_uid,
       std::to_string(opts.max_sessions_per_uid), nullptr);
  line("ticket_hold_ms", before.ticket_hold_ms != opts.ticket_hold_ms, std::to_string(opts.ticket_hold_ms), nullptr);
  line("max_streams_per_uid", before.max_streams_per_uid != opts.max_streams_per_uid,
       std::to_string(opts.max_streams_per_uid), nullptr);
  line("max_connections_per_uid", before.max_connections_per_uid != opts.max_connections_per_uid,
       std::to_string(opts.max_connections_per_uid), nullptr);
  line("log_level", before.log_level != opts.log_level, opts.log_level, nullptr);
  line("reflection", before.reflection != opts.reflection, opts.reflection ? "on" : "off", kRestart);
  line("shm_dir", before.shm_dir != opts.shm_dir, opts.shm_dir, kRestart);
  line("socket", before.socket != opts.socket, opts.socket, kRestart);
  line("threads", before.threads != opts.threads, std::to_string(opts.threads), kRestart);
  line("metrics_file", before.metrics_file != opts.metrics_file, opts.metrics_file, kRestart);
  line("metrics_address", before.metrics_address != opts.metrics_address, opts.metrics_address, kRestart);
  {
    std::lock_guard<std::mutex> lock(opts_mu_);
    opts_.group = opts.group;
    opts_.admin_group = opts.admin_group;
    opts_.max_sessions = opts.max_sessions;
    opts_.max_sessions_per_uid = opts.max_sessions_per_uid;
    opts_.max_streams_per_uid = opts.max_streams_per_uid;
    opts_.max_connections_per_uid = opts.max_connections_per_uid;
    opts_.log_level = opts.log_level;
  }
  spdlog::info("event=reload added={} removed={} tp={} tp_changed={} revised={} retired={} tickets={}",
               absl::StrJoin(r->added, ","), absl::StrJoin(r->removed, ","), absl::StrJoin(opts.tp_sizes, ","),
               absl::StrJoin(r->tp_changed, ","), absl::StrJoin(r->revised, ","), r->retired_segment_keys.size(),
               opts.tickets);
  return absl::OkStatus();
}

}  // namespace engram::daemon
