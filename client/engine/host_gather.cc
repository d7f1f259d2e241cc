// HostGather (client/engine/host_gather.h): its resources, the hand-off of a batch to the dispatcher thread, and the
// waits. The per-layer pipeline the dispatcher runs is client/engine/host_gather_layer.cc.
#include "client/engine/host_gather.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/spin.h"
#include "base/status_macros.h"
#include "client/environment.h"
#include "client/tuning.h"
#include "kernels/device_layout.h"
#include "kernels/engram_kernels.h"

namespace engram::client {

using kernels::CudaStatus;

HostGatherOptions ResolveHostGatherOptions(HostGatherOptions o, const Tuning& tuning) {
  auto resolve = [](int32_t* field, const std::optional<int64_t>& knob, int32_t fallback) {
    if (*field >= 0) return;
    *field = knob ? static_cast<int32_t>(std::clamp<int64_t>(*knob, 0, INT32_MAX)) : fallback;
  };
  resolve(&o.prefetch_rows, tuning.host_gather_prefetch, tuning_default::kHostGatherPrefetchRows);
  resolve(&o.stream_stores, tuning.host_gather_nt, tuning_default::kHostGatherStreamStores);
  resolve(&o.fused, tuning.host_gather_fused, tuning_default::kHostGatherFused);
  resolve(&o.copy_issuer, tuning.host_gather_issuer, tuning_default::kHostGatherCopyIssuer);
  resolve(&o.spin_us, tuning.host_gather_spin_us, tuning_default::kHostGatherSpinUs);
  resolve(&o.dispatch_spin_us, tuning.host_gather_dispatch_spin_us, tuning_default::kHostGatherDispatchSpinUs);
  resolve(&o.pass_spin_us, tuning.host_gather_pass_spin_us, tuning_default::kHostGatherPassSpinUs);
  resolve(&o.prewake, tuning.host_gather_prewake, tuning_default::kHostGatherPrewake);
  resolve(&o.issue_min_rows, tuning.host_gather_issue_min_rows, tuning_default::kHostGatherIssueMinRows);
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
  g->opt_ = ResolveHostGatherOptions(std::move(options), Environment().tuning);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = g->opt_.threads > 0 ? g->opt_.threads : DefaultGatherThreads(cores);
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&g->device_), "current device"));
  int lo = 0, hi = 0;
  cudaDeviceGetStreamPriorityRange(&lo, &hi);
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&g->copy_, cudaStreamNonBlocking), "copy stream"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithPriority(&g->unpack_, cudaStreamNonBlocking, hi), "unpack stream"));
  RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&g->main_ready_, cudaEventDisableTiming), "event"));
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

}  // namespace engram::client
