#include "client/engine/device_engine.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "client/log.h"
#include "client/tuning.h"

namespace engram::client {
namespace {

// The CPUs this process may run on (its affinity: a container's cpuset), at least 1.
int AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// The row-order gather's variant and grid are the kernels' process-wide state: set when a table's tuning names
// them (field by field: the last engine created naming a field decides it), left at the kernels' defaults otherwise.
void ApplyProcessWideLookupTuning(const Tuning& tuning) {
  std::optional<int32_t> variant, blocks;
  if (tuning.lookup_sort_variant) {
    variant = static_cast<int32_t>(std::clamp<int64_t>(*tuning.lookup_sort_variant, 0, 3));
  }
  if (tuning.lookup_sort_blocks) {
    blocks = static_cast<int32_t>(std::clamp<int64_t>(*tuning.lookup_sort_blocks, 0, 1 << 20));
  }
  if (variant || blocks) kernels::SetLookupSortShape(variant, blocks);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceEngine>> DeviceEngine::Create(const Table& table, int32_t max_tokens,
                                                                   cudaStream_t stream, bool staging) {
  if (table.backend() != Backend::kCuda) {
    return absl::FailedPreconditionError(
        "the table has the CPU backend (no usable GPU): use LookupEngine::Create, which gives the CPU engine");
  }
  if (max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  std::unique_ptr<DeviceEngine> e(new DeviceEngine());
  e->table_ = &table;
  e->stream_ = stream;
  e->max_tokens_ = max_tokens;
  ASSIGN_OR_RETURN(e->layout_, kernels::DeviceLayout::Upload(table.layout(), table.token_map()));
  std::vector<kernels::LayerTable> tables;
  for (size_t l = 0; l < table.layers().size(); ++l) {
    tables.push_back(
        {table.device_records(static_cast<int>(l)), table.layers()[l].row_begin, table.layers()[l].row_end});
  }
  e->has_staging_ = staging;
  if (staging) {
    RETURN_IF_ERROR(e->prefetcher_.Init(tables, max_tokens, static_cast<int32_t>(table.n_cols()),
                                        static_cast<int32_t>(table.head_dim())));
  }
  e->sort_bytes_ = kernels::LookupSortScratchBytes(static_cast<int64_t>(max_tokens) * table.n_cols());
  RETURN_IF_ERROR(kernels::CudaStatus(cudaMalloc(&e->sort_scratch_, e->sort_bytes_), "sort scratch"));
  const Tuning& tuning = table.tuning();
  ApplyProcessWideLookupTuning(tuning);
  if (tuning.lookup_sort_min_items) {  // a fixed row-order threshold for every launch: no calibration of it
    for (auto& by_background : e->sort_min_items_) {
      for (int64_t& from : by_background) from = *tuning.lookup_sort_min_items;
    }
    // The side-stream prefetch and the host gather's UVA share run a few blocks, a grid the calibration does not
    // time: they take the threshold only when it is fixed, else the process-wide one (the measured default).
    e->prefetcher_.set_sort_min_items(*tuning.lookup_sort_min_items);
  }
  e->path_ = PathFromTuning(tuning);
  e->path_table_ = PathTable(tuning);
  e->host_options_.threads = DefaultGatherThreads(AllowedCpus());
  // The gather threads and their CPUs (host_gather_threads, host_gather_cpus: a list such as "8-15").
  if (tuning.host_gather_threads.value_or(0) > 0) {
    e->host_options_.threads = static_cast<int>(std::min<int64_t>(*tuning.host_gather_threads, 1024));
  }
  if (!tuning.host_gather_cpus.empty()) {
    ASSIGN_OR_RETURN(e->host_options_.cpus, ParseCpuList(tuning.host_gather_cpus));
  }
  // The UVA share of a split batch (the measured default, client/tuning.h; the calibration may replace it) and the
  // gather loop's knobs.
  e->host_options_.uva_share =
      std::clamp(tuning.host_gather_uva_share.value_or(tuning_default::kHostGatherUvaShare), 0.0, 1.0);
  e->host_options_ = ResolveHostGatherOptions(e->host_options_, tuning);
  RETURN_IF_ERROR(e->Calibrate(tuning));
  const bool host_records = table.layers().empty() || table.records(0) != nullptr;
  std::string table_text;
  for (const auto& p : e->path_table_)
    table_text += absl::StrCat(table_text.empty() ? "" : ",", p.items, ":",
                               p.threshold ? "host_from"
                               : p.host    ? "host"
                                           : "uva");
  // The knobs set by the program or the environment (none: every choice is the default or the calibration's).
  const std::string set = TuningText(tuning);
  Log().info(
      "engram: event=lookup_engine backend=cuda lookup_path={} path_table={} host_gather_threads={} "
      "host_gather_uva_share={:.2f} host_records={} tuning={} (uva under CUDA graph capture and for device ids)",
      LookupPathName(e->path_), table_text, e->host_options_.threads, e->host_options_.uva_share, host_records,
      set.empty() ? "none" : set);
  e->choice_ =
      absl::StrCat("backend=cuda lookup_path=", LookupPathName(e->path_), " path_table=", table_text,
                   " host_gather_threads=", e->host_options_.threads,
                   absl::StrFormat(" host_gather_uva_share=%.2f", e->host_options_.uva_share),
                   " tuning=", set.empty() ? "none" : set, e->calibration_.empty() ? "" : " ", e->calibration_);
  return e;
}

absl::StatusOr<std::unique_ptr<HostGather>> DeviceEngine::MakeHostGather(int threads) const {
  std::vector<HostLayer> layers;
  std::vector<uint16_t*> out;
  for (size_t l = 0; l < table_->layers().size(); ++l) {
    const auto& li = table_->layers()[l];
    const int li32 = static_cast<int>(l);
    layers.push_back({table_->records(li32), li.row_begin, li.row_end, table_->device_records(li32)});
    out.push_back(prefetcher_.staging(li32));
  }
  HostGatherOptions o = host_options_;
  if (threads > 0) o.threads = threads;
  o.uva_sort_min_items = prefetcher_.sort_min_items();  // the few-block grids' threshold, as the prefetch's
  return HostGather::Create(std::move(layers), std::move(out), max_tokens_, static_cast<int32_t>(table_->n_cols()),
                            static_cast<int32_t>(table_->head_dim()), o);
}

absl::Status DeviceEngine::Calibrate(const Tuning& tuning) {
  if (table_->layers().empty()) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  CalibrationTarget t;
  for (size_t l = 0; l < table_->layers().size(); ++l) {
    const int li = static_cast<int>(l);
    t.layers.push_back({table_->device_records(li), table_->layers()[l].row_begin, table_->layers()[l].row_end,
                        has_staging_ ? prefetcher_.staging(li) : nullptr});
  }
  t.head_dim = static_cast<int32_t>(table_->head_dim());
  t.n_cols = static_cast<int32_t>(table_->n_cols());
  t.max_tokens = max_tokens_;
  t.sort_scratch = sort_scratch_;
  t.sort_bytes = sort_bytes_;
  std::string row_order = "fixed", decode = "default", host = "built-in";
  if (!tuning.lookup_sort_min_items) {
    ASSIGN_OR_RETURN(const RowOrderChoice ro, CalibrateRowOrder(t, stream_));
    for (int p = 0; p < 2; ++p) {
      for (int b = 0; b < 2; ++b) sort_min_items_[p][b] = ro.from_items[p][b];
    }
    row_order = ro.text;
  }
  const bool calibrate = tuning.engine_calibrate.value_or(true);
  if (calibrate) {
    ASSIGN_OR_RETURN(decode_, CalibrateDecode(t));
    decode = decode_.text.empty() ? "default" : decode_.text;
  }
  // The host-gather plan: only where the automatic choice could take that path, with nothing fixed by hand.
  const bool host_records = table_->records(0) != nullptr && table_->device_records(0) != nullptr;
  if (calibrate && has_staging_ && host_records && path_ == LookupPath::kAuto && tuning.lookup_path_table.empty() &&
      !tuning.host_gather_min_items && !tuning.host_gather_uva_share) {
    const std::vector<int> threads =
        HostGatherCalibrationThreads(AllowedCpus(), host_options_.threads, tuning.host_gather_threads.has_value());
    ASSIGN_OR_RETURN(const HostPlan plan, CalibrateHostGather(
                                              t, threads, HostGatherCalibrationShares(),
                                              [this](int th) { return MakeHostGather(th); }, stream_, &host_));
    if (!plan.points.empty()) {
      host_options_.threads = plan.threads;
      path_table_.clear();
      path_table_.push_back({1536, false});  // decode sizes stay on the UVA kernels (graphs capture them)
      for (const HostPoint& p : plan.points) path_table_.push_back({p.items, p.host, false, p.share});
      host = plan.text;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Log().info(
      "engram: event=lookup_calibrated row_order_from_items={} decode_shape={} host_gather={} table_rows={} "
      "seconds={:.3f}",
      row_order, decode, host, table_->layers()[0].row_end - table_->layers()[0].row_begin, seconds);
  calibration_ = absl::StrFormat("row_order_from_items=%s decode_shape=%s host_gather=%s calibration_seconds=%.3f",
                                 row_order, decode, host, seconds);
  return absl::OkStatus();
}

void DeviceEngine::NotePath(LookupPath path, int64_t items) {
  last_path_ = path;
  const unsigned bit = path == LookupPath::kHostGather ? 2u : 1u;
  if ((paths_logged_ & bit) != 0) return;
  paths_logged_ |= bit;  // the first batch of each path is logged, not every batch
  Log().info("engram: event=lookup_path_used lookup_path={} items_per_layer={}", LookupPathName(path), items);
}

bool DeviceEngine::HostWins(int64_t items) const {
  if (path_table_.size() == 1 && path_table_[0].threshold) return items >= path_table_[0].items;
  const PathPoint* p = NearestPoint(path_table_, items);
  return p != nullptr && p->host;
}

double DeviceEngine::ShareAt(int64_t items) const {
  const PathPoint* p = NearestPoint(path_table_, items);
  return p != nullptr ? p->share : -1;
}

absl::Status DeviceEngine::SetLookupPath(LookupPath path) {
  if (path == LookupPath::kHostGather && !table_->layers().empty() && table_->records(0) == nullptr) {
    return absl::FailedPreconditionError("the host-gather path needs host records (a DEVICE table has none)");
  }
  path_ = path;
  Log().info("engram: event=lookup_path lookup_path={}", LookupPathName(path));
  return absl::OkStatus();
}

DeviceEngine::~DeviceEngine() {
  host_.reset();
  if (sort_scratch_ != nullptr) cudaFree(sort_scratch_);
  if (d_ids_ != nullptr) cudaFree(d_ids_);
}

absl::Status DeviceEngine::Hash(const int32_t* tokens, const int64_t* positions, const int32_t* qsl,
                                const int32_t* lookback, const uint8_t* lookback_dead, const uint8_t* dead,
                                int32_t num_tokens, int32_t num_requests, int32_t* out) {
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens; the engine was sized for ", max_tokens_));
  }
  if (lookback_dead != nullptr && lookback == nullptr) {
    return absl::InvalidArgumentError("hash: lookback dead mask given without lookback ids");
  }
  kernels::HashArgs a{tokens, positions, qsl, lookback, dead, num_tokens, num_requests, out, nullptr, lookback_dead};
  return kernels::CudaStatus(kernels::LaunchHash(layout_->view(), a, stream_), "hash kernel");
}

absl::Status DeviceEngine::Lookup(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                                  bool packed) {
  return LookupInto(l, ids, num_tokens, ids_stride, out, packed, LookupWindow{});
}

absl::Status DeviceEngine::LookupInto(int l, const int32_t* ids, int32_t num_tokens, int64_t ids_stride, void* out,
                                      bool packed, const LookupWindow& window) {
  ASSIGN_OR_RETURN(const LookupWindow w,
                   CheckWindow(*table_, l, ids, num_tokens, max_tokens_, ids_stride, out, packed, window));
  kernels::LookupArgs a;
  a.records = table_->device_records(l);
  a.row_begin = table_->layers()[static_cast<size_t>(l)].row_begin;
  a.row_end = table_->layers()[static_cast<size_t>(l)].row_end;
  a.head_dim = static_cast<int32_t>(table_->head_dim());
  if (w.ids_int64) {
    a.ids64 = ids == nullptr ? nullptr : reinterpret_cast<const int64_t*>(ids) + w.col_begin;
  } else {
    a.ids = ids == nullptr ? nullptr : ids + w.col_begin;
  }
  a.num_tokens = num_tokens;
  a.num_cols = w.num_cols;
  a.ids_stride = ids_stride;
  a.out = out;
  a.out_token_stride = w.out_token_stride;
  a.packed = packed;
  // A background lookup (a side stream beside the model's kernels) takes half of the GPU at most.
  if (w.background) a.max_blocks = std::max(1, kernels::DeviceSmCount() / 2);
  a.sort_scratch = sort_scratch_;
  a.sort_scratch_bytes = sort_bytes_;
  a.sort_min_items = sort_min_items_[packed][w.background];
  if (!w.background) decode_.For(packed, num_tokens, &a.plain_rows, &a.plain_block_warps);
  return kernels::CudaStatus(kernels::LaunchLookup(a, stream_), "lookup kernel");
}

absl::Status DeviceEngine::SetStream(void* stream) {
  stream_ = static_cast<cudaStream_t>(stream);
  return absl::OkStatus();
}

absl::Status DeviceEngine::Gate(const GateInputs& g) {
  kernels::GateArgs a{g.hidden, g.kv, g.q_weight, g.k_weight, g.mask, g.out, g.num_tokens, g.hc_mult, g.dim, g.eps};
  return kernels::CudaStatus(kernels::LaunchGate(a, stream_), "gate kernel");
}

absl::Status DeviceEngine::Prefetch(const int32_t* hash_ids, int32_t num_tokens) {
  if (!has_staging_) {
    return absl::FailedPreconditionError("this engine was created without staging buffers: it looks up only");
  }
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens; the engine was sized for ", max_tokens_));
  }
  if (hash_ids == nullptr && num_tokens > 0) return absl::InvalidArgumentError("prefetch: null hash ids");
  const int32_t L = static_cast<int32_t>(table_->layers().size());
  const int64_t C = table_->n_cols(), n_ids = static_cast<int64_t>(num_tokens) * L * C;
  cudaPointerAttributes attr{};
  if (hash_ids != nullptr) {
    RETURN_IF_ERROR(kernels::CudaStatus(cudaPointerGetAttributes(&attr, hash_ids), "hash id pointer"));
  }
  const bool ids_on_device =
      hash_ids == nullptr || attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamIsCapturing(stream_, &capture), "capture status"));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  const bool host_records = L > 0 && table_->records(0) != nullptr;
  LookupPath path = path_;
  if (path == LookupPath::kAuto) {
    path = !capturing && !ids_on_device && host_records && num_tokens > 0 && HostWins(num_tokens * C)
               ? LookupPath::kHostGather
               : LookupPath::kUva;
  }
  if (path == LookupPath::kHostGather && capturing) {
    return absl::FailedPreconditionError(
        "the host-gather path runs outside CUDA graph capture: use LookupPath::kUva (or kAuto) for captured steps");
  }
  // Switching paths: the new one's writes into the staging buffers come after the old one's.
  if (path != last_path_ && last_path_ != LookupPath::kAuto) {
    for (int32_t l = 0; l < L; ++l) RETURN_IF_ERROR(Wait(l));
  }
  if (path == LookupPath::kHostGather) {
    if (!host_records) return absl::FailedPreconditionError("the host-gather path needs host records");
    if (host_ == nullptr) {
      ASSIGN_OR_RETURN(host_, MakeHostGather(0));
    }
    const double share = ShareAt(num_tokens * C);
    host_->set_uva_share(share >= 0 ? share : host_options_.uva_share);
    const int32_t* ids = hash_ids;
    if (ids_on_device && n_ids > 0) {  // forced host path with device ids: bring them over (synchronises)
      h_ids_.resize(static_cast<size_t>(n_ids));
      RETURN_IF_ERROR(kernels::CudaStatus(
          cudaMemcpyAsync(h_ids_.data(), hash_ids, static_cast<size_t>(n_ids) * 4, cudaMemcpyDeviceToHost, stream_),
          "hash ids to host"));
      RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamSynchronize(stream_), "hash ids to host"));
      ids = h_ids_.data();
    }
    NotePath(path, num_tokens * C);
    return host_->Prefetch(ids, num_tokens, L * C, stream_);
  }
  const int32_t* ids = hash_ids;
  if (!ids_on_device && n_ids > 0) {  // host ids on the UVA path: copy them to the device first
    if (d_ids_ == nullptr) {
      RETURN_IF_ERROR(kernels::CudaStatus(
          cudaMalloc(reinterpret_cast<void**>(&d_ids_), static_cast<size_t>(max_tokens_) * L * C * 4),
          "device hash ids"));
    }
    // The previous prefetch's side stream may still read d_ids_ (its caller may have waited on another stream):
    // the copy waits for its last layer.
    if (L > 0) {
      RETURN_IF_ERROR(
          kernels::CudaStatus(cudaStreamWaitEvent(stream_, prefetcher_.layer_event(L - 1), 0), "previous prefetch"));
    }
    RETURN_IF_ERROR(kernels::CudaStatus(
        cudaMemcpyAsync(d_ids_, hash_ids, static_cast<size_t>(n_ids) * 4, cudaMemcpyHostToDevice, stream_),
        "hash ids to device"));
    ids = d_ids_;
  }
  NotePath(path, num_tokens * C);
  return prefetcher_.Prefetch(ids, num_tokens, stream_);
}

absl::Status DeviceEngine::Wait(int l) {
  if (!has_staging_) {
    return absl::FailedPreconditionError("this engine was created without staging buffers: it looks up only");
  }
  if (last_path_ == LookupPath::kHostGather) return host_->Wait(l, stream_);
  return prefetcher_.Wait(l, stream_);
}

}  // namespace engram::client
