#include "client/table/tables.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "base/worker_threads.h"
#include "client/log.h"
#include "io/shard_records.h"
#include "model/tokenizer.h"

#ifdef ENGRAM_HAVE_CUDA
#include "client/table/cuda_backend.h"
#endif

namespace engram::client {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// MADV_POPULATE_READ over the mapping from up to 16 threads, one per GiB (one thread walks 4 KiB page tables at about
// 15 GiB/s: 6 s for a 94 GiB shard; 16 threads take about 2.5 s, bench/RESULTS.md "Full scale"). Best effort: a
// kernel without MADV_POPULATE_READ leaves the pages to the registration, which faults them itself.
void PopulateForRead(uint8_t* p, size_t bytes, Env* env) {
  const int threads = static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency())));
  (void)MadviseInSlices(env, p, bytes, MADV_POPULATE_READ, threads);
}

void FillLayers(const Layout& layout, const ShardRange& shard, TableImpl* t) {
  t->col_begin_ = shard.col_begin;
  t->col_end_ = shard.col_end;
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    LayerInfo li;
    li.layer_id = layout.config().layer_ids[l];
    li.row_begin = shard.row_begin[l];
    li.row_end = shard.row_end[l];
    li.multipliers = layout.multipliers(l);
    li.primes = layout.primes(l);
    li.offsets = layout.offsets(l);
    t->layers_.push_back(std::move(li));
  }
}

}  // namespace

void TableImpl::NoteEngineChoice(const std::string& choice) const {
  if (session_ == nullptr) return;
  if (auto st = session_->ReportEngineChoice(choice); !st.ok()) {
    Log().debug("engram: event=engine_choice_not_reported detail={}", engram::LogQuoted(std::string(st.message())));
  }
}

TableImpl::~TableImpl() {
  keep_.clear();  // unregister / free device copies before the memory goes
  session_.reset();
  if (mlocked_) env_->Munlock(base_, bytes_);
  segment_.reset();
  if (private_ != nullptr) env_->Munmap(private_, bytes_);
}

absl::StatusOr<std::unique_ptr<TableImpl>> OpenSharedTable(const Grant& g, int fd, const std::string& path,
                                                           uint64_t fingerprint, const Layout& layout,
                                                           const ShardRange& shard, Env* env) {
  const std::string name = fd >= 0 ? absl::StrCat(g.segment_path, " (descriptor from engramd)") : path;
  auto seg = fd >= 0 ? SegmentReader::OpenDescriptor(fd, name, env) : SegmentReader::Open(path, env);
  if (!seg.ok()) {
    if (seg.status().code() == absl::StatusCode::kNotFound ||
        seg.status().code() == absl::StatusCode::kPermissionDenied) {
      return seg.status();
    }
    return absl::FailedPreconditionError(absl::StrCat("the granted segment is unusable: ", seg.status().message()));
  }
  const SegmentReader& r = **seg;
  if (g.segment_ino != 0 && (r.device() != g.segment_dev || r.inode() != g.segment_ino)) {
    return absl::NotFoundError(absl::StrCat(name, " is not the file engramd granted (device/inode ", r.device(), "/",
                                            r.inode(), ", granted ", g.segment_dev, "/", g.segment_ino,
                                            "): another directory under the same path?"));
  }
  if (r.state() != SegmentState::kReady || r.header().fingerprint != fingerprint || g.fingerprint != fingerprint ||
      r.file_bytes() != g.segment_bytes || g.layers.size() != static_cast<size_t>(layout.n_layers()) ||
      g.token_map.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the granted segment ", name, " disagrees with the grant or this replica's checkpoint (state ",
                     SegmentStateName(r.state()), ", fingerprint ", r.header().fingerprint, " vs ", fingerprint, ", ",
                     r.file_bytes(), " bytes vs ", g.segment_bytes, ")"));
  }
  for (size_t l = 0; l < g.layers.size(); ++l) {  // data offsets count from the start of the records
    const GrantedLayer& gl = g.layers[l];
    const uint64_t rows = static_cast<uint64_t>(gl.row_end - gl.row_begin);
    const uint64_t data_bytes = r.header().data_bytes,
                   layer_bytes = rows * static_cast<uint64_t>(layout.record_bytes());
    // Compared without adding: an offset near 2^64 must not wrap past the check.
    if (gl.row_begin != shard.row_begin[l] || gl.row_end != shard.row_end[l] || gl.data_offset > data_bytes ||
        layer_bytes > data_bytes - gl.data_offset) {
      return absl::FailedPreconditionError(
          absl::StrCat("the granted segment's layer ", l, " does not cover this shard's rows inside the file"));
    }
  }
  auto t = std::make_unique<TableImpl>(env);
  t->mode_ = Mode::kShared;
  t->attach_ = fd >= 0 ? AttachMethod::kDescriptor : AttachMethod::kPath;
  t->base_ = r.data();
  t->bytes_ = r.file_bytes() - r.header().data_offset;
  // Build this process's page tables for the mapping before the node's ticket, so that the ticketed (serialised)
  // registration only pins pages that are already mapped.
  const auto populate0 = Clock::now();
  PopulateForRead(const_cast<uint8_t*>(t->base_), t->bytes_, env);
  t->times_.populate = SecondsSince(populate0);
  for (const auto& gl : g.layers) t->records_.push_back(r.data() + gl.data_offset);
  t->layout_ = std::make_unique<Layout>(layout);
  t->map_ = std::make_unique<TokenMap>(TokenMap::FromIds(std::vector<int32_t>(g.token_map)));
  FillLayers(layout, shard, t.get());
  t->segment_ = std::move(*seg);
  return t;
}

