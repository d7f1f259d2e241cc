// HostGather (client/engine/host_gather.h). One concern kept whole: the gather threads, the dispatcher that issues
// the copies and the GPU unpack are one pipeline whose hand-offs read best side by side.
#include "client/engine/host_gather.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/spin.h"
#include "base/status_macros.h"
#include "client/environment.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

using kernels::CudaStatus;

// The built-in defaults are bench_kernels' fastest "host gather variant" at 196K rows with the engine's UVA share
// (2 x H200, bench/RESULTS.md 2026-11-30: "all, chunks 256-1024, copies >= 4096": non-temporal stores, fused
// plan + gather, the dispatcher issuing merged copies of >= 4096 rows, pre-wake, dispatcher spin 200 us).
HostGatherOptions ResolveHostGatherOptions(HostGatherOptions o) {
  const ClientEnvironment& env = Environment();
  auto resolve = [](int32_t* field, const std::optional<int64_t>& from_env, int32_t fallback) {
    if (*field >= 0) return;
    *field = from_env ? static_cast<int32_t>(std::clamp<int64_t>(*from_env, 0, INT32_MAX)) : fallback;
  };
  resolve(&o.prefetch_rows, env.host_gather_prefetch, 16);
  resolve(&o.stream_stores, env.host_gather_nt, 1);
  resolve(&o.fused, env.host_gather_fused, 1);
  resolve(&o.copy_issuer, env.host_gather_issuer, 1);
  resolve(&o.spin_us, env.host_gather_spin_us, 200);
  resolve(&o.dispatch_spin_us, env.host_gather_dispatch_spin_us, 200);
  resolve(&o.pass_spin_us, env.host_gather_pass_spin_us, 200);
  resolve(&o.prewake, env.host_gather_prewake, 1);
  resolve(&o.issue_min_rows, env.host_gather_issue_min_rows, 4096);
  resolve(&o.stream_unpack, env.host_gather_stream_unpack, 0);
  return o;
}

absl::StatusOr<std::unique_ptr<HostGather>> HostGather::Create(std::vector<HostLayer> layers,
                                                               std::vector<uint16_t*> out, int32_t max_tokens,
                                                               int32_t n_cols, int32_t head_dim,
                                                               HostGatherOptions options) {
  if (layers.empty() || layers.size() != out.size() || max_tokens < 1 || n_cols < 1 || head_dim < 32 ||
      head_dim % 32 != 0) {
    return absl::InvalidArgumentError(
        "host gather needs one output per layer, max_tokens >= 1, n_cols >= 1, head_dim a multiple of 32");
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    if (out[l] == nullptr || (layers[l].records == nullptr && layers[l].row_end > layers[l].row_begin)) {
      return absl::InvalidArgumentError(absl::StrCat("host gather: layer ", l, " has no records or no output"));
    }
  }
  const int64_t max_items = static_cast<int64_t>(max_tokens) * n_cols;
  if (max_items >= (int64_t{1} << 30)) return absl::InvalidArgumentError("host gather: more than 2^30 items");
  std::unique_ptr<HostGather> g(new HostGather());
  g->layers_ = std::move(layers);
  g->out_ = std::move(out);
  g->max_tokens_ = max_tokens;
  g->n_cols_ = n_cols;
  g->head_dim_ = head_dim;
  g->rb_ = head_dim + head_dim / 32;
  g->opt_ = ResolveHostGatherOptions(std::move(options));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = g->opt_.threads > 0 ? g->opt_.threads : DefaultGatherThreads(cores);
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&g->device_), "current device"));
  int lo = 0, hi = 0;
  cudaDeviceGetStreamPriorityRange(&lo, &hi);
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&g->copy_, cudaStreamNonBlocking), "copy stream"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithPriority(&g->unpack_, cudaStreamNonBlocking, hi), "unpack stream"));
  RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&g->main_ready_, cudaEventDisableTiming), "event"));
  RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&g->group_copied_, cudaEventDisableTiming), "event"));
  const size_t L = g->layers_.size();
  g->uva_ok_ = std::all_of(g->layers_.begin(), g->layers_.end(),
                           [](const HostLayer& h) { return h.device_records != nullptr || h.row_end == h.row_begin; });
  if (g->uva_ok_) {
    RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&g->uva_, cudaStreamNonBlocking), "uva stream"));
    g->sort_bytes_ = kernels::LookupSortScratchBytes(max_items);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&g->sort_scratch_, g->sort_bytes_), "sort scratch"));
    for (size_t l = 0; l < L; ++l) {
      cudaEvent_t u = nullptr;
      RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&u, cudaEventDisableTiming), "event"));
      g->uva_done_.push_back(u);
    }
  }
  g->plans_.resize(L);
  g->stats_.resize(L);
  for (size_t l = 0; l < L; ++l) {
    cudaEvent_t c = nullptr, d = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&c, cudaEventDisableTiming), "event"));
    g->copied_.push_back(c);
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&d, cudaEventDefault), "event"));
    g->done_.push_back(d);
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&p, static_cast<size_t>(max_items * g->rb_), cudaHostAllocDefault),
                               "pinned row staging"));
    g->pinned_rows_.push_back(static_cast<uint8_t*>(p));
    RETURN_IF_ERROR(
        CudaStatus(cudaHostAlloc(&p, static_cast<size_t>(max_items) * 4, cudaHostAllocDefault), "pinned index"));
    g->pinned_index_.push_back(static_cast<int32_t*>(p));
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, static_cast<size_t>(max_items * g->rb_)), "device rows"));
    g->dev_rows_.push_back(static_cast<uint8_t*>(p));
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, static_cast<size_t>(max_items) * 4), "device index"));
    g->dev_index_.push_back(static_cast<int32_t*>(p));
    g->plans_[l].rows.resize(static_cast<size_t>(max_items));
  }
  g->pool_ = std::make_unique<GatherPool>(threads, g->opt_.cpus, g->opt_.spin_us, g->opt_.pass_spin_us);
  g->chunk_done_.reset(new std::atomic<uint8_t>[static_cast<size_t>(max_items) + 1]);
  g->dedup_ = std::make_unique<RowDeduper>(max_items);
  g->dispatcher_ = std::thread([p = g.get()] { p->Dispatch(); });
  return g;
}

