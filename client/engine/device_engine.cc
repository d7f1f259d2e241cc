#include "client/engine/device_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/environment.h"
#include "client/log.h"

namespace engram::client {
namespace {

// kAuto's choice, measured by bench_kernels on the H200 (bench/RESULTS.md, 2026-11-30): per batch size (items per
// layer, random rows of a 16 GiB table, fresh ids per batch), whether the host-gather path (the engine's
// configuration: every row, a share of the tokens on the UVA row-order kernel) beat the UVA path. A batch takes
// the choice of the nearest measured size (on a log scale).
// 1536 items (64 decode tokens x 24 columns) stays on UVA: 14 us in a graph, below the host path's ~90 us fixed cost.
constexpr PathPoint kDefaultPathTable[] = {
    {1536, false}, {6144, true}, {24576, true}, {196608, true}, {1048560, false}};

// ENGRAM_HOST_GATHER_MIN_ITEMS=N: host gather from N items (a plain threshold, a single point marked `threshold`);
// else the table bench_kernels writes (ENGRAM_LOOKUP_PATH_TABLE: lines "ITEMS host|uva"); else the measured default.
std::vector<PathPoint> PathTable(const ClientEnvironment& env) {
  if (env.host_gather_min_items.value_or(0) > 0) return {{*env.host_gather_min_items, true, true}};
  if (!env.lookup_path_table.empty()) {
    std::vector<PathPoint> table;
    if (FILE* f = std::fopen(env.lookup_path_table.c_str(), "r")) {
      long long n = 0;
      char what[16] = {};
      while (std::fscanf(f, "%lld %15s", &n, what) == 2) {
        if (n > 0) table.push_back({n, std::strcmp(what, "host") == 0});
      }
      std::fclose(f);
    }
    if (!table.empty()) return table;
  }
  return std::vector<PathPoint>(std::begin(kDefaultPathTable), std::end(kDefaultPathTable));
}

LookupPath PathFromEnv(const ClientEnvironment& env) {
  if (env.lookup_path == "uva") return LookupPath::kUva;
  if (env.lookup_path == "host" || env.lookup_path == "host_gather") return LookupPath::kHostGather;
  return LookupPath::kAuto;
}

// The UVA gather's tuning from the environment, applied once per process (before the first engine's launches).
void ApplyLookupTuningFromEnvironment(const ClientEnvironment& env) {
  static std::once_flag once;
  std::call_once(once, [&env] {
    kernels::LookupTuning t = kernels::GetLookupTuning();
    if (env.lookup_sort_min_items) t.sort_min_items = *env.lookup_sort_min_items;
    if (env.lookup_sort_variant)
      t.sort_variant = static_cast<int32_t>(std::clamp<int64_t>(*env.lookup_sort_variant, 0, 3));
    if (env.lookup_sort_blocks)
      t.sort_blocks = static_cast<int32_t>(std::clamp<int64_t>(*env.lookup_sort_blocks, 0, 1 << 20));
    kernels::SetLookupTuning(t);
  });
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
  const ClientEnvironment& env = Environment();
  ApplyLookupTuningFromEnvironment(env);
  e->path_ = PathFromEnv(env);
  e->path_table_ = PathTable(env);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  e->host_options_.threads = DefaultGatherThreads(cores);
  // The gather threads and their CPUs: ENGRAM_HOST_GATHER_THREADS=N, ENGRAM_HOST_GATHER_CPUS=LIST (e.g. "8-15").
  if (env.host_gather_threads.value_or(0) > 0) {
    e->host_options_.threads = static_cast<int>(std::min<int64_t>(*env.host_gather_threads, 1024));
  }
  if (!env.host_gather_cpus.empty()) {
    ASSIGN_OR_RETURN(e->host_options_.cpus, ParseCpuList(env.host_gather_cpus));
  }
  // De-duplication and the UVA share of a split batch: the measured defaults (host_gather.h, bench/RESULTS.md);
  // ENGRAM_HOST_GATHER_DEDUP=0|1 and ENGRAM_HOST_GATHER_UVA_SHARE=0..1 override them.
  e->host_options_.dedup = env.host_gather_dedup.value_or(kEngineHostGatherDedup);
  e->host_options_.uva_share = std::clamp(env.host_gather_uva_share.value_or(kEngineHostGatherUvaShare), 0.0, 1.0);
  if (!env.lookup_sort_min_items) RETURN_IF_ERROR(e->Calibrate());
  const bool host_records = table.layers().empty() || table.records(0) != nullptr;
  std::string table_text;
  for (const auto& p : e->path_table_)
    table_text += absl::StrCat(table_text.empty() ? "" : ",", p.items, ":",
                               p.threshold ? "host_from"
                               : p.host    ? "host"
                                           : "uva");
  Log().info(
      "engram: event=lookup_engine backend=cuda lookup_path={} path_table={} host_gather_threads={} "
      "host_gather_dedup={} host_gather_uva_share={:.2f} host_records={} (uva under CUDA graph capture and for device "
      "ids)",
      LookupPathName(e->path_), table_text, e->host_options_.threads, e->host_options_.dedup,
      e->host_options_.uva_share, host_records);
  return e;
}

// Whether the row-order gather pays depends on the table in hand: on a large host table address translation
// bounds a random gather and walking it in row order wins from some batch size on; on a small one (or in HBM) the
// sort is pure cost (a 512 MiB table: 0.35-0.8 of vLLM's plain Triton kernel at 1024 tokens with the sort, measured
// on an H200). So each engine times both on its own table, for each output format and grid, at a few batch sizes
// (fresh random rows each time), and sorts from the smallest size from which the row order won at every larger
// measured size. A few milliseconds at creation; ENGRAM_LOOKUP_SORT_MIN_ITEMS fixes the threshold instead.
absl::Status DeviceEngine::Calibrate() {
  if (table_->layers().empty()) return absl::OkStatus();
  const auto& li = table_->layers()[0];
  const int64_t rows = li.row_end - li.row_begin, C = table_->n_cols();
  const int64_t cap = static_cast<int64_t>(max_tokens_) * C;
  std::vector<int64_t> sizes;
  for (int64_t n : {int64_t{6144}, int64_t{24576}, int64_t{98304}, int64_t{196608}}) {
    if (n <= cap) sizes.push_back(n);
  }
  if (rows <= 0 || sizes.empty()) return absl::OkStatus();
  constexpr int kReps = 3;                // timed rounds after one warm-up round
  constexpr int kSets = 2 * (kReps + 1);  // a fresh id set for every launch: no row is in a cache from before
  const int64_t most = sizes.back();
  void* d_out = nullptr;  // room for the largest batch in either format, freed after
  RETURN_IF_ERROR(kernels::CudaStatus(cudaMalloc(&d_out, static_cast<size_t>(most) * table_->head_dim() * 2),
                                      "calibration output"));
  int32_t* d_ids = nullptr;
  RETURN_IF_ERROR(kernels::CudaStatus(
      cudaMalloc(reinterpret_cast<void**>(&d_ids), static_cast<size_t>(most) * kSets * 4), "calibration ids"));
  cudaEvent_t ev[2] = {nullptr, nullptr};
  absl::Status st = kernels::CudaStatus(cudaEventCreate(&ev[0]), "calibration event");
  if (st.ok()) st = kernels::CudaStatus(cudaEventCreate(&ev[1]), "calibration event");
  if (st.ok()) {
    std::vector<int32_t> ids(static_cast<size_t>(most) * kSets);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (auto& id : ids) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      id = static_cast<int32_t>(li.row_begin + static_cast<int64_t>(x % static_cast<uint64_t>(rows)));
    }
    st = kernels::CudaStatus(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "calibration ids");
  }
  // One timed launch (ms): `items` ids of set `set` as items / C tokens, into staging(0) (room for any format).
  auto time_one = [&](int64_t items, int set, bool packed, bool background, bool sorted, float* ms) -> absl::Status {
    kernels::LookupArgs a;
    a.records = table_->device_records(0);
    a.row_begin = li.row_begin;
    a.row_end = li.row_end;
    a.head_dim = static_cast<int32_t>(table_->head_dim());
    a.ids = d_ids + static_cast<int64_t>(set) * most;
    a.num_tokens = static_cast<int32_t>(items / C);
    a.num_cols = static_cast<int32_t>(C);
    a.ids_stride = C;
    a.out = d_out;
    a.packed = packed;
    if (background) a.max_blocks = std::max(1, kernels::DeviceSmCount() / 2);
    a.sort_scratch = sort_scratch_;
    a.sort_scratch_bytes = sort_bytes_;
    a.sort_min_items = sorted ? 0 : std::numeric_limits<int64_t>::max();
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev[0], stream_), "calibration event"));
    RETURN_IF_ERROR(kernels::CudaStatus(kernels::LaunchLookup(a, stream_), "calibration lookup"));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(ev[1], stream_), "calibration event"));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventSynchronize(ev[1]), "calibration lookup"));
    return kernels::CudaStatus(cudaEventElapsedTime(ms, ev[0], ev[1]), "calibration timing");
  };
  std::string text;
  for (int packed = 0; packed < 2 && st.ok(); ++packed) {
    for (int background = 0; background < 2 && st.ok(); ++background) {
      int64_t threshold = std::numeric_limits<int64_t>::max();
      for (auto it = sizes.rbegin(); it != sizes.rend() && st.ok(); ++it) {
        float best[2] = {1e30f, 1e30f};  // [sorted]: the best of kSets fresh batches
        for (int rep = 0; rep < kReps + 1 && st.ok(); ++rep) {
          for (int k = 0; k < 2 && st.ok(); ++k) {
            const int sorted = (rep + k) % 2;  // alternate which goes first
            float ms = 0;
            st = time_one(*it, 2 * rep + k, packed != 0, background != 0, sorted != 0, &ms);
            if (rep > 0) best[sorted] = std::min(best[sorted], ms);  // the first round warms up
          }
        }
        if (!st.ok() || best[1] >= best[0]) break;  // the row order lost here: not from any smaller size either
        threshold = *it;
      }
      sort_min_items_[packed][background] = threshold;
      absl::StrAppend(
          &text, text.empty() ? "" : ",", packed ? "packed" : "bf16", background ? "_bg" : "", ":",
          threshold == std::numeric_limits<int64_t>::max() ? std::string("never") : absl::StrCat(threshold));
    }
  }
  for (cudaEvent_t e : ev) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  cudaFree(d_ids);
  cudaFree(d_out);
  if (!st.ok()) return st;
  Log().info("engram: event=lookup_calibrated row_order_from_items={} table_rows={}", text, rows);
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
  const PathPoint* best = nullptr;
  double best_d = 0;
  for (const auto& p : path_table_) {
    const double d = std::fabs(std::log(static_cast<double>(items)) - std::log(static_cast<double>(p.items)));
    if (best == nullptr || d < best_d) {
      best = &p;
      best_d = d;
    }
  }
  return best != nullptr && best->host;
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
      std::vector<HostLayer> layers;
      std::vector<uint16_t*> out;
      for (int32_t l = 0; l < L; ++l) {
        const auto& li = table_->layers()[static_cast<size_t>(l)];
        layers.push_back({table_->records(l), li.row_begin, li.row_end, table_->device_records(l)});
        out.push_back(prefetcher_.staging(l));
      }
      ASSIGN_OR_RETURN(host_,
                       HostGather::Create(std::move(layers), std::move(out), max_tokens_, static_cast<int32_t>(C),
                                          static_cast<int32_t>(table_->head_dim()), host_options_));
    }
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