RegistrationReport PinTable(TableImpl& t, bool cuda, size_t chunk_bytes) {
  RegistrationReport rep;
  const auto t0 = Clock::now();
#ifdef ENGRAM_HAVE_CUDA
  if (cuda) {
    rep.backend = Backend::kCuda;
    int failed = -1;
    auto reg = HostRegistration::Register(t.base(), t.bytes(), chunk_bytes, &failed);
    rep.ok = reg.ok();
    if (reg.ok()) {
      t.keep_.push_back(std::shared_ptr<HostRegistration>(std::move(*reg)));
      t.device_records_ = t.records_;
      t.backend_ = Backend::kCuda;
    } else {
      rep.error = std::string(reg.status().message());
      rep.failed_chunk = failed;
    }
  }
#else
  (void)chunk_bytes;
#endif
  if (!cuda) {
    rep.backend = Backend::kCpu;
    rep.ok = t.env_->Mlock(t.base(), t.bytes()) == 0;
    if (rep.ok) {
      t.mlocked_ = true;
      t.backend_ = Backend::kCpu;
    } else {
      rep.error = absl::StrCat("mlock of ", t.bytes(), " bytes failed: ", std::strerror(errno));
    }
  }
  rep.seconds = SecondsSince(t0);
  if (rep.ok) t.register_seconds_ = rep.seconds;
  return rep;
}

absl::StatusOr<std::unique_ptr<TableImpl>> BuildPrivateTable(const Checkpoint& ckpt, const Layout& layout,
                                                             const ShardRange& shard, bool cpu_offload, bool cuda,
                                                             int threads, size_t chunk_bytes, Env* env) {
  auto t = std::make_unique<TableImpl>(env);
  t->mode_ = cpu_offload ? Mode::kPrivatePinned : Mode::kDevice;
  t->layout_ = std::make_unique<Layout>(layout);
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(ckpt.tokenizer_path()));
  t->map_ = std::make_unique<TokenMap>(TokenMap::Build(tok));
  RETURN_IF_ERROR(t->map_->CheckAgainst(ckpt.config()));
  RETURN_IF_ERROR(ckpt.ValidateEngramTensors());
  std::vector<LayerRows> rows;
  uint64_t offset = 0;
  for (int64_t l = 0; l < layout.n_layers(); ++l) {
    rows.push_back({l, shard.row_begin[l], shard.row_end[l], offset});
    offset += static_cast<uint64_t>(shard.row_end[l] - shard.row_begin[l]) * layout.record_bytes();
  }
  const size_t bytes = std::max<uint64_t>(offset, 1);
  void* p = env->Mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes for a private table: ", std::strerror(errno)));
  }
  t->private_ = static_cast<uint8_t*>(p);
  t->base_ = t->private_;
  t->bytes_ = bytes;
  env->Madvise(p, bytes, MADV_HUGEPAGE);
  RETURN_IF_ERROR(ReadShardRecords(ckpt, rows, t->private_, threads, nullptr));
  env->Mprotect(p, bytes, PROT_READ);  // a table is read-only once built
  for (const auto& r : rows) t->records_.push_back(t->private_ + r.dst_offset);
  FillLayers(layout, shard, t.get());
#ifdef ENGRAM_HAVE_CUDA
  if (cuda) {
    const auto t0 = Clock::now();
    if (cpu_offload) {
      RegistrationReport rep = PinTable(*t, true, chunk_bytes);
      if (!rep.ok) return absl::InternalError(absl::StrCat("registering the private table failed: ", rep.error));
    } else {
      ASSIGN_OR_RETURN(auto copy, DeviceCopy::Create(t->private_, bytes));
      for (const auto& r : rows) t->device_records_.push_back(copy->data() + r.dst_offset);
      t->keep_.push_back(std::shared_ptr<DeviceCopy>(std::move(copy)));
      env->Munmap(t->private_, bytes);  // the GPU holds the only copy
      t->private_ = nullptr;
      t->base_ = nullptr;
      std::fill(t->records_.begin(), t->records_.end(), nullptr);
    }
    t->backend_ = Backend::kCuda;
    t->register_seconds_ = SecondsSince(t0);
  }
#else
  (void)cuda;
  (void)chunk_bytes;
#endif
  return t;
}

}  // namespace engram::client