HostGather::~HostGather() {
  if (dispatcher_.joinable()) {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    dispatcher_.join();
  }
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  if (unpack_ != nullptr) cudaStreamSynchronize(unpack_);
  if (uva_ != nullptr) cudaStreamSynchronize(uva_);
  if (sort_scratch_ != nullptr) cudaFree(sort_scratch_);
  for (auto e : uva_done_) cudaEventDestroy(e);
  if (uva_ != nullptr) cudaStreamDestroy(uva_);
  for (auto* p : pinned_rows_) cudaFreeHost(p);
  for (auto* p : pinned_index_) cudaFreeHost(p);
  for (auto* p : dev_rows_) cudaFree(p);
  for (auto* p : dev_index_) cudaFree(p);
  for (auto e : copied_) cudaEventDestroy(e);
  for (auto e : done_) cudaEventDestroy(e);
  if (main_ready_ != nullptr) cudaEventDestroy(main_ready_);
  if (group_copied_ != nullptr) cudaEventDestroy(group_copied_);
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  if (unpack_ != nullptr) cudaStreamDestroy(unpack_);
}

absl::Status HostGather::Prefetch(const int32_t* host_ids, int32_t num_tokens, int64_t ids_stride,
                                  cudaStream_t main_stream) {
  const int32_t L = n_layers();
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(num_tokens, " tokens, the staging buffers hold ", max_tokens_));
  }
  if (host_ids == nullptr && num_tokens > 0) return absl::InvalidArgumentError("null hash ids");
  if (ids_stride < static_cast<int64_t>(L) * n_cols_) {
    return absl::InvalidArgumentError(absl::StrCat("ids stride ", ids_stride, " < n_layers * n_cols"));
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RETURN_IF_ERROR(CudaStatus(cudaStreamIsCapturing(main_stream, &capture), "capture status"));
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        "the host-gather path runs outside CUDA graph capture (host work): use the UVA path for captured steps");
  }
  // The previous batch must be fully enqueued before its buffers are planned over again.
  (void)Sync();
  RETURN_IF_ERROR(CudaStatus(cudaEventRecord(main_ready_, main_stream), "record main-stream event"));
  {
    std::lock_guard<std::mutex> l(mu_);
    ids_ = host_ids;
    tokens_ = num_tokens;
    stride_ = ids_stride;
    ++batch_;
    issued_ = 0;
    error_ = absl::OkStatus();
    pending_ = true;
    any_batch_ = true;
    pending_flag_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  if (opt_.prewake > 0 && num_tokens > 0) pool_->Wake();
  return absl::OkStatus();
}

