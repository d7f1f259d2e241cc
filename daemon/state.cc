#include "daemon/state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/publisher.h"
#include "base/status_macros.h"
#include "model/tokenizer.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {
namespace {

using Key = std::pair<int64_t, int64_t>;

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string ReasonsText(const std::vector<engram::v1::Reason>& reasons) {
  std::vector<std::string> names;
  for (const auto& r : reasons) names.push_back(ReasonName(r.code()));
  return absl::StrJoin(names, ",");
}

}  // namespace

DaemonState::DaemonState(Options opts) : opts_(std::move(opts)) {
  std::random_device rd;
  instance_id_ = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  threads_ = opts_.threads > 0 ? opts_.threads : static_cast<int>(std::min(16u, hw));
  tickets_free_ = std::max(1, opts_.tickets);
}

DaemonState::~DaemonState() {
  stopping_ = true;
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

absl::StatusOr<std::unique_ptr<CheckpointEntry>> DaemonState::OpenCheckpoint(const std::string& dir,
                                                                              const std::vector<int64_t>& tps) {
  auto c = std::make_unique<CheckpointEntry>();
  c->dir = dir;
  c->tp_sizes = tps;
  ASSIGN_OR_RETURN(c->ckpt, Checkpoint::Open(dir));
  c->fingerprint = c->ckpt->Fingerprint();
  if (c->ckpt->config().kind == ModelKind::kPle) {
    spdlog::warn("event=checkpoint_ple dir={} arch={}: PLE tables are never shared (MODEL_NOT_SHAREABLE)", dir,
                 c->ckpt->config().architecture);
    return c;
  }
  RETURN_IF_ERROR(c->ckpt->ValidateEngramTensors());
  ASSIGN_OR_RETURN(Layout layout, Layout::Build(c->ckpt->config()));
  c->layout = std::make_unique<Layout>(std::move(layout));
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(c->ckpt->tokenizer_path()));
  c->map = std::make_unique<TokenMap>(TokenMap::Build(tok));
  if (auto st = c->map->CheckAgainst(c->ckpt->config()); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat(dir, ": ", st.message()));
  }
  for (int64_t tp : tps) {
    if (auto s = c->layout->Shard(tp, 0); !s.ok()) return absl::InvalidArgumentError(absl::StrCat(dir, ": ", s.status().message()));
  }
  return c;
}

void DaemonState::ScanShmDirLocked() {
  // Debris (anything not READY) goes; READY segments that no configured checkpoint wants are retired (unlinked:
  // a replica that maps one keeps its mapping, the memory returns when the last mapping goes).
  for (const std::string& name : ListSegments(opts_.shm_dir)) {
    const std::string path = opts_.shm_dir + "/" + name;
    auto h = ReadSegmentHeader(path);
    if (!h.ok() || h->state != static_cast<uint32_t>(SegmentState::kReady)) {
      spdlog::warn("event=segment_debris path={} state={} detail=\"{}\": removed", path,
                   h.ok() ? SegmentStateName(static_cast<SegmentState>(h->state)) : "unreadable",
                   h.ok() ? "left by a crash during loading" : std::string(h.status().message()));
      ::unlink(path.c_str());
      continue;
    }
    bool wanted = false;
    for (const auto& [dir, c] : checkpoints_) {
      for (const auto& [key, seg] : c->segments) wanted = wanted || seg.name == name;
    }
    if (!wanted) {
      spdlog::info("event=segment_retired path={}: not served by this configuration", path);
      (void)SetSegmentState(path, SegmentState::kRetired);
      ::unlink(path.c_str());
    }
  }
}

