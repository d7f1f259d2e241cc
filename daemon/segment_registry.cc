// SegmentRegistry's catalogue (daemon/segment_registry.h): the checkpoints it opens, their planned segments, the
// start (adopting READY segments, queueing the rest) and the offers made to hellos. Load, Unload and Reconfigure are
// in segment_reconfigure.cc, the copies for status in segment_status.cc, the publish queue in publish_queue.cc, the
// shm directory's scan and adoption in segment_adoption.cc.
#include "daemon/segment_registry.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "daemon/options.h"
#include "daemon/publisher.h"
#include "daemon/segment_files.h"
#include "model/tokenizer.h"
#include "shm/segment.h"
#include "spdlog/spdlog.h"

namespace engram::daemon {

SegmentRegistry::SegmentRegistry(std::string shm_dir, int threads, uint64_t instance_id, Env* env,
                                 PublishTuning publish_tuning)
    : shm_dir_(std::move(shm_dir)),
      threads_(std::max(1, threads)),
      instance_id_(instance_id),
      env_(env),
      publish_tuning_(publish_tuning),
      shm_(absl::UnknownError("not probed yet")) {}

SegmentRegistry::~SegmentRegistry() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

absl::StatusOr<std::unique_ptr<SegmentRegistry::ServedCheckpoint>> SegmentRegistry::OpenCheckpoint(
    const std::string& dir, const std::vector<int64_t>& tps) const {
  auto c = std::make_unique<ServedCheckpoint>();
  c->dir = dir;
  if (tps.empty()) return absl::InvalidArgumentError(absl::StrCat(dir, ": no TP size to serve"));
  c->tp_sizes = tps;
  ASSIGN_OR_RETURN(c->ckpt, Checkpoint::Open(dir));
  c->fingerprint = c->ckpt->Fingerprint();
  if (c->ckpt->config().kind == ModelKind::kPle) {
    spdlog::warn("event=checkpoint_ple dir={} arch={}: PLE tables are never shared (MODEL_NOT_SHAREABLE)",
                 engram::LogValue(dir), c->ckpt->config().architecture);
    return c;
  }
  RETURN_IF_ERROR(c->ckpt->ValidateEngramTensors());
  ASSIGN_OR_RETURN(Layout layout, Layout::Build(c->ckpt->config()));
  c->layout = std::make_shared<const Layout>(std::move(layout));
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(c->ckpt->tokenizer_path()));
  c->map = std::make_shared<const TokenMap>(TokenMap::Build(tok));
  if (auto st = c->map->CheckAgainst(c->ckpt->config()); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat(dir, ": ", st.message()));
  }
  for (int64_t tp : tps) {
    if (auto s = c->layout->Shard(tp, 0); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": ", s.status().message()));
    }
  }
  return c;
}

void SegmentRegistry::PlanSegmentsLocked(ServedCheckpoint& c) const {
  for (int64_t tp : c.tp_sizes) PlanShardsLocked(c, tp);
}

void SegmentRegistry::PlanShardsLocked(ServedCheckpoint& c, int64_t tp) const {
  if (!c.layout) return;
  for (int64_t r = 0; r < tp; ++r) {
    Segment e;
    e.tp_size = tp;
    e.tp_rank = r;
    e.name = SegmentName(c.fingerprint, tp, r);
    e.path = shm_dir_ + "/" + e.name;
    auto shard = c.layout->Shard(tp, r);
    auto desc = MakeDescriptor(*c.ckpt, *c.layout, *c.map, *shard, c.fingerprint);
    for (auto& l : *desc.mutable_layers()) l.set_checksum(~uint64_t{0});
    e.bytes = SegmentFileBytes(desc.ByteSizeLong(), static_cast<uint64_t>(shard->bytes(c.layout->record_bytes())));
    e.rows_total = static_cast<uint64_t>(shard->rows());
    e.generation = next_generation_++;
    c.segments[{tp, r}] = e;
  }
}