absl::Status HostGather::Wait(int32_t layer, cudaStream_t main_stream) {
  if (layer < 0 || layer >= n_layers())
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return !any_batch_ || issued_ > layer || !error_.ok(); });
    if (!error_.ok()) return error_;
  }
  return CudaStatus(cudaStreamWaitEvent(main_stream, done_[static_cast<size_t>(layer)], 0), "wait layer event");
}

absl::Status HostGather::Sync() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !any_batch_ || issued_ >= n_layers() || !error_.ok(); });
  return error_;
}

void HostGather::Dispatch() {
  cudaSetDevice(device_);
  for (;;) {
    // The next batch often follows at once (a prefill's layers, a benchmark).
    SpinUntil([&] { return pending_flag_.load(std::memory_order_acquire); }, int64_t{opt_.dispatch_spin_us} * 1000);
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || pending_; });
      if (stop_) return;
      pending_ = false;
      pending_flag_.store(false, std::memory_order_relaxed);
    }
    // The unpack writes the caller's staging buffers: after whatever the main stream had queued at Prefetch.
    absl::Status st = CudaStatus(cudaStreamWaitEvent(unpack_, main_ready_, 0), "unpack stream wait");
    if (st.ok() && uva_ != nullptr) st = CudaStatus(cudaStreamWaitEvent(uva_, main_ready_, 0), "uva stream wait");
    for (int32_t l = 0; l < n_layers() && st.ok(); ++l) {
      st = RunLayer(l);
      std::lock_guard<std::mutex> g(mu_);
      if (st.ok())
        ++issued_;
      else
        error_ = st;
      cv_.notify_all();
    }
  }
}