void DaemonState::PlanSegmentsLocked(CheckpointEntry& c) {
  if (!c.layout) return;
  for (int64_t tp : c.tp_sizes) {
    for (int64_t r = 0; r < tp; ++r) {
      SegmentEntry e;
      e.tp_size = tp;
      e.tp_rank = r;
      e.name = SegmentName(c.fingerprint, tp, r);
      e.path = opts_.shm_dir + "/" + e.name;
      auto shard = c.layout->Shard(tp, r);
      auto desc = MakeDescriptor(*c.ckpt, *c.layout, *c.map, *shard, c.fingerprint);
      for (auto& l : *desc.mutable_layers()) l.set_checksum(~uint64_t{0});
      e.bytes = SegmentFileBytes(desc.ByteSizeLong(), static_cast<uint64_t>(shard->bytes(c.layout->record_bytes())));
      e.rows_total = static_cast<uint64_t>(shard->rows());
      c.segments[{tp, r}] = e;
    }
  }
}

absl::Status DaemonState::Start() {
  std::unique_lock<std::mutex> lock(mu_);
  shm_ = ProbeShm(opts_.shm_dir);
  for (const auto& dir : opts_.checkpoints) {
    ASSIGN_OR_RETURN(auto c, OpenCheckpoint(dir, opts_.tp_sizes));
    PlanSegmentsLocked(*c);
    checkpoints_[dir] = std::move(c);
  }
  if (!shm_.ok()) {
    spdlog::error("event=shm_missing dir={} detail=\"{}\": replicas will fall back (SHM_MISSING)", opts_.shm_dir,
                  std::string(shm_.status().message()));
    for (auto& [dir, c] : checkpoints_) {
      for (auto& [key, e] : c->segments) {
        e.state = "FAILED";
        e.error = std::string(shm_.status().message());
      }
    }
    return absl::OkStatus();
  }
  ScanShmDirLocked();
  for (auto& [dir, c] : checkpoints_) {
    for (auto& [key, e] : c->segments) {
      auto h = ReadSegmentHeader(e.path);
      if (h.ok() && h->state == static_cast<uint32_t>(SegmentState::kReady) && h->fingerprint == c->fingerprint &&
          h->total_bytes == e.bytes) {
        auto reader = SegmentReader::Open(e.path);
        if (reader.ok() && e.descriptor.ParseFromString((*reader)->descriptor_bytes())) {
          e.state = "READY";
          e.origin = "adopted";
          e.load_seconds = h->load_seconds;
          e.checksum_state = "verifying";
          spdlog::info("event=segment_adopted path={} bytes={} load_seconds={:.2f}", e.path, e.bytes, e.load_seconds);
          workers_.emplace_back([this, d = dir, k = key] { VerifyAdopted(d, k); });
          continue;
        }
      }
      if (h.ok()) ::unlink(e.path.c_str());  // stale: wrong size or fingerprint
      publish_queue_.push_back({dir, key});
    }
  }
  workers_.emplace_back([this] { PublishLoop(); });
  return absl::OkStatus();
}

void DaemonState::VerifyAdopted(const std::string& dir, Key key) {
  std::string path;
  std::shared_ptr<std::atomic<uint64_t>> progress;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = checkpoints_.find(dir);
    if (it == checkpoints_.end()) return;
    auto& e = it->second->segments[key];
    path = e.path;
    progress = e.rows_done;
  }
  absl::Status st = VerifyChecksums(path, std::max(1, threads_ / 2), progress.get());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = checkpoints_.find(dir);
  if (it == checkpoints_.end()) return;
  auto& e = it->second->segments[key];
  e.checksum_state = st.ok() ? "ok" : "mismatch";
  if (!st.ok()) {
    spdlog::error("event=segment_checksum_mismatch path={} detail=\"{}\": republishing", path, std::string(st.message()));
    e.state = "PENDING";
    ::unlink(path.c_str());
    publish_queue_.push_back({dir, key});
  }
  cv_.notify_all();
}