absl::Status SegmentRegistry::Start(const std::vector<std::string>& checkpoints, const std::vector<int64_t>& tp_sizes,
                                    bool lock_shm_dir) {
  std::unique_lock<std::mutex> lock(mu_);
  shm_ = ProbeShm(shm_dir_, env_);
  for (const auto& given : checkpoints) {
    const std::string dir = CanonicalCheckpointPath(given);
    if (checkpoints_.count(dir)) continue;  // the same checkpoint named twice
    ASSIGN_OR_RETURN(auto c, OpenCheckpoint(dir, tp_sizes));
    for (const auto& [other, oc] : checkpoints_) {
      if (oc->fingerprint == c->fingerprint) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s and %s are the same checkpoint (fingerprint %016x): serve it once", other, dir, c->fingerprint));
      }
    }
    PlanSegmentsLocked(*c);
    c->serial = next_serial_++;
    checkpoints_[dir] = std::move(c);
  }
  if (lock_shm_dir && shm_.ok()) {
    ASSIGN_OR_RETURN(shm_lock_, ShmDirLock::Acquire(shm_dir_));
  }
  if (!shm_.ok()) {
    spdlog::error("event=shm_missing dir={} detail={}: replicas will fall back (SHM_MISSING)",
                  engram::LogValue(shm_dir_), engram::LogQuoted(std::string(shm_.status().message())));
    for (auto& [dir, c] : checkpoints_) {
      for (auto& [key, e] : c->segments) {
        e.state = ServingState::kFailed;
        e.error = std::string(shm_.status().message());
      }
    }
    // A later load or SIGHUP queues segments: the publish loop probes the directory again and fails them cleanly.
    workers_.emplace_back([this] { PublishLoop(); });
    return absl::OkStatus();
  }
  uint64_t planned = 0;
  for (const auto& [dir, c] : checkpoints_) {
    for (const auto& [key, e] : c->segments) planned += e.bytes;
  }
  if (auto why = ShmPagesWarning(*shm_, planned)) {
    spdlog::warn("event=shm_small_pages dir={} bytes={} detail={}", engram::LogValue(shm_dir_), planned,
                 engram::LogQuoted(*why));
  }
  ScanShmDirLocked();
  for (auto& [dir, c] : checkpoints_) {
    for (auto& [key, e] : c->segments) {
      auto ours = OursOrClear(e.path, env_);
      if (!ours.ok()) {
        e.state = ServingState::kFailed;
        e.error = std::string(ours.status().message());
        continue;
      }
      auto h = *ours ? ReadOwnedSegmentHeader(e.path, ::geteuid(), env_)
                     : absl::StatusOr<SegmentHeader>(absl::NotFoundError("no segment"));
      if (h.ok() && h->state == static_cast<uint32_t>(SegmentState::kReady) && h->fingerprint == c->fingerprint &&
          h->total_bytes == e.bytes) {
        if (const std::string why = SizeProblem(e.path, e.bytes, env_); !why.empty()) {
          spdlog::warn("event=segment_debris path={} detail={}: removed, republishing", engram::LogValue(e.path),
                       engram::LogQuoted(why));
          env_->Unlink(e.path.c_str());
          publish_queue_.push_back({dir, key});
          continue;
        }
        if (auto desc = ReadDescriptor(e.path, env_)) {
          e.descriptor = std::move(desc);
          e.file = FileIdentityOf(e.path, env_);
          e.state = ServingState::kReady;
          e.origin = SegmentOrigin::kAdopted;
          e.load_seconds = h->load_seconds;
          e.checksum = ChecksumState::kVerifying;
          spdlog::info("event=segment_adopted path={} bytes={} load_seconds={:.2f}", engram::LogValue(e.path), e.bytes,
                       e.load_seconds);
          workers_.emplace_back([this, d = dir, k = key] { VerifyAdopted(d, k); });
          continue;
        }
      }
      if (h.ok()) env_->Unlink(e.path.c_str());  // stale: wrong size or fingerprint
      publish_queue_.push_back({dir, key});
    }
  }
  workers_.emplace_back([this] { PublishLoop(); });
  return absl::OkStatus();
}

SegmentRegistry::Segment* SegmentRegistry::FindLocked(const std::string& dir, Key key, uint64_t serial,
                                                      uint64_t generation) {
  auto it = checkpoints_.find(dir);
  if (it == checkpoints_.end() || (serial != 0 && it->second->serial != serial)) return nullptr;
  auto s = it->second->segments.find(key);
  if (s == it->second->segments.end()) return nullptr;
  return generation != 0 && s->second.generation != generation ? nullptr : &s->second;
}

absl::StatusOr<ShardOffer> SegmentRegistry::Offer(const engram::v1::Hello& h, const std::function<bool()>& cancelled,
                                                  const std::function<bool()>& give_up) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{h.tp_size(), h.tp_rank()};
  while (true) {
    ShardOffer offer;
    NodeView& node = offer.node;
    node.shm_path = shm_dir_;
    node.shm_exists = shm_.ok();
    if (shm_.ok()) node.shm_free_bytes = shm_->free_bytes;
    const ServedCheckpoint* c = nullptr;
    for (const auto& [dir, entry] : checkpoints_) {
      if (entry->fingerprint == h.fingerprint()) c = entry.get();
    }
    node.checkpoint_served = c != nullptr;
    if (c == nullptr) return offer;
    offer.checkpoint = c->dir;
    node.model_shareable = c->layout != nullptr;
    auto it = c->segments.find(key);
    if (it == c->segments.end()) {
      if (node.model_shareable) {
        node.segment_failed = true;
        node.segment_error =
            absl::StrFormat("TP size %d is not served (engramd --tp %s)", h.tp_size(), absl::StrJoin(c->tp_sizes, ","));
      }
      return offer;
    }
    const Segment& seg = it->second;
    // Wait for loading to settle; the replica's own timeout bounds this (it cancels the call). The entry is
    // looked up again after every wait: an Unload may have removed it meanwhile.
    if (Unsettled(seg.state) && !cancelled() && !give_up()) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      continue;
    }
    if (cancelled()) return absl::CancelledError("replica gave up waiting");
    for (const auto& [k, e] : c->segments) {
      if (k.first == h.tp_size()) node.tables_bytes += e.bytes;
    }
    const std::string size_problem =
        seg.state == ServingState::kReady && seg.descriptor ? SizeProblem(seg.path, seg.bytes, env_, seg.file) : "";
    if (seg.state == ServingState::kReady && seg.descriptor && size_problem.empty()) {
      offer.ready = true;
      offer.segment_name = seg.name;
      offer.segment_path = seg.path;
      offer.segment_bytes = seg.bytes;
      offer.descriptor = seg.descriptor;
      offer.file = seg.file;
    } else {
      node.shm_too_small = seg.too_small;
      node.segment_failed = true;
      node.segment_error = size_problem.empty() ? seg.error : size_problem;
    }
    return offer;
  }
}

}  // namespace engram::daemon