absl::Status HostGather::RunLayer(int32_t l) {
  const size_t li = static_cast<size_t>(l);
  const HostLayer& layer = layers_[li];
  const int64_t items = static_cast<int64_t>(tokens_) * n_cols_;
  // The split: tokens [host_tokens, tokens_) go to the UVA row-order gather, the rest to the CPU threads.
  int32_t uva_tokens = 0;
  if (uva_ok_ && opt_.uva_share > 0 && items >= std::max<int64_t>(opt_.uva_min_items, 1)) {
    uva_tokens =
        static_cast<int32_t>(std::clamp<double>(std::llround(tokens_ * std::min(opt_.uva_share, 1.0)), 0, tokens_));
  }
  const int32_t host_tokens = tokens_ - uva_tokens;
  const int64_t host_items = static_cast<int64_t>(host_tokens) * n_cols_, uva_items = items - host_items;
  // The pinned staging of this layer is free once the previous batch's copies out of it are done; the device rows
  // (and ids) once the previous batch's unpack has read them.
  RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(copied_[li]), "previous copies"));
  if (uva_ok_) RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(uva_done_[li]), "previous uva share"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copy_, done_[li], 0), "previous unpack"));
  // The UVA share: its ids packed after the host part's index in the pinned buffer, then to the device; the GPU
  // starts at once. `serial`: packed by this thread alone (it runs while the threads gather, with copy_issuer).
  auto launch_uva = [&](bool serial) -> absl::Status {
    if (uva_tokens > 0) {
      int32_t* packed = pinned_index_[li] + host_items;
      const int32_t* src = ids_ + static_cast<int64_t>(l) * n_cols_;
      auto pack = [&](int64_t t_begin, int64_t t_end) {
        for (int64_t t = t_begin; t < t_end; ++t) {
          std::memcpy(packed + t * n_cols_, src + (host_tokens + t) * stride_, static_cast<size_t>(n_cols_) * 4);
        }
      };
      if (serial) {
        pack(0, uva_tokens);
      } else {
        const int P = pool_->threads();
        pool_->Run([&](int w) {
          const Range r = SplitRange(uva_tokens, P, w);
          pack(r.begin, r.end);
        });
      }
      RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(uva_, done_[li], 0), "uva waits for previous unpack"));
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev_index_[li] + host_items, packed,
                                                 static_cast<size_t>(uva_items) * 4, cudaMemcpyHostToDevice, uva_),
                                 "uva ids copy"));
      kernels::LookupArgs u;
      u.records = layer.device_records;
      u.row_begin = layer.row_begin;
      u.row_end = layer.row_end;
      u.head_dim = head_dim_;
      u.ids = dev_index_[li] + host_items;
      u.num_tokens = uva_tokens;
      u.num_cols = n_cols_;
      u.ids_stride = n_cols_;
      u.out = out_[li] + host_items * head_dim_;
      u.sort_scratch = sort_scratch_;
      u.sort_scratch_bytes = sort_bytes_;
      u.max_blocks = opt_.uva_blocks;
      RETURN_IF_ERROR(CudaStatus(kernels::LaunchLookup(u, uva_), "uva share lookup"));
    }
    if (uva_ok_) RETURN_IF_ERROR(CudaStatus(cudaEventRecord(uva_done_[li], uva_), "record uva event"));
    return absl::OkStatus();
  };
  // With copy_issuer the share is launched by this thread at the start of the gather pass (no pass of its own).
  const bool uva_in_pass = opt_.copy_issuer > 0;
  if (!uva_in_pass) RETURN_IF_ERROR(launch_uva(false));
  GatherPlan& plan = plans_[li];
  // Fused: no planning pass; each thread plans the chunk it is about to gather (identity plan, item order).
  const bool fused = opt_.fused > 0 && !opt_.dedup;
  const int32_t* layer_ids = ids_ + static_cast<int64_t>(l) * n_cols_;
  if (fused) {
    plan.n_rows = host_items;
  } else {
    RETURN_IF_ERROR(dedup_->Plan(layer_ids, host_tokens, n_cols_, stride_, layer.row_begin, layer.row_end, opt_.dedup,
                                 *pool_, pinned_index_[li], &plan));
  }
  stats_[li] = {items, plan.n_rows + uva_items, uva_items};
  auto copy_index = [&] {
    if (host_items == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dev_index_[li], pinned_index_[li], static_cast<size_t>(host_items) * 4,
                                      cudaMemcpyHostToDevice, copy_),
                      "index copy");
  };
  if (!fused) RETURN_IF_ERROR(copy_index());
  int64_t chunk = PlanChunkRows(plan.n_rows, pool_->threads(), opt_.min_chunk_rows, opt_.max_chunk_rows);
  // Streamed unpack: each copy holds whole tokens (item order = token order in the fused plan).
  const bool stream_unpack = opt_.stream_unpack > 0 && opt_.copy_issuer > 0 && fused;
  // Whole groups of 8 rows (8 x 264 B = 33 cache lines): no two threads write one line of the staging; with the
  // streamed unpack, whole tokens too.
  const int64_t grain = stream_unpack ? std::lcm<int64_t>(8, n_cols_) : 8;
  if (chunk > grain || (stream_unpack && chunk > 0)) chunk = (chunk + grain - 1) / grain * grain;
  const int64_t n_chunks = chunk > 0 ? (plan.n_rows + chunk - 1) / chunk : 0;
  const GatherCopy how{opt_.prefetch_rows, opt_.stream_stores > 0};
  uint8_t* const staging = pinned_rows_[li];
  auto gather_chunk = [&](int64_t c) {
    const int64_t begin = c * chunk, end = std::min(plan.n_rows, begin + chunk);
    if (fused) {
      PlanIdentityRange(layer_ids, n_cols_, stride_, layer.row_begin, layer.row_end, begin, end, plan.rows.data(),
                        pinned_index_[li]);
    }
    GatherRecords(layer.records, rb_, plan.rows.data(), begin, end, staging, how);
  };
  auto copy_rows = [&](int64_t first_chunk, int64_t end_chunk) {
    const int64_t begin = first_chunk * chunk, end = std::min(plan.n_rows, end_chunk * chunk);
    return cudaMemcpyAsync(dev_rows_[li] + begin * rb_, staging + begin * rb_, static_cast<size_t>((end - begin) * rb_),
                           cudaMemcpyHostToDevice, copy_);
  };
  // The unpack: the lookup kernel over the dense gathered rows, item i reading row index[i] (-1: zeros); all the
  // host part's tokens at the end, or (streamed) tokens [t0, t1) as soon as their rows and index are copied.
  auto unpack_args = [&](int64_t t0, int64_t t1) {
    kernels::LookupArgs a;
    a.records = dev_rows_[li];
    a.row_begin = 0;
    a.row_end = plan.n_rows;
    a.head_dim = head_dim_;
    a.ids = dev_index_[li] + t0 * n_cols_;
    a.num_tokens = static_cast<int32_t>(t1 - t0);
    a.num_cols = n_cols_;
    a.ids_stride = n_cols_;
    a.out = out_[li] + t0 * n_cols_ * head_dim_;
    a.max_blocks = opt_.unpack_blocks;
    return a;
  };
  auto unpack_group = [&](int64_t c0, int64_t c1) {
    const int64_t begin = c0 * chunk, end = std::min(plan.n_rows, c1 * chunk);
    return cudaMemcpyAsync(dev_index_[li] + begin, pinned_index_[li] + begin, static_cast<size_t>(end - begin) * 4,
                           cudaMemcpyHostToDevice, copy_) == cudaSuccess &&
           cudaEventRecord(group_copied_, copy_) == cudaSuccess &&
           cudaStreamWaitEvent(unpack_, group_copied_, 0) == cudaSuccess &&
           kernels::LaunchLookup(unpack_args(begin / n_cols_, end / n_cols_), unpack_) == cudaSuccess;
  };
  std::atomic<int64_t> next{0};
  std::atomic<int> failed{0};
  const auto pass_start = std::chrono::steady_clock::now();
  absl::Status uva_status;
  if (opt_.copy_issuer > 0) {
    // The threads only gather; this thread hands each run of finished chunks (in order) to the copy engine.
    for (int64_t c = 0; c < n_chunks; ++c) chunk_done_[static_cast<size_t>(c)].store(0, std::memory_order_relaxed);
    pool_->Run(
        [&](int) {
          for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            gather_chunk(c);
            chunk_done_[static_cast<size_t>(c)].store(1, std::memory_order_release);
          }
        },
        [&] {
          uva_status = launch_uva(true);
          int64_t issued = 0;
          while (issued < n_chunks) {
            int64_t e = issued;
            while (e < n_chunks && chunk_done_[static_cast<size_t>(e)].load(std::memory_order_acquire) != 0) ++e;
            if (e == issued || (e < n_chunks && (e - issued) * chunk < opt_.issue_min_rows)) {
              CpuRelax();
              continue;
            }
            if (copy_rows(issued, e) != cudaSuccess || (stream_unpack && !unpack_group(issued, e))) {
              failed.store(1);
              return;
            }
            issued = e;
          }
        });
  } else {
    const int device = device_;
    pool_->Run([&](int) {
      cudaSetDevice(device);
      for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
        gather_chunk(c);
        if (copy_rows(c, c + 1) != cudaSuccess) failed.store(1);
      }
    });
  }
  stats_[li].gather_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - pass_start).count();
  RETURN_IF_ERROR(uva_status);
  if (failed.load() != 0) return absl::InternalError("host gather: a chunk copy failed to enqueue");
  if (fused && !stream_unpack) RETURN_IF_ERROR(copy_index());
  RETURN_IF_ERROR(CudaStatus(cudaEventRecord(copied_[li], copy_), "record copy event"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(unpack_, copied_[li], 0), "unpack waits for copies"));
  if (!stream_unpack) {
    RETURN_IF_ERROR(CudaStatus(kernels::LaunchLookup(unpack_args(0, host_tokens), unpack_), "unpack kernel"));
  }
  if (uva_tokens > 0) RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(unpack_, uva_done_[li], 0), "join uva share"));
  return CudaStatus(cudaEventRecord(done_[li], unpack_), "record layer event");
}

}  // namespace engram::client