void DaemonState::PublishLoop() {
  while (true) {
    std::string dir;
    Key key;
    std::shared_ptr<const Checkpoint> ckpt;
    const Layout* layout = nullptr;
    const TokenMap* map = nullptr;
    std::shared_ptr<std::atomic<uint64_t>> progress;
    uint64_t bytes = 0;
    std::string path;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !publish_queue_.empty(); });
      if (stopping_) return;
      std::tie(dir, key) = publish_queue_.front();
      publish_queue_.pop_front();
      auto it = checkpoints_.find(dir);
      if (it == checkpoints_.end()) continue;
      auto& e = it->second->segments[key];
      ckpt = it->second->ckpt;
      layout = it->second->layout.get();
      map = it->second->map.get();
      progress = e.rows_done;
      progress->store(0);
      bytes = e.bytes;
      path = e.path;
      // Capacity: the segment must fit in what the mount has free now.
      auto cap = ProbeShm(opts_.shm_dir);
      if (!cap.ok() || cap->free_bytes < bytes) {
        e.state = "FAILED";
        e.too_small = cap.ok();
        e.error = cap.ok() ? absl::StrFormat("%s has %d bytes free, the segment needs %d", opts_.shm_dir,
                                             cap->free_bytes, bytes)
                           : std::string(cap.status().message());
        spdlog::error("event=segment_not_created path={} reason={} detail=\"{}\"", path,
                      cap.ok() ? "SHM_TOO_SMALL" : "SHM_MISSING", e.error);
        cv_.notify_all();
        continue;
      }
      e.state = "LOADING";
      e.origin = "published";
    }
    spdlog::info("event=publish_start path={} bytes={} threads={}", path, bytes, threads_);
    auto r = Publish(*ckpt, *layout, *map, key.first, key.second, opts_.shm_dir, instance_id_, epoch_, threads_,
                     progress.get());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = checkpoints_.find(dir);
    if (it == checkpoints_.end()) continue;
    auto& e = it->second->segments[key];
    if (r.ok()) {
      auto reader = SegmentReader::Open(path);
      if (reader.ok()) e.descriptor.ParseFromString((*reader)->descriptor_bytes());
      e.state = "READY";
      e.load_seconds = r->seconds;
      e.checksum_state = "ok";
      spdlog::info("event=publish_done path={} bytes={} seconds={:.2f} gib_per_s={:.2f}", path, r->bytes, r->seconds,
                   r->bytes / 1073741824.0 / std::max(r->seconds, 1e-9));
    } else {
      e.state = "FAILED";
      e.too_small = r.status().code() == absl::StatusCode::kResourceExhausted;
      e.error = std::string(r.status().message());
      spdlog::error("event=publish_failed path={} detail=\"{}\"", path, e.error);
    }
    cv_.notify_all();
  }
}

bool DaemonState::WaitSettled(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    for (const auto& [dir, c] : checkpoints_) {
      for (const auto& [k, e] : c->segments) {
        if (e.state == "PENDING" || e.state == "LOADING") return false;
      }
    }
    return true;
  });
}

std::string DaemonState::LoadProgressLine() {
  std::lock_guard<std::mutex> lock(mu_);
  int ready = 0, total = 0;
  uint64_t done = 0, all = 0;
  for (const auto& [dir, c] : checkpoints_) {
    for (const auto& [k, e] : c->segments) {
      ++total;
      ready += e.state == "READY";
      all += e.rows_total;
      done += e.state == "READY" ? e.rows_total : e.rows_done->load();
    }
  }
  return absl::StrFormat("%d/%d segments ready, %.0f%% of rows", ready, total, all ? 100.0 * done / all : 100.0);
}

