#include "daemon/status_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engram/version.h"
#include "shm/capacity.h"

namespace engram::daemon {

engram::v1::StatusReply BuildStatus(const SegmentRegistry& segments, const ReplicaRegistry& replicas, bool draining,
                                    const RegistrationPrewarm* prewarm) {
  engram::v1::StatusReply s;
  const std::string& shm_dir = segments.shm_dir();
  auto cap = ProbeShm(shm_dir);
  auto* shm = s.mutable_shm();
  shm->set_path(cap.ok() ? cap->path : shm_dir);
  if (cap.ok()) {
    shm->set_total_bytes(cap->total_bytes);
    shm->set_free_bytes(cap->free_bytes);
    shm->set_huge_pages(cap->huge_pages);
  } else {
    shm->set_huge_pages("missing");
  }
  uint64_t engram_bytes = 0;
  for (const SegmentInfo& e : segments.Segments()) {
    auto* seg = s.add_segments();
    seg->set_name(e.name);
    seg->set_checkpoint(e.checkpoint);
    seg->set_tp_rank(static_cast<int32_t>(e.tp_rank));
    seg->set_tp_size(static_cast<int32_t>(e.tp_size));
    seg->set_bytes(e.bytes);
    seg->set_state(std::string(Name(e.state)));
    seg->set_origin(std::string(Name(e.origin)));
    seg->set_load_seconds(e.load_seconds);
    seg->set_checksum_state(std::string(Name(e.checksum)));
    seg->set_progress(e.state == ServingState::kReady && e.checksum != ChecksumState::kVerifying ? 1.0
                      : e.rows_total ? static_cast<double>(e.rows_done) / e.rows_total
                                     : 0.0);
    seg->set_error(e.error);
    PrewarmRecord pw;
    if (prewarm != nullptr) {
      pw = prewarm->RecordOf(e.path);
    } else {
      pw.detail = "engramd has not started serving";
    }
    auto* p = seg->mutable_prewarm();
    p->set_state(std::string(Name(pw.state)));
    p->set_register_seconds(pw.register_seconds);
    p->set_seconds(pw.seconds);
    p->set_at_unix_ms(pw.at_unix_ms);
    p->set_detail(pw.detail);
    if (e.state == ServingState::kReady) engram_bytes += e.bytes;
  }
  shm->set_engram_bytes(engram_bytes);
  // Bounded whatever the clients do: at most kMaxStatusReplicas replicas and kMaxStatusReplicaBytes of them (each
  // one's hints are bounded already); the rest are counted in a line of recent_fallbacks.
  size_t listed_bytes = 0, not_listed = 0;
  for (const ReplicaInfo& r : replicas.Replicas()) {
    if (static_cast<size_t>(s.replicas_size()) >= kMaxStatusReplicas || listed_bytes >= kMaxStatusReplicaBytes) {
      ++not_listed;
      continue;
    }
    auto* rep = s.add_replicas();
    rep->set_pid(r.peer.pid);
    rep->set_uid(r.peer.uid);
    rep->set_dp_rank(r.hello.dp_rank());
    rep->set_tp_rank(r.hello.tp_rank());
    rep->set_mode(ModeName(r.mode));
    rep->set_backend(r.ticket == TicketState::kHeld ? "registering" : r.backend);
    for (const auto& reason : r.reasons) *rep->add_reasons() = reason;
    rep->set_attached_seconds(r.attached_seconds);
    rep->set_register_seconds(r.register_seconds);
    rep->set_engine(r.engine);
    rep->set_lease_id(r.lease_id);
    rep->set_attach(std::string(AttachName(r.attach)));
    rep->set_own_pid(r.hello.pid());
    rep->set_dp_size(r.hello.dp_size());
    rep->set_local_dp_size(r.hello.local_dp_size());
    rep->set_tp_size(r.hello.tp_size());
    rep->set_client_version(r.hello.client_version());  // "" from a client that sends none
    const size_t slash = r.segment_key.rfind('/');
    rep->set_segment(slash == std::string::npos ? r.segment_key : r.segment_key.substr(slash + 1));
    listed_bytes += rep->ByteSizeLong();
  }
  for (const auto& f : replicas.RecentFallbacks()) s.add_recent_fallbacks(f);
  // Loads and reloads that failed (kept by the segment registry; `load_failed dir=... detail=...`).
  for (const auto& f : segments.RecentLoadFailures()) s.add_recent_fallbacks(f);
  if (not_listed > 0) {
    s.add_recent_fallbacks(absl::StrFormat("replicas_not_listed count=%d: status lists at most %d replicas", not_listed,
                                           s.replicas_size()));
  }
  s.set_draining(draining);
  s.set_epoch(segments.epoch());
  s.set_daemon_version(ENGRAM_VERSION_STRING);
  return s;
}

}  // namespace engram::daemon