absl::StatusOr<engram::v1::ServerMessage> DaemonState::Attach(
    const engram::v1::Hello& h, const PeerInfo& peer, std::function<bool()> cancelled,
    std::function<void(const engram::v1::ServerMessage&)> notify, std::string* lease_id) {
  if (h.tp_size() < 1 || h.tp_rank() < 0 || h.tp_rank() >= h.tp_size() || h.dp_size() < 1 || h.dp_rank() < 0 ||
      h.dp_rank() >= h.dp_size() || h.local_dp_size() < 0 || h.local_dp_size() > h.dp_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "hello: invalid topology tp %d/%d dp %d/%d local %d (need 0 <= rank < size, local <= dp size)",
        h.tp_rank(), h.tp_size(), h.dp_rank(), h.dp_size(), h.local_dp_size()));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (draining_) return absl::UnavailableError("engramd is draining: no new sessions");
  CheckpointEntry* c = nullptr;
  for (auto& [dir, entry] : checkpoints_) {
    if (entry->fingerprint == h.fingerprint()) c = entry.get();
  }
  NodeView node;
  node.shm_path = opts_.shm_dir;
  node.shm_exists = shm_.ok();
  if (shm_.ok()) {
    node.shm_dev = shm_->device;
    node.shm_ino = shm_->inode;
    node.shm_free_bytes = shm_->free_bytes;
  }
  node.checkpoint_served = c != nullptr;
  SegmentEntry* seg = nullptr;
  if (c != nullptr) {
    node.model_shareable = c->layout != nullptr;
    auto it = c->segments.find({h.tp_size(), h.tp_rank()});
    if (it == c->segments.end() && node.model_shareable) {
      node.segment_failed = true;
      node.segment_error = absl::StrFormat("TP size %d is not served (engramd --tp %s)", h.tp_size(),
                                           absl::StrJoin(c->tp_sizes, ","));
    } else if (it != c->segments.end()) {
      seg = &it->second;
      // Wait for loading to settle; the replica's own timeout bounds this (it cancels the call).
      while ((seg->state == "PENDING" || seg->state == "LOADING") && !cancelled() && !draining_) {
        cv_.wait_for(lock, std::chrono::milliseconds(100));
      }
      if (cancelled()) return absl::CancelledError("replica gave up waiting");
      for (const auto& [k, e] : c->segments) {
        if (k.first == h.tp_size()) node.tables_bytes += e.bytes;
      }
      if (seg->state != "READY") {
        node.shm_too_small = seg->too_small;
        node.segment_failed = true;
        node.segment_error = seg->error;
      }
    }
  }
  Decision d = Decide(h, node);
  Replica r;
  r.lease_id = absl::StrFormat("%016x-%d", instance_id_, next_lease_++);
  r.peer = peer;
  r.hello = h;
  r.mode = d.mode;
  r.reasons = d.reasons;
  r.attached = std::chrono::steady_clock::now();
  r.notify = std::move(notify);
  engram::v1::ServerMessage msg;
  if (d.share) {
    seg->leases++;
    r.segment_key = c->dir + "/" + seg->name;
    auto* g = msg.mutable_grant();
    g->set_segment_path(seg->path);
    g->set_segment_bytes(seg->bytes);
    *g->mutable_segment() = seg->descriptor;
    g->set_epoch(epoch_);
    g->set_lease_id(r.lease_id);
    spdlog::info("event=attach decision=shared pid={} uid={} dp_rank={} tp_rank={} segment={} lease={}", peer.pid,
                 peer.uid, h.dp_rank(), h.tp_rank(), seg->name, r.lease_id);
  } else {
    auto* f = msg.mutable_fallback();
    f->set_mode(d.mode);
    for (const auto& reason : d.reasons) *f->add_reasons() = reason;
    const std::string line = absl::StrFormat("pid %d dp %d tp %d: %s -> %s", peer.pid, h.dp_rank(), h.tp_rank(),
                                             ReasonsText(d.reasons), ModeName(d.mode));
    recent_fallbacks_.push_back(line);
    for (const auto& reason : d.reasons) ++fallbacks_by_reason_[ReasonName(reason.code())];
    while (recent_fallbacks_.size() > 32) recent_fallbacks_.pop_front();
    spdlog::warn("event=attach decision=fallback pid={} uid={} dp_rank={} tp_rank={} mode={} reasons={}", peer.pid,
                 peer.uid, h.dp_rank(), h.tp_rank(), ModeName(d.mode), ReasonsText(d.reasons));
  }
  *lease_id = r.lease_id;
  ++sessions_total_;
  replicas_[r.lease_id] = std::move(r);
  return msg;
}

bool DaemonState::AcquireTicket(const std::string& lease_id, std::function<bool()> cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  ticket_queue_.push_back(lease_id);
  while (true) {
    if (cancelled() || stopping_) {
      ticket_queue_.erase(std::remove(ticket_queue_.begin(), ticket_queue_.end(), lease_id), ticket_queue_.end());
      cv_.notify_all();
      return false;
    }
    if (tickets_free_ > 0 && !ticket_queue_.empty() && ticket_queue_.front() == lease_id) {
      ticket_queue_.pop_front();
      --tickets_free_;
      auto it = replicas_.find(lease_id);
      if (it != replicas_.end()) it->second.backend = "registering";
      cv_.notify_all();
      return true;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
}

void DaemonState::ReportRegistration(const std::string& lease_id, const engram::v1::RegisterResult& res) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end()) return;
  Replica& r = it->second;
  if (r.backend == "registering") ++tickets_free_;
  r.backend = res.backend().empty() ? (res.ok() ? "cuda" : "cpu") : res.backend();
  r.register_seconds = res.seconds();
  register_seconds_sum_ += res.seconds();
  ++register_count_;
  if (!res.ok()) {
    ++fallbacks_by_reason_["REGISTER_FAILED"];
    r.reasons.push_back(MakeReason(engram::v1::REGISTER_FAILED,
                                   absl::StrFormat("cudaHostRegister failed at chunk %d: %s (check ulimit -l / "
                                                   "LimitMEMLOCK)", res.failed_chunk(), res.error())));
    r.mode = r.hello.config().cpu_offload() == engram::v1::DISABLED ? engram::v1::DEVICE : engram::v1::PRIVATE_PINNED;
    ReleaseLeaseLocked(r);
    recent_fallbacks_.push_back(absl::StrFormat("pid %d dp %d tp %d: REGISTER_FAILED (chunk %d) -> %s", r.peer.pid,
                                                r.hello.dp_rank(), r.hello.tp_rank(), res.failed_chunk(),
                                                ModeName(r.mode)));
    while (recent_fallbacks_.size() > 32) recent_fallbacks_.pop_front();
    spdlog::warn("event=register_failed pid={} lease={} chunk={} detail=\"{}\"", r.peer.pid, lease_id,
                 res.failed_chunk(), res.error());
  }
  cv_.notify_all();
}

void DaemonState::ReleaseLeaseLocked(Replica& r) {
  if (r.segment_key.empty()) return;
  for (auto& [dir, c] : checkpoints_) {
    for (auto& [k, e] : c->segments) {
      if (dir + "/" + e.name == r.segment_key && e.leases > 0) e.leases--;
    }
  }
  r.segment_key.clear();
}

void DaemonState::Detach(const std::string& lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = replicas_.find(lease_id);
  if (it == replicas_.end()) return;
  Replica& r = it->second;
  if (r.backend == "registering") ++tickets_free_;
  ticket_queue_.erase(std::remove(ticket_queue_.begin(), ticket_queue_.end(), lease_id), ticket_queue_.end());
  ReleaseLeaseLocked(r);
  spdlog::info("event=detach pid={} lease={} attached_seconds={:.1f}", r.peer.pid, lease_id, SecondsSince(r.attached));
  replicas_.erase(it);
  cv_.notify_all();
}

engram::v1::StatusReply DaemonState::Status() {
  std::lock_guard<std::mutex> lock(mu_);
  engram::v1::StatusReply s;
  auto cap = ProbeShm(opts_.shm_dir);
  auto* shm = s.mutable_shm();
  shm->set_path(cap.ok() ? cap->path : opts_.shm_dir);
  if (cap.ok()) {
    shm->set_total_bytes(cap->total_bytes);
    shm->set_free_bytes(cap->free_bytes);
    shm->set_huge_pages(cap->huge_pages);
  } else {
    shm->set_huge_pages("missing");
  }
  uint64_t engram_bytes = 0;
  for (const auto& [dir, c] : checkpoints_) {
    for (const auto& [k, e] : c->segments) {
      auto* seg = s.add_segments();
      seg->set_name(e.name);
      seg->set_checkpoint(dir);
      seg->set_tp_rank(static_cast<int32_t>(e.tp_rank));
      seg->set_tp_size(static_cast<int32_t>(e.tp_size));
      seg->set_bytes(e.bytes);
      seg->set_state(e.state);
      seg->set_origin(e.origin);
      seg->set_load_seconds(e.load_seconds);
      seg->set_checksum_state(e.checksum_state);
      seg->set_progress(e.state == "READY" && e.checksum_state != "verifying"
                            ? 1.0
                            : e.rows_total ? static_cast<double>(e.rows_done->load()) / e.rows_total : 0.0);
      seg->set_error(e.error);
      if (e.state == "READY") engram_bytes += e.bytes;
    }
  }
  shm->set_engram_bytes(engram_bytes);
  for (const auto& [id, r] : replicas_) {
    auto* rep = s.add_replicas();
    rep->set_pid(r.peer.pid);
    rep->set_uid(r.peer.uid);
    rep->set_dp_rank(r.hello.dp_rank());
    rep->set_tp_rank(r.hello.tp_rank());
    rep->set_mode(ModeName(r.mode));
    rep->set_backend(r.backend);
    for (const auto& reason : r.reasons) *rep->add_reasons() = reason;
    rep->set_attached_seconds(SecondsSince(r.attached));
    rep->set_register_seconds(r.register_seconds);
    rep->set_lease_id(id);
  }
  for (const auto& f : recent_fallbacks_) s.add_recent_fallbacks(f);
  s.set_draining(draining_);
  s.set_epoch(epoch_);
  return s;
}

std::string DaemonState::MetricsText() {
  engram::v1::StatusReply s = Status();
  std::string out;
  auto line = [&](const std::string& name, const std::string& labels, double v) {
    absl::StrAppend(&out, name, labels.empty() ? "" : "{" + labels + "}", " ", absl::StrFormat("%.6g", v), "\n");
  };
  absl::StrAppend(&out, "# HELP engram_shm_bytes shm directory capacity.\n# TYPE engram_shm_bytes gauge\n");
  line("engram_shm_bytes", "kind=\"total\"", static_cast<double>(s.shm().total_bytes()));
  line("engram_shm_bytes", "kind=\"free\"", static_cast<double>(s.shm().free_bytes()));
  line("engram_shm_bytes", "kind=\"engram\"", static_cast<double>(s.shm().engram_bytes()));
  absl::StrAppend(&out, "# HELP engram_segment_bytes Size of each segment, by state.\n"
                        "# TYPE engram_segment_bytes gauge\n");
  std::map<std::string, int> by_state;
  for (const auto& g : s.segments()) {
    line("engram_segment_bytes", absl::StrFormat("segment=\"%s\",state=\"%s\",origin=\"%s\"", g.name(), g.state(),
                                                 g.origin()),
         static_cast<double>(g.bytes()));
    ++by_state[g.state()];
  }
  absl::StrAppend(&out, "# TYPE engram_segments gauge\n");
  for (const auto& [st, n] : by_state) line("engram_segments", "state=\"" + st + "\"", n);
  absl::StrAppend(&out, "# HELP engram_publish_gib_per_second Publish rate of each published segment.\n"
                        "# TYPE engram_publish_gib_per_second gauge\n");
  for (const auto& g : s.segments()) {
    if (g.origin() == "published" && g.state() == "READY" && g.load_seconds() > 0) {
      line("engram_publish_gib_per_second", "segment=\"" + g.name() + "\"",
           g.bytes() / 1073741824.0 / g.load_seconds());
    }
  }
  std::map<std::string, int> by_mode;
  for (const auto& r : s.replicas()) ++by_mode[r.mode()];
  absl::StrAppend(&out, "# HELP engram_replicas Attached replicas by mode.\n# TYPE engram_replicas gauge\n");
  for (const char* m : {"SHARED", "PRIVATE_PINNED", "DEVICE", "DP_SHARDED"}) line("engram_replicas", absl::StrCat("mode=\"", m, "\""), by_mode[m]);
  std::lock_guard<std::mutex> lock(mu_);
  absl::StrAppend(&out, "# HELP engram_fallbacks_total Fallback decisions since start, by reason.\n"
                        "# TYPE engram_fallbacks_total counter\n");
  for (const auto& [reason, n] : fallbacks_by_reason_) line("engram_fallbacks_total", "reason=\"" + reason + "\"", static_cast<double>(n));
  absl::StrAppend(&out, "# TYPE engram_sessions_total counter\n");
  line("engram_sessions_total", "", static_cast<double>(sessions_total_));
  absl::StrAppend(&out, "# HELP engram_register_seconds Registration time reported by replicas.\n"
                        "# TYPE engram_register_seconds summary\n");
  line("engram_register_seconds_sum", "", register_seconds_sum_);
  line("engram_register_seconds_count", "", static_cast<double>(register_count_));
  return out;
}

absl::Status DaemonState::Load(const std::string& dir, const std::vector<int64_t>& tp_sizes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (checkpoints_.count(dir)) return absl::AlreadyExistsError(absl::StrCat(dir, " is already served"));
  }
  ASSIGN_OR_RETURN(auto c, OpenCheckpoint(dir, tp_sizes.empty() ? opts_.tp_sizes : tp_sizes));
  std::lock_guard<std::mutex> lock(mu_);
  PlanSegmentsLocked(*c);
  for (auto& [key, e] : c->segments) {
    ::unlink(e.path.c_str());
    publish_queue_.push_back({dir, key});
  }
  checkpoints_[dir] = std::move(c);
  spdlog::info("event=load dir={}", dir);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status DaemonState::Unload(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = checkpoints_.find(dir);
  if (it == checkpoints_.end()) return absl::NotFoundError(absl::StrCat(dir, " is not served"));
  for (auto& [k, e] : it->second->segments) {
    (void)SetSegmentState(e.path, SegmentState::kRetired);
    ::unlink(e.path.c_str());  // replicas that map it keep their mapping
  }
  for (auto& [id, r] : replicas_) {
    if (r.segment_key.rfind(dir + "/", 0) == 0) r.segment_key.clear();
  }
  checkpoints_.erase(it);
  spdlog::info("event=unload dir={}", dir);
  cv_.notify_all();
  return absl::OkStatus();
}

void DaemonState::Drain() {
  draining_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  engram::v1::ServerMessage msg;
  msg.mutable_event()->set_kind(engram::v1::Event::DRAINING);
  msg.mutable_event()->set_detail("engramd is stopping; mapped segments stay valid");
  for (auto& [id, r] : replicas_) {
    if (r.notify) r.notify(msg);
  }
  cv_.notify_all();
  spdlog::info("event=drain replicas={}", replicas_.size());
}

absl::Status DaemonState::Reload(const Options& opts) {
  std::vector<std::string> to_load, to_unload;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& d : opts.checkpoints) {
      if (!checkpoints_.count(d)) to_load.push_back(d);
    }
    for (const auto& [d, c] : checkpoints_) {
      if (std::find(opts.checkpoints.begin(), opts.checkpoints.end(), d) == opts.checkpoints.end()) {
        to_unload.push_back(d);
      }
    }
    opts_.checkpoints = opts.checkpoints;
    opts_.tp_sizes = opts.tp_sizes;
    opts_.tickets = opts.tickets;
    ++epoch_;
  }
  for (const auto& d : to_unload) RETURN_IF_ERROR(Unload(d));
  for (const auto& d : to_load) RETURN_IF_ERROR(Load(d, opts.tp_sizes));
  spdlog::info("event=reload loaded={} unloaded={}", to_load.size(), to_unload.size());
  return absl::OkStatus();
}

}  // namespace engram::daemon
